"""`python -m bench.http_vs_grpc [--quick] [--json PATH]`: the OpenAI HTTP API against gRPC, and against llama-server.

Side by side in one run, on the same seeded workload (bench/load_workload.py), closed loop, each
side's rounds alternating and the medians reported:
  (a) per-token path cost: one cluster whose worker is bench/fake_worker.py (one token per running
      request every --step-ms, so the worker is never the bottleneck), driven over gRPC
      (bench/load_generator.py) and over its OpenAI API (bench/openai_load.py) with the official
      openai client and (unless --no-httpx-side) with plain httpx2: output tokens/s,
      the ratio HTTP / gRPC, ITL p50 / p99, and the worker-send -> client-receive latency of each
      token (the fake worker's send times, matched through the gateway's request log);
      (a') the same with one stream at a time;
  (b) a real model: a 1-worker cluster serving bench-small with a real worker, over gRPC and HTTP;
  (c) llama.cpp's llama-server serving the same weights (bench-small as float32 GGUF), `-t 2`,
      `-np` = the concurrency, `-cb`, the same workload over its OpenAI endpoint, beside (b)'s
      rounds, against a second 1-worker cluster with the default settings, which on a host of
      fewer than 8 cores give the worker every core, as llama-server has them (side "HTTP, every
      core"); ratio: that HTTP / llama-server. Skipped, with the reason, where llama.cpp is absent.
Targets: HTTP >= 90% of gRPC's throughput; < 1 ms added ITL p50 (HTTP minus gRPC).
(a) and (b) measure the path, so their clusters keep a core for the gateway (worker.reserved_cores
1, as in bench/cluster_vs_engine.py) and their client runs on it; llama-server and the cluster on
every core share both cores with an unpinned client.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from bench.cluster_process import ClusterProcess, free_port
from bench.contention import busy_other_processes, wait_for_idle
from bench.cpu_share import cpu_accounting, pinned_to
from bench.http_vs_grpc_report import busy_profile, compare, print_report, side_summary, targets
from bench.load_generator import run_load
from bench.load_stats import LoadResult, percentile
from bench.load_workload import LoadRequest, LoadSpec, make_load_workload, workload_totals
from bench.openai_load import CLIENTS, CLUSTER_EXTRA, run_openai_load
from bench.results_file import write_results
from bench.serving_model import model_limits, resolve_model

FOREIGN_WARN = 0.10
LLAMA_EXTRA = {"cache_prompt": False}  # alternating rounds repeat prompts: no KV reuse across them
DEFAULT_JSON = Path("bench/results/http_vs_grpc.json")
HTTPX_SIDE = "HTTP, httpx client"
EVERY_CORE_SIDE = "HTTP, every core"
# The path's measurements: the gateway and the client on a core of their own.
RESERVED = {"reserved_cores": 1}


@dataclass(frozen=True)
class Plan:
    fake_requests: int  # (a) closed loop
    single_requests: int  # (a') one stream at a time
    single_tokens: int
    model_requests: int  # (b), (c)
    repeats: int  # rounds per side, alternating
    concurrency: int = 16
    warmup_requests: int = 4


FULL = Plan(fake_requests=128, single_requests=3, single_tokens=128, model_requests=96, repeats=3)
QUICK = Plan(fake_requests=48, single_requests=2, single_tokens=64, model_requests=24, repeats=2)


def log(msg: str) -> None:
    print(f"[http-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.http_vs_grpc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests, 2 rounds a side (about 2 minutes)")
    p.add_argument("--json", metavar="PATH", default="",
                   help=f"where to write every result (default {DEFAULT_JSON}, or *_quick.json with --quick)")
    p.add_argument("--client", choices=CLIENTS, default="openai", help="the HTTP client (bench/openai_load.py)")
    p.add_argument("--concurrency", type=int, default=0, help="streams in (a), (b), (c); 0 = the plan's (16)")
    p.add_argument("--step-ms", type=float, default=20.0, help="(a)'s fake worker step")
    p.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--skip-fake", action="store_true", help="skip (a)")
    p.add_argument("--skip-model", action="store_true", help="skip (b) and (c)")
    p.add_argument("--skip-llama", action="store_true", help="skip (c)")
    p.add_argument("--no-httpx-side", action="store_true",
                   help="in (a), leave out the third side: HTTP through plain httpx2 instead of the openai client")
    p.add_argument("--profile", action="store_true",
                   help="afterwards, run (a)'s closed loop once more per protocol with the gateway under cProfile "
                        "and print the gateway's top functions by own time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for other processes to stop using the CPU before starting")
    p.add_argument("--retries", type=int, default=1,
                   help=f"re-run a round (after waiting up to 2 min for an idle CPU) when other processes used "
                        f"> {FOREIGN_WARN * 100:.0f}%% of the CPU during it; the least-disturbed attempt is kept")
    return p.parse_args(argv)


# ---- where the client runs ----------------------------------------------------------------------
_core_plan: dict[str, list[int]] = {}


def pinned(role: str | None):
    return pinned_to(_core_plan.get(role) if role else None)


# ---- one round of one side ------------------------------------------------------------------------
Side = Callable[[list[LoadRequest], int, str], LoadResult]  # (workload, concurrency, request prefix)


def grpc_side(cluster: ClusterProcess) -> Side:
    def run(workload, concurrency, prefix):
        return run_load(cluster.address, workload, concurrency=concurrency, label="gRPC", request_prefix=prefix,
                        poll_status=False)
    return run


def http_side(base_url: str, client: str, extra: dict | None, label: str) -> Side:
    def run(workload, concurrency, prefix):
        return run_openai_load(base_url, workload, concurrency=concurrency, label=label, client=client,
                               extra_body=extra, request_prefix=prefix)
    return run


def measured(label: str, side: Side, workload, concurrency: int, prefix: str, cpu_of, pin: str | None,
             retries: int) -> LoadResult:
    """One round; while other processes took more than FOREIGN_WARN of the CPU, wait for an idle CPU and
    run it again (up to `retries` times), keeping the least-disturbed attempt."""
    log(label)
    best = None
    for attempt in range(retries + 1):
        acct: dict = {}
        with cpu_accounting(acct, cpu_of), pinned(pin):
            result = side(workload, concurrency, f"{prefix}{attempt}")
        result.extra["cpu"] = acct
        result.extra["prefix"] = f"{prefix}{attempt}"
        if best is None or acct["foreign_share"] < best.extra["cpu"]["foreign_share"]:
            best = result
        if acct["foreign_share"] <= FOREIGN_WARN or attempt == retries:
            break
        log(f"{label}: other processes used {acct['foreign_share']:.0%} of the CPU; retrying")
        wait_for_idle(120)
    best.extra["attempts"] = attempt + 1
    return best


def alternate(label: str, sides: dict[str, tuple[Side, Callable, str | None]], workload, concurrency: int,
              repeats: int, retries: int, tag: str) -> dict[str, list[LoadResult]]:
    """Each side once per round, in turn, so a slow drift of the machine hits all sides alike."""
    out: dict[str, list[LoadResult]] = {name: [] for name in sides}
    for rep in range(repeats):
        for i, (name, (side, cpu_of, pin)) in enumerate(sides.items()):
            # Request ids are `{tag}{side}-{round}-{attempt}-{index}`: letters, digits and dashes only.
            out[name].append(measured(f"{label}: {name} ({rep + 1}/{repeats})", side, workload, concurrency,
                                      f"{tag}{i}-{rep}-", cpu_of, pin, retries))
    return out


# ---- the fake worker's send times ---------------------------------------------------------------
def internal_ids(gateway_log: Path) -> dict[str, str]:
    """Client request id -> the id the worker saw, from the gateway's request log."""
    out = {}
    for line in gateway_log.read_text(errors="replace").splitlines():
        if '"event":"request"' in line:
            try:
                record = json.loads(line[line.index("{"):])
            except json.JSONDecodeError:
                continue
            if record.get("internal_id"):
                out[record["request_id"]] = record["internal_id"]
    return out


