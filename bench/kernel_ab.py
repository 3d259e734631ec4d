"""`python -m bench.kernel_ab OTHER_CHECKOUT [--format int8] [--rounds 16]`: this checkout's CPU
kernels (A) against another checkout's build of them (B), on one engine in one process.

Built for hosts whose speed drifts faster than a change moves it (a shared VM whose memory and
cores slow by a third within minutes): two processes run minutes apart measure the host as much
as the code. Here one engine, built by this checkout, runs its single-stream decode steps
alternately on either build (B's module loaded beside A's, and the fast path, its projections
and `cpu_kernels.load()` pointed at it), the order flipped every round, and each round's A/B
ratio is taken from two runs seconds apart. Both builds must read the same weight layouts: A/B
a kernel change, not a layout change. Prints each side's median ms a token and the median,
smallest and largest per-round ratio (> 1: B faster). Not part of `make test`.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path

from shared.config import WorkerConfig
from worker.process_environment import apply_model_process_environment

apply_model_process_environment(WorkerConfig.cpu_huge_pages)

from bench.checkpoints import ensure_bench_small  # noqa: E402
from bench.engine_runs import engine_decode_seconds  # noqa: E402
from bench.vs_llama_cpp import FORMATS  # noqa: E402
from worker.model import cpu_kernels  # noqa: E402


def other_build(checkout: Path):
    """The other checkout's kernel module (built there first if it is not yet), loaded under a name
    of its own beside ours."""
    built = subprocess.run([sys.executable, "-c", "from worker.model import cpu_kernels; "
                            "print(cpu_kernels.load().__file__)"], cwd=checkout, capture_output=True, text=True,
                           timeout=1200)
    if built.returncode:
        raise SystemExit(f"building {checkout}'s kernels failed:\n{built.stderr[-2000:]}")
    path = built.stdout.strip().splitlines()[-1]
    name = "kernel_ab_other.inference_cpu_kernels"  # the last part names the module's init function
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
    loader.exec_module(module)
    return module


def use_kernels(engine, kernels) -> None:
    """Every step of `engine` from now on runs `kernels`."""
    cpu_kernels.load = lambda: kernels
    fast_path = engine.runner.fast_path
    holders = [fast_path, *vars(fast_path).values(),
               *(part for layer in fast_path.layers for part in vars(layer).values())]
    for holder in holders:
        if hasattr(holder, "kernels"):
            holder.kernels = kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the checkout whose kernel build is B")
    parser.add_argument("--format", default="int8", choices=[f[0] for f in FORMATS])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per timed run")
    parser.add_argument("--context", type=int, default=4,
                        help="prompt tokens before them (long ones weigh the attention kernels)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", help="checkpoint folder (default: bench-small)")
    args = parser.parse_args()
    from worker.engine import Engine
    settings = next(engine for name, engine, _ in FORMATS if name == args.format)
    model_dir = Path(args.model_dir) if args.model_dir else ensure_bench_small()
    num_kv_blocks = max(64, -(-(args.context + args.tokens + 1) // 16) + 1)
    engine = Engine.from_model_dir(model_dir, device="cpu", num_threads=args.threads, quantization_calibration="none",
                                   num_kv_blocks=num_kv_blocks, max_num_seqs=1, **settings)
    if engine.runner.fast_path is None:
        raise SystemExit("this engine runs no CPU fast path: there are no kernels to swap")
    builds = {"A": cpu_kernels.load(), "B": other_build(args.other)}
    prompt = [3 + i % 200 for i in range(args.context)]
    for kernels in builds.values():  # warm-up: first-call allocations on either build
        use_kernels(engine, kernels)
        engine_decode_seconds(engine, prompt, 16)
    ms = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            use_kernels(engine, builds[side])
            first = engine_decode_seconds(engine, prompt, 1)
            ms[side].append((engine_decode_seconds(engine, prompt, args.tokens + 1) - first) / args.tokens * 1e3)
    ratios = [a / b for a, b in zip(ms["A"], ms["B"])]
    print(f"{args.format}, {model_dir.name}, {args.context}-token prompt, {args.rounds} rounds: "
          f"A {statistics.median(ms['A']):.3f} ms a token, "
          f"B {statistics.median(ms['B']):.3f}; A/B per round: median {statistics.median(ratios):.3f}x "
          f"(smallest {min(ratios):.3f}x, largest {max(ratios):.3f}x)")


if __name__ == "__main__":
    main()
