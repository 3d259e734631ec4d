"""Experiment 10: load test of the running cluster as configs/default.toml sets it up (a gateway and
two workers, each its own process): the seeds' 4 connections x 10 requests (128-token prompts, 64
output tokens), then rising concurrency until requests/s stop growing.

Owns the concurrency ladder, the saturation rule and the memory sampler (each process's resident
set, sampled from a thread while the load runs). Processes come from bench/cluster_process.py,
which kills every one of them on the way out; load comes from bench/load_generator.py.
"""

from __future__ import annotations

import statistics
import threading
import time
import tomllib

import psutil

from bench.checkpoints import REPO_ROOT
from bench.cluster_process import ClusterProcess
from bench.experiments import plotting
from bench.experiments.common import DEFAULT_MODEL_DIR, Result, vocab_size
from bench.load_generator import run_load
from bench.load_workload import LoadSpec, make_load_workload

NUMBER, NAME = 10, "load_test"
TITLE = "Load test of the running cluster"
PROMPT_LEN, OUTPUT_LEN = 128, 64
MAX_LEVEL_REQUESTS = 512
SATURATION_GAIN = 1.10  # a level that raises requests/s by less than 10% over the best so far is saturated
MIB = 2**20


def cluster_sections() -> tuple[int, dict]:
    """configs/default.toml's workers and sections, less the gateway's address (the harness picks a free port)."""
    config = tomllib.loads((REPO_ROOT / "configs" / "default.toml").read_text())
    sections = {k: dict(v) for k, v in config.items() if isinstance(v, dict)}
    for key in ("host", "port", "metrics_port", "http_port"):
        sections.get("gateway", {}).pop(key, None)
    return int(config.get("num_workers", 1)), sections


def is_saturated(rates: list[float]) -> bool:
    """The last level did not beat the best earlier one by SATURATION_GAIN."""
    return len(rates) >= 2 and rates[-1] < SATURATION_GAIN * max(rates[:-1])


class MemorySampler:
    """Samples each cluster process's resident set (with its children) every interval_s, from a thread."""

    def __init__(self, cluster: ClusterProcess, interval_s: float = 0.5):
        self.cluster, self.interval_s = cluster, interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.t0 = time.perf_counter()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = {}
            for name, pids in self.cluster.pids().items():
                total = 0
                for pid in pids:
                    try:
                        total += psutil.Process(pid).memory_info().rss
                    except psutil.Error:
                        pass
                rss[name] = total
            self.samples.append((time.perf_counter() - self.t0, rss))

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def level_stats(result) -> dict:
    s = result.summary()
    done = [r.e2e_s for r in result.records if r.ok]
    return {"requests": s.requests, "completed": s.completed, "errors": s.errors, "requests_per_s": s.requests_per_s,
            "tokens_per_s": s.tokens_per_s, "e2e_mean_s": statistics.mean(done) if done else float("nan"),
            "e2e_p99_s": s.e2e_s[1], "ttft_p50_ms": s.ttft_ms[0], "ttft_p99_ms": s.ttft_ms[1]}


