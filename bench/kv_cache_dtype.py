"""The KV pool's element type, measured: `python -m bench.kv_cache_dtype` (`make bench-kv-cache`; not part of
`make test`).

float16 and bfloat16 pools (`kv_cache_dtype`) against float32 on one checkpoint (bench-small by default, the
engine benchmark's random Llama), one engine per type over the same kv_cache_bytes, side by side in one run:

  pool: the KV blocks that budget gives each type.
  accuracy: N random prompts x M greedy tokens from each engine against the float32 engine's outputs: the share
    of generated positions identical before their sequence's first divergence, and of sequences identical
    throughout. Then the float32 outputs fed back teacher-forced (prompt + output as one window, in chunks that
    read their context back from the pool): the largest |logit difference| from float32 over every position,
    and the share of positions whose argmax agrees.
  speed: decode tok/s after a long prompt (1500 tokens), one stream alone and a batch of streams, timed from the
    step where every stream has its first token to the last (the prompts come from the prefix cache after the
    first round, so rounds cost little besides the decode). The types alternate round by round, the order
    rotated every round, so a drifting machine hits each; medians, and ratios against float32.

Results as JSON (bench/results_file.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.checkpoints import REPO_ROOT, ensure_checkpoint
from bench.results_file import write_results
from bench.workload import WORKLOAD_SEED, WorkloadSpec, make_decode_prompt, make_requests

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "kv_cache_dtype.json"
BASELINE = "float32"
HALF_TYPES = ("float16", "bfloat16")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    num_prompts: int = 16
    prompt_lens: tuple[int, int] = (64, 512)  # inclusive range
    new_tokens: int = 64  # greedy tokens per prompt
    chunk_tokens: int = 128  # teacher-forced chunk: every later chunk reads its context from the pool
    context_len: int = 1500  # the speed runs' prompt length
    decode_tokens: int = 128  # timed decode tokens per stream
    batch: int = 8  # streams of the batched speed run (0: none)
    rounds: int = 5
    kv_cache_bytes: int = 256 << 20
    block_size: int = 16


QUICK = Settings(num_prompts=4, prompt_lens=(32, 128), new_tokens=16, context_len=512, decode_tokens=16, batch=4,
                 rounds=1)


@dataclass
class TypeResult:
    """One pool type: its size, its outputs' agreement with float32's, and its decode rates per round."""
    kv_cache_dtype: str
    num_blocks: int  # from Settings.kv_cache_bytes
    positions_matched: float = 1.0  # generated positions identical before their sequence's first divergence
    sequences_matched: float = 1.0  # sequences identical throughout
    max_abs_logit: float = 0.0  # teacher-forced, over every position: the logits' scale
    max_logit_diff: float = 0.0  # from float32's, teacher-forced, over every position
    argmax_agreement: float = 1.0  # teacher-forced positions whose argmax is float32's
    single_tok_s: list[float] = field(default_factory=list)  # per round
    batched_tok_s: list[float] = field(default_factory=list)


def prefix_match(reference: list[list[int]], outputs: list[list[int]]) -> tuple[float, float]:
    """(share of positions identical before each sequence's first divergence, share of sequences identical)."""
    matched = 0
    for want, got in zip(reference, outputs):
        matched += next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    whole = sum(want == got for want, got in zip(reference, outputs))
    return matched / max(1, sum(map(len, reference))), whole / max(1, len(reference))


def fit_to_model(settings: Settings, model_dir: Path) -> Settings:
    """`settings` with prompts cut to what the model's context holds with their new tokens."""
    max_len = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    lo, hi = settings.prompt_lens
    hi = min(hi, max_len - settings.new_tokens)
    return replace(settings, prompt_lens=(min(lo, hi), hi),
                   context_len=min(settings.context_len, max_len - settings.decode_tokens - 1))


def make_engine(model_dir: Path, kv_cache_dtype: str, settings: Settings):
    from worker.engine import Engine

    streams = max(1, settings.batch)
    return Engine.from_model_dir(str(model_dir), kv_cache_dtype=kv_cache_dtype,
                                 kv_cache_bytes=settings.kv_cache_bytes, block_size=settings.block_size,
                                 max_num_seqs=max(streams, settings.num_prompts), max_num_batched_tokens=2048)


def decode_tok_s(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of the steps after every prompt has its first token, to the last (greedy, EOS ignored)."""
    from worker.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True)
    waiting = {f"decode-{i}" for i in range(len(prompts))}
    for request_id, prompt in zip(sorted(waiting), prompts):
        engine.add_request(request_id, prompt, params)
    while waiting:
        waiting -= {d.request_id for d in engine.step() if d.new_token_ids}
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    return tokens / (time.perf_counter() - started)


def teacher_forced(engine, name: str, sequences: list[list[int]], chunk_tokens: int) -> list:
    from worker.scoring import window_logits

    return [window_logits(engine.model, s, block_size=engine.config.block_size, chunk_size=chunk_tokens,
                          fast_path=engine.runner.fast_path, kv_cache_dtype=name) for s in sequences]


def measure(model_dir: Path, settings: Settings = Settings(), half_types: tuple[str, ...] = HALF_TYPES
            ) -> list[TypeResult]:
    """float32 first, then each of `half_types`, measured as the module docstring says."""
    from worker.engine import SamplingParams

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    names = (BASELINE, *half_types)
    engines = {name: make_engine(model_dir, name, settings) for name in names}
    results = {name: TypeResult(name, e.block_manager.num_blocks) for name, e in engines.items()}
    spec = WorkloadSpec(settings.num_prompts, settings.prompt_lens, (settings.new_tokens, settings.new_tokens))
    prompts = [r.prompt_token_ids for r in make_requests(spec, vocab)]
    greedy = SamplingParams(max_tokens=settings.new_tokens, temperature=0.0, ignore_eos=True)
    outputs = {name: [o.token_ids for o in e.generate(prompts, greedy, use_tqdm=False)] for name, e in engines.items()}
    sequences = [p + o for p, o in zip(prompts, outputs[BASELINE])]
    reference = teacher_forced(engines[BASELINE], BASELINE, sequences, settings.chunk_tokens)
    results[BASELINE].max_abs_logit = max(r.abs().max().item() for r in reference)
    for name in half_types:
        result = results[name]
        result.positions_matched, result.sequences_matched = prefix_match(outputs[BASELINE], outputs[name])
        logits = teacher_forced(engines[name], name, sequences, settings.chunk_tokens)
        result.max_abs_logit = max(r.abs().max().item() for r in logits)
        result.max_logit_diff = max((a - b).abs().max().item() for a, b in zip(logits, reference))
        agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(logits, reference))
        result.argmax_agreement = agree / sum(len(s) for s in sequences)
        log(f"{name}: {result.positions_matched:.1%} of positions before divergence, max |dlogit| "
            f"{result.max_logit_diff:.2e}")
    single = [make_decode_prompt(vocab, settings.context_len)]
    batch = [make_decode_prompt(vocab, settings.context_len, seed=WORKLOAD_SEED + 10 + b) for b in range(settings.batch)]
    for engine in engines.values():  # warm-up, and the prompts into each prefix cache
        for streams in (single, batch) if batch else (single,):
            decode_tok_s(engine, streams, 4)
    for r in range(settings.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].single_tok_s.append(decode_tok_s(engines[name], single, settings.decode_tokens))
            if batch:
                results[name].batched_tok_s.append(decode_tok_s(engines[name], batch, settings.decode_tokens))
        log(f"round {r + 1}: single " + ", ".join(f"{n} {results[n].single_tok_s[-1]:.1f}" for n in names)
            + " tok/s")
    return [results[name] for name in names]


def _rate(rates: list[float], base: list[float]) -> str:
    if not rates:
        return "- | -"
    ratio = statistics.median(rates) / statistics.median(base)
    rounds = " / ".join(f"{r / b:.2f}" for r, b in zip(rates, base))
    return f"{statistics.median(rates):,.1f} | **{ratio:.2f}x** ({rounds})"


def table(results: list[TypeResult], settings: Settings) -> list[str]:
    """The Markdown table: one row per type, ratios against the float32 row (per-round ratios in brackets)."""
    base = results[0]
    streams = f"{settings.batch} x {settings.context_len}"
    lines = [f"| KV dtype | KV blocks ({settings.kv_cache_bytes / 2**20:.0f} MiB) | greedy positions matched "
             f"| sequences matched | max abs logit diff | argmax agreement | 1 x {settings.context_len} tok/s | ratio "
             f"| {streams} tok/s | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.kv_cache_dtype} | {r.num_blocks:,} | {r.positions_matched:.1%} | {r.sequences_matched:.1%} "
                     f"| {r.max_logit_diff:.2e} | {r.argmax_agreement:.2%} | {_rate(r.single_tok_s, base.single_tok_s)} "
                     f"| {_rate(r.batched_tok_s, base.batched_tok_s)} |")
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.kv_cache_dtype", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-small", help="bench-small (default), or a checkpoint folder")
    p.add_argument("--quick", action="store_true", help="fewer and shorter runs, one round: a smoke run")
    p.add_argument("--rounds", type=int, help=f"alternating speed rounds (default {Settings.rounds})")
    p.add_argument("--context", type=int, help=f"speed runs' prompt tokens (default {Settings.context_len})")
    p.add_argument("--batch", type=int, help=f"streams of the batched speed run, 0 = none (default {Settings.batch})")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--json", metavar="PATH", help=f"results JSON (default {DEFAULT_JSON.relative_to(REPO_ROOT)})")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    settings = QUICK if args.quick else Settings()
    given = {"rounds": args.rounds, "context_len": args.context, "batch": args.batch}
    settings = replace(settings, **{k: v for k, v in given.items() if v is not None})
    model_dir = ensure_checkpoint(args.model) if args.model == "bench-small" else Path(args.model)
    settings = fit_to_model(settings, model_dir)
    results = measure(model_dir, settings)
    print(f"\nKV cache dtype on {args.model}, {args.threads} threads: {settings.num_prompts} prompts of "
          f"{settings.prompt_lens[0]}-{settings.prompt_lens[1]} tokens x {settings.new_tokens} greedy tokens against "
          f"float32 (teacher-forced logits up to {results[0].max_abs_logit:.2f} in magnitude); decode of "
          f"{settings.decode_tokens} tokens per stream, median of {settings.rounds} alternating rounds (per-round "
          f"ratios in brackets)\n")
    print("\n".join(table(results, settings)))
    report = {"model": args.model, "threads": args.threads, "settings": asdict(settings),
              "results": [asdict(r) for r in results]}
    path = write_results(report, args.json, DEFAULT_JSON, args.quick)
    log(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
