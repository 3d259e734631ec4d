"""Experiment 2: paged KV blocks against contiguous per-request reservations.

Owns the utilisation bookkeeping: after every engine step it reads how many K/V slots hold live
tokens, how many the paged pool has handed out, and how many two contiguous schemes would hold
for the same running set (one region of max_model_len per sequence, or one of exactly
prompt + max_tokens). It also measures how many requests the paged pool runs at once in a
fixed budget, against what the contiguous schemes fit in it.
"""

from __future__ import annotations

import random

from bench.experiments import plotting
from bench.experiments.common import (FIRST_ORDINARY_ID, Result, greedy, long_context_model, make_engine, pct,
                                      times, vocab_size, warm_up)

NUMBER, NAME = 2, "paged_kv"
TITLE = "Paged vs contiguous KV cache"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024  # what a contiguous cache reserves per sequence when it cannot know the output length
# Totals average 512 tokens: prompts 192..576 (mean 384) and outputs 64..192 (mean 128).
PROMPT_LEN, OUTPUT_LEN = (192, 576), (64, 192)
QUICK_PROMPT_LEN, QUICK_OUTPUT_LEN = (192, 576), (16, 48)


def make_requests(n: int, vocab: int, prompt_len, output_len, seed: int = 2) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(rng.randint(*prompt_len))],
             rng.randint(*output_len)) for _ in range(n)]


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


def sample(running: list[tuple[int, int, int]], used_blocks: int, block_size: int, max_model_len: int) -> dict:
    """One step's slot counts. running: (computed tokens, prompt tokens, max_tokens) per running request."""
    return {"live": sum(c for c, _, _ in running),
            "paged": used_blocks * block_size,
            "exact": sum(p + m for _, p, m in running),
            "max_len": len(running) * max_model_len}


def utilisation(samples: list[dict]) -> dict[str, float]:
    """Live slots over held slots, summed over steps (a time average weighted by what is held)."""
    live = sum(s["live"] for s in samples)
    return {k: live / sum(s[k] for s in samples) if sum(s[k] for s in samples) else 0.0
            for k in ("paged", "exact", "max_len")}


def contiguous_fit(totals: list[int], budget_slots: int) -> int:
    """Requests admitted in order while their reservations fit in the budget at once."""
    used = n = 0
    for total in totals:
        if used + total > budget_slots:
            break
        used, n = used + total, n + 1
    return n


def run_sampled(engine, requests, max_model_len: int, prefix: str) -> tuple[list[dict], int, int]:
    """Run every request; returns per-step samples, the most requests running at once, and preemptions."""
    for i, (prompt, out) in enumerate(requests):
        engine.add_request(f"{prefix}-{i}", prompt, greedy(out))
    samples, peak_running, preemptions = [], 0, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                preemptions += o.num_preemptions
        running = engine.scheduler.running
        if running:
            peak_running = max(peak_running, len(running))
            samples.append(sample([(r.num_computed_tokens, r.num_prompt_tokens, r.params.max_tokens)
                                   for r in running], engine.block_manager.num_used_blocks,
                                  engine.block_manager.block_size, max_model_len))
    return samples, peak_running, preemptions


def run(quick: bool = False) -> Result:
    model_dir = long_context_model()
    vocab = vocab_size(model_dir)
    p_len, o_len = (QUICK_PROMPT_LEN, QUICK_OUTPUT_LEN) if quick else (PROMPT_LEN, OUTPUT_LEN)
    # (a) 16 concurrent requests, a pool big enough for all: utilisation alone.
    reqs = make_requests(16, vocab, p_len, o_len)
    engine = make_engine(model_dir, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                         max_num_batched_tokens=2048, enable_prefix_caching=False, num_kv_blocks=2048)
    warm_up(engine, vocab)
    samples, _, _ = run_sampled(engine, reqs, MAX_MODEL_LEN, "a")
    util = utilisation(samples)
    del engine
    # (b) a fixed budget of 16 x 512 slots, and twice as many requests as (a) waiting: how many run at once.
    budget_slots = 16 * 512
    many = make_requests(32 if quick else 48, vocab, p_len, o_len, seed=3)
    engine = make_engine(model_dir, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                         max_num_batched_tokens=2048, enable_prefix_caching=False,
                         num_kv_blocks=budget_slots // BLOCK_SIZE)
    _, peak_paged, preemptions = run_sampled(engine, many, MAX_MODEL_LEN, "b")
    fit_exact = contiguous_fit([len(p) + o for p, o in many], budget_slots)
    fit_max = budget_slots // MAX_MODEL_LEN
    rows = [["contiguous, max_model_len per request", pct(util["max_len"]), fit_max, times(1.0)],
            ["contiguous, prompt + max_tokens per request", pct(util["exact"]), fit_exact, times(fit_exact / fit_max)],
            [f"paged, {BLOCK_SIZE}-token blocks (this engine)", pct(util["paged"]), peak_paged,
             times(peak_paged / fit_max)]]
    return Result(
        headers=["KV layout", "slot utilisation, 16 requests", f"requests at once in {budget_slots} slots",
                 "vs max_model_len"],
        rows=rows,
        headline=(f"paged KV keeps {util['paged']:.0%} of held slots live (contiguous: {util['max_len']:.0%} "
                  f"reserving max_model_len, {util['exact']:.0%} reserving prompt + max_tokens) and runs "
                  f"{peak_paged} requests at once where contiguous fits {fit_max} / {fit_exact}"),
        data={"samples": samples, "utilisation": util, "budget_slots": budget_slots, "fit": {
            "max_len": fit_max, "exact": fit_exact, "paged": peak_paged}, "preemptions_b": preemptions,
            "max_model_len": MAX_MODEL_LEN, "mean_total": sum(len(p) + o for p, o in reqs) / len(reqs)})


def plot(data: dict, path) -> None:
    samples = data["samples"]
    fig, (ax1, ax2) = plotting.figure(2, "Experiment 2: paged vs contiguous KV")
    steps = range(len(samples))
    for key, label in (("max_len", f"contiguous, {data['max_model_len']} per request"),
                       ("exact", "contiguous, prompt + max_tokens"), ("paged", "paged (held blocks)")):
        ax1.plot(steps, [s[key] for s in samples], label=label)
    ax1.plot(steps, [s["live"] for s in samples], label="live tokens", color="black", linestyle="--")
    ax1.set_xlabel("engine step")
    ax1.set_ylabel("KV slots (16 requests)")
    ax1.legend(fontsize=7)
    fit = data["fit"]
    plotting.bars(ax2, ["contiguous\nmax_model_len", "contiguous\nprompt+max_tokens", "paged"],
                  [fit["max_len"], fit["exact"], fit["paged"]], f"requests at once in {data['budget_slots']} slots")
    plotting.save(fig, path)