def path_latencies(result: LoadResult, prefix: str, ids: dict[str, str], trace: dict[str, list[float]]) -> list[float]:
    """Per token-bearing chunk: its arrival at the client minus the fake worker's send of its last token, ms."""
    t0 = result.extra["t0_perf_counter"]
    out = []
    for record in result.records:
        sends = trace.get(ids.get(f"{prefix}-{record.index}", ""), [])
        seen = 0
        for t, n in record.chunks:
            seen += n
            if seen <= len(sends):
                out.append((t0 + t - sends[seen - 1]) * 1e3)
    return out


# ---- the phases ---------------------------------------------------------------------------------
def fake_phase(args, plan, model_dir, vocab, ctx, specs) -> dict:
    trace_dir = Path(tempfile.mkdtemp(prefix="icb-http-"))
    trace_path = trace_dir / "trace.json"
    sections = {"gateway": {"http_port": free_port()},
                "worker": {"max_num_seqs": max(32, plan.concurrency), "max_queued": 0, **RESERVED}}
    cluster = ClusterProcess(model_dir, 1, sections,
                             worker_module=["bench.fake_worker", "--step-ms", str(args.step_ms),
                                            "--trace", str(trace_path)])
    log(f"(a) starting a cluster with a fake worker (step {args.step_ms:g} ms)")
    cluster.start(ready_timeout_s=60)
    try:
        url = f"http://127.0.0.1:{cluster.http_port}"
        sides = {"gRPC": (grpc_side(cluster), cluster.cpu_seconds, "gateway"),
                 "HTTP": (http_side(url, args.client, CLUSTER_EXTRA, "HTTP"), cluster.cpu_seconds, "gateway")}
        if not args.no_httpx_side and args.client != "httpx":
            sides[HTTPX_SIDE] = (http_side(url, "httpx", CLUSTER_EXTRA, HTTPX_SIDE), cluster.cpu_seconds, "gateway")
        warm = make_load_workload(specs["warmup"], vocab, ctx)
        for side, _, _ in sides.values():
            side(warm, 4, "warm-")
        many = make_load_workload(specs["fake"], vocab, ctx)
        closed = alternate(f"(a) fake worker, closed loop {plan.concurrency}", sides, many, plan.concurrency,
                           plan.repeats, args.retries, "a")
        one = make_load_workload(specs["single"], vocab, ctx)
        single = alternate("(a') fake worker, one stream", sides, one, 1, plan.repeats, args.retries, "s")
        ids = internal_ids(cluster.run_dir / "gateway.log")
    finally:
        cluster.stop(keep_run_dir=True)  # the fake worker writes its trace as it exits
        shutil.rmtree(cluster.run_dir, ignore_errors=True)
    trace = json.loads(trace_path.read_text()) if trace_path.exists() else {}
    shutil.rmtree(trace_dir, ignore_errors=True)
    for runs in (closed, single):
        for results in runs.values():
            for r in results:
                lat = path_latencies(r, r.extra["prefix"], ids, trace)
                r.extra["path_ms"] = {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)}
    return {"closed": closed, "single": single}


