"""`python -m bench.vs_llama_cpp [--model bench-small|tinyllama-shape] [--rounds 3] [--quick]`: our
engine against llama.cpp on the same random weights, side by side in one run.

For each weight format (our float32, bfloat16, float16, INT8 and INT4, the output head quantized
too, the quantized ones also with int8 activations, against llama.cpp's f32, bf16, f16, q8_0 and
q4_0 of the same checkpoint): the single-stream decode rate (ours:
(t(n+1) - t(1)) / n; theirs: `llama-bench` tg<n>) and the batched generation rate (N sequences of
P prompt + G new tokens; theirs: `llama-batched-bench`), each format's runs alternating ours and
theirs, the order flipped every round, so a drifting machine hits both; medians over the rounds
(three by default: the median of two is their mean, which one slow round of either side drags).
Also: the memory-bandwidth bounds of each single-stream rate (the weight bytes a step reads over
the copy bandwidth, read + written, and over the read-only bandwidth, both probed just before each
run, so a host whose memory rate drifts within the run bounds each run by its own moment), the compute bound of the batched run (its FLOPs over the host's
measured float32 FMA peak, bench/fma_peak.py: what float arithmetic, ours or llama.cpp's, cannot
beat) and our fixed per-step cost (the step of a hidden-64, 8-layer model with almost no
weights). llama.cpp comes from `shared/tools/build-llama-cpp`; checkpoints and GGUFs are made
once under `.cache/`. Not part of `make test`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import llama_cpp_tools
from bench.checkpoints import REPO_ROOT, ensure_checkpoint
from bench.fma_peak import measure_fma_gflops
from bench.hardware_bounds import ModelShape, measure_copy_gbps, measure_read_gbps, workload_flops
from bench.json_child import run_json_child
from bench.llama_server import find_llama_cpp
from bench.results_file import write_results

DEFAULT_RESULTS = REPO_ROOT / "bench" / "results" / "vs_llama_cpp.json"
# (our format, its engine settings, llama.cpp's GGUF type); the head is quantized on both sides.
FORMATS = [
    ("float32", {}, "f32"),
    ("bfloat16", {"dtype": "bfloat16"}, "bf16"),  # the float32 weights rounded to bf16 on both sides
    ("float16", {"dtype": "float16"}, "f16"),  # likewise to fp16
    ("int8", {"quantization": "mixed", "quantization_rule": "*:int8,head:int8"}, "q8_0"),
    ("int4", {"quantization": "mixed", "quantization_rule": "*:int4,head:int4"}, "q4_0"),
    # Activations rounded to int8 per 32-block as well: the arithmetic of llama.cpp's q8_0 / q4_0.
    ("int8 + int8 activations", {"quantization": "mixed", "quantization_rule": "*:int8,head:int8",
                                 "quantization_activations": "int8"}, "q8_0"),
    ("int4 + int8 activations", {"quantization": "mixed", "quantization_rule": "*:int4,head:int4",
                                 "quantization_activations": "int8"}, "q4_0"),
]
# Per model: decode tokens, (sequences, prompt length, new tokens) of the batched run.
SETTINGS = {
    "bench-small": dict(decode_tokens=128, batched=(32, 332, 140)),
    "tinyllama-shape": dict(decode_tokens=32, batched=(8, 128, 32)),
}
QUICK = dict(decode_tokens=16, batched=(4, 32, 8))


def run_ours(model_dir: Path, engine: dict, decode_tokens: int, batched, threads: int, repeats: int) -> dict:
    sequences, prompt_len, new_tokens = batched or (1, 8, decode_tokens + 1)
    blocks = sequences * (-(-(prompt_len + new_tokens) // 16) + 1) + 16  # every sequence whole, no preemption
    spec = dict(model_dir=str(model_dir), decode_tokens=decode_tokens, repeats=repeats, batched=batched,
                engine=dict(device="cpu", num_threads=threads, quantization_calibration="none",
                            num_kv_blocks=blocks, max_num_seqs=sequences, **engine))
    return run_json_child("bench.ours_decode_child", spec)


def run_theirs(llama_dir: Path, gguf: Path, decode_tokens: int, batched, threads: int, repeats: int) -> dict:
    record = {"decode_tok_s": llama_cpp_tools.decode_rate(llama_dir, gguf, threads, decode_tokens, repeats),
              "weight_bytes_per_token": gguf.stat().st_size}
    if batched:
        record["batched_tok_s"] = llama_cpp_tools.batched_rate(llama_dir, gguf, threads, batched[1], batched[2],
                                                               batched[0])
    return record


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def batched_bound_tok_s(model_dir: Path, batched, fma_gflops: float) -> float:
    """Generated tokens/s of the batched run if every FLOP it must do ran at the FMA peak."""
    from transformers import AutoConfig
    sequences, prompt_len, new_tokens = batched
    flops = workload_flops(ModelShape.from_config(AutoConfig.from_pretrained(model_dir)),
                           [(prompt_len, new_tokens)] * sequences)["total"]
    return sequences * new_tokens / (flops / (fma_gflops * 1e9))


def probe_memory() -> dict:
    """The host's memory rates now: what bounds the run that follows."""
    return {"copy_gbps": measure_copy_gbps(repeats=5), "read_gbps": measure_read_gbps(repeats=5)}


