"""`python -m bench.routing [--quick]`: cache-aware routing against least-loaded and round-robin (issue 20).

For each cluster (8 and 32 fake workers, 2 real workers on models/default) and each policy, plus a
baseline of ONE worker holding the cluster's whole cache (the hit-rate reference), a fresh
cluster plays three workloads (bench/routing_workload.py): multi-turn chat, each turn's prompt
extending the last and sent as the previous reply ends; the same with a think time between turns;
and a no-sharing twin with the same arrivals and lengths. Per run: the prefix-cache hit rate
(cached prompt tokens / prompt tokens, from each response's usage), TTFT p50/p99 and throughput
(bench/load_stats.py), and the gateway's routing decisions. Then the targets: cache_aware's hit
rate >= 90% of one worker's, least_loaded's TTFT p50 >= 1.5x cache_aware's (multi-turn), and
cache_aware's throughput >= 95% of least_loaded's (no-sharing). Fake workers (bench/fake_worker.py)
prefill one request at a time at --prefill-us-per-token per uncached token, so prefill dominates
TTFT, in a cache of --cache-blocks each (small: spreading a conversation's turns over workers costs
its hits). JSON goes to bench/results/routing.json (--quick: routing_quick.json).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.checkpoints import REPO_ROOT
from bench.contention import busy_other_processes, wait_for_idle
from bench.cpu_share import cpu_accounting
from bench.results_file import write_results
from bench.experiments.common import long_context_model, vocab_size
from bench.routing_driver import (POLICIES, FakeWorkers, counter_deltas, play, read_counters, start_cluster)
from bench.routing_report import print_report, ratios, summarize, targets
from bench.routing_workload import WORKLOADS, ChatSpec, make_conversations

SINGLE = "single_worker"  # the baseline's row: one worker, the cluster's whole cache, all conversations
RUNS = (*POLICIES, SINGLE)
DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "routing.json"
SETTLE_S = 0.5  # after a run, for the heartbeats that carry the workers' last counters


@dataclass(frozen=True)
class ClusterPlan:
    name: str
    num_workers: int
    spec: ChatSpec
    fake: FakeWorkers | None  # None: real workers
    worker_section: dict = field(default_factory=dict)


def plans(quick: bool, fake: FakeWorkers, names: list[str] | None = None) -> list[ClusterPlan]:
    """The clusters to run (`names` as on the command line: "8fake", "2real"). models/default is fast
    enough on this CPU that the real workers play the fake clusters' whole workload."""
    if quick:
        spec = ChatSpec(num_conversations=8, num_turns=4, rate=8.0, think_s=0.5)
        out = [ClusterPlan("2 fake", 2, spec, fake), ClusterPlan("4 fake", 4, spec, fake)]
    else:
        out = [ClusterPlan("8 fake", 8, ChatSpec(), fake), ClusterPlan("32 fake", 32, ChatSpec(), fake),
               ClusterPlan("2 real", 2, ChatSpec(), None, {"num_kv_blocks": fake.cache_blocks})]
    return [p for p in out if not names or p.name.replace(" ", "") in names]


def real_workers_send_kv_events() -> bool:
    return "kv_events" in (REPO_ROOT / "worker" / "service.py").read_text()


def run_policy(model_dir: Path, plan: ClusterPlan, run: str, vocab: int,
               workloads: tuple[str, ...] = WORKLOADS) -> dict[str, dict]:
    """One fresh cluster for `run` (a policy, or SINGLE), playing each workload in turn. The baseline
    is the multi-turn hit-rate reference only: it skips no_sharing (a cluster's load on one worker)."""
    single = run == SINGLE
    workloads = tuple(w for w in workloads if not (single and w == "no_sharing"))
    cluster = start_cluster(model_dir, 1 if single else plan.num_workers, "cache_aware" if single else run,
                            plan.fake, plan.worker_section, cache_scale=plan.num_workers if single else 1)
    out = {}
    try:
        for workload in workloads:
            conversations = make_conversations(plan.spec, vocab, workload)
            before = read_counters(cluster)
            acct: dict = {}
            with cpu_accounting(acct, cluster.cpu_seconds):
                records, wall_s = play(cluster.address, conversations, plan.spec)
            time.sleep(SETTLE_S)
            out[workload] = summarize(records, wall_s, counter_deltas(before, read_counters(cluster)), acct)
            log(f"{plan.name} {run} {workload}: hit {out[workload]['hit_rate']:.1%}, TTFT p50 "
                f"{out[workload]['ttft_ms_p50'] or 0:.0f} ms, {out[workload]['requests_per_s']:.2f} req/s, "
                f"{out[workload]['completed']}/{out[workload]['requests']} done")
    finally:
        cluster.stop()
    return out


