"""Experiment 3: the gateway's length buckets x priority queues against one FIFO queue, with
interactive (urgent) and bulk traffic arriving faster than the worker serves.

Owns the calibration (the in-process engine's capacity at the worker's batch size sets the
arrival rate at 1.5x it, so the gateway's queue grows whatever the machine's speed) and the
per-class comparison. The runs themselves are real clusters (bench/cluster_process.py) loaded by
the gRPC load generator (bench/load_generator.py); the workload is bench/load_workload.py's.
"""

from __future__ import annotations

from dataclasses import replace

from bench.cluster_process import ClusterProcess
from bench.engine_replay import replay
from bench.experiments import plotting
from bench.experiments.common import DEFAULT_MODEL_DIR, NUM_THREADS, Result, make_engine, pct, times, vocab_size
from bench.load_generator import run_load
from bench.load_workload import BULK_PRIORITY, URGENT_PRIORITY, LoadSpec, make_load_workload

NUMBER, NAME = 3, "priority"
TITLE = "Priority and length buckets vs one FIFO queue"
MAX_NUM_SEQS = 4  # a small worker batch, so the backlog waits in the gateway's queue
OVERLOAD = 1.5  # arrivals per second as a multiple of what the worker serves
SPEC = LoadSpec(urgent_fraction=0.3, seed=3)  # 30% interactive; prompts and outputs as the cluster bench


def calibrate(vocab: int, ctx: int, num_requests: int) -> float:
    """Requests/s the in-process engine serves with the worker's batch size, closed loop."""
    engine = make_engine(DEFAULT_MODEL_DIR, max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=False)
    workload = make_load_workload(replace(SPEC, num_requests=num_requests, rate=0, seed=SPEC.seed + 50), vocab, ctx)
    replay(engine, workload[:2], concurrency=2, prefix="warm")
    return replay(engine, workload, concurrency=MAX_NUM_SEQS, prefix="cal").summary().requests_per_s


def class_stats(result) -> dict:
    by_p = result.by_priority()
    urgent, bulk = by_p[URGENT_PRIORITY], by_p[BULK_PRIORITY]
    return {"urgent_ttft_ms": list(urgent.ttft_ms), "urgent_e2e_s": list(urgent.e2e_s),
            "bulk_ttft_ms": list(bulk.ttft_ms), "bulk_tokens_per_s": bulk.tokens_per_s,
            "completed": result.summary().completed, "requests": len(result.records),
            "urgent_ttfts_ms": sorted(r.ttft_s * 1e3 for r in result.records
                                      if r.priority == URGENT_PRIORITY and r.ok and r.ttft_s is not None),
            "queue_depth_max": result.extra.get("queue_depth_max")}


def run(quick: bool = False) -> Result:
    vocab, ctx = vocab_size(DEFAULT_MODEL_DIR), 512
    capacity = calibrate(vocab, ctx, 10 if quick else 24)
    duration_s = 6.0 if quick else 15.0
    rate = OVERLOAD * capacity
    spec = replace(SPEC, rate=rate, num_requests=max(12, round(rate * duration_s)))
    workload = make_load_workload(spec, vocab, ctx)
    warmup = make_load_workload(replace(SPEC, num_requests=2, rate=0, seed=SPEC.seed + 100), vocab, ctx)
    stats = {}
    for policy in ("fifo", "priority"):
        # max_queued 0: the worker holds only what it runs; the backlog is ordered by the policy under test.
        sections = {"worker": {"num_threads": NUM_THREADS, "max_num_seqs": MAX_NUM_SEQS, "max_queued": 0,
                               "enable_prefix_caching": False},
                    "queues": {"policy": policy}}
        with ClusterProcess(DEFAULT_MODEL_DIR, 1, sections) as cluster:
            run_load(cluster.address, warmup, concurrency=2, request_prefix="warm", poll_status=False)
            stats[policy] = class_stats(run_load(cluster.address, workload, label=policy, request_prefix=policy))
    fifo, prio = stats["fifo"], stats["priority"]
    rows = [[name, s["urgent_ttft_ms"][0], s["urgent_ttft_ms"][1], s["urgent_e2e_s"][0], s["urgent_e2e_s"][1],
             s["bulk_ttft_ms"][1], s["bulk_tokens_per_s"], f"{s['completed']} / {s['requests']}"]
            for name, s in (("one FIFO queue", fifo), ("buckets x priority (default)", prio))]
    cost = 1 - prio["bulk_tokens_per_s"] / fifo["bulk_tokens_per_s"]
    fifo_p99, prio_p99 = fifo["urgent_ttft_ms"][1], prio["urgent_ttft_ms"][1]
    return Result(
        headers=["gateway queues", "interactive TTFT p50 ms", "interactive TTFT p99 ms", "interactive E2E p50 s",
                 "interactive E2E p99 s", "bulk TTFT p99 ms", "bulk out tok/s", "completed"],
        rows=rows,
        headline=(f"priorities cut the interactive class's p99 TTFT from {fifo_p99:.0f} to {prio_p99:.0f} ms "
                  f"({times(fifo_p99 / prio_p99)}) and its p99 end-to-end latency from "
                  f"{fifo['urgent_e2e_s'][1]:.2f} to {prio['urgent_e2e_s'][1]:.2f} s; "
                  f"bulk throughput goes from {fifo['bulk_tokens_per_s']:.1f} to {prio['bulk_tokens_per_s']:.1f} "
                  f"output tokens/s ({'+' if cost <= 0 else ''}{pct(-cost)})"),
        data={"policies": stats, "capacity_rps": capacity, "rate_rps": rate, "num_requests": spec.num_requests,
              "workload": spec.describe()})


def plot(data: dict, path) -> None:
    pol = data["policies"]
    fig, (ax1, ax2) = plotting.figure(2, f"Experiment 3: {data['num_requests']} requests at "
                                         f"{data['rate_rps']:.1f} req/s into a 4-sequence worker")
    for name, label in (("fifo", "one FIFO queue"), ("priority", "buckets x priority")):
        xs = pol[name]["urgent_ttfts_ms"]
        ax1.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post", label=label)
    ax1.set_xscale("log")
    ax1.set_xlabel("interactive requests' time to first token, ms")
    ax1.set_ylabel("fraction of interactive requests")
    ax1.legend(fontsize=8)
    plotting.bars(ax2, ["one FIFO queue", "buckets x priority"],
                  [pol["fifo"]["bulk_tokens_per_s"], pol["priority"]["bulk_tokens_per_s"]], "bulk output tokens/s")
    plotting.save(fig, path)
