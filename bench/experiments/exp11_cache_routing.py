"""Experiment 11: cache-aware routing against least-loaded and round-robin as the cluster grows.

Owns only the sweep: 2 to 16 model-free workers (bench/fake_worker.py: prefill 1 ms per uncached
prompt token, one request at a time, a 256-block cache each) play the multi-turn chat with think
time between turns (bench/routing_workload.py) under each policy, beside one worker holding the
whole cluster's cache, the hit-rate reference. Clusters, clients and numbers are
bench/routing.py's; the gateway's routing is under test, so no model runs.
"""
from __future__ import annotations

from bench.experiments import plotting
from bench.experiments.common import Result, long_context_model, pct, vocab_size
from bench.routing import RUNS, SINGLE, ClusterPlan, run_plan
from bench.routing_driver import POLICIES, FakeWorkers
from bench.routing_workload import ChatSpec

NUMBER, NAME = 11, "cache_routing"
TITLE = "Cache-aware routing as the cluster grows"
WORKLOAD = "multi_turn_think"
STYLE = {"cache_aware": "tab:green", "least_loaded": "tab:blue", "round_robin": "tab:orange", SINGLE: "grey"}


def _decisions(counters: dict) -> str:
    prefix = "inference_routing_decisions_total{"
    return ", ".join(f"{k[len(prefix):-1]} {v:.0f}" for k, v in counters.items() if k.startswith(prefix))


def run(quick: bool = False) -> Result:
    model_dir = long_context_model()  # the longest turn is longer than models/default's 512
    vocab = vocab_size(model_dir)
    sizes = (2, 4) if quick else (2, 4, 8, 16)
    spec = ChatSpec(num_conversations=8, num_turns=4, rate=8.0, think_s=0.5) if quick else ChatSpec()
    fake = FakeWorkers()
    by_size: dict[int, dict[str, dict]] = {}
    rows = []
    for n in sizes:
        result = run_plan(model_dir, ClusterPlan(f"{n} fake", n, spec, fake), vocab, RUNS, (WORKLOAD,))
        by_size[n] = {}
        for policy in RUNS:
            s = result["runs"][policy][WORKLOAD]
            by_size[n][policy] = {k: s[k] for k in ("hit_rate", "ttft_ms_p50", "ttft_ms_p99", "requests_per_s",
                                                    "workers_per_conversation", "requests_per_worker",
                                                    "completed", "requests", "counters")}
            rows.append([n, policy, pct(s["hit_rate"]), s["ttft_ms_p50"], s["ttft_ms_p99"], s["requests_per_s"],
                         f"{len(s['requests_per_worker'])} / {1 if policy == SINGLE else n}",
                         s["workers_per_conversation"], _decisions(s["counters"]) or "-"])
    top = by_size[sizes[-1]]
    ca, ll, one = top["cache_aware"], top["least_loaded"], top[SINGLE]
    return Result(
        headers=["workers", "policy", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "requests/s", "workers used",
                 "workers per conversation", "routing decisions"],
        rows=rows,
        headline=(f"on {sizes[-1]} workers cache_aware finds {ca['hit_rate']:.0%} of prompt tokens cached "
                  f"({ca['hit_rate'] / one['hit_rate']:.0%} of one worker's {one['hit_rate']:.0%}), least_loaded "
                  f"{ll['hit_rate']:.0%}; TTFT p50 {ca['ttft_ms_p50']:.0f} against {ll['ttft_ms_p50']:.0f} ms"),
        data={"sizes": list(sizes), "by_size": by_size, "spec": spec.to_dict(),
              "fake_workers": {"step_ms": fake.step_ms, "prefill_us_per_token": fake.prefill_us_per_token,
                               "cache_blocks": fake.cache_blocks}, "workload": WORKLOAD},
        notes=[f"workload: {spec.describe()}; {WORKLOAD}",
               f"fake workers: {fake.step_ms:g} ms a token, prefill {fake.prefill_us_per_token:g} us per uncached "
               f"token one request at a time, {fake.cache_blocks} cache blocks each (the baseline: n x that)"])


def plot(data: dict, path) -> None:
    sizes = [int(n) for n in data["sizes"]]
    by_size = {int(n): v for n, v in data["by_size"].items()}
    fig, (ax1, ax2) = plotting.figure(2, "Experiment 11: routing multi-turn chat over model-free workers")
    for policy in (*POLICIES, SINGLE):
        if not all(policy in by_size[n] for n in sizes):
            continue
        style = dict(color=STYLE[policy], marker="o", linestyle="--" if policy == SINGLE else "-",
                     label="one worker, whole cache" if policy == SINGLE else policy)
        ax1.plot(sizes, [by_size[n][policy]["hit_rate"] * 100 for n in sizes], **style)
        if policy != SINGLE:  # one worker carries the whole load: its TTFT is about queueing, not routing
            ax2.plot(sizes, [by_size[n][policy]["ttft_ms_p50"] for n in sizes], **style)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("workers")
        ax.legend(fontsize=8)
    ax1.set_ylabel("prompt tokens served from cache, %")
    ax1.set_ylim(0, 100)
    ax2.set_ylabel("TTFT p50, ms (log)")
    ax2.set_yscale("log")  # a 2-worker cluster is overloaded: seconds, beside tens of ms
    plotting.save(fig, path)
