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
from functools import partial
from pathlib import Path

import torch

from bench import hardware_bounds as hw
from bench.checkpoints import ensure_bench_small
from bench.decode_rate import DecodeRate, measure_decode_rate
from bench.engine_runs import MAX_MODEL_LEN, EngineSettings, KVUsage, blocks_for
from bench.report import Target, num, pct, table
from bench.workload import (DECODE_NEW_TOKENS, FULL, QUICK, QUICK_DECODE_NEW_TOKENS, make_decode_prompt,
                            make_requests, make_warmup_requests)

TARGET_VS_STATIC = 2.0
TARGET_VS_HF_CB = 1.5
TARGET_COMPUTE_FRACTION = 0.5
TARGET_DECODE_VS_HF = 1.2
TARGET_BANDWIDTH_FRACTION = 0.6
TARGET_KV_UTILISATION = 0.9


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
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for other processes to stop using the CPU before measuring")
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


def wait_for_idle(max_wait_s: float) -> list[str]:
    busy = hw.busy_other_processes()
    deadline = time.monotonic() + max_wait_s
    while busy and time.monotonic() < deadline:
        log(f"waiting for an idle CPU: {busy}")
        time.sleep(min(15.0, max(0.0, deadline - time.monotonic())))
        busy = hw.busy_other_processes()
    return busy


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
    settings = EngineSettings(num_kv_blocks=args.num_kv_blocks or blocks_for(requests, args.block_size),
                              block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens)
    hf_cb_tokens = args.hf_cb_max_batch_tokens or args.max_num_batched_tokens
    errors: dict[str, str] = {}

    busy_before = wait_for_idle(args.wait_idle)
    log("measuring matmul rate and copy bandwidth")
    mm = hw.measure_matmul_gflops()
    copy_gbps = hw.measure_copy_gbps()
    flops = hw.workload_flops(shape, lengths)
    compute_bound_s = flops["total"] / (mm["gflops"] * 1e9)
    decode_bytes = hw.decode_bytes_per_token(shape)
    decode_bound_tps = copy_gbps * 1e9 / decode_bytes

    # ---- transformers baselines ----
    from bench import hf_baselines as hf

    log("loading the transformers model")
    hf_model = hf.load_hf_model(model_dir)
    static = None
    if not args.skip_hf_static:
        log(f"(a) HF generate, static batches of {args.static_batch_size}")
        static = _try("(a) HF static generate", errors,
                      lambda: hf.run_static_generate(hf_model, requests, warmup, args.static_batch_size))
    log("HF batch-1 decode rate")
    hf_decode: DecodeRate | None = _try("HF decode", errors, lambda: measure_decode_rate(
        partial(hf.hf_decode_seconds, hf_model), decode_prompt, decode_tokens, args.decode_repeats))
    cb = None
    if not args.skip_hf_cb:
        log("(b) HF continuous batching")
        cb = hf.run_continuous_batching(hf_model, requests, warmup, hf_cb_tokens, args.max_num_seqs,
                                        args.hf_cb_page_size)
        if cb.error:
            log(f"(b) failed: {cb.error}")
    del hf_model
    gc.collect()

    # ---- our engine ----
    from bench import engine_runs as ours

    engine = _try("engine load", errors, lambda: ours.load_engine(model_dir, settings))
    mine = our_decode = kv = None
    if engine is not None:
        log("(c) our engine: throughput")
        mine = _try("(c) engine throughput", errors, lambda: ours.run_throughput(engine, requests, warmup))
        log("our engine: batch-1 decode rate")
        our_decode = _try("engine decode", errors, lambda: measure_decode_rate(
            partial(ours.engine_decode_seconds, engine), decode_prompt, decode_tokens, args.decode_repeats))
        log("our engine: KV-slot utilisation (add_request/step)")
        kv = _try("engine kv usage", errors, lambda: ours.run_kv_usage(engine, requests))
    busy_after = hw.busy_other_processes()

    results = collect(args, shape, spec, lengths, settings, hf_cb_tokens, mm, copy_gbps, flops, compute_bound_s,
                      decode_bytes, decode_bound_tps, static, cb, mine, hf_decode, our_decode, kv, errors,
                      busy_before, busy_after, time.perf_counter() - t_start)
    print_report(results, static, cb, mine)
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
            busy_after, total_s) -> dict:
    a, b, c = (_system(r, compute_bound_s) for r in (static, cb, mine))
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
                  "dtype": "float32", "threads": args.threads},
        "workload": {"quick": args.quick, "num_requests": spec.num_requests, "prompt_len_range": spec.prompt_len,
                     "output_len_range": spec.output_len, "lengths": lengths,
                     "prompt_tokens": sum(p for p, _ in lengths), "output_tokens": sum(o for _, o in lengths)},
        "engine_settings": settings.__dict__,
        "hf_cb_settings": {"attn_implementation": "sdpa", "page_size": args.hf_cb_page_size,
                           "max_batch_tokens": hf_cb_tokens, "max_requests_per_batch": args.max_num_seqs},
        "hardware": {"matmul_gflops": mm["gflops"], "matmul_per_shape_gflops": mm["per_shape_gflops"],
                     "copy_gbps": copy_gbps, "busy_other_processes_before": busy_before,
                     "busy_other_processes_after": busy_after},
        "bounds": {"workload_flops": flops, "compute_bound_s": compute_bound_s,
                   "decode_bytes_per_token": decode_bytes, "decode_bound_tokens_per_s": decode_bound_tps},
        "systems": {"hf_static": a, "hf_continuous_batching": b, "ours": c},
        "hf_cb_error": cb.error if cb is not None else ("skipped" if args.skip_hf_cb else None),
        "agreement": {"ours_vs_hf_static": agreement(mine and mine.outputs, static and static.outputs),
                      "ours_vs_hf_cb": agreement(mine and mine.outputs, cb and cb.outputs),
                      "hf_cb_vs_hf_static": agreement(cb and cb.outputs, static and static.outputs)},
        "ratios": {"ours_vs_hf_static": _ratio(c, a), "ours_vs_hf_cb": _ratio(c, b)},
        "decode": {"hf": dec(hf_decode), "ours": dec(our_decode),
                   "ratio": our_tps / hf_tps if our_tps and hf_tps else None,
                   "ours_bandwidth_fraction": our_tps / decode_bound_tps if our_tps else None,
                   "hf_bandwidth_fraction": hf_tps / decode_bound_tps if hf_tps else None},
        "kv": kv_d,
        "errors": errors,
        "total_s": total_s,
    }


