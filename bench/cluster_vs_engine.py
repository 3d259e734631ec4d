"""`python -m bench.cluster_vs_engine [--quick] [--json PATH]`: what serving through the cluster costs.

Side by side on the same seeded workloads (bench/load_workload.py), all in this one process:
  (a) throughput: a closed loop of N streams through the in-process engine and through a
      1-worker cluster (gateway + worker processes, bench/cluster_process.py) with the same
      engine settings and torch threads; target: cluster >= 90% of the engine's output tokens/s;
  (b) latency: Poisson arrivals at a fraction of the engine's measured capacity through both;
      target: the cluster adds < 2 ms to the p50 inter-token latency; (b') the same for one stream at
      a time, where nothing hides the per-token path cost;
  (c) the ratios and differences of (a) and (b), with where the cluster's CPU went;
  (d) a saturated mixed workload (urgent + bulk, arrivals above capacity, a small worker batch so
      the gateway queue builds) with queues.policy "priority" and then "fifo": urgent-class TTFT
      and bulk throughput both ways.
Every run's table has p50/p99 TTFT, ITL and end-to-end latency per length bucket and priority.
(a) and (b') alternate engine and cluster runs and report medians; prefix caching is off on both
sides (random prompts share no prefixes, and a retried run then repeats exactly the same work).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from bench.cluster_process import ClusterProcess
from bench.cluster_report import FOREIGN_WARN, print_report, representative, summarize_compare, summarize_priority
from bench.contention import busy_other_processes, wait_for_idle
from bench.cpu_share import cpu_accounting, pinned_to
from bench.engine_replay import replay
from bench.load_generator import run_load
from bench.load_stats import DEFAULT_BUCKET_BOUNDS, LoadResult
from bench.load_workload import LoadSpec, make_load_workload, workload_totals
from bench.serving_model import model_limits, resolve_model



@dataclass(frozen=True)
class Plan:
    compare_requests: int  # (a) closed loop
    compare_concurrency: int
    latency_s: float  # (b) Poisson arrivals over about this long
    latency_load: float  # (b) arrival rate as a fraction of the engine's (a) requests/s
    saturated_s: float  # (d) arrivals over about this long
    # (d) arrival rate as a multiple of the engine's (a) requests/s. The (a) engine batches 16 and (d)'s
    # worker 4, so 0.6 x that is about 1.5-2x what (d)'s worker can serve: its queue grows all run long.
    saturated_overload: float
    saturated_max_num_seqs: int
    repeats: int = 3  # (a) and (b') run this many times per side, alternating; medians are reported
    single_requests: int = 3  # (b') one stream at a time: the per-token path cost with nothing batched
    single_tokens: int = 128
    warmup_requests: int = 4
    min_requests: int = 12  # (b) and (d) never run fewer, however slow the model


# Request counts for (b) and (d) follow from measured capacity, so the run time is about the
# same for a fast or a slow model.
FULL = Plan(compare_requests=128, compare_concurrency=16, latency_s=30.0, latency_load=0.5, saturated_s=15.0,
            saturated_overload=0.6, saturated_max_num_seqs=4)
QUICK = Plan(compare_requests=32, compare_concurrency=8, latency_s=10.0, latency_load=0.5, saturated_s=6.0,
             saturated_overload=0.6, saturated_max_num_seqs=4, repeats=2, single_requests=2, single_tokens=64,
             warmup_requests=2)


def log(msg: str) -> None:
    print(f"[cluster-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.cluster_vs_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer, shorter runs (about 2-3 minutes)")
    p.add_argument("--json", metavar="PATH", help="also write every result (with per-request records) as JSON")
    p.add_argument("--model", default="auto",
                   help='"auto" (models/default if servable, else bench-small), "default", "bench-small" or a folder')
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for the engine and the worker alike; 0 = what a 1-worker cluster gets with "
                        "a core kept for the gateway (worker.reserved_cores 1: 1 thread on a 2-core host)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="engine / worker batch for (a) and (b)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the gateway's stream_interval for (a)-(c): tokens per GenerateResponse (1 = every token)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-compare", action="store_true", help="skip (a)-(c)")
    p.add_argument("--skip-priority", action="store_true", help="skip (d)")
    p.add_argument("--saturated-rate", type=float, default=0.0,
                   help="(d) arrival rate in req/s; 0 = the plan's multiple of the engine's measured capacity")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for other processes to stop using the CPU before starting")
    p.add_argument("--retries", type=int, default=1,
                   help=f"re-run a measurement (after waiting up to 2 min for an idle CPU) when other processes "
                        f"used > {FOREIGN_WARN * 100:.0f}%% of the CPU during it; the least-disturbed attempt is kept")
    return p.parse_args(argv)


# ---- configuration shared by both sides ---------------------------------------------------------
def worker_section(args, max_num_seqs: int, **extra) -> dict:
    # No prefix caching: a retried run then replays exactly the same work, and nothing here
    # shares prefixes anyway (random prompt ids).
    # A core of its own for the gateway (and the load generator beside it), whatever the host's size:
    # this measures the cluster's path, not the workers' share of a crowded core.
    return {"num_threads": args.threads, "reserved_cores": 1, "max_num_seqs": max_num_seqs,
            "enable_prefix_caching": False, **extra}


def engine_for(model_dir: Path, worker: dict):
    """The engine a worker with this [worker] section would build: same overrides, same code path."""
    from shared.config import load_config
    from worker.engine import Engine
    from worker.service import engine_config

    overrides = {f"worker.{k}": v for k, v in worker.items()}
    config = load_config(None, {"model_dir": str(model_dir), "num_workers": 1, **overrides})
    return Engine.from_model_dir(model_dir, engine_config(config))


def specs(plan: Plan, seed: int) -> dict[str, LoadSpec]:
    """Each phase its own seed. (b)'s and (d)'s rates and counts are set once the engine is measured."""
    return {"warmup": LoadSpec(num_requests=plan.warmup_requests, rate=0, short_output=(8, 16),
                               long_output=(8, 16), seed=seed + 100),
            "compare": LoadSpec(num_requests=plan.compare_requests, rate=0, seed=seed + 1),
            "latency": LoadSpec(seed=seed + 2),
            "single": LoadSpec(num_requests=plan.single_requests, rate=0, long_fraction=0.0, short_prompt=(64, 64),
                               short_output=(plan.single_tokens, plan.single_tokens), seed=seed + 4),
            "saturated": LoadSpec(seed=seed + 3)}


def paced(spec: LoadSpec, rate: float, duration_s: float, min_requests: int) -> LoadSpec:
    return replace(spec, rate=rate, num_requests=max(min_requests, round(rate * duration_s)))


def measured(label: str, fn: Callable[[int], LoadResult], retries: int) -> LoadResult:
    """Run fn(attempt); while other processes took more than FOREIGN_WARN of the CPU, wait for an idle
    CPU and run it again (up to `retries` times), keeping the least-disturbed attempt. On 2 cores a
    neighbour's burst stalls every 2-thread parallel region and can double a timing."""
    log(label)
    best = None
    for attempt in range(retries + 1):
        result = fn(attempt)
        share = result.extra["cpu"]["foreign_share"]
        if best is None or share < best.extra["cpu"]["foreign_share"]:
            best = result
        if share <= FOREIGN_WARN or attempt == retries:
            break
        log(f"{label}: other processes used {share:.0%} of the CPU; retrying ({attempt + 1}/{retries})")
        wait_for_idle(120)
    best.extra["attempts"] = attempt + 1
    return best


