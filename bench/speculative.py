"""Speculative decoding by prompt lookup, measured: `python -m bench.speculative` (not part of `make test`).

Tokens/s with and without drafts, side by side in one run: one engine per model, the draft length chosen
per request (SamplingParams.speculative_ngram_k), the two modes alternating round by round (the order
flipped every round) so a drifting machine hits both; medians and their ratio, per workload. Single stream
(each prompt alone, one after another) but for W1's throughput workload:

  (a) copy-heavy, models/default: "repeat", "fix the spelling", "summarise" and "rewrite" chat prompts
      around held-out paragraphs of its own training domain, greedy. (The tiny model does not follow the
      instructions; what it writes repeats spans of the prompt and of itself, which is what prompt lookup
      feeds on.)
  (b) copy-heavy, synthetic: bench-small's shape with weights that copy (bench/copy_checkpoint.py): it
      repeats the last 64 tokens of the engine benchmark's single-stream prompt.
  (c) W1 on bench-small (the engine benchmark's random checkpoint): its single-stream decode request
      (128 prompt tokens, 256 generated) greedy, and sampled at temperature 1 (seeded), where the text
      hardly repeats and proposals rarely match; and its 32-request throughput workload (batched, as
      `make bench` runs it), with every request opted in.
  (d) what a step costs on bench-small by the tokens it brings: where drafts stop being nearly free.

Every pair of runs is checked token-identical (greedy, and seeded sampling). Targets: >= 2x on (a) and (b), >= 0.97x on (c).
Results as JSON (bench/results_file.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.checkpoints import BENCH_SMALL, REPO_ROOT, ensure_bench_small
from bench.results_file import write_results
from bench.workload import (DECODE_NEW_TOKENS, FULL, QUICK, QUICK_DECODE_NEW_TOKENS, make_decode_prompt,
                            make_requests)

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "speculative.json"
COPY_DIR = REPO_ROOT / ".cache" / "bench-copy"
COPY_PERIOD = 64
COPY_TARGET, W1_TARGET = 2.0, 0.97
INSTRUCTIONS = ("Repeat this text exactly:", "Fix the spelling in this text:", "Summarise this text:",
                "Rewrite this text in plain words:")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Measured:
    """One workload: the median seconds of each mode, every round's, and what the drafts did."""
    name: str
    target: float
    output_tokens: int  # per run
    plain_s: list[float] = field(default_factory=list)  # wall seconds per round
    speculative_s: list[float] = field(default_factory=list)
    # This process's CPU seconds per round: on a shared host, what the work cost whatever else ran.
    plain_cpu_s: list[float] = field(default_factory=list)
    speculative_cpu_s: list[float] = field(default_factory=list)
    draft_tokens: int = 0  # per speculative run
    accepted_tokens: int = 0
    steps_plain: int = 0
    steps_speculative: int = 0
    identical: bool = True

    @property
    def ratio(self) -> float:
        return statistics.median(self.plain_s) / statistics.median(self.speculative_s)

    @property
    def cpu_ratio(self) -> float:
        return statistics.median(self.plain_cpu_s) / statistics.median(self.speculative_cpu_s)

    def row(self) -> str:
        plain = self.output_tokens / statistics.median(self.plain_s)
        spec = self.output_tokens / statistics.median(self.speculative_s)
        rounds = " / ".join(f"{p / s:.2f}" for p, s in zip(self.plain_s, self.speculative_s))
        accept = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        per_step = self.output_tokens / self.steps_speculative if self.steps_speculative else 0.0
        met = "met" if self.ratio >= self.target and self.identical else "MISS"
        return (f"| {self.name} | {plain:,.1f} | {spec:,.1f} | **{self.ratio:.2f}x** ({rounds}) | "
                f"{self.cpu_ratio:.2f}x | {accept:.1%} of {self.draft_tokens:,} | {per_step:.2f} | "
                f">= {self.target}x | {met} |")


