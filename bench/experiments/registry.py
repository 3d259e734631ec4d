"""The experiments in docs/experiments.md's order: number, name and module. The runner imports a module only
when its experiment is asked for, so one experiment's imports never slow another's start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    number: int
    name: str
    module: str  # has NUMBER, NAME, TITLE, run(quick) -> Result and plot(data, path)


EXPERIMENTS = [
    Entry(1, "batching", "bench.experiments.exp01_batching"),
    Entry(2, "paged_kv", "bench.experiments.exp02_paged_kv"),
    Entry(3, "priority", "bench.experiments.exp03_priority"),
    Entry(4, "chunked_prefill", "bench.experiments.exp04_chunked_prefill"),
    Entry(5, "prefix_cache", "bench.experiments.exp05_prefix_cache"),
    Entry(6, "step_buffers", "bench.experiments.exp06_step_buffers"),
    Entry(7, "quantization", "bench.experiments.exp07_quantization"),
    Entry(8, "max_tokens", "bench.experiments.exp08_max_tokens"),
    Entry(9, "sched_overhead", "bench.experiments.exp09_sched_overhead"),
    Entry(10, "load_test", "bench.experiments.exp10_load_test"),
    Entry(11, "cache_routing", "bench.experiments.exp11_cache_routing"),
]


def select(names: list[str]) -> list[Entry]:
    """Entries by number or name, in registry order; all of them for no names."""
    if not names:
        return list(EXPERIMENTS)
    known = {e.name: e for e in EXPERIMENTS} | {str(e.number): e for e in EXPERIMENTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown experiments {unknown}; known: "
                         + ", ".join(f"{e.number} {e.name}" for e in EXPERIMENTS))
    wanted = {known[n].number for n in names}
    return [e for e in EXPERIMENTS if e.number in wanted]
