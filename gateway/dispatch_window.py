"""When the dispatcher makes a pass over the queue: at most once per batch window.

A pass that finds the dispatcher quiet for a whole window runs at once, so a lone request pays
no window; a wake-up within a window of the last pass that had work waits out the rest of it,
so the requests of a burst after the first leave together and the passes (each a scan of the
queue and the workers) stay at most one per window under load. A pass over an empty queue (a
heartbeat's wake-up, a finished request's) does not count: it dispatched nothing.
"""
from __future__ import annotations

import math


class DispatchWindow:
    def __init__(self, window_s: float):
        self.window_s = window_s
        self._last_pass_s = -math.inf  # the last pass that had queued requests to place

    def wait_s(self, now: float) -> float:
        """How long a pass woken at `now` waits before it runs."""
        return max(0.0, self._last_pass_s + self.window_s - now)

    def passed(self, now: float, had_work: bool) -> None:
        """A pass ran at `now`; `had_work`: the queue held requests when it began."""
        if had_work:
            self._last_pass_s = now
