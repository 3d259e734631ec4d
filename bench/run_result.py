"""The record every system's timed run returns, and the hook type that wraps only a run's timed region."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

# Called with no arguments around the timed region only (warm-up excluded), e.g. to watch for foreign CPU load.
Timed = Callable[[], AbstractContextManager]


@dataclass
class RunResult:
    name: str
    wall_s: float
    useful_tokens: int
    outputs: list[list[int]] | None = None  # generated ids per request, for cross-system agreement checks
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s if self.wall_s > 0 else 0.0