# ---- where each side runs -------------------------------------------------------------------------
# The cores a 1-worker cluster with these threads pins its worker and gateway to (shared/cpu_affinity.py),
# set once in main(); empty where it pins nothing. The in-process engine then runs on the worker's cores and
# the load generator on the gateway's, as a client elsewhere would leave the worker's cores alone.
_core_plan: dict[str, list[int]] = {}


def one_worker_config(threads: int = 0):
    """The config of a 1-worker cluster with `threads` torch threads (0: the cores less the gateway's one)."""
    from shared.config import load_config
    return load_config(None, {"num_workers": 1, "worker.num_threads": threads, "worker.reserved_cores": 1})


def pinned(role: str | None):
    return pinned_to(_core_plan.get(role) if role else None)


# ---- the phases ---------------------------------------------------------------------------------
def engine_run(engine, workload, label: str, prefix: str, concurrency: int = 0) -> Callable[[int], LoadResult]:
    def run(attempt: int) -> LoadResult:
        acct: dict = {}
        with cpu_accounting(acct), pinned("worker-0"):
            result = replay(engine, workload, concurrency=concurrency, label=label, prefix=f"{prefix}{attempt}")
        result.extra["cpu"] = acct
        return result
    return run


def cluster_run(cluster: ClusterProcess, workload, label: str, prefix: str,
                concurrency: int = 0) -> Callable[[int], LoadResult]:
    def run(attempt: int) -> LoadResult:
        acct: dict = {}
        with cpu_accounting(acct, cluster.cpu_seconds), pinned("gateway"):
            result = run_load(cluster.address, workload, concurrency=concurrency, label=label,
                              bucket_bounds=DEFAULT_BUCKET_BOUNDS, request_prefix=f"{prefix}{attempt}")
        result.extra["cpu"] = acct
        return result
    return run


