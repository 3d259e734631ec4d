"""A token bucket: the per-key rate limits of requests and of tokens per minute (gateway/auth.py).

Stdlib only, on the caller's clock, so tests step time by hand.
"""
from __future__ import annotations

import math


class TokenBucket:
    """Holds up to `capacity` units, refilled at `per_minute / 60` a second; full at the start."""

    def __init__(self, per_minute: float, now_s: float, capacity: float | None = None):
        self.rate_per_s = per_minute / 60.0
        self.capacity = per_minute if capacity is None else capacity
        self._level = self.capacity
        self._at_s = now_s

    def level(self, now_s: float) -> float:
        self._level = min(self.capacity, self._level + (now_s - self._at_s) * self.rate_per_s)
        self._at_s = now_s
        return self._level

    def take(self, amount: float, now_s: float) -> float:
        """Take `amount` and return 0.0, or take nothing and return the seconds until it could be
        taken (math.inf when it is more than the bucket ever holds)."""
        level = self.level(now_s)
        if amount <= level:
            self._level = level - amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - level) / self.rate_per_s

    def give_back(self, amount: float) -> None:
        """Undo a take that did not lead to work (the request was refused after it)."""
        self._level = min(self.capacity, self._level + amount)