def _of_bound(runs: list[dict], side_gbps: str) -> float | None:
    """Median over the runs of each run's rate over its own bound (its weight bytes at the rate probed before it)."""
    shares = [r["decode_tok_s"] * r["weight_bytes_per_token"] / (r[side_gbps] * 1e9)
              for r in runs if r.get("decode_tok_s") and r.get(side_gbps)]
    return statistics.median(shares) if shares else None


def pick_formats(names: str | None) -> list[tuple]:
    """The FORMATS named in a comma-separated list (all for None), in the table's order."""
    if names is None:
        return list(FORMATS)
    wanted = [name.strip() for name in names.split(",")]
    unknown = [name for name in wanted if name not in {f[0] for f in FORMATS}]
    if unknown:
        raise ValueError(f"no format {', '.join(map(repr, unknown))}; the formats: {', '.join(f[0] for f in FORMATS)}")
    return [f for f in FORMATS if f[0] in wanted]


def probe_range(rounds: dict[str, dict[str, list[dict]]], key: str) -> tuple[float, float] | None:
    values = [r[key] for sides in rounds.values() for runs in sides.values() for r in runs if r.get(key)]
    return (min(values), max(values)) if values else None


def summarize(rounds: dict[str, dict[str, list[dict]]], batched_bound: float | None = None) -> list[dict]:
    rows = []
    for name, _, kind in FORMATS:
        if name not in rounds:  # left out by --formats
            continue
        ours, theirs = rounds[name]["ours"], rounds[name]["theirs"]
        row = {"format": name, "llama_cpp": kind}
        for key in ("decode_tok_s", "batched_tok_s"):
            row[f"ours_{key}"], row[f"theirs_{key}"] = _median(ours, key), _median(theirs, key)
            row[f"ratio_{key}"] = (row[f"ours_{key}"] / row[f"theirs_{key}"]
                                   if row[f"ours_{key}"] and row[f"theirs_{key}"] else None)
        for side, runs in (("ours", ours), ("theirs", theirs)):
            row[f"{side}_weight_mib"] = runs[0]["weight_bytes_per_token"] / 2**20
            row[f"{side}_of_bound"] = _of_bound(runs, "copy_gbps")
            row[f"{side}_of_read_bound"] = _of_bound(runs, "read_gbps")
            row[f"{side}_of_compute_bound"] = (row[f"{side}_batched_tok_s"] / batched_bound
                                               if batched_bound and row[f"{side}_batched_tok_s"] else None)
        row["route"] = ours[0]["route"]
        rows.append(row)
    return rows


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _span(values) -> str:
    return "-" if not values else f"{values[0]:.1f}-{values[1]:.1f}"


def _share(value) -> str:
    return "" if value is None else f" ({value:.0%})"


def _bounds(row: dict, side: str) -> str:
    return (f"{_fmt(row[f'{side}_of_bound'], '.0%')} / {_fmt(row.get(f'{side}_of_read_bound'), '.0%')} "
            f"({row[f'{side}_weight_mib']:.0f})")