def profile_phase(args, plan, model_dir, vocab, ctx, specs) -> dict[str, str]:
    """(a)'s closed loop once per protocol, each against its own gateway under cProfile: the top functions."""
    import pstats
    out = {}
    workload = make_load_workload(specs["fake"], vocab, ctx)
    for name in ("gRPC", "HTTP"):
        prof_dir = Path(tempfile.mkdtemp(prefix="icb-prof-"))
        prof = prof_dir / "gateway.prof"
        cluster = ClusterProcess(model_dir, 1, {"gateway": {"http_port": free_port()},
                                                "worker": {"max_num_seqs": max(32, plan.concurrency), "max_queued": 0,
                                                           **RESERVED}},
                                 gateway_module=["cProfile", "-o", str(prof), "-m", "gateway"],
                                 worker_module=["bench.fake_worker", "--step-ms", str(args.step_ms),
                                                "--trace", str(prof_dir / "trace.json")])
        log(f"profile: {name} against a gateway under cProfile")
        with cluster:
            side = (grpc_side(cluster) if name == "gRPC" else
                    http_side(f"http://127.0.0.1:{cluster.http_port}", args.client, CLUSTER_EXTRA, "HTTP"))
            with pinned("gateway"):
                result = side(workload, plan.concurrency, "p-")
        out[name] = (busy_profile(pstats.Stats(str(prof)), result.summary().output_tokens, name) if prof.exists()
                     else f"{name}: no profile written")
        shutil.rmtree(prof_dir, ignore_errors=True)
    return out


