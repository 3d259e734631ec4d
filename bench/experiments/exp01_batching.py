"""Experiment 1: continuous batching against static padded batches, on the same engine.

Owns the static-batching emulation (every prompt of a batch left-padded to the batch's longest,
every request generating the batch's longest output, no admission until the batch is done) and
the token accounting; the model, scheduler and step loop are the engine's own.
"""

from __future__ import annotations

import time
from dataclasses import replace

from bench.experiments import plotting
from bench.experiments.common import (FIRST_ORDINARY_ID, Result, StepCounter, greedy, long_context_model,
                                      make_engine, run_to_completion, times, vocab_size, warm_up)
from bench.workload import WORKLOAD_SEED, Request, WorkloadSpec, make_requests

NUMBER, NAME = 1, "batching"
TITLE = "Continuous vs static batching"
FULL = WorkloadSpec(num_requests=8, prompt_len=(128, 1024), output_len=(64, 512))
QUICK = WorkloadSpec(num_requests=8, prompt_len=(32, 256), output_len=(16, 128))
STATIC_BATCH_SIZES = (8, 4)
SLOTS = 8  # sequences the engine runs at once, and the static server's batch
MORE_REQUESTS_FACTOR = 4
CONTINUOUS = "continuous (this engine)"
PAD_ID = FIRST_ORDINARY_ID


def static_batches(requests: list[Request], batch_size: int) -> list[list[Request]]:
    """Batches in arrival order, as a static server forms them."""
    return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]


def padded_slots(batch: list[Request]) -> int:
    """Token positions a static batch holds: batch size x (longest prompt + longest output)."""
    return len(batch) * (max(len(r.prompt_token_ids) for r in batch) + max(r.output_len for r in batch))


def computed_tokens(prompt_len: int, output_len: int) -> int:
    """Positions a forward pass computes for one sequence: every prompt token and every generated
    token but the last (which is sampled, never fed back)."""
    return prompt_len + output_len - 1


def static_computed_tokens(batch: list[Request]) -> int:
    longest_prompt = max(len(r.prompt_token_ids) for r in batch)
    longest_output = max(r.output_len for r in batch)
    return len(batch) * computed_tokens(longest_prompt, longest_output)


def continuous_computed_tokens(requests: list[Request]) -> int:
    return sum(computed_tokens(len(r.prompt_token_ids), r.output_len) for r in requests)


def pad_batch(batch: list[Request]) -> list[Request]:
    """Left padding to the longest prompt, and the longest output for everyone."""
    longest_prompt = max(len(r.prompt_token_ids) for r in batch)
    longest_output = max(r.output_len for r in batch)
    return [Request([PAD_ID] * (longest_prompt - len(r.prompt_token_ids)) + list(r.prompt_token_ids),
                    longest_output) for r in batch]


def run_batches(engine, batches: list[list[Request]], counter: StepCounter, prefix: str) -> dict:
    """Each batch runs to completion before the next is admitted; returns wall time and counts."""
    counter.reset()
    t0 = time.perf_counter()
    for b, batch in enumerate(batches):
        for i, r in enumerate(batch):
            engine.add_request(f"{prefix}-{b}-{i}", r.prompt_token_ids, greedy(r.output_len))
        final = run_to_completion(engine)
        if any(o.num_preemptions for o in final.values()):
            raise RuntimeError("a request was preempted: the KV pool is too small for this experiment")
    return {"wall_s": time.perf_counter() - t0, "computed_tokens": counter.num_tokens,
            "forwards": counter.num_forwards}


def run_workload(engine, counter: StepCounter, requests: list[Request], sizes: tuple[int, ...], tag: str,
                 repeats: int) -> dict:
    """Static batches of each size, then the whole list through the scheduler, alternating, `repeats`
    times; the fastest repeat of each is kept (interference on a shared VM only ever adds time)."""
    plans = {f"static, batches of {size}": ([pad_batch(b) for b in static_batches(requests, size)],
                                            sum(static_computed_tokens(b) for b in static_batches(requests, size)))
             for size in sizes}
    plans[CONTINUOUS] = ([requests], continuous_computed_tokens(requests))
    runs: dict[str, dict] = {}
    for rep in range(repeats):
        for name, (batches, expected) in plans.items():
            measured = run_batches(engine, batches, counter, f"{tag}-{len(runs)}-{rep}-{name[:6]}")
            if name not in runs or measured["wall_s"] < runs[name]["wall_s"]:
                runs[name] = {**measured, "expected": expected, "walls_s": runs.get(name, {}).get("walls_s", [])}
            runs[name]["walls_s"].append(measured["wall_s"])
    useful = sum(r.output_len for r in requests)
    for m in runs.values():
        m["useful_tokens_per_s"] = useful / m["wall_s"]
    return runs