def report(rows: list[dict], overhead: dict, probes: dict, model: str, settings: dict,
           fma_gflops: float | None = None, batched_bound: float | None = None) -> str:
    """`probes`: the (lowest, highest) copy_gbps and read_gbps probed over the run."""
    sequences, prompt_len, new_tokens = settings["batched"]
    compute = (f" Float32 FMA peak {fma_gflops:.0f} GFLOP/s: batched at most {batched_bound:.0f} tok/s in float "
               "arithmetic (the percentages after the batched rates)." if fma_gflops and batched_bound else "")
    lines = [f"## {model}: ours against llama.cpp, 2 threads", "",
             f"Single stream: tg{settings['decode_tokens']}. Batched: {sequences} sequences x {prompt_len} prompt "
             f"+ {new_tokens} new tokens, generated tokens over the whole run. Of bound: the single-stream rate over "
             "the weight bytes a token reads at the copy bandwidth / at the read-only bandwidth, each probed before "
             f"the run it bounds (copy {_span(probes.get('copy_gbps'))} GB/s, read {_span(probes.get('read_gbps'))} "
             "GB/s over this run)." + compute,
             "", "| format | ours tok/s | llama.cpp tok/s | ratio | ours of bound (weights MiB) | llama.cpp of bound "
             "(GGUF MiB) | batched ours | batched llama.cpp | ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['format']} / {r['llama_cpp']} | {_fmt(r['ours_decode_tok_s'])} | {_fmt(r['theirs_decode_tok_s'])} "
            f"| {_fmt(r['ratio_decode_tok_s'], '.2f')}x | {_bounds(r, 'ours')} | {_bounds(r, 'theirs')} "
            f"| {_fmt(r['ours_batched_tok_s'])}{_share(r.get('ours_of_compute_bound'))} "
            f"| {_fmt(r['theirs_batched_tok_s'])}{_share(r.get('theirs_of_compute_bound'))} "
            f"| {_fmt(r['ratio_batched_tok_s'], '.2f')}x |")
    lines += ["", f"Fixed per-step cost (hidden 64, 8 layers, batch 1): {_fmt(overhead['step_ms'], '.3f')} ms "
                  f"({overhead['decode_tok_s']:.0f} tok/s; route: {overhead['route']})."]
    lines += [f"- {r['format']}: {r['route']}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vs_llama_cpp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SETTINGS), default="bench-small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement within a round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-batched", action="store_true", help="single stream only")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few tokens, one round")
    parser.add_argument("--formats", default=None,
                        help="comma-separated formats to run (default all): " + ", ".join(name for name, _, _ in FORMATS))
    parser.add_argument("--json", default=None, help=f"results file (default {DEFAULT_RESULTS.relative_to(REPO_ROOT)})")
    args = parser.parse_args(argv)
    try:
        formats = pick_formats(args.formats)
    except ValueError as e:
        parser.error(f"--formats: {e}")
    llama_dir, why = find_llama_cpp()
    if llama_dir is None:
        print(f"llama.cpp not found: {why}", file=sys.stderr)
        return 2
    settings = dict(SETTINGS[args.model], **(QUICK if args.quick else {}))
    batched = None if args.no_batched else settings["batched"]
    rounds_count = 1 if args.quick else args.rounds
    model_dir = ensure_checkpoint(args.model)
    ggufs = llama_cpp_tools.gguf_files(llama_dir, model_dir, args.model)
    torch.set_num_threads(args.threads)  # the memory probes stream on as many threads as the engines
    rounds = {name: {"ours": [], "theirs": []} for name, _, _ in formats}
    for round_index in range(rounds_count):
        for name, engine, kind in formats:
            sides = [("ours", lambda: run_ours(model_dir, engine, settings["decode_tokens"], batched, args.threads,
                                               args.repeats)),
                     ("theirs", lambda: run_theirs(llama_dir, ggufs[kind], settings["decode_tokens"], batched,
                                                   args.threads, args.repeats))]
            for side, run in sides if round_index % 2 == 0 else reversed(sides):
                probe = probe_memory()
                started = time.perf_counter()
                rounds[name][side].append(dict(run(), **probe))
                print(f"[{time.strftime('%H:%M:%S')}] round {round_index + 1} {name} {side}: "
                      f"{rounds[name][side][-1]['decode_tok_s']:.1f} tok/s ({time.perf_counter() - started:.0f} s; "
                      f"copy {probe['copy_gbps']:.1f} GB/s, read {probe['read_gbps']:.1f} before it)",
                      file=sys.stderr, flush=True)
    overhead = run_ours(ensure_checkpoint("overhead-probe"), {}, 64, None, args.threads, args.repeats)
    probes = {key: probe_range(rounds, key) for key in ("copy_gbps", "read_gbps")}
    fma_gflops = measure_fma_gflops(args.threads)
    bound = batched_bound_tok_s(model_dir, batched, fma_gflops) if batched else None
    rows = summarize(rounds, bound)
    print(report(rows, overhead, probes, args.model, dict(settings, batched=batched or settings["batched"]),
                 fma_gflops, bound))
    path = write_results({"model": args.model, "settings": settings, "threads": args.threads,
                          "probes": probes, "fma_gflops": fma_gflops, "batched_bound_tok_s": bound,
                          "rows": rows, "overhead": overhead, "rounds": rounds,
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                         args.json, DEFAULT_RESULTS.with_name(f"vs_llama_cpp_{args.model}.json"), args.quick)
    print(f"\nresults: {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
