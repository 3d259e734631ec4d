"""Keeping a long-running process's startup objects out of Python's cyclic garbage collector.

A model process holds some 290,000 objects the collector tracks once torch, transformers and the
model are loaded (a gateway some 70,000), nearly all of them alive for the life of the process. A
full collection walks every one: 230 ms in a model process, during which no step runs, and 65-70
ms on the gateway's event loop, during which no stream is relayed (docs/benchmarks.md). Frozen
once the process is ready, they sit in the permanent generation that collections skip; objects made
later (requests, streams, steps) are collected as before. Pure Python, no torch.
"""
from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what startup left unreachable, then move every object still tracked into the permanent
    generation; returns how many are frozen now. Call once the process is ready to serve."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