def alternate(label: str, runs: dict[str, Callable[[int], LoadResult]], repeats: int,
              retries: int) -> dict[str, list[LoadResult]]:
    """Each side once per repeat, in turn, so a slow drift of the machine hits both sides alike."""
    out: dict[str, list[LoadResult]] = {name: [] for name in runs}
    for rep in range(repeats):
        for name, fn in runs.items():
            out[name].append(measured(f"{label}: {name} ({rep + 1}/{repeats})",
                                      lambda attempt, fn=fn, rep=rep: fn(10 * rep + attempt), retries))
    return out


def compare_phases(args, plan, model_dir, vocab, ctx, spec) -> dict:
    """(a), (b) and (b'): the engine lives in this process while the cluster runs beside it, idle in turn."""
    worker = worker_section(args, args.max_num_seqs)
    engine = engine_for(model_dir, worker)
    try:
        log("starting a 1-worker cluster")
        gateway = {"stream_interval": args.stream_interval}
        with ClusterProcess(model_dir, 1, {"worker": worker, "gateway": gateway}) as cluster:
            warmup = make_load_workload(spec["warmup"], vocab, ctx)
            replay(engine, warmup, concurrency=4, prefix="warm")
            run_load(cluster.address, warmup, concurrency=4, request_prefix="warm", poll_status=False)
            compare = make_load_workload(spec["compare"], vocab, ctx)
            c = plan.compare_concurrency
            thr = alternate(f"(a) closed loop, {c} streams", {
                "engine": engine_run(engine, compare, "engine (a)", "a", c),
                "cluster": cluster_run(cluster, compare, "cluster (a)", "a", c)}, plan.repeats, args.retries)
            capacity = statistics.median(r.summary().requests_per_s for r in thr["engine"])
            lat_spec = paced(spec["latency"], plan.latency_load * capacity, plan.latency_s, plan.min_requests)
            poisson = make_load_workload(lat_spec, vocab, ctx)
            lat = alternate(f"(b) Poisson {lat_spec.rate:.2f} req/s, {lat_spec.num_requests} requests", {
                "engine": engine_run(engine, poisson, "engine (b)", "b"),
                "cluster": cluster_run(cluster, poisson, "cluster (b)", "b")}, 1, args.retries)
            one = make_load_workload(spec["single"], vocab, ctx)
            single = alternate("(b') one stream at a time", {
                "engine": engine_run(engine, one, "engine (b')", "s", 1),
                "cluster": cluster_run(cluster, one, "cluster (b')", "s", 1)}, plan.repeats, args.retries)
    finally:
        del engine
        gc.collect()
    return {"throughput": thr, "latency": lat, "single": single, "capacity_rps": capacity, "latency_spec": lat_spec}


