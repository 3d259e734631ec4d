"""The worker's side of the wire: heartbeats out, on a thread of their own.

The heartbeat runs on its own thread with its own socket, so a long step never makes a live
worker look dead: liveness stays cheap and truthful. Readiness is judged at send time from what
the loop last published, how long ago the loop last made progress, and the watchdog's level;
a hung loop turns the worker not-ready while its heartbeats keep flowing. A heartbeat also
carries the seq of the last KvEvents report the loop sent, so the gateway can spot a lost one.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from protos import worker_pb2
from shared.curve import ClientKeys
from shared.ipc import WorkerSocket
from worker.watchdog import MemoryLevel, MemoryStatus

log = logging.getLogger(__name__)
NO_GATEWAY_WARN_S = 10.0  # how long without a gateway before the first warning, and between warnings


@dataclass(frozen=True)
class LoadSnapshot:
    """What the loop publishes after every iteration; the heartbeat thread only reads it."""
    is_loaded: bool = False  # model loaded and warmed up
    is_draining: bool = False
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    # Cumulative since this process started.
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_oom_recoveries: int = 0
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    kv_events_seq: int = 0  # the last KvEvents seq sent, never one not yet sent


class LoopProgress:
    """When the loop last completed an iteration, and whether it has work it must get through.

    Written by the loop, read by the heartbeat thread: each is a single attribute store, atomic
    under the GIL. The clock is injectable so tests can age it without sleeping."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.last_progress_s = clock()
        self.has_work = False

    def expect_step(self) -> None:
        """Work is due: from now on the loop must complete a step within hung_after_s."""
        self.has_work = True

    def record(self, has_work: bool) -> None:
        """An iteration completed (a step ran, or the loop found nothing to do)."""
        self.last_progress_s = self._clock()
        self.has_work = has_work

    def age_s(self) -> float:
        return self._clock() - self.last_progress_s

    def is_hung(self, hung_after_s: float) -> bool:
        return self.has_work and self.age_s() > hung_after_s


@dataclass(frozen=True)
class StaticInfo:
    max_num_seqs: int
    max_queued: int
    block_size: int
    max_model_len: int
    vocab_size: int
    device: str
    model_fingerprint: str = ""  # shared/model_fingerprint.py: what the gateway checks it serves
    model_name: str = ""


def is_ready(snapshot: LoadSnapshot, level: MemoryLevel, is_hung: bool) -> bool:
    """Loaded and warmed up, not draining, below CRITICAL and making progress."""
    return snapshot.is_loaded and not snapshot.is_draining and level < MemoryLevel.CRITICAL and not is_hung


def build_heartbeat(s: LoadSnapshot, info: StaticInfo, progress: LoopProgress, memory: MemoryStatus,
                    hung_after_s: float) -> worker_pb2.Heartbeat:
    hung = progress.is_hung(hung_after_s)
    m = memory.reading
    return worker_pb2.Heartbeat(
        ready=is_ready(s, memory.level, hung), num_running=s.num_running, num_waiting=s.num_waiting,
        max_num_seqs=info.max_num_seqs, max_queued=info.max_queued,
        kv_blocks_total=s.kv_blocks_total, kv_blocks_free=s.kv_blocks_free, kv_blocks_cached=s.kv_blocks_cached,
        block_size=info.block_size, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        memory_used_bytes=memory.used_bytes, memory_limit_bytes=memory.limit_bytes, memory_level=memory.level.name,
        last_step_age_s=progress.age_s(), device=info.device,
        memory_allocated_bytes=m.allocated_bytes, memory_reserved_bytes=m.reserved_bytes,
        memory_peak_bytes=m.peak_bytes, memory_resident_bytes=m.resident_bytes,
        device_free_bytes=m.device_free_bytes, fragmentation_bytes=m.fragmentation_bytes,
        utilization_percent=m.utilization_percent,
        num_prefix_query_tokens=s.num_prefix_query_tokens, num_prefix_hit_tokens=s.num_prefix_hit_tokens,
        num_preemptions=s.num_preemptions, num_steps=s.num_steps, num_oom_recoveries=s.num_oom_recoveries,
        num_spec_drafts=s.num_spec_drafts, num_spec_draft_tokens=s.num_spec_draft_tokens,
        num_spec_accepted_tokens=s.num_spec_accepted_tokens,
        is_hung=hung, is_draining=s.is_draining, kv_events_seq=s.kv_events_seq,
        model_fingerprint=info.model_fingerprint, model_name=info.model_name)


class Unheard:
    """Warns, every NO_GATEWAY_WARN_S while it lasts, that no gateway takes this worker's
    heartbeats: a worker pointed at an endpoint where nobody listens (or started long before its
    gateway) would otherwise say nothing after its "ready" line."""

    def __init__(self, endpoint: str, clock: Callable[[], float] = time.monotonic):
        self.endpoint = endpoint
        self.since_s: float | None = clock()
        self.warned_s = -math.inf

    def after_send(self, delivered: bool, now_s: float) -> None:
        if delivered:
            if self.warned_s > -math.inf:
                log.info("a gateway at %s takes this worker's heartbeats", self.endpoint)
            self.since_s, self.warned_s = None, -math.inf
            return
        if self.since_s is None:
            self.since_s = now_s
        if now_s - self.since_s >= NO_GATEWAY_WARN_S and now_s - self.warned_s >= NO_GATEWAY_WARN_S:
            self.warned_s = now_s
            log.warning("no gateway has taken this worker's heartbeats at %s for %.0f s: is a gateway listening "
                        "there (gateway.worker_endpoint / --connect)?", self.endpoint, now_s - self.since_s)


class HeartbeatThread(threading.Thread):
    def __init__(self, endpoint: str, worker_id: str, incarnation: str, interval_s: float, info: StaticInfo,
                 progress: LoopProgress, memory: Callable[[], MemoryStatus], hung_after_s: float,
                 keys: ClientKeys | None = None):
        """`keys`: the worker's CURVE keys (shared/curve.py), the same its main socket holds."""
        super().__init__(name=f"heartbeat-{worker_id}", daemon=True)
        self._args = (endpoint, worker_id, incarnation)
        self._keys = keys
        self._interval_s = interval_s
        self._info = info
        self._progress = progress
        self._memory = memory
        self._hung_after_s = hung_after_s
        self._stopped = threading.Event()
        self._send_last = True
        self.delivered = False  # whether the last heartbeat found a connection to the gateway
        self.snapshot = LoadSnapshot()  # replaced whole by the loop: an atomic reference swap

    def run(self) -> None:
        socket = WorkerSocket(*self._args, routed=False, keys=self._keys)
        unheard = Unheard(socket.endpoint)
        try:
            # Only the first heartbeat waits for the connection (the gateway learns of this worker by
            # it); later ones never do: the next goes on it, and one that waited for a gateway that
            # is gone would hold up this thread's stop.
            first = True
            while not self._stopped.is_set():
                self.delivered = socket.send(self.heartbeat(), wait=first)
                first = False
                unheard.after_send(self.delivered, time.monotonic())
                self._stopped.wait(self._interval_s)
            if self._send_last:  # a draining worker says so at once rather than going quiet
                self.delivered = socket.send(self.heartbeat(), wait=False)
        finally:
            socket.close()

    def heartbeat(self) -> worker_pb2.Envelope:
        return worker_pb2.Envelope(heartbeat=build_heartbeat(self.snapshot, self._info, self._progress,
                                                             self._memory(), self._hung_after_s))

    def stop(self, send_last: bool = True) -> None:
        self._send_last = send_last
        self._stopped.set()
