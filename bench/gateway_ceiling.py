"""`python -m bench.gateway_ceiling [--quick]`: how many tokens/s one gateway process relays (issue 21).

One gateway fronts 8, 32 and 128 model-free workers (bench/fake_worker.py, several to a process,
each its own ZeroMQ peer) over tcp://127.0.0.1 with CURVE (the cluster's run-dir keys, as every
tcp:// deployment has keys). For `gateway.stream_interval` 1 and 8, a ladder of closed-loop gRPC
stream counts (bench/load_generator.py, one grpc.aio channel) is played until the relayed tokens/s
stops growing; each level is measured over its steady window: tokens/s the client received, tokens
per message, the gateway's CPU per token (all its threads, and its main thread, which runs the
asyncio loop), the client's and the fleet's, the dispatch latency (the gateway's own arrival ->
dispatch time, Timing.queue_ms), TTFT and ITL. Before the load, the fleet idles: the gateway's
CPU with only heartbeats coming in, against a gateway with no workers, is the heartbeat cost.
By default the gateway runs alone on the last core and the client and fleet share the others, so
"the gateway had one core" holds and the bottleneck shows as the core that filled up.
Checks: every finished request streamed exactly its max_tokens, and the tokens the workers sent
(their traces) equal the tokens the client received. JSON: bench/results/gateway_ceiling.json
(--quick: gateway_ceiling_quick.json); figure: docs/figures/gateway_ceiling.png.
"""
from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.checkpoints import REPO_ROOT
from bench.contention import busy_other_processes, wait_for_idle
from bench.gateway_ceiling_driver import Fleet, FleetSpec, measure_idle, run_level, wait_for_quiet
from bench.report import num, table
from bench.results_file import write_results
from bench.serving_model import DEFAULT_MODEL_DIR, model_limits

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "gateway_ceiling.json"
DEFAULT_FIGURE = REPO_ROOT / "docs" / "figures" / "gateway_ceiling.png"
GAIN_TO_CONTINUE = 1.10  # a level must relay 10% more than the best before it for the ladder to go on
SATURATED_SHARE = 0.90  # a thread or core this busy over a window is the bottleneck
KEPT_UP_TTFT_MS = 100.0  # a level whose TTFT p50 stays under this (5 steps) had the gateway keeping up
TARGETS_TOKENS_PER_S = (25_000, 50_000, 100_000)  # what a GPU host (or several) produces


@dataclass(frozen=True)
class Plan:
    fleets: tuple[int, ...] = (8, 32, 128)
    intervals: tuple[int, ...] = (1, 8)
    # Closed-loop streams on one gRPC connection: of more than about a thousand opened at once, grpc
    # 1.85 cancels some (CANCELLED; a bare grpc.aio server does the same), so the ladder ends at 1024.
    levels: tuple[int, ...] = (64, 128, 256, 512, 1024)
    idle_s: float = 8.0
    wait_quiet_s: float = 0.0  # before each cluster, wait up to this long for other load to leave
    spec: FleetSpec = field(default_factory=FleetSpec)

    def hold_ms(self, interval: int) -> float:
        """stream_hold_ms: long enough that a group fills by count at the workers' cadence."""
        return 2.0 * interval * self.spec.step_ms


FULL = Plan()
QUICK = Plan(fleets=(4, 16), levels=(64, 256), idle_s=3.0, spec=FleetSpec(requests_per_stream=3))


