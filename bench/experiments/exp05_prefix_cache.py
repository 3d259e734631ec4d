"""Experiment 5: prefix caching on multi-turn conversations.

Owns the conversation scenario: every turn's prompt is the previous turn's prompt, the reply the
model actually generated, and a new user message, all after a system prompt every conversation
shares. Turns run one request at a time, so time to first token is the prefill alone. The cache
itself (chained block hashes, LRU of unreferenced blocks) is the block manager's.
"""

from __future__ import annotations

import random
import statistics
import time

from bench.experiments import plotting
from bench.experiments.common import (FIRST_ORDINARY_ID, Result, greedy, long_context_model, make_engine, pct,
                                      times, vocab_size, warm_up)

NUMBER, NAME = 5, "prefix_cache"
TITLE = "Prefix caching on multi-turn conversations"
SYSTEM_LEN, USER_LEN, REPLY_LEN = 128, 64, 48


def conversation_script(num_conversations: int, num_turns: int, vocab: int, seed: int = 5):
    """The shared system prompt and each conversation's user messages (replies come from the model)."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]  # noqa: E731
    return draw(SYSTEM_LEN), [[draw(USER_LEN) for _ in range(num_turns)] for _ in range(num_conversations)]


def run_conversations(engine, system: list[int], users: list[list[list[int]]]) -> list[dict]:
    """Turn by turn across conversations (turn 1 of each, then turn 2 ...), one request at a time."""
    histories = [list(system) for _ in users]
    records = []
    for turn in range(len(users[0])):
        for c, messages in enumerate(users):
            prompt = histories[c] + messages[turn]
            rid = f"c{c}-t{turn}-{id(engine)}"
            t0 = time.perf_counter()
            engine.add_request(rid, prompt, greedy(REPLY_LEN))
            ttft = None
            final = None
            while final is None:
                for o in engine.step():
                    if o.request_id == rid and o.new_token_ids and ttft is None:
                        ttft = time.perf_counter() - t0
                    if o.request_id == rid and o.finished:
                        final = o.final
            histories[c] = prompt + list(final.token_ids)
            records.append({"conversation": c, "turn": turn + 1, "prompt_tokens": len(prompt),
                            "cached_tokens": final.num_cached_tokens, "ttft_s": ttft,
                            "reply": list(final.token_ids)})
    return records


def per_turn(records: list[dict]) -> dict[int, dict]:
    """Mean TTFT and summed prompt / cached tokens for each turn number."""
    out: dict[int, dict] = {}
    for turn in sorted({r["turn"] for r in records}):
        rs = [r for r in records if r["turn"] == turn]
        out[turn] = {"ttft_ms": statistics.mean(r["ttft_s"] for r in rs) * 1e3,
                     "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
                     "cached_tokens": sum(r["cached_tokens"] for r in rs)}
    return out


def run(quick: bool = False) -> Result:
    model_dir = long_context_model()
    vocab = vocab_size(model_dir)
    num_conv, num_turns = (3, 4) if quick else (6, 8)
    system, users = conversation_script(num_conv, num_turns, vocab)
    runs = {}
    for caching in (False, True):
        engine = make_engine(model_dir, max_num_seqs=8, max_num_batched_tokens=2048, enable_prefix_caching=caching)
        warm_up(engine, vocab, prompt_len=1024)
        runs[caching] = run_conversations(engine, system, users)
        del engine
    # Greedy decoding: a cache hit must not change a single token (the engine's invariant).
    same = all(a["reply"] == b["reply"] for a, b in zip(runs[False], runs[True]))
    off, on = per_turn(runs[False]), per_turn(runs[True])
    rows = []
    for turn in off:
        rows.append([turn, off[turn]["prompt_tokens"] // num_conv, pct(on[turn]["cached_tokens"] /
                                                                         on[turn]["prompt_tokens"]),
                     off[turn]["ttft_ms"], on[turn]["ttft_ms"], times(off[turn]["ttft_ms"] / on[turn]["ttft_ms"])])
    prompt_total = sum(r["prompt_tokens"] for r in runs[True])
    cached_total = sum(r["cached_tokens"] for r in runs[True])
    ttft_off = statistics.mean(r["ttft_s"] for r in runs[False]) * 1e3
    ttft_on = statistics.mean(r["ttft_s"] for r in runs[True]) * 1e3
    rows.append(["all", prompt_total // (num_conv * num_turns), pct(cached_total / prompt_total), ttft_off, ttft_on,
                 times(ttft_off / ttft_on)])
    return Result(
        headers=["turn", "prompt tokens (mean)", "served from cache", "TTFT ms, cache off", "TTFT ms, cache on",
                 "speed-up"],
        rows=rows,
        headline=(f"over {num_conv} conversations x {num_turns} turns the prefix cache serves "
                  f"{cached_total / prompt_total:.0%} of prompt tokens and cuts mean TTFT from {ttft_off:.1f} to "
                  f"{ttft_on:.1f} ms ({times(ttft_off / ttft_on)}); the replies are "
                  + ("identical with and without the cache" if same else "NOT identical with and without the cache")),
        data={"off": off, "on": on, "identical_replies": same, "prefill_tokens_saved": cached_total,
              "prompt_tokens": prompt_total, "conversations": num_conv, "turns": num_turns},
        notes=[] if same else ["replies differ with the cache on: the greedy-invariance tests should catch this"])


def plot(data: dict, path) -> None:
    off, on = data["off"], data["on"]
    turns = [int(t) for t in off]
    fig, (ax1, ax2) = plotting.figure(2, "Experiment 5: prefix caching, multi-turn conversations")
    ax1.plot(turns, [off[t]["ttft_ms"] for t in off], marker="o", label="cache off")
    ax1.plot(turns, [on[t]["ttft_ms"] for t in on], marker="o", label="cache on")
    ax1.set_xlabel("turn")
    ax1.set_ylabel("mean time to first token, ms")
    ax1.legend(fontsize=8)
    computed = [on[t]["prompt_tokens"] - on[t]["cached_tokens"] for t in on]
    ax2.bar(turns, [on[t]["cached_tokens"] for t in on], label="served from cache", color="tab:green")
    ax2.bar(turns, computed, bottom=[on[t]["cached_tokens"] for t in on], label="computed", color="tab:blue")
    ax2.set_xlabel("turn")
    ax2.set_ylabel("prompt tokens, all conversations")
    ax2.legend(fontsize=8)
    plotting.save(fig, path)
