"""The benchmark entry point (`python -m bench.engine_throughput`, `make bench`): runs transformers' static generate,
transformers' continuous batching and our engine side by side on one seeded workload, against measured hardware
bounds, and prints the table, the single-stream decode and KV-utilisation results, and PASS/MISS per target."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from bench import hardware_bounds as hw
from bench.contention import FOREIGN_LOAD_WARN, busy_other_processes, foreign_load, wait_for_idle
from bench.checkpoints import ensure_bench_small
from bench.decode_rate import DecodeRate, measure_decode_rate
from bench.engine_runs import MAX_MODEL_LEN, EngineSettings, KVUsage, blocks_for
from bench.report import print_report
from bench.workload import (DECODE_NEW_TOKENS, FULL, QUICK, QUICK_DECODE_NEW_TOKENS, make_decode_prompt,
                            make_requests, make_warmup_requests)

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.engine_throughput", description=__doc__)
    p.add_argument("--model-dir", help="checkpoint folder (default: .cache/bench-small, created on first use)")
    p.add_argument("--quick", action="store_true", help="8 short requests and a 32-token decode: a smoke run")
    p.add_argument("--skip-hf-cb", action="store_true", help="skip transformers' continuous batching baseline")
    p.add_argument("--skip-hf-static", action="store_true", help="skip transformers' static-batch generate")
    p.add_argument("--json", metavar="PATH", help="also write every result as JSON to PATH")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--static-batch-size", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="engine KV blocks; 0 = enough for every request at full length at once (default)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--hf-cb-max-batch-tokens", type=int, default=0,
                   help="HF continuous batching token budget per step; 0 = same as --max-num-batched-tokens")
    p.add_argument("--hf-cb-page-size", type=int, default=256, help="HF paged-cache page size (its default: 256)")
    p.add_argument("--decode-repeats", type=int, default=3, help="timings per point of the decode-rate measurement")
    p.add_argument("--engine-repeats", type=int, default=3,
                   help="(c) runs of the whole workload; the median is reported (default 3)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for other processes to stop using the CPU before measuring")
    p.add_argument("--retries", type=int, default=1,
                   help="re-run a measurement (after waiting up to 2 min for an idle CPU) when other processes used "
                        f"> {FOREIGN_LOAD_WARN * 100:.0f}%% of the CPU during it; the least-disturbed attempt is kept")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def quiet_transformers() -> None:
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # The continuous-batching logger does not propagate to transformers' root logger, so quiet it directly.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)


def agreement(ours: list[list[int]] | None, theirs: list[list[int]] | None) -> str:
    """Greedy float32 outputs should agree token for token; a fast engine producing other tokens is not a win."""
    if not ours or not theirs:
        return "-"
    exact = sum(a == b for a, b in zip(ours, theirs))
    prefix = []
    for a, b in zip(ours, theirs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, len(b)))
    return f"{exact}/{len(theirs)} identical, mean common prefix {100 * sum(prefix) / len(prefix):.1f}%"


def _try(label: str, errors: dict, fn):
    """Run one measurement; a failure is recorded and reported instead of ending the benchmark."""
    try:
        return fn()
    except Exception as e:
        errors[label] = f"{type(e).__name__}: {e}"
        log(f"{label} failed: {errors[label]}")
        traceback.print_exc(file=sys.stderr)
        return None


def _measure(label: str, key: str, fn, errors: dict, load: dict, retries: int):
    """Run fn, which records the foreign CPU share of its timed region in load[key]. While that share is above
    FOREIGN_LOAD_WARN, wait for an idle CPU and run it again (up to `retries` times), keeping the least-disturbed
    attempt: on this shared 2-core machine a neighbour's burst can double a timing."""
    best, best_load = None, None
    for attempt in range(retries + 1):
        result = _try(label, errors, fn)
        if result is None or getattr(result, "error", None):
            return best if best is not None else result
        share = load.get(key, 0.0)
        if best is None or share < best_load:
            best, best_load = result, share
        if share <= FOREIGN_LOAD_WARN or attempt == retries:
            break
        log(f"{label}: other processes used {share:.0%} of the CPU; retrying ({attempt + 1}/{retries})")
        wait_for_idle(120)
    load[key] = best_load
    return best


@contextmanager
def _worst_load(load: dict, key: str):
    """foreign_load around one of several runs: load[key] keeps the most disturbed run's share."""
    run: dict[str, float] = {}
    with foreign_load(run, key):
        yield
    load[key] = max(load.get(key, 0.0), run[key])