def model_phase(args, plan, model_dir, vocab, ctx, specs) -> dict:
    workload = make_load_workload(specs["model"], vocab, ctx)
    warm = make_load_workload(specs["warmup"], vocab, ctx)
    llama, reason = None, ""
    if not args.skip_llama:
        from bench.llama_server import LlamaServer, bench_small_gguf, find_llama_cpp
        llama_dir, reason = find_llama_cpp()
        if llama_dir is not None:
            try:
                gguf = bench_small_gguf(llama_dir)
                slot_ctx = max(r.prompt_len + r.max_tokens for r in workload + warm)
                slot_ctx = -(-slot_ctx // 256) * 256
                llama = LlamaServer(llama_dir, gguf, threads=args.llama_threads, parallel=plan.concurrency,
                                    ctx=slot_ctx * plan.concurrency)
            except ImportError as e:
                reason = f"cannot convert bench-small to GGUF: {e} (pip install sentencepiece)"
            except (RuntimeError, OSError) as e:
                reason = f"cannot convert bench-small to GGUF: {e}"
    else:
        reason = "--skip-llama"
    if llama is None:
        log(f"(c) skipped: {reason}")
    worker = {"enable_prefix_caching": False, "max_num_seqs": max(32, plan.concurrency)}
    log("(b) starting a 1-worker cluster serving bench-small")
    with ClusterProcess(model_dir, 1, {"gateway": {"http_port": free_port()},
                                       "worker": {**worker, **RESERVED}}) as cluster:
        url = f"http://127.0.0.1:{cluster.http_port}"
        sides = {"gRPC": (grpc_side(cluster), cluster.cpu_seconds, "gateway"),
                 "HTTP": (http_side(url, args.client, CLUSTER_EXTRA, "HTTP"), cluster.cpu_seconds, "gateway")}
        every_core = None
        try:
            if llama is not None:
                log("(c) starting a 1-worker cluster with the default cores")
                every_core = ClusterProcess(model_dir, 1, {"gateway": {"http_port": free_port()}, "worker": worker})
                every_core.start(ready_timeout_s=120)
                sides[EVERY_CORE_SIDE] = (
                    http_side(f"http://127.0.0.1:{every_core.http_port}", args.client, CLUSTER_EXTRA, EVERY_CORE_SIDE),
                    every_core.cpu_seconds, None)
                log(f"(c) starting llama-server: {' '.join(llama.args[1:])}")
                llama.start()
                sides["llama-server"] = (http_side(llama.base_url, args.client, LLAMA_EXTRA, "llama-server"),
                                         lambda: {**cluster.cpu_seconds(), **llama.cpu_seconds()}, None)
            for side, _, _ in sides.values():
                side(warm, 4, "warm-")
            runs = alternate(f"(b) bench-small, closed loop {plan.concurrency}", sides, workload, plan.concurrency,
                             plan.repeats, args.retries, "b")
        finally:
            if llama is not None:
                llama.stop()
            if every_core is not None:
                every_core.stop()
    return {"runs": runs, "llama_skipped": reason if llama is None else "",
            "llama_args": llama.args[1:] if llama is not None else None}


def specs_for(plan: Plan, seed: int) -> dict[str, LoadSpec]:
    return {"warmup": LoadSpec(num_requests=plan.warmup_requests, rate=0, short_output=(8, 16),
                               long_output=(8, 16), seed=seed + 100),
            "fake": LoadSpec(num_requests=plan.fake_requests, rate=0, seed=seed + 1),
            "single": LoadSpec(num_requests=plan.single_requests, rate=0, long_fraction=0.0, short_prompt=(64, 64),
                               short_output=(plan.single_tokens, plan.single_tokens), seed=seed + 4),
            "model": LoadSpec(num_requests=plan.model_requests, rate=0, seed=seed + 2)}


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.concurrency:
        from dataclasses import replace
        plan = replace(plan, concurrency=args.concurrency)
    from shared.config import load_config
    from shared.cpu_affinity import plan_cores
    _core_plan.update(plan_cores(load_config(None, {"num_workers": 1, "worker.reserved_cores": 1})) or {})
    t_start = time.perf_counter()
    model_dir = resolve_model("bench-small")
    vocab, ctx = model_limits(model_dir)
    specs = specs_for(plan, args.seed)
    busy = wait_for_idle(args.wait_idle)
    log(f"model {model_dir}; busy before start: {busy or 'none'}")
    phases: dict[str, dict[str, list[LoadResult]]] = {}
    llama_skipped, llama_args = "", None
    if not args.skip_fake:
        fake = fake_phase(args, plan, model_dir, vocab, ctx, specs)
        phases["(a) fake worker"] = fake["closed"]
        phases["(a') fake worker, one stream"] = fake["single"]
    if not args.skip_model:
        model = model_phase(args, plan, model_dir, vocab, ctx, specs)
        phases["(b) bench-small"] = model["runs"]
        llama_skipped, llama_args = model["llama_skipped"], model["llama_args"]
    profiles = profile_phase(args, plan, model_dir, vocab, ctx, specs) if args.profile else {}
    summaries = {phase: {name: side_summary(rs) for name, rs in sides.items()} for phase, sides in phases.items()}
    comparisons = {}
    for phase, label in (("(a) fake worker", "(a) HTTP / gRPC, fake worker"),
                         ("(a') fake worker, one stream", "(a') HTTP / gRPC, fake worker, one stream"),
                         ("(b) bench-small", "(b) HTTP / gRPC, bench-small")):
        if phase in summaries:
            comparisons[label] = compare(summaries[phase], "gRPC", "HTTP")
            if HTTPX_SIDE in summaries[phase]:
                comparisons[label.replace("HTTP", "HTTP (httpx client)", 1)] = compare(summaries[phase], "gRPC",
                                                                                       HTTPX_SIDE)
    if "llama-server" in summaries.get("(b) bench-small", {}):
        comparisons["(c) our HTTP, every core / llama-server, bench-small"] = compare(
            summaries["(b) bench-small"], "llama-server", EVERY_CORE_SIDE)
    report = {"model_dir": str(model_dir), "client": args.client, "concurrency": plan.concurrency,
              "step_ms": args.step_ms, "llama_threads": args.llama_threads, "llama_args": llama_args,
              "llama_skipped": llama_skipped, "cpus": os.cpu_count(), "cores": dict(_core_plan),
              "plan": asdict(plan), "busy_before": busy,
              "specs": {k: v.describe() for k, v in specs.items()},
              "workloads": {k: workload_totals(make_load_workload(v, vocab, ctx)) for k, v in specs.items()},
              "phases": summaries, "comparisons": comparisons, "targets": targets(comparisons),
              "profiles": profiles}
    report["busy_after"] = busy_other_processes()
    report["total_s"] = time.perf_counter() - t_start
    print_report(report)
    out = {**report, "runs": {phase: {name: [r.to_dict(with_records=True) for r in rs] for name, rs in sides.items()}
                              for phase, sides in phases.items()}}
    path = write_results(out, args.json, DEFAULT_JSON, args.quick)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
