"""Experiment 8: max_tokens and end-to-end latency, the seeds' shape (4 concurrent streams x 10
requests, 128-token prompts) with 16, 32, 64 and 128 output tokens.

Owns the sweep and the 32-vs-64 ratio; requests are replayed through the in-process engine by
bench/engine_replay.py and summarised by bench/load_stats.py, as the cluster benchmarks are.
"""

from __future__ import annotations

import statistics

from bench.engine_replay import replay
from bench.experiments import plotting
from bench.experiments.common import DEFAULT_MODEL_DIR, Result, make_engine, pct, vocab_size, warm_up
from bench.load_workload import LoadSpec, make_load_workload

NUMBER, NAME = 8, "max_tokens"
TITLE = "max_tokens and end-to-end latency"
CONCURRENCY, PROMPT_LEN = 4, 128
MAX_TOKENS = (16, 32, 64, 128)


def workload(max_tokens: int, num_requests: int, vocab: int, ctx: int):
    spec = LoadSpec(num_requests=num_requests, rate=0, long_fraction=0.0, short_prompt=(PROMPT_LEN, PROMPT_LEN),
                    short_output=(max_tokens, max_tokens), urgent_fraction=0.0, seed=8)
    return make_load_workload(spec, vocab, ctx)


def run(quick: bool = False) -> Result:
    model_dir = DEFAULT_MODEL_DIR
    vocab = vocab_size(model_dir)
    num_requests = 12 if quick else CONCURRENCY * 10
    engine = make_engine(model_dir, max_num_seqs=16, enable_prefix_caching=False)
    warm_up(engine, vocab)
    repeats = 1 if quick else 3
    per_n: dict[int, list[dict]] = {n: [] for n in MAX_TOKENS}
    # Settings alternate within each repeat, so a drift of the machine hits them all alike; medians of repeats.
    for rep in range(repeats):
        for n in MAX_TOKENS:
            s = replay(engine, workload(n, num_requests, vocab, 512), concurrency=CONCURRENCY,
                       label=f"max_tokens {n}", prefix=f"mt{n}-{rep}").summary()
            per_n[n].append({"e2e_p50_s": s.e2e_s[0], "e2e_p99_s": s.e2e_s[1], "ttft_p50_ms": s.ttft_ms[0],
                             "tpot_p50_ms": s.tpot_ms_p50, "requests_per_s": s.requests_per_s,
                             "tokens_per_s": s.tokens_per_s})
    sweep = {n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in per_n.items()}
    rows = [[n, r["e2e_p50_s"] * 1e3, r["e2e_p99_s"] * 1e3, r["ttft_p50_ms"], r["tpot_p50_ms"], r["requests_per_s"]]
            for n, r in sweep.items()]
    cut = 1 - sweep[32]["e2e_p50_s"] / sweep[64]["e2e_p50_s"]
    return Result(
        headers=["max_tokens", "E2E p50 ms", "E2E p99 ms", "TTFT p50 ms", "time per output token p50 ms",
                 "requests/s"],
        rows=rows,
        headline=(f"32 instead of 64 output tokens cuts the p50 end-to-end latency by {pct(cut)} "
                  f"({sweep[64]['e2e_p50_s'] * 1e3:.0f} -> {sweep[32]['e2e_p50_s'] * 1e3:.0f} ms)"),
        data={"sweep": sweep, "cut_32_vs_64": cut, "num_requests": num_requests, "repeats": repeats,
              "per_repeat": per_n})


def plot(data: dict, path) -> None:
    sweep = data["sweep"]
    ns = [int(n) for n in sweep]
    fig, (ax,) = plotting.figure(1, f"Experiment 8: latency against max_tokens ({CONCURRENCY} streams, "
                                    f"{PROMPT_LEN}-token prompts)", width_in=7.0)
    ax.plot(ns, [r["e2e_p50_s"] * 1e3 for r in sweep.values()], marker="o", label="end-to-end p50")
    ax.plot(ns, [r["e2e_p99_s"] * 1e3 for r in sweep.values()], marker="o", label="end-to-end p99")
    ax.plot(ns, [r["ttft_p50_ms"] for r in sweep.values()], marker="o", label="time to first token p50")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("max_tokens (every request generates exactly this many)")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    plotting.save(fig, path)
