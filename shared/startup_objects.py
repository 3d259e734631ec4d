"""Keeping a long-running process's startup objects out of Python's cyclic garbage collector.

Once torch, transformers and the model are loaded (or the gateway's libraries), a process holds
hundreds of thousands of tracked objects that live as long as it does, and a full collection walks
every one while no step runs and no stream is relayed (docs/architecture.md has the measurement).
Frozen once the process is ready, they sit in the permanent generation that collections skip;
objects made later (requests, streams, steps) are collected as before. Pure Python, no torch.
"""
from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what startup left unreachable, then move every object still tracked into the permanent
    generation; returns how many are frozen now. Call once the process is ready to serve."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