def print_report(r: dict, static, cb, mine) -> None:
    m, w, hwd, bd = r["model"], r["workload"], r["hardware"], r["bounds"]
    f = bd["workload_flops"]
    print()
    print(f"bench-small: {m['params'] / 1e6:.1f}M params (block linears {m['block_linear_params'] / 1e6:.1f}M, "
          f"LM head {m['lm_head_params'] / 1e6:.1f}M), float32, {m['threads']} torch threads")
    print(f"workload: {w['num_requests']} requests, prompts {w['prompt_len_range'][0]}..{w['prompt_len_range'][1]} "
          f"({w['prompt_tokens']} tokens), outputs {w['output_len_range'][0]}..{w['output_len_range'][1]} "
          f"({w['output_tokens']} tokens, EOS ignored), greedy, seeded")
    es = r["engine_settings"]
    print(f"engine: num_kv_blocks={es['num_kv_blocks']} block_size={es['block_size']} "
          f"max_num_seqs={es['max_num_seqs']} max_num_batched_tokens={es['max_num_batched_tokens']} "
          f"prefix caching off")
    for label, busy in (("before", hwd["busy_other_processes_before"]), ("after", hwd["busy_other_processes_after"])):
        if busy:
            print(f"WARNING: other processes were using the CPU {label} the run; timings are unreliable: "
                  + "; ".join(busy))
    print()
    shapes = ", ".join(f"{k} {v:.0f}" for k, v in hwd["matmul_per_shape_gflops"].items())
    print(f"matmul rate: {hwd['matmul_gflops']:.1f} GFLOP/s float32 (best per-shape median of torch.mm: {shapes})")
    print(f"copy bandwidth: {hwd['copy_gbps']:.1f} GB/s (median of 256 MiB tensor copies, bytes read + written)")
    print("workload FLOPs = sum over requests of 2 x N_block x (P + O - 1) + sum over those processed tokens of "
          "4 x ctx x hidden x layers + 2 x hidden x vocab x O")
    print(f"  = {f['total'] / 1e9:.1f} GFLOP (block linears {f['linear'] / 1e9:.1f}, attention "
          f"{f['attention'] / 1e9:.1f}, LM head {f['lm_head'] / 1e9:.1f}); N_block = "
          f"{m['block_linear_params'] / 1e6:.2f}M non-embedding matmul params, ctx = position + 1 (causal)")
    print(f"  compute bound: {bd['compute_bound_s']:.2f} s = {w['output_tokens'] / bd['compute_bound_s']:.0f} "
          f"useful tok/s")
    print()
    rows, notes = [], []
    names = {"hf_static": "(a) HF generate (static batch)", "hf_continuous_batching": "(b) HF continuous batching",
             "ours": "(c) our engine"}
    for key, run in (("hf_static", static), ("hf_continuous_batching", cb), ("ours", mine)):
        s = r["systems"][key]
        if s is None:
            why = "skipped" if run is None else (run.error or "failed")
            if key == "ours" and run is None:
                why = r["errors"].get("engine load") or r["errors"].get("(c) engine throughput") or "not run"
            rows.append([names[key], "-", "-", "-", "-"])
            notes.append(f"{names[key][:3]} not measured: {why}")
        else:
            rows.append([names[key], num(s["wall_s"], 2), str(s["useful_tokens"]), num(s["tokens_per_s"]),
                         pct(s["compute_bound_fraction"])])
            notes += [f"{names[key][:3]} {n}" for n in s["notes"]]
    print(table(rows, ["system", "wall s", "useful tok", "useful tok/s", "of compute bound"]))
    for n in notes:
        print(n)
    ra = r["ratios"]
    times = lambda x: "-" if x is None else f"{x:.2f}x"
    print(f"(c)/(a) = {times(ra['ours_vs_hf_static'])}   (c)/(b) = {times(ra['ours_vs_hf_cb'])}   (useful tok/s)")
    cbs = r["hf_cb_settings"]
    print(f"(b) setup: ContinuousBatchingManager.add_request per request with its own max_new_tokens and "
          f"eos_token_id=-1 (generate_batch takes one max_new_tokens for all); attn={cbs['attn_implementation']}, "
          f"page_size={cbs['page_size']}, max_batch_tokens={cbs['max_batch_tokens']}, "
          f"max_requests_per_batch={cbs['max_requests_per_batch']}, cache sized to hold every request, "
          f"no prefix sharing, no CUDA graphs/compile")
    ag = r["agreement"]
    print(f"greedy agreement: ours vs (a) {ag['ours_vs_hf_static']}; ours vs (b) {ag['ours_vs_hf_cb']}; "
          f"(b) vs (a) {ag['hf_cb_vs_hf_static']}")
    print()
    d = r["decode"]
    n = (d["hf"] or d["ours"] or {}).get("new_tokens", "?")
    print(f"single-stream decode (prompt 128, {n} decode steps, greedy, ignore_eos; "
          f"rate = n / (t(n+1 tokens) - t(1 token))):")
    for label, key in (("HF generate batch 1", "hf"), ("our engine", "ours")):
        x = d[key]
        print(f"  {label:<20s} " + ("not measured" if x is None else
              f"{x['tokens_per_s']:.1f} tok/s  (t1 {x['t_first_s']:.3f}s, t{x['new_tokens'] + 1} "
              f"{x['t_full_s']:.3f}s)  = {pct(d[key + '_bandwidth_fraction'])} of bandwidth bound"))
    print(f"  bandwidth bound: {bd['decode_bytes_per_token'] / 1e6:.1f} MB of weights per token (block linears + "
          f"LM head, no embedding table) / {hwd['copy_gbps']:.1f} GB/s = {bd['decode_bound_tokens_per_s']:.1f} tok/s")
    print()
    kv = r["kv"]
    if kv is None:
        print(f"KV-slot utilisation: not measured ({r['errors'].get('engine kv usage') or 'engine unavailable'})")
    else:
        print(f"KV-slot utilisation over {kv['steps']} engine steps (sum live / sum allocated, sampled after every "
              f"step; {kv['wall_s']:.2f}s): paged {pct(kv['paged_utilisation'])}")
        print(f"  contiguous, every unfinished request reserving max_model_len={kv['max_model_len']}: "
              f"{pct(kv['contiguous_max_len_utilisation'])}")
        print(f"  contiguous, every unfinished request reserving its own prompt+max_tokens: "
              f"{pct(kv['contiguous_exact_reservation_utilisation'])}")
        print(f"  (same per-step live counts; all requests arrive at t=0 and max_num_seqs >= requests, so a "
              f"contiguous allocator holds a reservation for every unfinished request)")
    if r["errors"]:
        print()
        for k, v in r["errors"].items():
            print(f"error in {k}: {v}")
    print()
    missing = lambda key: r["errors"].get(key) or "engine unavailable"
    cb_missing = "baseline (b) " + ("skipped" if r["hf_cb_error"] == "skipped" else "failed")
    targets = [
        Target("(c) vs (a) HF static generate, useful tok/s", ra["ours_vs_hf_static"], TARGET_VS_STATIC,
               why_missing=missing("(c) engine throughput") if r["systems"]["hf_static"] else "baseline (a) missing"),
        Target("(c) vs (b) HF continuous batching", ra["ours_vs_hf_cb"], TARGET_VS_HF_CB,
               why_missing=cb_missing if not r["systems"]["hf_continuous_batching"] else
               missing("(c) engine throughput")),
        Target("(c) fraction of the compute bound", (r["systems"]["ours"] or {}).get("compute_bound_fraction"),
               TARGET_COMPUTE_FRACTION, unit="%", why_missing=missing("(c) engine throughput")),
        Target("single-stream decode vs HF generate", d["ratio"], TARGET_DECODE_VS_HF,
               why_missing=missing("engine decode") if d["hf"] else "baseline HF decode missing"),
        Target("single-stream decode fraction of bandwidth bound", d["ours_bandwidth_fraction"],
               TARGET_BANDWIDTH_FRACTION, unit="%", why_missing=missing("engine decode")),
        Target("KV-slot utilisation (paged)", kv and kv["paged_utilisation"], TARGET_KV_UTILISATION, unit="%",
               why_missing=missing("engine kv usage")),
    ]
    for t in targets:
        print(t.line())
    print(f"total benchmark time {r['total_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
