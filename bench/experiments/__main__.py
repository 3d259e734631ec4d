"""`python -m bench.experiments [names or numbers...] [--quick]`: run the seed experiments.

Each experiment waits for an idle CPU (bench/contention.py), runs, and its share of foreign CPU
load is recorded (its own cluster processes are charged to it, not to the neighbours). Results go
to bench/results/experiments/<name>.json and figures to docs/figures/<name>.png; --quick runs
smaller versions and writes both under bench/results/experiments/quick/ so the docs' figures
are only ever the full runs'. Every table is printed as markdown.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench.checkpoints import REPO_ROOT
from bench.experiments.registry import select

RESULTS_DIR = REPO_ROOT / "bench" / "results" / "experiments"
FIGURES_DIR = REPO_ROOT / "docs" / "figures"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.experiments", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="experiments by name or number (default: all)")
    p.add_argument("--quick", action="store_true", help="smaller, faster versions (figures go to the quick folder)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of in-process engines and workers")
    p.add_argument("--wait-idle", type=float, default=None, metavar="S",
                   help="wait up to S s for other processes to leave the CPU before each experiment "
                        "(default 120, 0 with --quick)")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--figures-dir", type=Path, default=None)
    return p.parse_args(argv)


def children_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's descendants, live and already reaped: the clusters an experiment
    starts belong to the system under test, not to the foreign load."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return {"descendants": total}


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_one(entry, args, results_dir: Path, figures_dir: Path) -> dict:
    from bench.contention import wait_for_idle
    from bench.cpu_share import cpu_accounting

    module = importlib.import_module(entry.module)
    wait_s = args.wait_idle if args.wait_idle is not None else (0.0 if args.quick else 120.0)
    still_busy = wait_for_idle(wait_s) if wait_s > 0 else []
    print(f"\n## {entry.number}. {module.TITLE}  ({time.strftime('%H:%M:%S')})", flush=True)
    acct: dict = {}
    with cpu_accounting(acct, children_cpu_s):
        result = module.run(quick=args.quick)
    figure = figures_dir / f"{entry.name}.png"
    module.plot(result.data, figure)
    record = {"number": entry.number, "name": entry.name, "title": module.TITLE, "quick": args.quick,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit(), "threads": args.threads,
              "host": f"{platform.machine()}, {psutil.cpu_count()} cores", "wall_s": acct["wall_s"],
              "foreign_cpu_share": acct["foreign_share"], "busy_at_start": still_busy,
              "figure": str(figure.relative_to(REPO_ROOT)) if figure.is_relative_to(REPO_ROOT) else str(figure),
              **result.to_dict()}
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{entry.name}.json").write_text(json.dumps(record, indent=1, default=str))
    print(result.markdown())
    print(f"\n{result.headline}")
    for note in result.notes:
        print(f"note: {note}")
    print(f"({acct['wall_s']:.0f} s; other processes used {acct['foreign_share']:.0%} of the CPU; figure {figure})",
          flush=True)
    return record


def main(argv=None) -> int:
    args = parse_args(argv)
    # Read by bench.experiments.common at import, before any experiment module loads it.
    os.environ["EXPERIMENTS_THREADS"] = str(args.threads)
    entries = select(args.names)
    results_dir = args.results_dir or (RESULTS_DIR / "quick" if args.quick else RESULTS_DIR)
    figures_dir = args.figures_dir or (results_dir / "figures" if args.quick else FIGURES_DIR)
    t0 = time.perf_counter()
    records = [run_one(e, args, results_dir, figures_dir) for e in entries]
    print(f"\n{len(records)} experiments in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{r['name']} {r['wall_s']:.0f} s ({r['foreign_cpu_share']:.0%} foreign)" for r in records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