def _loaded(load: dict, key: str, fn):
    with foreign_load(load, key):
        return fn()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    quiet_transformers()
    from transformers import AutoConfig

    t_start = time.perf_counter()
    model_dir = ensure_bench_small(args.model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    shape = hw.ModelShape.from_config(config)
    spec = QUICK if args.quick else FULL
    requests = make_requests(spec, config.vocab_size)
    warmup = make_warmup_requests(config.vocab_size)
    decode_prompt = make_decode_prompt(config.vocab_size)
    decode_tokens = QUICK_DECODE_NEW_TOKENS if args.quick else DECODE_NEW_TOKENS
    lengths = [(len(r.prompt_token_ids), r.output_len) for r in requests]
    flops = hw.workload_flops(shape, lengths)
    settings = EngineSettings(num_kv_blocks=args.num_kv_blocks or blocks_for(requests, args.block_size),
                              block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens)
    hf_cb_tokens = args.hf_cb_max_batch_tokens or args.max_num_batched_tokens
    errors: dict[str, str] = {}
    load: dict[str, float] = {}  # share of the CPU other processes used during each phase

    busy_before = wait_for_idle(args.wait_idle)
    log("measuring matmul rate and copy bandwidth")
    with foreign_load(load, "bounds"):
        bounds_rounds = [(hw.measure_matmul_gflops(), hw.measure_copy_gbps())]

    # ---- transformers baselines ----
    from bench import hf_baselines as hf

    log("loading the transformers model")
    hf_model = hf.load_hf_model(model_dir)
    static = None
    if not args.skip_hf_static:
        log(f"(a) HF generate, static batches of {args.static_batch_size}")
        static = _measure("(a) HF static generate", "hf_static", lambda: hf.run_static_generate(
            hf_model, requests, warmup, args.static_batch_size, timed=partial(foreign_load, load, "hf_static")),
            errors, load, args.retries)
    log("HF batch-1 decode rate")
    hf_decode: DecodeRate | None = _measure("HF decode", "hf_decode", lambda: _loaded(
        load, "hf_decode", lambda: measure_decode_rate(partial(hf.hf_decode_seconds, hf_model), decode_prompt,
                                                       decode_tokens, args.decode_repeats)),
        errors, load, args.retries)
    cb = None
    if not args.skip_hf_cb:
        log("(b) HF continuous batching")
        cb = _measure("(b) HF continuous batching", "hf_continuous_batching", lambda: hf.run_continuous_batching(
            hf_model, requests, warmup, hf_cb_tokens, args.max_num_seqs, args.hf_cb_page_size,
            timed=partial(foreign_load, load, "hf_continuous_batching")), errors, load, args.retries)
        if cb is not None and cb.error:
            log(f"(b) failed: {cb.error}")
    hf_model = None
    gc.collect()

    # ---- our engine ----
    from bench import engine_runs as ours

    engine = _try("engine load", errors, lambda: ours.load_engine(model_dir, settings))
    mine = our_decode = kv = ours_gflops = None
    if engine is not None:
        log("(c) our engine: throughput")
        def engine_runs():
            load.pop("ours", None)  # this attempt's repeats only
            return ours.run_throughput_paired(engine, requests, warmup, args.engine_repeats,
                                              lambda: hw.measure_matmul_gflops()["gflops"],
                                              timed=partial(_worst_load, load, "ours"))

        paired = _measure("(c) engine throughput", "ours", engine_runs, errors, load, args.retries)
        if paired:
            chosen = ours.median_run(paired, flops["total"])
            mine, ours_gflops = chosen.run, chosen.gflops
        log("our engine: batch-1 decode rate")
        our_decode = _measure("engine decode", "ours_decode", lambda: _loaded(
            load, "ours_decode", lambda: measure_decode_rate(partial(ours.engine_decode_seconds, engine),
                                                             decode_prompt, decode_tokens, args.decode_repeats)),
            errors, load, args.retries)
        log("our engine: KV-slot utilisation (add_request/step)")
        kv = _try("engine kv usage", errors, lambda: ours.run_kv_usage(engine, requests))
    busy_after = busy_other_processes()
    log("measuring matmul rate and copy bandwidth again")
    with foreign_load(load, "bounds_end"):
        bounds_rounds.append((hw.measure_matmul_gflops(), hw.measure_copy_gbps()))
    # A ceiling is what the machine can attain: keep the better of the two rounds (start, end), which also
    # discounts a round slowed by a neighbour process.
    mm = max((m for m, _ in bounds_rounds), key=lambda m: m["gflops"])
    copy_gbps = max(c for _, c in bounds_rounds)
    compute_bound_s = flops["total"] / (mm["gflops"] * 1e9)
    # A half checkpoint (--model-dir) is held in its own type: its step reads 2 bytes a weight.
    weight_dtype = engine.model.embed_tokens.weight.dtype if engine is not None else torch.float32
    decode_bytes = hw.decode_bytes_per_token(shape, weight_dtype.itemsize)
    decode_bound_tps = copy_gbps * 1e9 / decode_bytes

    # (c) against the rate measured around its own runs (see engine_runs.run_throughput_paired).
    ours_bound_s = flops["total"] / (ours_gflops * 1e9) if ours_gflops else compute_bound_s
    results = collect(args, shape, spec, lengths, settings, hf_cb_tokens, mm, copy_gbps, flops, compute_bound_s,
                      decode_bytes, decode_bound_tps, static, cb, mine, hf_decode, our_decode, kv, errors,
                      busy_before, busy_after, load, bounds_rounds, time.perf_counter() - t_start, ours_bound_s,
                      weight_dtype)
    print_report(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
        log(f"wrote {args.json}")
    return 0


def _system(run, compute_bound_s):
    if run is None or run.error or run.wall_s <= 0:
        return None
    return {"name": run.name, "wall_s": run.wall_s, "useful_tokens": run.useful_tokens,
            "tokens_per_s": run.tokens_per_s, "compute_bound_fraction": compute_bound_s / run.wall_s,
            "notes": run.notes}


def _ratio(x, y):
    return x["tokens_per_s"] / y["tokens_per_s"] if x and y and y["tokens_per_s"] > 0 else None


def collect(args, shape, spec, lengths, settings, hf_cb_tokens, mm, copy_gbps, flops, compute_bound_s, decode_bytes,
            decode_bound_tps, static, cb, mine, hf_decode, our_decode, kv: KVUsage | None, errors, busy_before,
            busy_after, load, bounds_rounds, total_s, ours_bound_s: float, weight_dtype: torch.dtype) -> dict:
    a, b = (_system(r, compute_bound_s) for r in (static, cb))
    c = _system(mine, ours_bound_s)
    engine_missing = errors.get("engine load") or errors.get("(c) engine throughput")
    why_missing = {"hf_static": "skipped" if args.skip_hf_static else errors.get("(a) HF static generate"),
                   "hf_continuous_batching": "skipped" if args.skip_hf_cb else
                   (cb.error if cb else errors.get("(b) HF continuous batching")),
                   "ours": engine_missing,
                   "hf_decode": errors.get("HF decode"),
                   "ours_decode": errors.get("engine load") or errors.get("engine decode"),
                   "kv": errors.get("engine load") or errors.get("engine kv usage")}
    dec = lambda d: None if d is None else {"tokens_per_s": d.tokens_per_s, "t_first_s": d.t_first_s,
                                            "t_full_s": d.t_full_s, "new_tokens": d.new_tokens}
    hf_tps = hf_decode.tokens_per_s if hf_decode else None
    our_tps = our_decode.tokens_per_s if our_decode else None
    kv_d = None if kv is None else {
        "steps": kv.steps, "wall_s": kv.wall_s, "paged_utilisation": kv.paged_utilisation,
        "contiguous_max_len_utilisation": kv.contiguous_max_utilisation,
        "contiguous_exact_reservation_utilisation": kv.contiguous_exact_utilisation,
        "max_model_len": MAX_MODEL_LEN, "sum_live": sum(kv.live), "sum_allocated": sum(kv.allocated),
        "peak_allocated": max(kv.allocated, default=0)}
    return {
        "model": {"params": shape.block_linear_params + 2 * shape.lm_head_params,
                  "block_linear_params": shape.block_linear_params, "lm_head_params": shape.lm_head_params,
                  "dtype": str(weight_dtype).removeprefix("torch."), "threads": args.threads},
        "workload": {"quick": args.quick, "num_requests": spec.num_requests, "prompt_len_range": spec.prompt_len,
                     "output_len_range": spec.output_len, "lengths": lengths,
                     "prompt_tokens": sum(p for p, _ in lengths), "output_tokens": sum(o for _, o in lengths)},
        "engine_settings": settings.__dict__,
        "hf_cb_settings": {"attn_implementation": "sdpa", "page_size": args.hf_cb_page_size,
                           "max_batch_tokens": hf_cb_tokens, "max_requests_per_batch": args.max_num_seqs},
        "hardware": {"matmul_gflops": mm["gflops"], "matmul_per_shape_gflops": mm["per_shape_gflops"],
                     "copy_gbps": copy_gbps, "rounds": bounds_rounds, "busy_other_processes_before": busy_before,
                     "busy_other_processes_after": busy_after, "foreign_cpu_share_by_phase": load},
        "bounds": {"workload_flops": flops, "compute_bound_s": compute_bound_s, "ours_compute_bound_s": ours_bound_s,
                   "decode_bytes_per_token": decode_bytes, "decode_bound_tokens_per_s": decode_bound_tps},
        "systems": {"hf_static": a, "hf_continuous_batching": b, "ours": c},
        "why_missing": {k: v for k, v in why_missing.items() if v},
        "agreement": {"ours_vs_hf_static": agreement(mine and mine.outputs, static and static.outputs),
                      "ours_vs_hf_cb": agreement(mine and mine.outputs, cb and cb.outputs),
                      "hf_cb_vs_hf_static": agreement(cb and cb.outputs, static and static.outputs)},
        "ratios": {"ours_vs_hf_static": _ratio(c, a), "ours_vs_hf_cb": _ratio(c, b)},
        "decode": {"hf": dec(hf_decode), "ours": dec(our_decode),
                   "ratio": our_tps / hf_tps if our_tps and hf_tps else None,
                   "ours_bandwidth_fraction": our_tps / decode_bound_tps if our_tps else None,
                   "hf_bandwidth_fraction": hf_tps / decode_bound_tps if hf_tps else None},
        "kv": kv_d,
        "static_batch_size": args.static_batch_size,
        "decode_repeats": args.decode_repeats,
        "errors": errors,
        "total_s": total_s,
    }


if __name__ == "__main__":
    sys.exit(main())
