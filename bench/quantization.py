"""Quantization (none / int8 / int4 / mixed) and the loading modes (full / sharded / on
demand), side by side on one model: weight and KV bytes, peak memory, load time, single-stream
and batched tokens/s, held-out perplexity (where the model folder has a held-out text) and
the greedy-match rate against full precision. Every ratio is against the "none" row of the
same run; every variant runs in a fresh process (bench/quantization_child.py).

    python -m bench.quantization                     # models/default
    python -m bench.quantization --model bench-small # the random 56M-parameter Llama
    python -m bench.quantization --quick             # fewer tokens
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.checkpoints import REPO_ROOT, ensure_bench_small
from bench.contention import wait_for_idle
from bench.json_child import run_json_child

TEXTS = ["The json module", "The for statement", "Return the number of items", "os.path.join", "The class",
         "Raise an exception", "Open a file and", "A list is"]
SEEDS_RULE = "params>=1e6:int8,*:int4"  # the seeds' mixed rule: a layer over 1M parameters stays INT8
VARIANTS = [
    ("none", {}),
    ("int8", {"quantization": "int8"}),
    ("int4", {"quantization": "int4"}),
    ("int4, plain rounding", {"quantization": "int4", "quantization_calibration": "none"}),
    ("mixed: attention int8, MLP int4", {"quantization": "mixed"}),
    ("mixed: seeds' rule, >=1M params int8", {"quantization": "mixed", "quantization_rule": SEEDS_RULE}),
    ("int8, output head int8 too", {"quantization": "mixed", "quantization_rule": "*:int8,head:int8"}),
    ("int8 + int8 activations", {"quantization": "int8", "quantization_activations": "int8"}),
    ("int4 + int8 activations", {"quantization": "int4", "quantization_activations": "int8"}),
    ("int4, pre-quantized checkpoint", {}),  # the folder tools/quantize_checkpoint.py writes
    ("sharded over cpu, cpu", {"load_mode": "sharded", "devices": ["cpu", "cpu"]}),
    ("on demand", {"load_mode": "on_demand"}),
]
PREQUANTIZED = "int4, pre-quantized checkpoint"


def _prompts(model_dir: Path) -> list[list[int]]:
    if (model_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        return [tokenizer.encode(t).ids for t in TEXTS]
    generator = torch.Generator().manual_seed(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return [torch.randint(3, vocab, (8 + 4 * i,), generator=generator).tolist() for i in range(len(TEXTS))]


def _prequantize(model_dir: Path, name: str) -> Path:
    out = REPO_ROOT / ".cache" / "quantized" / f"{name}-int4"
    source = model_dir / "model.safetensors"
    if not (out / "model.safetensors").is_file() or (out / "model.safetensors").stat().st_mtime < source.stat().st_mtime:
        subprocess.run([sys.executable, "-m", "tools.quantize_checkpoint", str(model_dir), str(out),
                        "--quantization", "int4"], check=True, cwd=REPO_ROOT)
    return out


def _run_child(spec: dict) -> dict:
    return run_json_child("bench.quantization_child", spec)


def match_rate(reference: list[list[int]], outputs: list[list[int]]) -> tuple[int, float]:
    identical = sum(r == o for r, o in zip(reference, outputs))
    positions = sum(a == b for r, o in zip(reference, outputs) for a, b in zip(r, o))
    return identical, positions / max(1, sum(len(r) for r in reference))


def report(results: dict[str, dict], model_name: str) -> str:
    base = results["none"]
    lines = [f"## {model_name}", "",
             "| variant | weights MiB | x none | KV B/token | load s | start s | peak RSS MiB | 1-stream tok/s "
             "| x none | batched tok/s | x none | perplexity | greedy same (prompts, positions) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        identical, positions = match_rate(base["greedy"], r["greedy"])
        ppl = f"{r['perplexity']:.2f}" if "perplexity" in r else "-"
        load = f"{r['load_s']:.2f}" if r.get("load_s") is not None else "-"
        lines.append(
            f"| {name} | {r['weight_bytes'] / 2**20:.2f} | {r['weight_bytes'] / base['weight_bytes']:.2f} "
            f"| {r['kv_bytes_per_token']} | {load} | {r['init_s']:.2f} | {r['rss_peak'] / 2**20:.0f} "
            f"| {r['single_tok_s']:.1f} | {r['single_tok_s'] / base['single_tok_s']:.2f} "
            f"| {r['batched_tok_s']:.1f} | {r['batched_tok_s'] / base['batched_tok_s']:.2f} | {ppl} "
            f"| {identical}/{len(base['greedy'])}, {positions:.0%} |")
    lines.append("")
    for name, r in results.items():
        if r.get("calibration"):
            c = r["calibration"]
            lines.append(f"- {name}: calibration {c['summary']}; {c['num_sequences']} self-generated sequences, "
                         f"{c['num_tokens']} tokens, {c['seconds']:.1f} s when first computed; compute paths {r['paths']}")
    return "\n".join(lines)


def measure_variants(model_dir: Path, threads: int = 2, quick: bool = False, only: list[str] | None = None,
                     max_wait: float = 120) -> dict[str, dict]:
    """Every variant (or `only` those, with "none" always) of model_dir, each in a fresh process."""
    prompts = _prompts(model_dir)
    common = dict(device="cpu", num_threads=threads, num_kv_blocks=512, max_num_seqs=16,
                  enable_prefix_caching=False)
    spec = dict(prompts=prompts, match_tokens=32, heldout=True, single=(64, 32 if quick else 128),
                batched=(16, 16 if quick else 64))
    results: dict[str, dict] = {}
    for variant, overrides in VARIANTS:
        if only and variant != "none" and variant not in only:
            continue
        folder = _prequantize(model_dir, model_dir.name) if variant == PREQUANTIZED else model_dir
        busy = wait_for_idle(max_wait)
        started = time.perf_counter()
        results[variant] = _run_child(dict(spec, model_dir=str(folder), engine=dict(common, **overrides)))
        results[variant]["foreign_busy"] = busy
        print(f"[{time.strftime('%H:%M:%S')}] {variant}: {time.perf_counter() - started:.0f} s"
              + (f" (busy: {busy})" if busy else ""), file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default, bench-small, or a checkpoint folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", help="variant names to run (none always runs)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--max-wait", type=float, default=120, help="seconds to wait for an idle CPU per variant")
    args = parser.parse_args(argv)
    if args.model == "default":
        model_dir, name = REPO_ROOT / "models" / "default", "models/default"
    elif args.model == "bench-small":
        model_dir, name = ensure_bench_small(), "bench-small"
    else:
        model_dir = Path(args.model)
        name = model_dir.name
    results = measure_variants(model_dir, args.threads, args.quick, args.only, args.max_wait)
    print(report(results, name))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(model=name, results=results), indent=1))


if __name__ == "__main__":
    main()
