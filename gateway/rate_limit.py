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
        wait_s = self.wait_s(amount, now_s)
        if not wait_s:
            self._level -= amount
        return wait_s

    def wait_s(self, amount: float, now_s: float) -> float:
        """What take(amount) would return, taking nothing."""
        level = self.level(now_s)
        if amount <= level:
            return 0.0
        return math.inf if amount > self.capacity else (amount - level) / self.rate_per_s

    def give_back(self, amount: float) -> None:
        """Undo a take, or the part of it that did not lead to work."""
        self._level = min(self.capacity, self._level + amount)


class TokenCharge:
    """The tokens one request took from its key's per-minute budget: `sequences` x (prompt +
    max_tokens), taken before it was queued. What did not turn into work goes back: the whole
    share of a sequence that was never queued (a refusal, a client gone, another prompt of the
    request refused), and a queued sequence's max_tokens it did not generate when it ends."""

    def __init__(self, bucket: TokenBucket, per_sequence: int, max_tokens: int, sequences: int):
        self.bucket, self.per_sequence, self.max_tokens = bucket, per_sequence, max_tokens
        self.unqueued = sequences

    def queued(self) -> None:
        self.unqueued -= 1

    def sequence_ended(self, generated_tokens: int) -> None:
        self.bucket.give_back(max(0, self.max_tokens - generated_tokens))

    def release_unqueued(self) -> None:
        """Give back the share of every sequence that was not queued; later calls give nothing."""
        self.bucket.give_back(self.unqueued * self.per_sequence)
        self.unqueued = 0