def log(message: str) -> None:
    print(f"[gateway-ceiling {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_fleet(model_dir: Path, plan: Plan, num_workers: int, interval: int, measure_heartbeats: bool) -> dict:
    """One fresh cluster: its idle phase (when asked), then the ladder of stream counts."""
    vocab, ctx = model_limits(model_dir)
    other_load = wait_for_quiet(plan.wait_quiet_s) if plan.wait_quiet_s else None
    gateway = {"stream_interval": interval, "stream_hold_ms": plan.hold_ms(interval)}
    fleet = Fleet(model_dir, num_workers, plan.spec, gateway, max_streams=2 * max(plan.levels)).start()
    out: dict = {"num_workers": num_workers, "stream_interval": interval, "stream_hold_ms": plan.hold_ms(interval),
                 "processes": len(fleet.fleet_pids), "other_load_before": other_load, "levels": []}
    try:
        if measure_heartbeats:
            time.sleep(1.0)  # the workers' first heartbeats and KV snapshots settle
            out["idle"] = measure_idle(fleet, plan.idle_s)
        best = 0.0
        for i, concurrency in enumerate(plan.levels):
            level = run_level(fleet, concurrency, vocab, ctx, seed=i)
            out["levels"].append(level)
            log(f"{num_workers} workers, interval {interval}, {concurrency} streams: {level['tokens_per_s']:,.0f} "
                f"tok/s ({level['tokens_per_message'] or 0:.2f} per message), gateway "
                f"{level['cpu']['gateway_share']:.0%} of a core (main thread {level['cpu']['gateway_main_share']:.0%}),"
                f" {level['gateway_us_per_token'] or 0:.1f} us/token; {level['completed']}/{level['requests']} done")
            if level["tokens_per_s"] < GAIN_TO_CONTINUE * best:
                break
            best = max(best, level["tokens_per_s"])
    finally:
        out["tokens_sent_by_workers"] = fleet.stop_and_count()
    out["tokens_received"] = sum(level["tokens_received"] for level in out["levels"])
    return out


def idle_baseline(model_dir: Path, plan: Plan) -> dict:
    """A gateway with no workers at all: what it spends idle on its own timers."""
    if plan.wait_quiet_s:
        wait_for_quiet(plan.wait_quiet_s)
    fleet = Fleet(model_dir, 0, plan.spec, {}, max_streams=64).start()
    try:
        time.sleep(1.0)
        return measure_idle(fleet, plan.idle_s)
    finally:
        fleet.stop_and_count()


def bottleneck(level: dict) -> str:
    """What filled up during the level: the gateway's loop thread, a core, or nothing (the offered load)."""
    cpu, full = level["cpu"], []
    if cpu["gateway_main_share"] >= SATURATED_SHARE:
        full.append("gateway event loop")
    busy = cpu["core_busy"]
    if cpu["pinned"] and len(busy) > 1:
        if busy[-1] >= SATURATED_SHARE and not full:
            full.append("gateway's core")
        if min(busy[:-1]) >= SATURATED_SHARE:
            full.append("client/fleet core")
    elif cpu["machine_busy_cores"] >= SATURATED_SHARE * len(busy):
        full.append("all cores")
    if full and cpu["foreign_share"] >= 0.1:
        full.append("other load")
    return " + ".join(full) or "offered load"


def summarize(report: dict) -> list[dict]:
    """One row per (fleet, interval): its best level, the per-core ceiling, and heartbeat cost."""
    base = report.get("idle_baseline", {}).get("gateway_share")
    hb_interval_s = report["heartbeat_interval_s"]
    rows = []
    for run in report["runs"]:
        levels = run["levels"]
        if not levels:
            continue
        best = max(levels, key=lambda lv: lv["tokens_per_s"])
        kept_up = [lv for lv in levels if (lv["ttft_ms_p50"] or math.inf) <= KEPT_UP_TTFT_MS]
        kept = max(kept_up, key=lambda lv: lv["tokens_per_s"]) if kept_up else None
        us = best["gateway_us_per_token"]
        row = {"num_workers": run["num_workers"], "stream_interval": run["stream_interval"],
               "concurrency": best["concurrency"], "tokens_per_s": best["tokens_per_s"],
               "tokens_per_message": best["tokens_per_message"], "gateway_us_per_token": us,
               "gateway_main_us_per_token": best["gateway_main_us_per_token"],
               "client_us_per_token": best["client_us_per_token"], "fleet_us_per_token": best["fleet_us_per_token"],
               "gateway_share": best["cpu"]["gateway_share"], "gateway_main_share": best["cpu"]["gateway_main_share"],
               "client_share": best["cpu"]["client_share"], "fleet_share": best["cpu"]["fleet_share"],
               "foreign_share": best["cpu"]["foreign_share"], "core_busy": best["cpu"]["core_busy"],
               "dispatch_ms_p50": best["dispatch_ms_p50"], "dispatch_ms_p99": best["dispatch_ms_p99"],
               "ttft_ms_p50": best["ttft_ms_p50"], "itl_ms_p99": best["itl_ms_p99"],
               "bottleneck": bottleneck(best),
               # The most it relayed while the first token still came within a few steps.
               "kept_up_concurrency": kept["concurrency"] if kept else None,
               "kept_up_tokens_per_s": kept["tokens_per_s"] if kept else None,
               "kept_up_ttft_ms_p50": kept["ttft_ms_p50"] if kept else None,
               # One core's worth of the gateway's CPU per token, and of its loop thread's alone.
               "tokens_per_s_per_core": 1e6 / us if us else None,
               "loop_thread_tokens_per_s": 1e6 / best["gateway_main_us_per_token"]
               if best["gateway_main_us_per_token"] else None,
               "tokens_match": run["tokens_sent_by_workers"] == run["tokens_received"],
               "exact_requests": all(lv["exact_requests"] == lv["completed"] == lv["requests"] for lv in levels)}
        row["gateways_for"] = {str(t): math.ceil(t / row["tokens_per_s_per_core"]) if us else None
                               for t in TARGETS_TOKENS_PER_S}
        if "idle" in run:
            idle = run["idle"]
            heartbeats_per_s = run["num_workers"] / hb_interval_s
            row["idle_gateway_share"] = idle["gateway_share"]
            row["idle_fleet_share"] = idle["fleet_share"]
            row["heartbeats_per_s"] = heartbeats_per_s
            row["us_per_heartbeat"] = ((idle["gateway_share"] - base) / heartbeats_per_s * 1e6
                                       if base is not None and heartbeats_per_s else None)
        rows.append(row)
    return rows


HEADER = ["workers", "interval", "streams", "tok/s", "kept up: streams, tok/s", "tok/msg", "gw us/tok (loop)",
          "client us/tok", "fleet us/tok", "gw / loop / client / fleet % core", "other", "dispatch p50/p99 ms",
          "TTFT p50", "tok/s per gw core", "bottleneck", "checks"]


def print_report(report: dict) -> None:
    print(f"bench.gateway_ceiling {report['date']} commit {report['commit']}: {report['command']}")
    spec = report["plan"]["spec"]
    print(f"fake workers: {spec['step_ms']:g} ms a step, up to {spec['processes']} processes; "
          f"{spec['prompt_tokens']}-token prompts, {spec['output_tokens'][0]}-{spec['output_tokens'][1]} tokens out; "
          f"{'gateway pinned to the last core, client and fleet to the others' if spec['pin'] else 'unpinned'}")
    rows = [[r["num_workers"], r["stream_interval"], r["concurrency"], num(r["tokens_per_s"], 0),
             f"{r['kept_up_concurrency']}, {num(r['kept_up_tokens_per_s'], 0)}" if r["kept_up_concurrency"] else "-",
             num(r["tokens_per_message"], 2),
             f"{num(r['gateway_us_per_token'])} ({num(r['gateway_main_us_per_token'])})",
             num(r["client_us_per_token"]), num(r["fleet_us_per_token"]),
             " / ".join(f"{r[k] * 100:.0f}" for k in ("gateway_share", "gateway_main_share", "client_share",
                                                      "fleet_share")),
             f"{r['foreign_share'] * 100:.0f}%", f"{num(r['dispatch_ms_p50'], 2)} / {num(r['dispatch_ms_p99'], 1)}",
             num(r["ttft_ms_p50"], 1), num(r["tokens_per_s_per_core"], 0), r["bottleneck"],
             "ok" if r["tokens_match"] and r["exact_requests"] else "MISMATCH"] for r in report["summary"]]
    if rows:
        print(table(rows, HEADER))
    base = report.get("idle_baseline", {})
    hb = [[r["num_workers"], num(r["heartbeats_per_s"], 0), f"{r['idle_gateway_share'] * 100:.1f}%",
           num(r["us_per_heartbeat"], 1), f"{r['idle_fleet_share'] * 100:.1f}%"]
          for r in report["summary"] if "heartbeats_per_s" in r]
    if hb:
        print(f"\nidle: a gateway with no workers uses {base.get('gateway_share', 0) * 100:.1f}% of a core")
        print(table(hb, ["workers", "heartbeats/s", "gateway CPU", "us per heartbeat", "fleet CPU"]))
    print(f"({report.get('total_s', 0):.0f} s in all)")


def plot(report: dict, path: Path) -> Path:
    from matplotlib.ticker import FuncFormatter, NullLocator

    from bench.experiments import plotting

    fig, (ax_tps, ax_cpu, ax_hb) = plotting.figure(3, "One gateway process: tokens/s relayed, CPU per token, "
                                                      "heartbeats", width_in=5.2)
    plan = report["plan"]
    colours = dict(zip(plan["fleets"], ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for run in report["runs"]:
        ax_tps.plot([lv["concurrency"] for lv in run["levels"]], [lv["tokens_per_s"] for lv in run["levels"]],
                    marker="o" if run["stream_interval"] == 1 else "s", color=colours.get(run["num_workers"]),
                    linestyle="-" if run["stream_interval"] == 1 else "--",
                    label=f"{run['num_workers']} workers, interval {run['stream_interval']}")
    ax_tps.plot(plan["levels"], [c * 1e3 / plan["spec"]["step_ms"] for c in plan["levels"]], color="grey",
                linestyle=":", label="offered (streams / step)")
    ax_tps.set(xscale="log", yscale="log", xlabel="closed-loop gRPC streams", ylabel="tokens/s received")
    ax_cpu.set(xscale="log", xlabel="workers", ylabel="gateway CPU, us per token (best level)")
    for ax, ticks in ((ax_tps, plan["levels"]), (ax_cpu, plan["fleets"])):
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(ticks, [str(t) for t in ticks])
    thousands = FuncFormatter(lambda v, _: f"{v / 1e3:g}k")
    ax_tps.yaxis.set_major_formatter(thousands)
    ax_tps.yaxis.set_minor_formatter(thousands)
    ax_tps.tick_params(axis="y", which="minor", labelsize=7)
    summary = report["summary"]
    for interval, colour in zip(plan["intervals"], ("tab:purple", "tab:brown")):
        rows = [r for r in summary if r["stream_interval"] == interval]
        xs = [r["num_workers"] for r in rows]
        ax_cpu.plot(xs, [r["gateway_us_per_token"] for r in rows], marker="o", color=colour,
                    label=f"gateway, interval {interval}")
        ax_cpu.plot(xs, [r["gateway_main_us_per_token"] for r in rows], marker="o", linestyle="--", color=colour,
                    label=f"its loop thread, interval {interval}")
    hb = [r for r in summary if "heartbeats_per_s" in r]
    base = report.get("idle_baseline", {}).get("gateway_share", 0.0)
    ax_hb.plot([0] + [r["num_workers"] for r in hb], [base * 100] + [r["idle_gateway_share"] * 100 for r in hb],
               marker="o", label="gateway")
    ax_hb.plot([r["num_workers"] for r in hb], [r["idle_fleet_share"] * 100 for r in hb], marker="s",
               label="the idle fleet itself")
    costs = [f"{r['num_workers']} workers: {r['us_per_heartbeat']:.0f} us" for r in hb
             if r["us_per_heartbeat"] is not None]
    if costs:
        ax_hb.text(0.03, 0.62, "gateway CPU per heartbeat\n" + "\n".join(costs), transform=ax_hb.transAxes,
                   fontsize=8, va="top")
    ax_hb.set(xlabel=f"idle workers (a heartbeat every {report['heartbeat_interval_s']:g} s each)",
              ylabel="CPU, % of one core")
    for ax in (ax_tps, ax_cpu, ax_hb):
        ax.legend(fontsize=7)
    return plotting.save(fig, path)


def run(plan: Plan, model_dir: Path, command: str, quick: bool) -> dict:
    from bench.experiments.__main__ import commit
    from shared.config import WorkerConfig

    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
                    "command": command, "quick": quick, "model_dir": str(model_dir), "plan": asdict(plan),
                    "heartbeat_interval_s": WorkerConfig().heartbeat_interval_s, "busy_before": busy_other_processes(),
                    "runs": []}
    t0 = time.perf_counter()
    report["idle_baseline"] = idle_baseline(model_dir, plan)
    for num_workers in plan.fleets:
        for interval in plan.intervals:
            log(f"{num_workers} workers, stream_interval {interval}")
            report["runs"].append(run_fleet(model_dir, plan, num_workers, interval,
                                            measure_heartbeats=interval == plan.intervals[0]))
    report["summary"] = summarize(report)
    report["busy_after"] = busy_other_processes()
    report["total_s"] = time.perf_counter() - t0
    return report


def profile(model_dir: Path, plan: Plan, num_workers: int, interval: int, concurrency: int = 256) -> str:
    """One level against a gateway under cProfile: its busy functions in us per token (cProfile's own
    overhead included, so read the shares, not the sums)."""
    import pstats
    import shutil
    import tempfile

    from bench.http_vs_grpc_report import busy_profile

    prof = Path(tempfile.mkdtemp(prefix="icb-prof-")) / "gateway.prof"
    vocab, ctx = model_limits(model_dir)
    fleet = Fleet(model_dir, num_workers, plan.spec, {"stream_interval": interval,
                                                      "stream_hold_ms": plan.hold_ms(interval)},
                  max_streams=2 * concurrency, gateway_module=["cProfile", "-o", str(prof), "-m", "gateway"]).start()
    log(f"profile: {num_workers} workers, interval {interval}, {concurrency} streams, gateway under cProfile")
    try:
        level = run_level(fleet, concurrency, vocab, ctx)
    finally:
        fleet.stop_and_count()
    name = f"{num_workers} workers, interval {interval}, {concurrency} streams ({level['tokens_per_s']:,.0f} tok/s)"
    text = busy_profile(pstats.Stats(str(prof)), level["tokens_received"], name) if prof.exists() else \
        f"{name}: no profile written"
    shutil.rmtree(prof.parent, ignore_errors=True)
    return text


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.gateway_ceiling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 and 16 workers, 2 levels each (about a minute)")
    p.add_argument("--fleets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="fleet sizes, e.g. 8,32,128")
    p.add_argument("--step-ms", type=float, default=None, help="the fake workers' step")
    p.add_argument("--processes", type=int, default=None, help="at most this many fake-worker processes")
    p.add_argument("--no-pin", action="store_true", help="leave every process on every core")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="its tokenizer is the gateway's")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for other processes to leave the CPU first")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each cluster, wait up to S seconds until the machine's other load (visible or "
                        "not: /proc/stat less this process) is under 10%%")
    p.add_argument("--profile", action="store_true",
                   help="afterwards, one level (256 streams) per interval on the smallest and largest fleet against "
                        "a gateway under cProfile; prints its busy functions per token")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--figure", type=Path, default=None, help=f"default {DEFAULT_FIGURE.relative_to(REPO_ROOT)} "
                                                              "(a --quick run draws none unless given)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so every cluster is stopped
    plan = QUICK if args.quick else FULL
    spec = replace(plan.spec, pin=not args.no_pin, **({"step_ms": args.step_ms} if args.step_ms else {}),
                   **({"processes": args.processes} if args.processes else {}))
    plan = replace(plan, spec=spec, wait_quiet_s=args.wait_quiet, **({"fleets": args.fleets} if args.fleets else {}))
    if args.wait_idle:
        wait_for_idle(args.wait_idle)
    command = "python -m bench.gateway_ceiling " + " ".join(argv if argv is not None else sys.argv[1:])
    report = run(plan, args.model_dir.resolve(), command, args.quick)
    if args.profile:
        report["profiles"] = [profile(args.model_dir.resolve(), plan, n, interval)
                              for n in sorted({plan.fleets[0], plan.fleets[-1]}) for interval in plan.intervals]
    print_report(report)
    for text in report.get("profiles", []):
        print(text)
    path = write_results(report, args.json, DEFAULT_JSON, args.quick)
    log(f"wrote {path}")
    figure = args.figure or (None if args.quick else DEFAULT_FIGURE)
    if figure is not None and report["summary"]:
        log(f"wrote {plot(report, figure)}")
    return 0 if all(r["tokens_match"] and r["exact_requests"] for r in report["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
