"""`python -m bench.gpu_decode [--model tinyllama-shape] [--device cuda]`: per-token speed on an
accelerator, our engine beside transformers on the same checkpoint, dtype and device, in one run.

For each system: the single-stream decode rate ((t(n+1) - t(1)) / n, bench/decode_rate.py, so
prefill cancels), a batch of sequences run to the end (our continuous batching against
transformers' static `generate()` of the whole batch), and the single-stream step time of the
overhead-probe model (hidden 64: almost no weights, so the step is the fixed cost of dispatch and
bookkeeping). Ours runs twice, with decode steps replayed from CUDA graphs (the default) and
eagerly (`cuda_graphs = false`). Beside them the device's measured copy bandwidth and the single-stream bound it
gives: the weight bytes a decode step must read over that bandwidth. `--device cpu --model
bench-small --dtype float32` is a dry run of the whole script on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.checkpoints import ensure_checkpoint
from bench.decode_rate import measure_decode_rate
from bench.engine_runs import engine_decode_seconds
from bench.hardware_bounds import ModelShape, measure_copy_gbps
from bench.hf_baselines import _generate_static, hf_decode_seconds
from bench.results_file import write_results
from bench.workload import Request

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def device_copy_gbps(device: torch.device, mib: int = 1024, repeats: int = 10) -> float:
    """Median device-to-device copy rate, bytes read plus bytes written, timed with device events."""
    if device.type != "cuda":
        return measure_copy_gbps()
    src = torch.rand(mib << 18, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch and kernel load are not timed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(seconds) / 1e9


def decode_weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """Weight bytes one single-stream decode step must read: every block linear and the head, once."""
    from transformers import AutoConfig
    shape = ModelShape.from_config(AutoConfig.from_pretrained(model_dir))
    return (shape.block_linear_params + shape.lm_head_params) * torch.finfo(dtype).bits // 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(engine) -> dict[str, list[float]]:
    """Wall seconds of each engine step from now on, as "decode graph" steps (decode-only steps
    the graphs ran) and "other" (prompt chunks, mixed and eager steps)."""
    graphs = engine.runner.decode_graphs
    times: dict[str, list[float]] = {"decode graph": [], "other": []}
    step = engine.step

    def timed():
        before = graphs.num_steps if graphs is not None else 0
        started = time.perf_counter()
        deltas = step()
        ran_graph = graphs is not None and graphs.num_steps > before
        times["decode graph" if ran_graph else "other"].append(time.perf_counter() - started)
        return deltas

    engine.step = timed  # generate() calls self.step
    return times


def _profile(device: torch.device, run, rows: int = 14) -> str:
    """torch.profiler's table of `run()`: the ops by their own device time (CPU time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def _tokens_per_s(device: torch.device, generate) -> float:
    """Tokens a second of `generate()`, which returns each sequence's new tokens."""
    _sync(device)
    started = time.perf_counter()
    outputs = generate()
    return sum(map(len, outputs)) / (time.perf_counter() - started)


def _prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def _single_stream(decode_seconds, vocab: int, decode_tokens: int, repeats: int) -> dict:
    """The record's single-stream rate, from `decode_seconds(prompt, n)` on a 4-token prompt."""
    prompt = _prompts(vocab, 1, 4)[0]
    return dict(decode_tok_s=measure_decode_rate(decode_seconds, prompt, decode_tokens, repeats).tokens_per_s)


def measure_ours(model_dir: Path, device: torch.device, dtype: str, decode_tokens: int, batched, repeats: int,
                 kv_blocks: int, graphs: bool = True, profile: bool = False) -> dict:
    from worker.engine import Engine, SamplingParams

    engine = Engine.from_model_dir(model_dir, device=str(device), dtype=dtype, num_kv_blocks=kv_blocks,
                                   max_num_seqs=max(32, batched[0]) if batched else 32,
                                   max_num_batched_tokens=2048, cuda_graphs=graphs)
    vocab = engine.model_config.vocab_size
    record = _single_stream(lambda p, n: engine_decode_seconds(engine, p, n), vocab, decode_tokens, repeats)
    if batched:
        sequences, prompt_len, new_tokens = batched
        prompts = _prompts(vocab, sequences, prompt_len, seed=1)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        engine.evict_prefix_cache()
        steps = _time_steps(engine)
        record["batched_tok_s"] = _tokens_per_s(device, lambda: [o.token_ids for o in
                                                                 engine.generate(prompts, params, use_tqdm=False)])
        record["batched_steps"] = {kind: dict(count=len(times), median_ms=1e3 * statistics.median(times),
                                              total_s=sum(times)) for kind, times in steps.items() if times}
        if profile:
            engine.evict_prefix_cache()
            record["profile"] = _profile(device, lambda: engine.generate(
                prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False))
    engine = None
    _release(device)
    return record


