"""A bounded thread pool for the gateway's CPU-heavy request work: tokenizing large prompts and
rendering chat templates, so that the event loop (every stream, every heartbeat) never waits on it.

The tokenizers library releases the GIL while it encodes (gateway/tokenizer.py calls its batch
API, which does), so a 3 MB prompt tokenizes on a pool thread while the loop runs on. Small
inputs stay on the loop: a thread hop costs more than their work. The pool's queue is bounded
too: past `max_pending` large jobs, `run` raises OffloadBusyError rather than queue without end.
A small request that comes only for its structured-output check (a grammar's lexer build, never
on the loop) is not a large job: it holds little memory, and the gateway's stream cap bounds how
many can wait.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

# Below these an input is prepared on the loop: about a millisecond of tokenizing or template
# rendering (docs/architecture.md, Reliability), less than a thread hand-off is worth.
OFFLOAD_MIN_CHARS = 2048
OFFLOAD_MIN_MESSAGES = 64
PENDING_PER_THREAD = 4
# Tokenizing 3 MB of text allocates ~400 MiB in the tokenizer (a string per token); freed, it stays
# in glibc's heap, so the gateway's resident memory would keep the peak of its largest prompt.
RELEASE_MIN_CHARS = 256 << 10


class OffloadBusyError(RuntimeError):
    """Every pool thread is busy and the pool's queue is full; the message says how full."""


def should_offload(num_chars: int, num_messages: int) -> bool:
    return num_chars >= OFFLOAD_MIN_CHARS or num_messages >= OFFLOAD_MIN_MESSAGES


class Offload:
    def __init__(self, num_threads: int, max_pending: int | None = None):
        self.max_pending = max_pending if max_pending is not None else num_threads * PENDING_PER_THREAD
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="gateway-offload")
        self.num_pending = 0  # large jobs submitted and not yet done (running or queued)

    async def run(self, fn: Callable[..., T], *args, release_memory: bool = False, large: bool = True) -> T:
        """fn(*args) on a pool thread, then (`release_memory`) the heap's free memory handed back to the
        OS; a `large` job counts against `max_pending`. A caller cancelled while its job is still queued
        takes the job out of the queue; one already running finishes on its thread and its result is
        dropped."""
        if large and self.num_pending >= self.max_pending:
            raise OffloadBusyError(f"the gateway is already preparing {self.num_pending} large requests "
                                   f"(at most {self.max_pending} at once)")
        self.num_pending += large
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, _call, fn, args, release_memory)
        finally:
            self.num_pending -= large

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _call(fn: Callable[..., T], args: tuple, release_memory: bool) -> T:
    try:
        return fn(*args)
    finally:
        if release_memory and _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)  # a ctypes call: the GIL is released while it runs


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


_MALLOC_TRIM = _malloc_trim()