def _run(engine, prompts, params, one_at_a_time: bool) -> tuple[float, float, list, int]:
    """Wall and CPU seconds, outputs and engine steps of the prompts: in one batch, or each alone (single
    stream)."""
    steps = engine.num_steps
    t0, c0 = time.perf_counter(), time.process_time()
    if one_at_a_time:
        outs = [engine.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outs = engine.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, time.process_time() - c0, outs, engine.num_steps - steps


def measure(name: str, engine, prompts: list[list[int]], max_tokens: list[int], k: int, rounds: int,
            target: float, temperature: float = 0.0, single_stream: bool = True) -> Measured:
    from worker.engine import SamplingParams

    def params(spec_k):
        return [SamplingParams(max_tokens=m, temperature=temperature, seed=i, ignore_eos=True,
                               speculative_ngram_k=spec_k) for i, m in enumerate(max_tokens)]

    result = Measured(name, target, sum(max_tokens))
    # Warm-up: first-call allocations and kernel choices are not timed.
    _run(engine, [p[:64] for p in prompts], [SamplingParams(max_tokens=8, ignore_eos=True)] * len(prompts), False)
    reference = None
    for r in range(rounds):
        for mode in (("plain", "speculative") if r % 2 == 0 else ("speculative", "plain")):
            seconds, cpu, outs, steps = _run(engine, prompts, params(k if mode == "speculative" else 0),
                                             single_stream)
            tokens = [o.token_ids for o in outs]
            reference = reference or tokens
            result.identical &= tokens == reference
            if mode == "plain":
                result.plain_s.append(seconds)
                result.plain_cpu_s.append(cpu)
                result.steps_plain = steps
            else:
                result.speculative_s.append(seconds)
                result.speculative_cpu_s.append(cpu)
                result.steps_speculative = steps
                result.draft_tokens = sum(o.num_draft_tokens for o in outs)
                result.accepted_tokens = sum(o.num_accepted_draft_tokens for o in outs)
        log(f"{name}: round {r + 1}: plain {result.plain_s[-1]:.2f} s, speculative {result.speculative_s[-1]:.2f} s")
    return result


def default_model_prompts(quick: bool) -> list[list[int]]:
    from gateway.tokenizer import Tokenizer

    model_dir = REPO_ROOT / "models" / "default"
    tokenizer = Tokenizer(model_dir)
    text = (model_dir / "heldout_sample.txt").read_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if 300 <= len(p.strip()) <= 700]
    prompts = []
    for i, instruction in enumerate(INSTRUCTIONS[:2] if quick else INSTRUCTIONS):
        content = f"{instruction}\n\n{paragraphs[i]}"
        prompts.append(tokenizer.encode_chat([{"role": "user", "content": content}]))
    return prompts


def engine_for(model_dir, k: int, max_num_seqs: int = 4, num_kv_blocks: int = 512):
    from worker.engine import Engine

    # No prefix caching: each mode's run must prefill as the first did, not find the other's blocks.
    return Engine.from_model_dir(str(model_dir), num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=512, enable_prefix_caching=False, speculative_ngram_max_k=k)


def ensure_copy_checkpoint() -> Path:
    from bench.copy_checkpoint import make_copy_checkpoint

    marker = COPY_DIR / "bench-copy.json"
    settings = {"period": COPY_PERIOD, **BENCH_SMALL}
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        return COPY_DIR
    log(f"building the copying checkpoint in {COPY_DIR} (once)")
    make_copy_checkpoint(COPY_DIR, period=COPY_PERIOD, **BENCH_SMALL)
    marker.write_text(json.dumps(settings))
    return COPY_DIR