def measure_transformers(model_dir: Path, device: torch.device, dtype: str, decode_tokens: int, batched,
                         repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa")
    model = model.to(device).eval()
    vocab = model.config.vocab_size
    record = _single_stream(lambda p, n: hf_decode_seconds(model, p, n), vocab, decode_tokens, repeats)
    if batched:
        sequences, prompt_len, new_tokens = batched
        requests = [Request(p, new_tokens) for p in _prompts(vocab, sequences, prompt_len, seed=1)]
        with torch.inference_mode():
            _generate_static(model, [Request(r.prompt_token_ids, 4) for r in requests[:2]])  # warm-up
            record["batched_tok_s"] = _tokens_per_s(device, lambda: _generate_static(model, requests))
    model = None
    _release(device)
    return record


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _ratio(ours, theirs) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def report(results: dict) -> str:
    ours, eager, theirs, probe = results["ours"], results["ours_eager"], results["transformers"], \
        results["overhead_probe"]
    bound = results["decode_bound_tok_s"]
    lines = [f"{results['device_name']}, {results['model']} in {results['dtype']}: "
             f"copy {results['copy_gbps']:.0f} GB/s, "
             f"{results['weight_bytes_per_token'] / 1e6:.0f} MB of weights a decode step, "
             f"single-stream bound {bound:.0f} tok/s",
             f"{'':34} {'ours':>9} {'ours eager':>11} {'transformers':>13} {'ours/tf':>8}",
             f"{'single stream, tok/s':34} {ours['decode_tok_s']:9.1f} {eager['decode_tok_s']:11.1f} "
             f"{theirs['decode_tok_s']:13.1f} {_ratio(ours['decode_tok_s'], theirs['decode_tok_s']):>8}"
             f"   ({ours['decode_tok_s'] / bound:.0%} of bound)"]
    if "batched_tok_s" in ours:
        sequences, prompt_len, new_tokens = results["batched"]
        lines.append(f"{f'{sequences} x ({prompt_len} + {new_tokens}) batched, tok/s':34} "
                     f"{ours['batched_tok_s']:9.1f} {'':>11} {theirs['batched_tok_s']:13.1f} "
                     f"{_ratio(ours['batched_tok_s'], theirs['batched_tok_s']):>8}")
    for kind, step in ours.get("batched_steps", {}).items():
        lines.append(f"  ours, batched: {step['count']} {kind} steps, median {step['median_ms']:.2f} ms, "
                     f"{step['total_s']:.2f} s in all")
    lines.append(f"{'overhead-probe step, ms':34} {1e3 / probe['ours']['decode_tok_s']:9.3f} "
                 f"{1e3 / probe['ours_eager']['decode_tok_s']:11.3f} "
                 f"{1e3 / probe['transformers']['decode_tok_s']:13.3f} "
                 f"{_ratio(probe['ours']['decode_tok_s'], probe['transformers']['decode_tok_s']):>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tinyllama-shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--batched", type=int, nargs=3, default=[32, 332, 140], metavar=("SEQS", "PROMPT", "NEW"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler's table of a short batched run of ours")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes (default bench/results/)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    model_dir = ensure_checkpoint(args.model)
    probe_dir = ensure_checkpoint("overhead-probe")
    copy_gbps = device_copy_gbps(device)
    weight_bytes = decode_weight_bytes(model_dir, DTYPES[args.dtype])
    common = dict(device=device, dtype=args.dtype, decode_tokens=args.decode_tokens, repeats=args.repeats)
    results = dict(model=args.model, dtype=args.dtype, batched=args.batched, copy_gbps=copy_gbps,
                   device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   weight_bytes_per_token=weight_bytes, decode_bound_tok_s=copy_gbps * 1e9 / weight_bytes)
    # Alternating order would cost a second load of each; one order, theirs last, is what fits a lease.
    results["ours"] = measure_ours(model_dir, batched=args.batched, kv_blocks=args.kv_blocks, profile=args.profile,
                                   **common)
    results["ours_eager"] = measure_ours(model_dir, batched=None, kv_blocks=args.kv_blocks, graphs=False, **common)
    results["transformers"] = measure_transformers(model_dir, batched=args.batched, **common)
    results["overhead_probe"] = dict(ours=measure_ours(probe_dir, batched=None, kv_blocks=256, **common),
                                     ours_eager=measure_ours(probe_dir, batched=None, kv_blocks=256, graphs=False,
                                                             **common),
                                     transformers=measure_transformers(probe_dir, batched=None, **common))
    print(report(results), flush=True)
    if "profile" in results["ours"]:
        print(results["ours"].pop("profile"))
    print(f"results in {write_results(results, args.out, RESULTS / f'gpu_decode_{args.device}.json', quick=False)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
