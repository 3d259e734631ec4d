"""Experiment 4: chunked prefill. One very long prompt arrives while short requests are decoding;
the decodes' inter-token latency with the prompt computed in one step, and in chunks.

Owns the scenario and the gap bookkeeping (a decode's inter-token gap is the time between the
steps that returned its consecutive tokens); chunking itself is the scheduler's
`max_prefill_chunk_tokens`.
"""

from __future__ import annotations

import random
import statistics
import time

from bench.experiments import plotting
from bench.experiments.common import (FIRST_ORDINARY_ID, Result, greedy, long_context_model, make_engine,
                                      percentile, times, vocab_size, warm_up)

NUMBER, NAME = 4, "chunked_prefill"
TITLE = "Chunked prefill"
CHUNK_TOKENS = 128
NUM_DECODES = 8
SETTLE_STEPS = 20  # decode steps before the long prompt arrives, so the others are in steady state


def decode_gaps(arrivals: dict[str, list[float]]) -> list[tuple[float, float]]:
    """(time of the later token, gap) for every pair of consecutive tokens of each request."""
    return [(b, b - a) for times_ in arrivals.values() for a, b in zip(times_, times_[1:])]


def one_run(engine, vocab: int, long_len: int, decode_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    ids = [f"d{seed}-{i}" for i in range(NUM_DECODES)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(64)], greedy(decode_tokens))
    arrivals: dict[str, list[float]] = {rid: [] for rid in ids}
    long_id = f"long{seed}"
    t0 = time.perf_counter()
    long_added = long_first = None
    steps = 0
    while engine.has_unfinished_requests():
        if steps == SETTLE_STEPS:
            engine.add_request(long_id, [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(long_len)], greedy(8))
            long_added = time.perf_counter() - t0
        outputs = engine.step()
        steps += 1
        now = time.perf_counter() - t0
        for o in outputs:
            if o.request_id in arrivals and o.new_token_ids:
                arrivals[o.request_id].append(now)
            elif o.request_id == long_id and o.new_token_ids and long_first is None:
                long_first = now
    gaps = decode_gaps(arrivals)
    # Gaps that end while the long prompt is being computed (up to the step giving its first token).
    window = [g for t, g in gaps if long_added < t <= long_first]
    return {"gaps": [(t - long_added, g) for t, g in gaps], "long_ttft_s": long_first - long_added,
            "itl_p50_ms": percentile([g for _, g in gaps], 50) * 1e3,
            "itl_max_ms": max(g for _, g in gaps) * 1e3,
            "window_mean_ms": statistics.mean(window) * 1e3 if window else float("nan")}


def run(quick: bool = False) -> Result:
    model_dir = long_context_model()
    vocab = vocab_size(model_dir)
    long_len = 768 if quick else 1536
    decode_tokens = 100 if quick else 200
    repeats = 1 if quick else 3
    modes = {"one step (no chunking)": None, f"chunks of {CHUNK_TOKENS} tokens": CHUNK_TOKENS}
    results = {}
    for name, chunk in modes.items():
        engine = make_engine(model_dir, max_num_seqs=16, max_num_batched_tokens=2048,
                             max_prefill_chunk_tokens=chunk, enable_prefix_caching=False)
        warm_up(engine, vocab, prompt_len=long_len)  # the long shape too: its first run allocates
        runs = [one_run(engine, vocab, long_len, decode_tokens, seed) for seed in range(repeats)]
        results[name] = {"runs": runs, **{k: statistics.median(r[k] for r in runs)
                                          for k in ("itl_p50_ms", "itl_max_ms", "window_mean_ms", "long_ttft_s")}}
        del engine
    base, chunked = results.values()
    rows = [[name, r["itl_p50_ms"], r["itl_max_ms"], r["window_mean_ms"], r["long_ttft_s"] * 1e3]
            for name, r in results.items()]
    return Result(
        headers=["long prompt computed in", "decode ITL p50 ms", "decode ITL max ms",
                 "decode ITL mean ms while it prefills", "long prompt TTFT ms"],
        rows=rows,
        headline=(f"chunking a {long_len}-token prompt cuts the running decodes' worst inter-token gap from "
                  f"{base['itl_max_ms']:.0f} to {chunked['itl_max_ms']:.0f} ms "
                  f"({times(base['itl_max_ms'] / chunked['itl_max_ms'])}); the long prompt's own TTFT goes "
                  f"from {base['long_ttft_s'] * 1e3:.0f} to {chunked['long_ttft_s'] * 1e3:.0f} ms"),
        data={"modes": {n: {"gaps": r["runs"][0]["gaps"], **{k: v for k, v in r.items() if k != "runs"}}
                        for n, r in results.items()},
              "long_len": long_len, "num_decodes": NUM_DECODES, "repeats": repeats})


def plot(data: dict, path) -> None:
    fig, (ax,) = plotting.figure(1, f"Experiment 4: {data['num_decodes']} decodes, a {data['long_len']}-token "
                                    "prompt arrives at t = 0", width_in=7.5)
    for name, mode in data["modes"].items():
        pts = sorted(mode["gaps"])
        ax.plot([t * 1e3 for t, _ in pts], [g * 1e3 for _, g in pts], marker=".", linestyle="none", label=name)
    ax.set_xlabel("ms since the long prompt arrived")
    ax.set_ylabel("decode inter-token gap, ms")
    ax.set_xlim(-100, None)
    ax.legend(fontsize=8)
    plotting.save(fig, path)