def priority_phases(args, plan, model_dir, vocab, ctx, sat_spec) -> dict:
    workload = make_load_workload(sat_spec, vocab, ctx)
    warmup = make_load_workload(replace(sat_spec, num_requests=plan.warmup_requests, seed=sat_spec.seed + 100,
                                        rate=0), vocab, ctx)
    out = {}
    for policy in ("priority", "fifo"):
        # max_queued 0: the worker holds only what it runs, so the backlog waits in the gateway's queue,
        # where the policy under test orders it.
        sections = {"worker": worker_section(args, plan.saturated_max_num_seqs, max_queued=0),
                    "queues": {"policy": policy}}
        with ClusterProcess(model_dir, 1, sections) as cluster:
            run_load(cluster.address, warmup, concurrency=2, request_prefix="warm", poll_status=False)
            out[policy] = measured(
                f"(d) cluster, queues.policy = {policy!r}: Poisson {sat_spec.rate:.2f} req/s, "
                f"{sat_spec.num_requests} requests",
                cluster_run(cluster, workload, f"{policy} (d)", f"d-{policy}"), args.retries)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from shared.cpu_affinity import plan_cores
    if args.threads <= 0:
        args.threads = one_worker_config().worker_threads()  # what `honcho start` with one worker gives it
    _core_plan.update(plan_cores(one_worker_config(args.threads)) or {})
    plan = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    model_dir = resolve_model(args.model)
    vocab, ctx = model_limits(model_dir)
    spec = specs(plan, args.seed)
    busy = wait_for_idle(args.wait_idle)
    results: dict = {"model_dir": str(model_dir), "vocab": vocab, "context": ctx, "threads": args.threads,
                     "cores": dict(_core_plan),
                     "stream_interval": args.stream_interval, "cpus": os.cpu_count(), "plan": plan.__dict__,
                     "busy_before": busy, "runs": [], "all_runs": [],
                     "specs": {}}
    log(f"model {model_dir}; busy before start: {busy or 'none'}")
    capacity = None
    if not args.skip_compare:
        phases = compare_phases(args, plan, model_dir, vocab, ctx, spec)
        for key in ("throughput", "latency", "single"):
            results["runs"] += [representative(phases[key][side]) for side in ("engine", "cluster")]
            results["all_runs"] += phases[key]["engine"] + phases[key]["cluster"]
        results["compare"] = summarize_compare(phases)
        results["specs"].update(compare=spec["compare"].describe(), latency=phases["latency_spec"].describe(),
                                single=spec["single"].describe())
        capacity = phases["capacity_rps"]
    if not args.skip_priority:
        rate = args.saturated_rate or plan.saturated_overload * (capacity or 1.0)
        sat_spec = paced(spec["saturated"], rate, plan.saturated_s, plan.min_requests)
        runs = priority_phases(args, plan, model_dir, vocab, ctx, sat_spec)
        results["runs"] += list(runs.values())
        results["all_runs"] += list(runs.values())
        results["priority"] = summarize_priority(runs, rate, plan.saturated_max_num_seqs, sat_spec)
        results["specs"]["saturated"] = sat_spec.describe()
        results["saturated_workload"] = workload_totals(make_load_workload(sat_spec, vocab, ctx))
    results["busy_after"] = busy_other_processes()
    results["total_s"] = time.perf_counter() - t_start
    print_report(results)
    for name, text in results["specs"].items():
        print(f"workload {name}: {text}")
    print(f"busy before: {results['busy_before'] or 'none'}; after: {results['busy_after'] or 'none'}; "
          f"total {results['total_s']:.0f} s")
    if args.json:
        out = {**results, "runs": [r.to_dict() for r in results["runs"]],
               "all_runs": [r.to_dict(with_records=True) for r in results["all_runs"]]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
