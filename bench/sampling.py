"""`python -m bench.sampling`: what sampling a token costs, our CPU kernels against the torch path (not part of
`make test`).

The torch path (worker.sampling_draws.sample_rows_torch, apply_repetition_penalty) is what every device other
than a CPU with our kernels runs; on the CPU the Sampler takes our kernels (worker/model/csrc/sampling.cpp).
Both are measured in one process, alternating round by round with the order flipped every round:

  (a) the Sampler alone on random peaked logits, 1 and 32 rows, vocabularies of 4,096 (models/default),
      32,000 (Llama 2, bench-small) and 128,256 (Llama 3): temperature 0.7, top-p 0.9, repetition penalty
      1.1 over a 300-token history, seeded; median microseconds a call.
  (b) single-stream decode through the engine on models/default and bench-small, 2 torch threads by
      default: the same settings (sampled) against greedy decoding on the same engine, tokens/s.

Each seeded pair of runs is checked token-identical where both paths must agree to the last bit (greedy);
sampled runs of the two paths may part at a draw that falls within float rounding of a boundary, so they
are compared and the share of identical tokens printed. Results as JSON (bench/results_file.py).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.checkpoints import ensure_bench_small
from bench.results_file import write_results

VOCABULARIES = (4096, 32000, 128256)
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "default"


def sampled_params(seed: int | None = 0, max_tokens: int = 1):
    from shared.sampling_params import SamplingParams
    return SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True)


def use_torch_path(sampler, on: bool, kernels) -> None:
    """Points the sampler at torch's path (on) or back at our kernels."""
    for name in ("sample_rows", "repetition_penalty_rows", "presence_frequency_rows"):
        setattr(sampler, f"_{name}", None if on else getattr(kernels, name))


def time_sampler(rows: int, vocab: int, rounds: int, calls: int) -> dict:
    from worker.model import cpu_kernels
    from worker.sampler import Sampler, SamplingBatch
    from worker.sampling_draws import make_generator
    kernels = cpu_kernels.load()
    gen = torch.Generator().manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    histories = [torch.randint(0, vocab, (300,), generator=gen).tolist() for _ in range(rows)]
    params = [sampled_params(seed=r) for r in range(rows)]
    sampler = Sampler(seed=0)
    times = {"kernels": [], "torch": []}
    tokens = {}
    for r in range(rounds):
        for side in (("kernels", "torch") if r % 2 == 0 else ("torch", "kernels")):
            use_torch_path(sampler, side == "torch", kernels)
            batch = SamplingBatch(params=params, generators=[make_generator(p.seed) for p in params],
                                  token_histories=histories, seeds=[7] * rows)
            sampler(logits, batch)  # warm
            start = time.perf_counter()
            for _ in range(calls):
                out = sampler(logits, batch)
            times[side].append((time.perf_counter() - start) / calls * 1e6)
            tokens[side] = out.token_ids
    use_torch_path(sampler, False, kernels)
    same = sum(a == b for a, b in zip(tokens["kernels"], tokens["torch"])) / rows
    return {"rows": rows, "vocab": vocab, "kernels_us": statistics.median(times["kernels"]),
            "torch_us": statistics.median(times["torch"]), "same_tokens": same}


def time_decode(model_dir: Path, rounds: int, new_tokens: int) -> dict:
    from shared.sampling_params import SamplingParams
    from worker.engine import Engine
    from worker.model import cpu_kernels
    kernels = cpu_kernels.load()
    engine = Engine.from_model_dir(str(model_dir), num_kv_blocks=64, block_size=16, max_num_seqs=4,
                                   max_num_batched_tokens=512, enable_prefix_caching=False)
    prompt = list(range(5, 69))
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    sampled = sampled_params(seed=0, max_tokens=new_tokens)
    runs = {"kernels": [], "torch": [], "greedy": []}
    outputs = {}

    def run(side: str) -> None:
        use_torch_path(engine.sampler, side == "torch", kernels)
        params = greedy if side == "greedy" else sampled
        start = time.perf_counter()
        out = engine.generate([prompt], [params], use_tqdm=False)[0]
        runs[side].append(new_tokens / (time.perf_counter() - start))
        outputs[side] = list(out.token_ids)

    for side in runs:
        run(side)  # warm
    for r in range(rounds):
        for side in (("kernels", "torch", "greedy") if r % 2 == 0 else ("greedy", "torch", "kernels")):
            run(side)
    use_torch_path(engine.sampler, False, kernels)
    same = sum(a == b for a, b in zip(outputs["kernels"], outputs["torch"])) / new_tokens
    return {"model": model_dir.name, **{f"{side}_tok_s": statistics.median(v) for side, v in runs.items()},
            "same_tokens": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens per timed run in (b)")
    parser.add_argument("--quick", action="store_true", help="one round, 64 tokens, the small vocabularies")
    parser.add_argument("--json", help="where to write the results (default bench/results/sampling.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, new_tokens = (1, 64) if args.quick else (args.rounds, args.tokens)
    results = {"threads": args.threads, "rounds": rounds, "sampler": [], "decode": []}

    print(f"(a) the Sampler alone, {args.threads} threads, median of {rounds} rounds (us a call)")
    print(f"{'rows':>5} {'vocab':>8} {'kernels':>10} {'torch':>10} {'ratio':>7} {'same tokens':>12}")
    for vocab in VOCABULARIES[:2] if args.quick else VOCABULARIES:
        for rows in (1, 32):
            calls = max(3, 200_000 // (rows * vocab) * 10)
            r = time_sampler(rows, vocab, rounds, calls)
            results["sampler"].append(r)
            print(f"{rows:>5} {vocab:>8} {r['kernels_us']:>10.1f} {r['torch_us']:>10.1f} "
                  f"{r['torch_us'] / r['kernels_us']:>6.2f}x {r['same_tokens']:>11.0%}")

    print(f"\n(b) single-stream decode, {new_tokens} tokens, median of {rounds} rounds (tok/s)")
    print(f"{'model':>14} {'greedy':>9} {'sampled, kernels':>17} {'sampled, torch':>15} {'ratio':>7} "
          f"{'of greedy':>10} {'same tokens':>12}")
    for model_dir in (DEFAULT_MODEL, ensure_bench_small()):
        r = time_decode(model_dir, rounds, new_tokens)
        results["decode"].append(r)
        print(f"{r['model']:>14} {r['greedy_tok_s']:>9.1f} {r['kernels_tok_s']:>17.1f} {r['torch_tok_s']:>15.1f} "
              f"{r['kernels_tok_s'] / r['torch_tok_s']:>6.2f}x {r['kernels_tok_s'] / r['greedy_tok_s']:>9.0%} "
              f"{r['same_tokens']:>11.0%}")
    path = write_results(results, args.json, Path(__file__).parent / "results" / "sampling.json", args.quick)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
