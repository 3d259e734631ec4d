"""Memory readings for heartbeats: the process's or the device's use, against a limit.

This module only reads and classifies; it never frees anything (the loop decides what to do).
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

HIGH_FRACTION = 0.85
CRITICAL_FRACTION = 0.95


@dataclass(frozen=True)
class MemoryReading:
    used_bytes: int  # CUDA: allocated by torch; CPU: the process's resident set
    limit_bytes: int
    reserved_bytes: int = 0  # CUDA only: held by the caching allocator
    device_free_bytes: int = 0  # CUDA only: free on the device, as the driver says

    @property
    def level(self) -> str:
        if not self.limit_bytes:
            return "OK"
        fraction = self.used_bytes / self.limit_bytes
        return "CRITICAL" if fraction >= CRITICAL_FRACTION else "HIGH" if fraction >= HIGH_FRACTION else "OK"


def read_memory(device: torch.device, limit_bytes: int = 0) -> MemoryReading:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemoryReading(used_bytes=torch.cuda.memory_allocated(device), limit_bytes=limit_bytes or total,
                             reserved_bytes=torch.cuda.memory_reserved(device), device_free_bytes=free)
    rss = psutil.Process().memory_info().rss
    return MemoryReading(used_bytes=rss, limit_bytes=limit_bytes or psutil.virtual_memory().total)
