"""Experiment 9: the scheduler's cost per step at 4, 16 and 64 running requests.

Owns the timing split of an engine step in steady decode: `Scheduler.schedule()`, the model
runner (pack inputs, forward, sample) and the rest of the engine's bookkeeping (appending tokens,
prefix-cache registration, outputs). Both inner calls are timed by wrapping the instance's
attributes; the code is the engine's own.
"""

from __future__ import annotations

import random
import statistics
import time

from bench.experiments import plotting
from bench.experiments.common import (DEFAULT_MODEL_DIR, FIRST_ORDINARY_ID, Result, greedy, make_engine, pct,
                                      vocab_size, warm_up)

NUMBER, NAME = 9, "sched_overhead"
TITLE = "Scheduler overhead per step"
RUNNING = (4, 16, 64)
PROMPT_LEN = 32


class Timer:
    """Wraps obj.attr (a bound method) so every call's duration is appended to self.samples."""

    def __init__(self, obj, attr: str):
        self.obj, self.attr, self.samples = obj, attr, []
        self._inner = getattr(obj, attr)
        self._shadowed = attr in vars(obj)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self._inner(*args, **kwargs)
            finally:
                self.samples.append(time.perf_counter() - t0)

        setattr(obj, attr, timed)

    def detach(self) -> None:
        if self._shadowed:
            setattr(self.obj, self.attr, self._inner)
        else:
            delattr(self.obj, self.attr)


def split_step(step_s: list[float], schedule_s: list[float], execute_s: list[float],
               prepare_s: list[float]) -> dict[str, float]:
    """Medians per step in ms: the whole step, the scheduler, packing the inputs, the forward and
    sampling (the runner less its packing), and the engine's remainder (the step less the runner and
    the scheduler)."""
    forward = [e - p for e, p in zip(execute_s, prepare_s)]
    rest = [s - a - b for s, a, b in zip(step_s, schedule_s, execute_s)]
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"step_ms": med(step_s), "schedule_ms": med(schedule_s), "prepare_ms": med(prepare_s),
            "forward_ms": med(forward), "rest_ms": med(rest)}


def measure(engine, vocab: int, num_running: int, num_steps: int) -> dict[str, float]:
    rng = random.Random(num_running)
    for i in range(num_running):
        engine.add_request(f"n{num_running}-{i}", [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(PROMPT_LEN)],
                           greedy(num_steps + 16))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prompts first: only steady decode steps are timed
    schedule, execute = Timer(engine.scheduler, "schedule"), Timer(engine.runner, "execute_splitting")
    prepare = Timer(engine.runner, "_prepare")
    step_s = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
    for timer in (schedule, execute, prepare):
        timer.detach()
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    engine.step()
    return split_step(step_s, schedule.samples, execute.samples, prepare.samples)


def run(quick: bool = False) -> Result:
    model_dir = DEFAULT_MODEL_DIR
    vocab = vocab_size(model_dir)
    num_steps = 20 if quick else 100
    engine = make_engine(model_dir, max_num_seqs=max(RUNNING), max_num_batched_tokens=2048,
                         enable_prefix_caching=False)
    warm_up(engine, vocab)
    by_n = {n: measure(engine, vocab, n, num_steps) for n in RUNNING}
    rows = [[n, r["schedule_ms"], r["prepare_ms"], r["rest_ms"], r["forward_ms"], r["step_ms"],
             pct((r["schedule_ms"] + r["prepare_ms"] + r["rest_ms"]) / r["step_ms"])] for n, r in by_n.items()]
    first = by_n[RUNNING[0]]
    return Result(
        headers=["running requests", "schedule() ms", "pack inputs ms", "other engine bookkeeping ms",
                 "forward + sample ms", "whole step ms", "share not in forward + sample"],
        rows=rows,
        headline=(f"schedule() takes {first['schedule_ms']:.3f} ms per step at {RUNNING[0]} running requests and "
                  f"{by_n[RUNNING[-1]]['schedule_ms']:.3f} ms at {RUNNING[-1]}"),
        data={"by_running": by_n, "num_steps": num_steps})


def plot(data: dict, path) -> None:
    by_n = data["by_running"]
    ns = [str(n) for n in by_n]
    fig, (ax,) = plotting.figure(1, "Experiment 9: where a decode step's time goes", width_in=7.0)
    bottom = [0.0] * len(ns)
    for key, label in (("schedule_ms", "schedule()"), ("prepare_ms", "pack inputs"),
                       ("rest_ms", "engine bookkeeping"), ("forward_ms", "forward + sample")):
        values = [r[key] for r in by_n.values()]
        ax.bar(ns, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("running requests (all decoding)")
    ax.set_ylabel("ms per step (medians)")
    ax.legend(fontsize=8)
    plotting.save(fig, path)