def run_plan(model_dir: Path, plan: ClusterPlan, vocab: int, runs: tuple[str, ...] = RUNS,
             workloads: tuple[str, ...] = WORKLOADS) -> dict:
    results = {run: run_policy(model_dir, plan, run, vocab, workloads) for run in runs}
    return {"name": plan.name, "num_workers": plan.num_workers, "spec": plan.spec.to_dict(),
            "fake_workers": asdict(plan.fake) if plan.fake else None, "worker_section": plan.worker_section,
            "runs": results, "ratios": ratios(results)}


def log(message: str) -> None:
    print(f"[routing {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 conversations x 4 turns on 2 and 4 fake workers")
    p.add_argument("--clusters", type=lambda s: s.split(","), default=None,
                   help="only these, e.g. 8fake,32fake,2real")
    p.add_argument("--runs", type=lambda s: tuple(s.split(",")), default=RUNS,
                   help=f"policies and baseline to run (default: {','.join(RUNS)})")
    p.add_argument("--workloads", type=lambda s: tuple(s.split(",")), default=WORKLOADS,
                   help=f"default: {','.join(WORKLOADS)}")
    p.add_argument("--think-s", type=float, default=None,
                   help="multi_turn_think's mean pause between turns (default: the plan's)")
    p.add_argument("--step-ms", type=float, default=FakeWorkers.step_ms)
    p.add_argument("--prefill-us-per-token", type=float, default=FakeWorkers.prefill_us_per_token)
    p.add_argument("--cache-blocks", type=int, default=FakeWorkers.cache_blocks,
                   help="each worker's KV pool in blocks (fake and real)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for other processes to leave the CPU first")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from bench.experiments.__main__ import commit

    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every cluster started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fake = replace(FakeWorkers(), step_ms=args.step_ms, prefill_us_per_token=args.prefill_us_per_token,
                   cache_blocks=args.cache_blocks)
    model_dir = long_context_model()  # models/default's weights at a 2048-token context (the default: 512)
    vocab = vocab_size(model_dir)
    busy = wait_for_idle(args.wait_idle) if args.wait_idle else busy_other_processes()
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
                    "command": "python -m bench.routing " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "quick": args.quick, "model_dir": "models/default (context 2048)", "busy_before": busy,
                    "clusters": [], "skipped": {}}
    t0 = time.perf_counter()
    for plan in plans(args.quick, fake, args.clusters):
        if args.think_s is not None:
            plan = replace(plan, spec=replace(plan.spec, think_s=args.think_s))
        if plan.fake is None and not real_workers_send_kv_events():
            report["skipped"][plan.name] = "the real worker does not send KV events yet (worker/service.py)"
            continue
        log(f"{plan.name}: {plan.spec.describe()}")
        try:
            report["clusters"].append(run_plan(model_dir, plan, vocab, args.runs, args.workloads))
        except (TimeoutError, RuntimeError) as e:  # a cluster that never came up: say why, go on
            report["skipped"][plan.name] = f"a cluster failed to start: {str(e).splitlines()[0][:300]}"
            log(f"{plan.name}: {report['skipped'][plan.name]}")
    report["targets"] = [{"name": t.name, "value": t.value, "goal": t.goal, "status": t.status}
                         for cluster in report["clusters"] for t in targets(cluster)]
    report["busy_after"] = busy_other_processes()
    report["total_s"] = time.perf_counter() - t0
    print_report(report)
    path = write_results(report, args.json, DEFAULT_JSON, args.quick)
    log(f"wrote {path} ({report['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
