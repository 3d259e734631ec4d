"""Formats the benchmark's results: the side-by-side table, the bound and utilisation lines, and one PASS/MISS line
per target. Pure formatting: no measurement happens here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Target:
    name: str
    value: float | None  # None: could not be measured
    goal: float
    unit: str = "x"
    why_missing: str = ""

    @property
    def status(self) -> str:
        if self.value is None:
            return "SKIP" if self.why_missing.startswith("baseline") else "MISS"
        return "PASS" if self.value >= self.goal else "MISS"

    def line(self) -> str:
        fmt = (lambda v: f"{v * 100:.1f}%") if self.unit == "%" else (lambda v: f"{v:.2f}x")
        got = fmt(self.value) if self.value is not None else f"not measured ({self.why_missing})"
        return f"{self.status:4s}  {self.name:<46s} {got:>12s}   target >= {fmt(self.goal)}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    def fmt(r):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"