def run(quick: bool = False) -> Result:
    vocab = vocab_size(DEFAULT_MODEL_DIR)
    ladder = (1, 2, 4, 8, 16) if quick else (1, 2, 4, 8, 16, 32, 64, 128)
    per_stream = 3 if quick else 8
    num_workers, sections = cluster_sections()

    def workload(n: int, seed: int):
        spec = LoadSpec(num_requests=n, rate=0, long_fraction=0.0, short_prompt=(PROMPT_LEN, PROMPT_LEN),
                        short_output=(OUTPUT_LEN, OUTPUT_LEN), urgent_fraction=0.0, seed=seed)
        return make_load_workload(spec, vocab, 512)

    levels, marks = {}, []
    with ClusterProcess(DEFAULT_MODEL_DIR, num_workers, sections) as cluster, MemorySampler(cluster) as memory:
        run_load(cluster.address, workload(4, 99), concurrency=2, request_prefix="warm", poll_status=False)
        marks.append((time.perf_counter() - memory.t0, "4 x 10"))
        seeds = run_load(cluster.address, workload(40, 10), concurrency=4, request_prefix="seeds")
        rates = []
        for c in ladder:
            marks.append((time.perf_counter() - memory.t0, f"c={c}"))
            # At most MAX_LEVEL_REQUESTS per level: the top levels are about queueing, not more samples.
            n = min(MAX_LEVEL_REQUESTS, max(12, per_stream * c))
            levels[c] = level_stats(run_load(cluster.address, workload(n, 20 + c),
                                             concurrency=c, request_prefix=f"c{c}"))
            rates.append(levels[c]["requests_per_s"])
            if is_saturated(rates):
                break
        marks.append((time.perf_counter() - memory.t0, "end"))
    seeds_stats = level_stats(seeds)
    rows = [["4 connections x 10 requests", seeds_stats["requests_per_s"], seeds_stats["e2e_mean_s"],
             seeds_stats["e2e_p99_s"], seeds_stats["ttft_p50_ms"], seeds_stats["tokens_per_s"],
             f"{seeds_stats['completed']} / {seeds_stats['requests']}"]]
    rows += [[f"concurrency {c}", s["requests_per_s"], s["e2e_mean_s"], s["e2e_p99_s"], s["ttft_p50_ms"],
              s["tokens_per_s"], f"{s['completed']} / {s['requests']}"] for c, s in levels.items()]
    names = sorted({n for _, rss in memory.samples for n in rss})
    peak = {n: max(rss.get(n, 0) for _, rss in memory.samples) / MIB for n in names} if memory.samples else {}
    first = {n: memory.samples[0][1].get(n, 0) / MIB for n in names} if memory.samples else {}
    best = max(levels, key=lambda c: levels[c]["requests_per_s"])
    saturated = is_saturated([s["requests_per_s"] for s in levels.values()])
    peak_text = (f"saturates at {levels[best]['requests_per_s']:.1f} req/s (concurrency {best})" if saturated else
                 f"not saturated by concurrency {max(levels)}: {levels[best]['requests_per_s']:.1f} req/s")
    return Result(
        headers=["load", "requests/s", "E2E mean s", "E2E p99 s", "TTFT p50 ms", "out tok/s", "completed"],
        rows=rows,
        headline=(f"4 x 10 requests: {seeds_stats['requests_per_s']:.1f} req/s, mean {seeds_stats['e2e_mean_s']:.2f} s,"
                  f" p99 {seeds_stats['e2e_p99_s']:.2f} s; {peak_text}; peak RSS "
                  + ", ".join(f"{n} {peak[n]:.0f} MiB" for n in names)),
        data={"seeds_shape": seeds_stats, "levels": levels, "memory": memory.samples, "marks": marks,
              "rss_first_mib": first, "rss_peak_mib": peak, "num_workers": num_workers,
              "saturated": saturated})


def plot(data: dict, path) -> None:
    levels = data["levels"]
    cs = [int(c) for c in levels]
    fig, (ax1, ax2) = plotting.figure(2, f"Experiment 10: a gateway + {data['num_workers']} workers under rising load")
    ax1.plot(cs, [s["requests_per_s"] for s in levels.values()], marker="o", color="tab:blue", label="requests/s")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(cs, [str(c) for c in cs])
    ax1.set_xlabel("concurrent streams")
    ax1.set_ylabel("requests/s", color="tab:blue")
    twin = ax1.twinx()
    twin.plot(cs, [s["e2e_mean_s"] for s in levels.values()], marker="s", color="tab:orange", label="E2E mean")
    twin.plot(cs, [s["e2e_p99_s"] for s in levels.values()], marker="^", color="tab:red", label="E2E p99")
    twin.set_ylabel("end-to-end latency, s")
    twin.legend(fontsize=8, loc="upper left")
    samples = data["memory"]
    names = sorted({n for _, rss in samples for n in rss})
    for name in names:
        ax2.plot([t for t, _ in samples], [rss.get(name, 0) / MIB for _, rss in samples], label=name)
    for t, label in data["marks"]:
        ax2.axvline(t, color="grey", alpha=0.3)
        ax2.annotate(label, (t, 0), fontsize=6, rotation=90, va="bottom")
    ax2.set_xlabel("s since the cluster was ready")
    ax2.set_ylabel("resident set, MiB")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    plotting.save(fig, path)