def run(quick: bool = False) -> Result:
    spec = QUICK if quick else FULL
    model_dir = long_context_model()
    vocab = vocab_size(model_dir)
    # (a) the seeds' 8 requests, all present at once; (b) four times as many through the same 8 slots,
    # where a static server must wait for each batch's longest request before admitting the next.
    workloads = {f"{spec.num_requests} requests": (make_requests(spec, vocab), STATIC_BATCH_SIZES),
                 f"{MORE_REQUESTS_FACTOR * spec.num_requests} requests, {SLOTS} slots":
                     (make_requests(replace(spec, num_requests=MORE_REQUESTS_FACTOR * spec.num_requests), vocab,
                                    seed=WORKLOAD_SEED + 7), (SLOTS,))}
    # Prefix caching off: padded prompts share a prefix of pad tokens, which would be served from the
    # cache and hide the very cost being measured.
    engine = make_engine(model_dir, max_num_seqs=SLOTS, max_num_batched_tokens=1024, enable_prefix_caching=False)
    warm_up(engine, vocab)
    counter = StepCounter(engine)
    repeats = 1 if quick else 2
    results = {name: run_workload(engine, counter, reqs, sizes, f"w{i}", repeats)
               for i, (name, (reqs, sizes)) in enumerate(workloads.items())}
    counter.detach()

    rows, notes = [], []
    for wname, runs in results.items():
        base = runs[f"static, batches of {SLOTS}"]
        needed = runs[CONTINUOUS]["expected"]
        for name, m in runs.items():
            rows.append([wname, name, m["computed_tokens"], m["computed_tokens"] - needed, m["wall_s"],
                         m["useful_tokens_per_s"], times(base["wall_s"] / m["wall_s"])])
        mismatched = [n for n, m in runs.items() if m["computed_tokens"] != m["expected"]]
        if mismatched:
            notes.append(f"{wname}: computed tokens differ from the formula for {mismatched}")
    (a_name, a), (b_name, b) = results.items()
    saved = 1 - a[CONTINUOUS]["computed_tokens"] / a[f"static, batches of {SLOTS}"]["computed_tokens"]
    speed = lambda runs: runs[f"static, batches of {SLOTS}"]["wall_s"] / runs[CONTINUOUS]["wall_s"]  # noqa: E731
    return Result(
        headers=["workload", "system", "tokens computed", "of which padding", "wall s (best of repeats)",
                 "useful out tok/s",
                 f"speed vs static batches of {SLOTS}"],
        rows=rows,
        headline=(f"with {a_name} continuous batching computes {saved:.0%} fewer tokens than one static batch and "
                  f"runs {times(speed(a))} as fast; with {b_name} it runs {times(speed(b))} as fast"),
        data={"workloads": results, "saved_fraction": saved, "repeats": repeats,
              "requests": {w: [(len(r.prompt_token_ids), r.output_len) for r in reqs]
                           for w, (reqs, _) in workloads.items()}},
        notes=notes)


def plot(data: dict, path) -> None:
    labels, computed, needed, rates = [], [], [], []
    for wname, runs in data["workloads"].items():
        for name, m in runs.items():
            labels.append(f"{wname}\n{name.replace(' (this engine)', '').replace('batches of ', 'by ')}")
            computed.append(m["computed_tokens"])
            needed.append(runs[CONTINUOUS]["expected"])
            rates.append(m["useful_tokens_per_s"])
    xs = range(len(labels))
    fig, (ax1, ax2) = plotting.figure(2, "Experiment 1: continuous vs static batching", width_in=7.0)
    ax1.bar(xs, needed, label="needed")
    ax1.bar(xs, [c - n for c, n in zip(computed, needed)], bottom=needed, label="padding", color="tab:red")
    ax1.set_xticks(list(xs), labels, fontsize=6)
    ax1.set_ylabel("tokens computed")
    ax1.legend(fontsize=8)
    plotting.bars(ax2, labels, rates, "useful output tokens/s")
    ax2.tick_params(axis="x", labelsize=6)
    plotting.save(fig, path)
