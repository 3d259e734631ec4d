"""The event loop's lag: how late a short timer fires, measured all the time, and the stalls it shows.

Every stream, every heartbeat and every dispatch share the gateway's one loop, so a stall
delays them all. The lag goes to a Prometheus histogram, and the worker registry asks
`heard_since` so that heartbeats that waited, unread, behind a stall never read as missing.
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Callable


class LoopLag:
    def __init__(self, interval_s: float, stall_s: float, observe: Callable[[float], None] = lambda _: None):
        """A tick every `interval_s`; a tick later than `stall_s` marks a stall (its end is kept)."""
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.last_tick_s = time.monotonic()
        self.last_stall_end_s = -math.inf
        self.max_lag_s = 0.0
        self._observe = observe

    async def run(self) -> None:
        while True:
            due = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.tick(time.monotonic(), due)

    def tick(self, now_s: float, due_s: float) -> float:
        lag = max(0.0, now_s - due_s)
        self._observe(lag)
        self.max_lag_s = max(self.max_lag_s, lag)
        if lag > self.stall_s:
            self.last_stall_end_s = now_s
        self.last_tick_s = now_s
        return lag

    def heard_since(self, now_s: float) -> float:
        """From when silence counts against a worker: the end of the last stall, or `now_s` while
        the loop is late right now (what it has not yet read may well be heartbeats)."""
        if now_s - self.last_tick_s > self.interval_s + self.stall_s:
            return now_s
        return self.last_stall_end_s