def step_costs(model_dir, repeats: int = 7) -> dict[str, float]:
    """Median ms of one forward + sampling on bench-small at 300 tokens of context: one sequence bringing
    T tokens (a decode with a draft of T - 1), and B decodes of one token. Where extra tokens stop being
    nearly free is where speculative_ngram_max_step_tokens belongs."""
    from worker.engine import SamplingParams
    from worker.model_runner import SequenceStep

    engine = engine_for(model_dir, 16, max_num_seqs=32, num_kv_blocks=32 * 22)
    blocks = engine.block_manager
    for b in range(32):
        blocks.allocate_slots(f"s{b}", 340)
    greedy = SamplingParams(temperature=0.0)

    def median_ms(num_seqs: int, num_tokens: int) -> float:
        seqs = [SequenceStep(new_token_ids=[5] * num_tokens, context_len=300, block_table=blocks.block_table(f"s{b}"),
                             needs_sample=True, params=greedy, generator=None, token_history=[5],
                             draft_token_ids=[5] * (num_tokens - 1)) for b in range(num_seqs)]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.runner.execute(seqs)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    costs = {f"1 x {t} tokens": median_ms(1, t) for t in (1, 2, 4, 8, 9, 16)}
    costs.update({f"{b} decodes": median_ms(b, 1) for b in (2, 4, 8, 16, 32)})
    return costs


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short outputs, one round: a smoke run")
    p.add_argument("--k", type=int, default=8, help="speculative_ngram_k of the opted-in requests (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per workload (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--only", choices=["default", "copy", "w1-single", "w1", "step-costs"], action="append",
                   help="run only these workloads (repeatable)")
    p.add_argument("--json", metavar="PATH", help=f"results JSON (default {DEFAULT_JSON.relative_to(REPO_ROOT)})")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rounds = 1 if args.quick else args.rounds
    only = set(args.only or ["default", "copy", "w1-single", "w1", "step-costs"])
    decode_tokens = QUICK_DECODE_NEW_TOKENS if args.quick else DECODE_NEW_TOKENS
    results: list[Measured] = []
    if "default" in only:
        prompts = default_model_prompts(args.quick)
        engine = engine_for(REPO_ROOT / "models" / "default", args.k)
        results.append(measure("(a) copy-heavy, models/default", engine, prompts, [decode_tokens] * len(prompts),
                               args.k, rounds, COPY_TARGET))
        del engine
    bench_small = ensure_bench_small() if only & {"w1-single", "w1", "step-costs"} else None
    vocab = BENCH_SMALL["vocab_size"]
    if "copy" in only:
        engine = engine_for(ensure_copy_checkpoint(), args.k)
        results.append(measure("(b) copy-heavy, synthetic copier", engine, [make_decode_prompt(vocab)],
                               [decode_tokens], args.k, rounds, COPY_TARGET))
        del engine
    if "w1-single" in only or "w1" in only:
        requests = make_requests(QUICK if args.quick else FULL, vocab)
        blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // 16) + 1 for r in requests)
        engine = engine_for(bench_small, args.k, max_num_seqs=32, num_kv_blocks=blocks)
        if "w1-single" in only:
            results.append(measure("(c) W1 single stream, bench-small", engine, [make_decode_prompt(vocab)],
                                   [decode_tokens], args.k, rounds, W1_TARGET))
            # Sampled at temperature 1 the random model's text hardly repeats: what no match costs.
            results.append(measure("(c) W1 single stream sampled (T = 1, seeded)", engine,
                                   [make_decode_prompt(vocab)], [decode_tokens], args.k, rounds, W1_TARGET,
                                   temperature=1.0))
        if "w1" in only:
            results.append(measure(f"(c) W1 throughput ({len(requests)} requests), bench-small", engine,
                                   [r.prompt_token_ids for r in requests], [r.output_len for r in requests],
                                   args.k, rounds, W1_TARGET, single_stream=False))
        del engine
    costs = step_costs(bench_small) if "step-costs" in only else {}
    if costs:
        print(f"\nbench-small step cost, {args.threads} threads, 300 tokens of context (median ms):")
        print("| " + " | ".join(costs) + " |\n|" + "---:|" * len(costs))
        print("| " + " | ".join(f"{ms:.1f}" for ms in costs.values()) + " |")
    print(f"\nSpeculative decoding by prompt lookup, k = {args.k}, {args.threads} threads, median of {rounds} "
          "alternating rounds (per-round ratios in brackets)\n")
    print("| workload | plain tok/s | speculative tok/s | ratio (wall) | ratio (CPU time) | draft tokens accepted | "
          "tokens per step | target | |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for m in results:
        print(m.row())
    if not all(m.identical for m in results):
        print("\nMISMATCH: outputs differ with and without speculation:",
              [m.name for m in results if not m.identical])
    report = {"k": args.k, "threads": args.threads, "rounds": rounds, "quick": args.quick, "step_costs_ms": costs,
              "results": [{**asdict(m), "ratio": m.ratio, "cpu_ratio": m.cpu_ratio} for m in results]}
    path = write_results(report, args.json, DEFAULT_JSON, args.quick)
    log(f"results in {path}")
    return 0 if all(m.identical for m in results) else 1


if __name__ == "__main__":
    sys.exit(main())
