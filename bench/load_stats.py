"""Per-request timing records of a load run and the statistics made from them.

The same record type serves the gRPC client and the in-process engine replay, so both are
summarised by one code path. Latencies count from a request's *scheduled* arrival (an open-loop
client that falls behind still charges its lateness to the request). Inter-token latency (ITL)
is the gap between successive token-bearing messages of one stream, divided evenly among the
tokens of the later message, pooled over all requests (token-weighted). Pure Python, no I/O.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import asdict, dataclass, field

DEFAULT_BUCKET_BOUNDS = (128, 512, 2048)  # the gateway's default queues.bucket_bounds


@dataclass
class RequestRecord:
    index: int
    priority: int
    prompt_len: int
    max_tokens: int
    scheduled_s: float  # due time, seconds from the run's start
    sent_s: float | None = None  # when it actually left (the client or engine may be late)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival s, tokens) per token message
    end_s: float | None = None
    error: str | None = None  # a gRPC status name, or an exception's type, when it failed
    finish_reason: str | None = None
    # The gateway's own view, from the final message's Timing (cluster runs only): arrival at the
    # gateway to dispatch, to the first token leaving it, and to the end.
    server_queue_ms: float | None = None
    server_ttft_ms: float | None = None
    server_total_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.scheduled_s if self.chunks else None

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.scheduled_s if self.end_s is not None else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first message's; None when that message carried
        them all (the gateway holds tokens back until their text is whole characters)."""
        if self.num_tokens < 2 or not self.chunks or self.chunks[0][1] >= self.num_tokens:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (self.num_tokens - self.chunks[0][1])

    def itl_samples(self) -> list[float]:
        return itl_samples(self.chunks)


def itl_samples(chunks: list[tuple[float, int]]) -> list[float]:
    """One sample per token after the first message: the gap to the previous message over its token count."""
    out: list[float] = []
    for (t_prev, _), (t, n) in zip(chunks, chunks[1:]):
        if n > 0:
            out.extend([(t - t_prev) / n] * n)
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bucket_label(index: int, bounds: tuple[int, ...]) -> str:
    lo = 1 if index == 0 else bounds[index - 1] + 1
    return f">{bounds[-1]}" if index == len(bounds) else f"{lo}-{bounds[index]}"


def bucket_of(prompt_len: int, bounds: tuple[int, ...]) -> int:
    """The gateway's rule: the first bucket whose upper bound is >= the prompt length."""
    return bisect.bisect_left(bounds, prompt_len)


@dataclass
class Summary:
    requests: int
    completed: int
    errors: dict[str, int]
    output_tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_ms: tuple[float | None, float | None]  # (p50, p99)
    itl_ms: tuple[float | None, float | None]
    e2e_s: tuple[float | None, float | None]
    tpot_ms_p50: float | None

    @classmethod
    def of(cls, records: list[RequestRecord], wall_s: float) -> "Summary":
        done = [r for r in records if r.ok]
        ttft = [r.ttft_s * 1e3 for r in done if r.ttft_s is not None]
        itl = [s * 1e3 for r in done for s in r.itl_samples()]
        e2e = [r.e2e_s for r in done]
        tpot = [r.tpot_s * 1e3 for r in done if r.tpot_s is not None]
        tokens = sum(r.num_tokens for r in records)
        per_s = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: 0.0)
        return cls(requests=len(records), completed=len(done),
                   errors=dict(Counter(r.error for r in records if r.error is not None)),
                   output_tokens=tokens, tokens_per_s=per_s(tokens), requests_per_s=per_s(len(done)),
                   ttft_ms=(percentile(ttft, 50), percentile(ttft, 99)),
                   itl_ms=(percentile(itl, 50), percentile(itl, 99)),
                   e2e_s=(percentile(e2e, 50), percentile(e2e, 99)), tpot_ms_p50=percentile(tpot, 50))


@dataclass
class LoadResult:
    label: str
    records: list[RequestRecord]
    wall_s: float  # the run's start (t = 0, the first arrival slot) to the last completion
    bucket_bounds: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS
    extra: dict = field(default_factory=dict)  # run-specific facts: queue depth, CPU use, send lag

    def summary(self) -> Summary:
        return Summary.of(self.records, self.wall_s)

    def by_bucket(self) -> dict[str, Summary]:
        groups: dict[int, list[RequestRecord]] = {}
        for r in self.records:
            groups.setdefault(bucket_of(r.prompt_len, self.bucket_bounds), []).append(r)
        return {bucket_label(i, self.bucket_bounds): Summary.of(groups[i], self.wall_s) for i in sorted(groups)}

    def by_priority(self) -> dict[int, Summary]:
        groups: dict[int, list[RequestRecord]] = {}
        for r in self.records:
            groups.setdefault(r.priority, []).append(r)
        return {p: Summary.of(groups[p], self.wall_s) for p in sorted(groups)}

    def max_send_lag_ms(self) -> float:
        lags = [(r.sent_s - r.scheduled_s) * 1e3 for r in self.records if r.sent_s is not None]
        return max(lags, default=0.0)

    def to_dict(self, with_records: bool = False) -> dict:
        d = {"label": self.label, "wall_s": self.wall_s, "bucket_bounds": list(self.bucket_bounds),
             "overall": asdict(self.summary()),
             "by_bucket": {k: asdict(v) for k, v in self.by_bucket().items()},
             "by_priority": {str(k): asdict(v) for k, v in self.by_priority().items()},
             "max_send_lag_ms": self.max_send_lag_ms(), "extra": self.extra}
        if with_records:
            d["records"] = [asdict(r) for r in self.records]
        return d

    def format(self) -> str:
        rows = [("all", self.summary())]
        rows += [(f"bucket {k}", v) for k, v in self.by_bucket().items()]
        rows += [(f"priority {k}", v) for k, v in self.by_priority().items()]
        return format_rows(f"{self.label}: wall {self.wall_s:.2f} s", rows)


def _ms(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_rows(title: str, rows: list[tuple[str, Summary]]) -> str:
    header = ("group", "n", "done", "errors", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
              "ITL p99 ms", "E2E p50 s", "E2E p99 s")
    table = [header]
    for name, s in rows:
        errors = ",".join(f"{k}:{v}" for k, v in sorted(s.errors.items())) or "0"
        table.append((name, str(s.requests), str(s.completed), errors, f"{s.tokens_per_s:.1f}",
                      f"{s.requests_per_s:.2f}", _ms(s.ttft_ms[0]), _ms(s.ttft_ms[1]), _ms(s.itl_ms[0], 2),
                      _ms(s.itl_ms[1], 2), _ms(s.e2e_s[0], 2), _ms(s.e2e_s[1], 2)))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [title]
    for row in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def report(result: "LoadResult", spec, num_requests: int, json_path: str | None) -> int:
    """A load generator's command-line ending: the table, the JSON when asked, and exit status 1
    unless every request completed."""
    import json
    from pathlib import Path
    print(result.format())
    print(f"extra: {result.extra}; max send lag {result.max_send_lag_ms():.1f} ms")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"spec": spec.__dict__, **result.to_dict(with_records=True)}, indent=1))
    return 1 if result.summary().completed < num_requests else 0
