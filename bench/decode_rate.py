"""Batch-1 decode rate, measured the same way for every system: (t(n+1 tokens) - t(1 token)) / n, so the prefill
and first-token cost cancel and only the n decode steps remain."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class DecodeRate:
    new_tokens: int
    t_first_s: float  # median time to generate 1 token (prefill + 1 sample)
    t_full_s: float   # median time to generate new_tokens + 1 tokens

    @property
    def tokens_per_s(self) -> float:
        dt = self.t_full_s - self.t_first_s
        return self.new_tokens / dt if dt > 0 else 0.0


def measure_decode_rate(generate_seconds: Callable[[list[int], int], float], prompt: list[int], new_tokens: int,
                        repeats: int = 3) -> DecodeRate:
    """generate_seconds(prompt, n) runs one greedy request for exactly n tokens and returns its wall time."""
    generate_seconds(prompt, 8)  # warm-up: first-call allocations and kernel choices are not timed
    t_first = statistics.median(generate_seconds(prompt, 1) for _ in range(repeats))
    t_full = statistics.median(generate_seconds(prompt, new_tokens + 1) for _ in range(repeats))
    return DecodeRate(new_tokens, t_first, t_full)
