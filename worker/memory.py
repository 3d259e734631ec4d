"""Memory readings: what the device's caching allocator or this process holds, and the KV pool's use.

Reads and formats only. It never frees anything and never judges a level: the watchdog
(worker/watchdog.py) classifies, the loop decides, the scheduler and engine act.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

log = logging.getLogger(__name__)
_MIB = 2**20
# cgroup v2, then v1: a container's limit is what the kernel's OOM killer enforces.
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclass(frozen=True)
class MemoryReading:
    used_bytes: int  # what this worker holds: CUDA the allocator's reserved bytes, CPU the resident set
    total_bytes: int  # the device's memory (CUDA) or the host's / container's (CPU): the default limit
    allocated_bytes: int = 0  # CUDA: bytes in live tensors
    reserved_bytes: int = 0  # CUDA: bytes the caching allocator holds (allocated + cached)
    peak_bytes: int = 0  # CUDA: the most ever allocated at once
    resident_bytes: int = 0  # the process's resident set, on either device
    device_free_bytes: int = 0  # CUDA: free on the device as the driver says (other processes count)
    largest_free_block_bytes: int = 0  # CUDA: biggest unused block inside reserved segments (timer reads)
    utilization_percent: float = 0.0  # NVML GPU utilisation, else this process's CPU percent (timer reads)

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated: cached by the allocator, possibly in pieces too small to reuse."""
        return max(0, self.reserved_bytes - self.allocated_bytes)


@dataclass(frozen=True)
class KVUsage:
    """The KV pool in blocks. The pool's tensors are allocated once, so its bytes never change;
    what changes is how much of it holds data."""
    num_blocks: int = 0
    num_used_blocks: int = 0  # referenced by requests
    num_cached_blocks: int = 0  # unreferenced but still in the prefix cache (evictable)
    bytes_per_block: int = 0

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def held_bytes(self) -> int:
        return (self.num_used_blocks + self.num_cached_blocks) * self.bytes_per_block


class MemoryReader:
    """Reads memory for one device. `read()` is cheap enough for every step; `read(detailed=True)`
    adds the largest free block and utilisation, which cost more and are read on a timer (their last
    values are repeated by cheap reads, so heartbeats do not flicker between a value and zero)."""

    def __init__(self, device: torch.device):
        if device.type == "cuda" and device.index is None:
            # Pin the index: the watchdog's timer thread has its own current device (0).
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only starts the measuring interval
        self._total_bytes = _host_limit_bytes() if device.type == "cpu" else 0
        self._largest_free_block_bytes = 0
        self._utilization_percent = 0.0
        self._has_nvml = device.type == "cuda"

    def __call__(self, detailed: bool = False) -> MemoryReading:
        return self.read(detailed)

    def read(self, detailed: bool = False) -> MemoryReading:
        resident = self._process.memory_info().rss
        if detailed:
            self._utilization_percent = self._utilization()
        if self.device.type != "cuda":
            return MemoryReading(used_bytes=resident, total_bytes=self._total_bytes, resident_bytes=resident,
                                 utilization_percent=self._utilization_percent)
        device = self.device
        free, total = torch.cuda.mem_get_info(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        if detailed:
            self._largest_free_block_bytes = _largest_free_block(device)
        return MemoryReading(used_bytes=reserved, total_bytes=total, allocated_bytes=allocated,
                             reserved_bytes=reserved, peak_bytes=torch.cuda.max_memory_allocated(device),
                             resident_bytes=resident, device_free_bytes=free,
                             largest_free_block_bytes=self._largest_free_block_bytes,
                             utilization_percent=self._utilization_percent)

    def _utilization(self) -> float:
        if self._has_nvml:
            try:
                return float(torch.cuda.utilization(self.device))
            except Exception as e:  # no pynvml, or NVML refused: fall back to the CPU for good
                log.info("GPU utilisation unavailable (%s); reporting this process's CPU percent", e)
                self._has_nvml = False
        return self._process.cpu_percent(None)

    def report(self) -> str:
        """The allocator's full report (CUDA) or the process's memory in detail (CPU)."""
        info = self._process.memory_info()
        lines = [f"process resident set (rss): {info.rss / _MIB:.1f} MiB, virtual (vms): {info.vms / _MIB:.1f} MiB"]
        if self.device.type == "cpu":
            host = psutil.virtual_memory()
            lines.append(f"host: {host.total / _MIB:.0f} MiB total, {host.available / _MIB:.0f} MiB available; "
                         f"limit for this worker: {self._total_bytes / _MIB:.0f} MiB")
            return "\n".join(lines)
        free, total = torch.cuda.mem_get_info(self.device)
        lines.append(f"device {self.device}: {free / _MIB:.0f} MiB free of {total / _MIB:.0f} MiB")
        lines.append(torch.cuda.memory_summary(self.device, abbreviated=False))
        return "\n".join(lines)


def _largest_free_block(device: torch.device) -> int:
    """The biggest inactive block in this device's reserved segments: the largest tensor that fits
    without asking the driver for more. Walks the allocator's state, so only on the timer."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # older or exotic allocator backends
        return 0
    return max((block["size"] for segment in segments if segment.get("device", device.index) == device.index
                for block in segment.get("blocks", ()) if block.get("state") == "inactive"), default=0)


def _host_limit_bytes() -> int:
    total = psutil.virtual_memory().total
    for name in _CGROUP_LIMIT_FILES:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) or a huge number (v1) mean no limit
            return min(total, int(text))
    return total
