"""`python -m bench.structured_output [--quick] [--json PATH]` (`make bench-structured`): the cost of
structured output, side by side in one run.

  (1) Throughput. The engine benchmark's workload W1 (bench/workload.py: 32 requests, random
      prompts of 64-512 tokens, 32-256 output tokens, greedy, EOS ignored) on bench-small, in one
      engine, three ways in alternating rounds, medians reported:
        A  W1 unconstrained, as `make bench` runs it;
        B  W1 with every 4th request constrained by a JSON schema (W1_SCHEMA: four typed fields,
           bounded strings and integers, so every output can end);
        C  W1 unconstrained with each of B's constrained requests given max_tokens = the number of
           tokens its constrained output took in B.
      A constrained request ends `stop` when its JSON is complete (ignore_eos or not), so B
      produces fewer tokens than A, and a batch that thins out sooner runs at a lower tokens/s
      for reasons that have nothing to do with masks. C has B's exact token counts and so B's
      batch shapes step for step: B / C is the cost of the constraints (the target), B / A is
      what a user of W1 sees. Per-step time (wall / engine steps) is reported for each.
      Every constrained output that completes is decoded, parsed and validated with jsonschema.
  (2) Per-step mask time at 32 rows: worker.constraints.mask_rows on [32, V] float32 logits with
      32 matchers walking 32 different valid documents (spread positions, each advanced one token
      per step, a finished one replaced by a new request), on each tokenizer available
      (models/default's real BPE, V = 4096; bench-small's synthetic byte-level BPE, V = 32000);
      its two halves (llguidance filling the bitmasks; applying them to the logits); and the
      sampler's whole call on the same logits with and without the 32 constraints. Also the
      first mask application of a fresh process, ours and llguidance's own kernel (which torch.compile
      builds on its first call).
  (3) Compile time per schema, for five schemas of increasing size: the gateway's check
      (gateway.constraints.ConstraintCompiler.grammar, which has no cache: schema -> grammar and
      a validation against the tokenizer), the worker's cold compile (the first
      worker.constraints.ConstraintCompiler.constraint of a grammar) and cached (the same
      grammar again: a hash and a copy of the compiled matcher).
Target: B >= 0.9x the throughput of C.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Sequence

from bench.contention import busy_other_processes, wait_for_idle
from bench.results_file import write_results
from bench.serving_model import model_limits
from bench.structured_output_arms import log, measure_throughput
from bench.structured_output_report import print_report
from bench.structured_output_workload import (CONSTRAIN_EVERY, FULL_PLAN, MASK_ROWS, QUICK_PLAN, W1_SCHEMA, Walk,
                                              compile_schemas, eos_ids, tokenizers_to_measure)

# (1)'s arms are bench/structured_output_arms.py, what every part runs is
# bench/structured_output_workload.py, and the printed report is bench/structured_output_report.py.

# The walk's first steps visit its lexer states for the first time (llguidance builds its DFA lazily,
# shared by every copy of a compiled grammar): reported apart from the steady state.
MASK_WARMUP_STEPS = 8
DEFAULT_JSON = Path("bench/results/structured_output.json")


# ---- (2) per-step mask time --------------------------------------------------------------------


def percentiles_ms(values: Sequence[float]) -> dict:
    xs = sorted(values)
    pick = lambda q: 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]
    return {"median_ms": 1e3 * statistics.median(xs), "p90_ms": pick(0.9), "min_ms": 1e3 * xs[0],
            "max_ms": 1e3 * xs[-1], "n": len(xs)}


def measure_masks(model_dir: Path, label: str, steps: int) -> dict:
    import torch
    from tokenizers import Tokenizer

    import worker.constraints as wc
    from gateway.constraints import ConstraintCompiler as GatewayCompiler
    from protos import inference_pb2 as pb
    from shared.sampling_params import SamplingParams
    from worker.sampler import Sampler, SamplingBatch

    with warnings.catch_warnings():  # its import touches torch.jit, which torch marks deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        import llguidance.torch as llg_torch  # llguidance's own kernel, for comparison (the worker does not use it)
    vocab_size, _ = model_limits(model_dir)
    eos = eos_ids(model_dir)
    grammar = GatewayCompiler(model_dir, vocab_size, eos).grammar(pb.StructuredOutput(json_schema=json.dumps(W1_SCHEMA)))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
    compiler = wc.ConstraintCompiler(model_dir, vocab_size, eos)
    walk = Walk(compiler, grammar, W1_SCHEMA, encode)
    rows = list(range(MASK_ROWS))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(MASK_ROWS, vocab_size, generator=gen)  # [32, V] float32
    sampler = Sampler("cpu", seed=0)
    params = [SamplingParams(max_tokens=16, temperature=0.0)] * MASK_ROWS
    plain = SamplingBatch(params=params, generators=[None] * MASK_ROWS, token_histories=[[]] * MASK_ROWS)
    # Untimed: the first masks of the lexer, and llguidance's kernel's torch.compile (measured in `first_mask`).
    wc.mask_rows(logits.clone(), rows, walk.constraints)
    llg_torch.apply_token_bitmask_inplace(logits.clone(), wc.fill_bitmask(walk.constraints, vocab_size))
    times = {k: [] for k in ("mask_rows", "fill", "apply", "advance", "sampler_plain", "sampler_constrained",
                             "apply_kernel", "mask_rows_8", "mask_rows_1")}
    for step in range(steps):
        constrained = SamplingBatch(params=params, generators=[None] * MASK_ROWS, token_histories=[[]] * MASK_ROWS,
                                    constraints=list(walk.constraints))
        x = logits.clone()
        t0 = time.perf_counter()
        wc.mask_rows(x, rows, walk.constraints)
        times["mask_rows"].append(time.perf_counter() - t0)
        # The same two halves by hand: llguidance filling the bitmasks, then torch applying them.
        t0 = time.perf_counter()
        bitmask = wc.fill_bitmask(walk.constraints, vocab_size)
        t1 = time.perf_counter()
        y = logits.clone()
        t2 = time.perf_counter()
        wc.apply_bitmask(y, rows, bitmask)
        t3 = time.perf_counter()
        times["fill"].append(t1 - t0)
        times["apply"].append(t3 - t2)
        z = logits.clone()
        t0 = time.perf_counter()
        llg_torch.apply_token_bitmask_inplace(z, bitmask)  # llguidance's own kernel, for comparison
        times["apply_kernel"].append(time.perf_counter() - t0)
        for n in (8, 1):  # the same states, fewer rows: what a step with fewer constrained rows pays
            z = logits.clone()
            t0 = time.perf_counter()
            wc.mask_rows(z, rows[:n], walk.constraints[:n])
            times[f"mask_rows_{n}"].append(time.perf_counter() - t0)
        if not torch.equal(torch.isinf(x), torch.isinf(y)):
            raise RuntimeError("the hand-made mask differs from mask_rows'")
        pair = [("sampler_plain", plain), ("sampler_constrained", constrained)]
        for name, batch in (pair if step % 2 else pair[::-1]):
            t0 = time.perf_counter()
            out = sampler(logits, batch)
            times[name].append(time.perf_counter() - t0)
            if name == "sampler_constrained":
                allowed = [bool(torch.isfinite(x[i, t])) for i, t in enumerate(out.token_ids)]
                if not all(allowed):
                    raise RuntimeError("the constrained sampler chose a masked token")
        t0 = time.perf_counter()
        walk.advance()
        times["advance"].append(time.perf_counter() - t0)
    warm = min(MASK_WARMUP_STEPS, steps // 2)
    return {"label": label, "model_dir": str(model_dir), "vocab_size": vocab_size, "rows": MASK_ROWS,
            "steps": steps, "warmup_steps": warm, **{k: percentiles_ms(v[warm:]) for k, v in times.items()},
            "warmup": {k: percentiles_ms(v[:warm]) for k, v in times.items()}}


FIRST_MASK_SNIPPET = """
import time, torch
torch.set_num_threads({threads})
import worker.constraints as wc
import llguidance.torch as llg_torch
x = torch.randn({rows}, {vocab}); m = llg_torch.allocate_token_bitmask({rows}, {vocab})
t0 = time.perf_counter(); wc.apply_bitmask(x, list(range({rows})), m); t1 = time.perf_counter()
t2 = time.perf_counter(); llg_torch.apply_token_bitmask_inplace(x, m); t3 = time.perf_counter()
print(t1 - t0, t3 - t2)
"""


def measure_first_mask(vocab_size: int, threads: int) -> dict:
    """The first mask application of a fresh process: the worker's (numpy unpack), and llguidance's own
    kernel, which torch.compile builds then, with the inductor cache left by earlier runs and with an
    empty one (a fresh host)."""
    code = FIRST_MASK_SNIPPET.format(threads=threads, rows=MASK_ROWS, vocab=vocab_size)
    out = {}
    with tempfile.TemporaryDirectory() as empty:
        for name, env in (("warm_cache", {}), ("empty_cache", {"TORCHINDUCTOR_CACHE_DIR": empty})):
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                                 env={**os.environ, **env}, cwd=Path(__file__).resolve().parent.parent)
            if res.returncode != 0:
                out[name] = {"error": res.stderr.strip()[-500:]}
                continue
            ours, theirs = (float(v) for v in res.stdout.split()[-2:])
            out[name] = {"first_s": ours, "llguidance_kernel_first_s": theirs}
    return out


# ---- (3) compile time ----------------------------------------------------------------------------


def measure_compiles(model_dir: Path, label: str, repeats: int) -> dict:
    from gateway.constraints import ConstraintCompiler as GatewayCompiler
    from protos import inference_pb2 as pb
    from worker.constraints import ConstraintCompiler

    vocab_size, _ = model_limits(model_dir)
    eos = eos_ids(model_dir)
    gateway = GatewayCompiler(model_dir, vocab_size, eos)
    t0 = time.perf_counter()
    gateway.tokenizer  # built on first use; once per gateway
    gateway_tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cold = ConstraintCompiler(model_dir, vocab_size, eos, cache_size=0)  # no cache: every call compiles
    worker_tokenizer_s = time.perf_counter() - t0
    cached = ConstraintCompiler(model_dir, vocab_size, eos)
    rows = []
    for name, schema in compile_schemas():
        proto = pb.StructuredOutput(json_schema=json.dumps(schema))
        check = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            grammar = gateway.grammar(proto)
            check.append(time.perf_counter() - t0)
        compiles = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cold.constraint(grammar)
            compiles.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cached.constraint(grammar)
        first_cached_compiler = time.perf_counter() - t0
        hits = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cached.constraint(grammar)
            hits.append(time.perf_counter() - t0)
        rows.append({"schema": name, "schema_bytes": len(json.dumps(schema)), "grammar_bytes": len(grammar),
                     "gateway_check_first_ms": 1e3 * check[0], "gateway_check_ms": 1e3 * statistics.median(check),
                     "worker_cold_first_ms": 1e3 * compiles[0],
                     "worker_cold_ms": 1e3 * statistics.median(compiles),
                     "worker_cold_in_cached_compiler_ms": 1e3 * first_cached_compiler,
                     "worker_cached_ms": 1e3 * statistics.median(hits)})
    return {"label": label, "model_dir": str(model_dir), "vocab_size": vocab_size, "repeats": repeats,
            "gateway_tokenizer_ms": 1e3 * gateway_tokenizer_s, "worker_tokenizer_ms": 1e3 * worker_tokenizer_s,
            "schemas": rows}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.structured_output", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="W1's 8-request quick workload, one round, fewer steps")
    p.add_argument("--json", metavar="PATH", default="",
                   help=f"where to write every result (default {DEFAULT_JSON}, or *_quick.json with --quick)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2, as `make bench`)")
    p.add_argument("--only", choices=("throughput", "masks", "compile"), action="append",
                   help="run only these parts (repeatable)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for other processes to stop using the CPU first")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    parts = set(args.only or ("throughput", "masks", "compile"))
    busy = wait_for_idle(args.wait_idle) if args.wait_idle else busy_other_processes()
    if busy:
        log(f"other processes busy: {busy}")
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": args.quick,
                    "threads": args.threads, "busy_before": busy}
    t_start = time.perf_counter()
    if "throughput" in parts:
        log("(1) throughput: W1 unconstrained / 1/4 constrained / unconstrained at the constrained lengths")
        report["throughput"] = measure_throughput(plan, args.threads)
    if "masks" in parts:
        report["masks"] = []
        for label, model_dir in tokenizers_to_measure():
            log(f"(2) masks at {MASK_ROWS} rows: {label}")
            report["masks"].append(measure_masks(model_dir, label, plan.mask_steps))
        if plan.first_mask:
            vocab = max(m["vocab_size"] for m in report["masks"])
            log("(2) the first mask of a fresh process (warm and empty inductor cache)")
            report["first_mask_vocab"] = vocab
            report["first_mask"] = measure_first_mask(vocab, args.threads)
    if "compile" in parts:
        report["compiles"] = []
        for label, model_dir in tokenizers_to_measure():
            log(f"(3) compile times: {label}")
            report["compiles"].append(measure_compiles(model_dir, label, plan.compile_repeats))
    report["busy_after"] = busy_other_processes()
    report["total_s"] = time.perf_counter() - t_start
    print_report(report, CONSTRAIN_EVERY)
    path = write_results(report, args.json, DEFAULT_JSON, args.quick)
    log(f"wrote {path} ({report['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
