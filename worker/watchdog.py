"""The memory watchdog: turns readings into a level, OK / HIGH / CRITICAL, with hysteresis.

It reports and never acts: the worker loop (worker/service.py) decides what a level calls for,
the scheduler and engine act. Nothing here frees memory or touches a request.

What is judged is the memory the worker has committed: what it holds (CUDA: the allocator's
reserved bytes; CPU: the resident set) less the part of the preallocated KV pool that holds no
data. The pool is allocated once, so raw readings never change when blocks are freed; counting
only its occupied blocks is what lets evicting cached blocks and preempting requests bring the
level down, and makes one worker's full pool show as pressure.
"""
from __future__ import annotations

import enum
import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable

from worker.memory import KVUsage, MemoryReading

log = logging.getLogger(__name__)


class MemoryLevel(enum.IntEnum):
    OK = 0
    HIGH = 1  # admit nothing new, give back cached memory
    CRITICAL = 2  # also preempt the lowest-priority requests; not ready


@dataclass(frozen=True)
class MemoryStatus:
    reading: MemoryReading
    kv: KVUsage
    used_bytes: int  # the committed memory the level is judged on (see the module docstring)
    limit_bytes: int
    level: MemoryLevel

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.limit_bytes if self.limit_bytes else 0.0


class Watchdog:
    """Levels from readings. A level is entered at `fraction >= its threshold` and left only below
    `threshold - hysteresis_fraction`, so a reading that hovers at a threshold does not flap.

    `read_memory(detailed)` is injectable (tests feed it fake readings); KV usage is passed in by
    the loop, which owns the block manager, and the timer thread reuses the last one it was given.
    """

    def __init__(self, read_memory: Callable[[bool], MemoryReading], limit_bytes: int = 0,
                 high_fraction: float = 0.85, critical_fraction: float = 0.95, hysteresis_fraction: float = 0.05,
                 poll_interval_s: float = 1.0):
        if not 0 <= hysteresis_fraction < high_fraction < critical_fraction <= 1:
            raise ValueError("need 0 <= hysteresis_fraction < high_fraction < critical_fraction <= 1, got "
                             f"{hysteresis_fraction}, {high_fraction}, {critical_fraction}")
        self._read_memory = read_memory
        self._limit_bytes = limit_bytes
        self._enter = {MemoryLevel.HIGH: high_fraction, MemoryLevel.CRITICAL: critical_fraction}
        self._hysteresis = hysteresis_fraction
        self.poll_interval_s = poll_interval_s
        # The loop and the timer both update: the next level depends on the current one.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.status = self._judge(read_memory(False), KVUsage(), MemoryLevel.OK)

    # ---- readings ---------------------------------------------------------------------------
    def update(self, kv: KVUsage | None = None, detailed: bool = False) -> MemoryStatus:
        """Read memory now and judge it; `kv` defaults to the last KV usage given."""
        reading = self._read_memory(detailed)
        with self._lock:
            self.status = self._judge(reading, kv or self.status.kv, self.status.level)
            return self.status

    def update_kv(self, kv: KVUsage) -> MemoryStatus:
        """Judge again after the loop freed blocks, without a new device reading: the pool's
        bytes are fixed, so the reading itself has not changed."""
        with self._lock:
            self.status = self._judge(self.status.reading, kv, self.status.level)
            return self.status

    def _judge(self, reading: MemoryReading, kv: KVUsage, current: MemoryLevel) -> MemoryStatus:
        used = max(0, reading.used_bytes - kv.pool_bytes) + kv.held_bytes
        limit = self._limit_bytes or reading.total_bytes
        fraction = used / limit if limit else 0.0
        level = MemoryLevel.OK
        for candidate in (MemoryLevel.CRITICAL, MemoryLevel.HIGH):
            threshold = self._enter[candidate]
            if fraction >= threshold or (current >= candidate and fraction >= threshold - self._hysteresis):
                level = candidate
                break
        return MemoryStatus(reading=reading, kv=kv, used_bytes=used, limit_bytes=limit, level=level)

    # ---- what the loop asks -----------------------------------------------------------------
    def leave_bytes(self, level: MemoryLevel) -> int:
        """The committed bytes below which `level` is left."""
        return int((self._enter[level] - self._hysteresis) * self.status.limit_bytes)

    def excess_blocks(self, level: MemoryLevel) -> int:
        """KV blocks to free for the current reading to leave `level` (0 if it already would)."""
        status = self.status
        excess = status.used_bytes - self.leave_bytes(level) + 1  # leaving needs strictly below
        if excess <= 0:
            return 0
        return math.ceil(excess / status.kv.bytes_per_block) if status.kv.bytes_per_block else 0

    def describe(self) -> str:
        s = self.status
        high, critical = self._enter[MemoryLevel.HIGH], self._enter[MemoryLevel.CRITICAL]
        return (f"memory level {s.level.name}: {s.used_bytes / 2**20:.1f} MiB committed of a "
                f"{s.limit_bytes / 2**20:.1f} MiB limit ({s.fraction:.1%}); HIGH from {high:.0%}, CRITICAL "
                f"from {critical:.0%}, each left {self._hysteresis:.0%} below; fragmentation "
                f"{s.reading.fragmentation_bytes / 2**20:.1f} MiB, largest free block "
                f"{s.reading.largest_free_block_bytes / 2**20:.1f} MiB")

    # ---- the timer --------------------------------------------------------------------------
    def start(self) -> None:
        """Read on a timer too (with the costlier details), so the level stays fresh in heartbeats
        while a long step runs, when the loop itself cannot read."""
        self._thread = threading.Thread(target=self._poll, name="memory-watchdog", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.update(detailed=True)
            except Exception:  # a failed reading must not kill the timer; the loop still reads
                log.exception("memory reading failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
