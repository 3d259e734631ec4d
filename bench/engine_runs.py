"""Runs our engine (worker.engine) through the benchmark's three measurements: workload throughput, batch-1
decode rate, and KV-slot utilisation sampled after every step."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

from bench.run_result import RunResult, Timed
from bench.workload import Request

MAX_MODEL_LEN = 2048  # the checkpoint's max_position_embeddings: what a contiguous cache reserves per sequence


@dataclass
class EngineSettings:
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512

    def as_kwargs(self) -> dict:
        return dict(num_kv_blocks=self.num_kv_blocks, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens, enable_prefix_caching=False)


def blocks_for(requests: list[Request], block_size: int) -> int:
    """Blocks to hold every request at its full length at once, plus one spare each, so nothing is ever preempted
    (a preemption would measure the scheduler's recovery, not its steady state)."""
    return sum(-(-(len(r.prompt_token_ids) + r.output_len) // block_size) + 1 for r in requests)


def load_engine(model_dir, settings: EngineSettings):
    from worker.engine import Engine

    return Engine.from_model_dir(str(model_dir), **settings.as_kwargs())


def _params(n: int):
    from worker.engine import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _generate(engine, requests: list[Request]) -> list[list[int]]:
    outs = engine.generate([r.prompt_token_ids for r in requests], [_params(r.output_len) for r in requests],
                           use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def run_throughput(engine, requests: list[Request], warmup: list[Request], timed: Timed = nullcontext) -> RunResult:
    """(c) The whole workload in one engine.generate() call; useful tokens are checked, not assumed."""
    _generate(engine, warmup)
    with timed():
        t0 = time.perf_counter()
        outputs = _generate(engine, requests)
        wall = time.perf_counter() - t0
    notes = []
    wrong = [i for i, (o, r) in enumerate(zip(outputs, requests)) if len(o) != r.output_len]
    if wrong:
        notes.append(f"{len(wrong)} requests returned a length other than requested (e.g. #{wrong[0]}: "
                     f"{len(outputs[wrong[0]])} vs {requests[wrong[0]].output_len})")
    useful = sum(min(len(o), r.output_len) for o, r in zip(outputs, requests))
    return RunResult("our engine", wall, useful, outputs, notes)


@dataclass
class PairedRun:
    """One (c) run and the machine's matmul rate measured just before and just after it."""
    run: RunResult
    gflops: float  # the better of the two

    def compute_bound_fraction(self, flops: float) -> float:
        return flops / (self.gflops * 1e9) / self.run.wall_s


def run_throughput_paired(engine, requests: list[Request], warmup: list[Request], repeats: int,
                          measure_gflops, timed: Timed = nullcontext) -> list[PairedRun]:
    """(c) `repeats` times over, each run between two measurements of the matmul rate.

    On a shared VM the matmul rate moves over minutes (docs/benchmarks.md) and the engine with
    it, so a run's fraction of the compute bound is taken against the rate measured around that
    run, not against a lucky moment minutes away. Our run is short where the baselines take
    minutes, so it alone can afford the repeats."""
    paired = []
    for _ in range(max(1, repeats)):
        before = measure_gflops()
        run = run_throughput(engine, requests, warmup, timed)
        paired.append(PairedRun(run, max(before, measure_gflops())))
    return paired


def median_run(paired: list[PairedRun], flops: float) -> PairedRun:
    """The run with the median fraction of the compute bound, noting every run."""
    ranked = sorted(paired, key=lambda p: p.compute_bound_fraction(flops))
    median = ranked[len(ranked) // 2]
    if len(paired) > 1:
        median.run.notes.append("median of %d runs, each against the matmul rate measured around it: %s" % (
            len(paired), "; ".join(f"{p.run.wall_s:.2f} s at {p.gflops:.1f} GFLOP/s = "
                                   f"{p.compute_bound_fraction(flops):.1%}" for p in paired)))
    return median


def engine_decode_seconds(engine, prompt: list[int], new_tokens: int) -> float:
    t0 = time.perf_counter()
    engine.generate([prompt], [_params(new_tokens)], use_tqdm=False)
    return time.perf_counter() - t0


def _is_finished(out) -> bool:
    finished = getattr(out, "finished", None)
    if isinstance(finished, bool):
        return finished
    return getattr(out, "finish_reason", None) is not None


@dataclass
class KVUsage:
    steps: int = 0
    wall_s: float = 0.0
    live: list[int] = field(default_factory=list)            # live token slots after each step
    allocated: list[int] = field(default_factory=list)       # slots in allocated blocks after each step
    contiguous_max: list[int] = field(default_factory=list)  # unfinished requests x MAX_MODEL_LEN
    contiguous_exact: list[int] = field(default_factory=list)  # sum over unfinished requests of prompt+max_tokens

    @staticmethod
    def _ratio(num: list[int], den: list[int]) -> float:
        return sum(num) / sum(den) if sum(den) else 0.0

    @property
    def paged_utilisation(self) -> float:
        return self._ratio(self.live, self.allocated)

    @property
    def contiguous_max_utilisation(self) -> float:
        return self._ratio(self.live, self.contiguous_max)

    @property
    def contiguous_exact_utilisation(self) -> float:
        return self._ratio(self.live, self.contiguous_exact)


def run_kv_usage(engine, requests: list[Request], max_model_len: int = MAX_MODEL_LEN) -> KVUsage:
    """Drive the workload with add_request/step and sample engine.kv_usage() after every step.

    The contiguous baselines use the same per-step live counts. With every request arriving at t=0 and
    max_num_seqs >= the request count, a contiguous allocator admits every unfinished request at once and holds its
    reservation until it finishes, so the reserving set is exactly the unfinished requests."""
    usage = KVUsage()
    reserve = {}
    for i, r in enumerate(requests):
        rid = f"kv-{i}"
        engine.add_request(rid, r.prompt_token_ids, _params(r.output_len))
        reserve[rid] = len(r.prompt_token_ids) + r.output_len
    unfinished = set(reserve)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if _is_finished(out):
                unfinished.discard(getattr(out, "request_id", None))
        live, allocated = engine.kv_usage()
        usage.steps += 1
        usage.live.append(int(live))
        usage.allocated.append(int(allocated))
        # Sampled after the step, like kv_usage: requests that just finished no longer reserve anything.
        usage.contiguous_max.append(len(unfinished) * max_model_len)
        usage.contiguous_exact.append(sum(reserve[rid] for rid in unfinished))
    usage.wall_s = time.perf_counter() - t0
    return usage
