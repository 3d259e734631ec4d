"""The structured-output benchmark's throughput arms (bench/structured_output.py, part (1)): each arm's
sampling params (A unconstrained, B every CONSTRAIN_EVERY-th request constrained by W1_SCHEMA, C
unconstrained at B's lengths), one timed run of an arm, the validation of B's outputs, the rotation
of the arms over rounds, their summary and ratios, and B once more with its mask time instrumented."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from bench.contention import foreign_load
from bench.engine_runs import EngineSettings, blocks_for, load_engine
from bench.serving_model import model_limits, served_bench_small
from bench.structured_output_workload import W1_SCHEMA, Plan, constrained_indices, eos_ids
from bench.workload import Request, make_requests, make_warmup_requests


def log(msg: str) -> None:
    print(f"[structured-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def arm_params(requests: Sequence[Request], grammar: str = "", constrained: Sequence[int] = (),
               lengths: dict[int, int] | None = None) -> list:
    """SamplingParams per request, greedy and ignoring EOS as W1 is: `grammar` on the `constrained`
    requests (arm B); `lengths` replaces those requests' max_tokens (arm C)."""
    from worker.engine import SamplingParams

    chosen, lengths = set(constrained), lengths or {}
    return [SamplingParams(max_tokens=lengths.get(i, r.output_len), temperature=0.0, ignore_eos=True,
                           grammar=grammar if i in chosen else "") for i, r in enumerate(requests)]


@dataclass
class ArmRun:
    arm: str
    wall_s: float
    steps: int
    tokens: int
    foreign_load: float
    lengths: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.wall_s / self.steps if self.steps else 0.0


def run_arm(engine, arm: str, requests: Sequence[Request], params: list, warmup: Sequence[Request]):
    """One timed engine.generate of the whole workload after an untimed short warm-up (as the engine
    benchmark's run_throughput does); returns the ArmRun and the outputs."""
    warm = arm_params(warmup)
    engine.generate([r.prompt_token_ids for r in warmup], warm, use_tqdm=False)
    load: dict[str, float] = {}
    steps0 = engine.num_steps
    with foreign_load(load, "run"):
        t0 = time.perf_counter()
        outs = engine.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    lengths = [len(o.token_ids) for o in outs]
    return ArmRun(arm, wall, engine.num_steps - steps0, sum(lengths), load["run"], lengths,
                  [o.finish_reason for o in outs]), outs


@dataclass
class Validation:
    constrained: int
    completed: int  # ended `stop`
    valid: int  # completed, parsed and validated
    failures: list[str] = field(default_factory=list)


def validate_outputs(texts: dict[int, str], finish_reasons: dict[int, str], schema: dict) -> Validation:
    """Count the constrained outputs that completed; every completed one must parse and validate."""
    import jsonschema

    v = Validation(constrained=len(texts), completed=0, valid=0)
    for i, text in sorted(texts.items()):
        if finish_reasons[i] != "stop":
            v.failures.append(f"#{i} ended {finish_reasons[i]} after {text!r}")
            continue
        v.completed += 1
        try:
            jsonschema.validate(json.loads(text), schema)
            v.valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            v.failures.append(f"#{i} completed but does not validate ({type(e).__name__}): {text!r}")
    return v


def rotations(arms: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the arms in each round: rotated by one each round, so no arm always runs first."""
    return [list(arms[r % len(arms):]) + list(arms[:r % len(arms)]) for r in range(rounds)]


def summarize_arms(runs: dict[str, list[ArmRun]]) -> dict:
    """Per arm: median tokens/s, each round's, median ms per step and tokens; ratios B/C and B/A as the
    ratio of medians and round by round (rounds pair the arms run back to back)."""
    out = {}
    for arm, rs in runs.items():
        out[arm] = {"tokens_per_s": statistics.median(r.tokens_per_s for r in rs),
                    "rounds_tokens_per_s": [r.tokens_per_s for r in rs],
                    "ms_per_step": statistics.median(r.ms_per_step for r in rs),
                    "wall_s": statistics.median(r.wall_s for r in rs),
                    "steps": [r.steps for r in rs], "tokens": [r.tokens for r in rs],
                    "foreign_load_max": max(r.foreign_load for r in rs)}
    ratios = {}
    for num, den in (("B", "C"), ("B", "A"), ("C", "A")):
        if num in runs and den in runs:
            ratios[f"{num}/{den}"] = {
                "tokens_per_s": out[num]["tokens_per_s"] / out[den]["tokens_per_s"],
                "rounds": [a.tokens_per_s / b.tokens_per_s for a, b in zip(runs[num], runs[den])],
                "ms_per_step": out[num]["ms_per_step"] / out[den]["ms_per_step"]}
    return {"arms": out, "ratios": ratios}


class SpanTimer:
    """Wraps a function to add up the time spent in it (an instrumented run, never a timed one)."""

    def __init__(self, fn: Callable):
        self.fn, self.calls, self.seconds, self.rows = fn, 0, 0.0, 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            if len(args) >= 2 and isinstance(args[1], (list, tuple)):
                self.rows += len(args[1])


def instrumented_run(engine, requests, params, warmup) -> dict:
    """Arm B once more with the sampler's mask_rows and Constraint.advance timed: where B's time goes."""
    import worker.constraints as wc
    import worker.sampler as ws

    mask, advance = SpanTimer(ws.mask_rows), SpanTimer(wc.Constraint.advance)
    ws.mask_rows, wc.Constraint.advance = mask, lambda self, token_id: advance(self, token_id)
    try:
        run, _ = run_arm(engine, "B (instrumented)", requests, params, warmup)
    finally:
        ws.mask_rows, wc.Constraint.advance = mask.fn, advance.fn
    return {"wall_s": run.wall_s, "steps": run.steps, "mask_calls": mask.calls, "mask_rows": mask.rows,
            "mask_s": mask.seconds, "advance_calls": advance.calls, "advance_s": advance.seconds}


def measure_throughput(plan: Plan, threads: int) -> dict:
    from gateway.constraints import ConstraintCompiler as GatewayCompiler
    from protos import inference_pb2 as pb
    from tokenizers import Tokenizer

    model_dir = served_bench_small()
    vocab_size, _ = model_limits(model_dir)
    eos = eos_ids(model_dir)
    grammar = GatewayCompiler(model_dir, vocab_size, eos).grammar(pb.StructuredOutput(json_schema=json.dumps(W1_SCHEMA)))
    requests = make_requests(plan.workload, vocab_size)
    warmup = make_warmup_requests(vocab_size)
    constrained = constrained_indices(len(requests))
    settings = EngineSettings(num_kv_blocks=blocks_for(requests, 16))
    engine = load_engine(model_dir, settings)
    detok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    log("arm B untimed once: compiles the grammar and fixes the constrained outputs' lengths")
    params_b = arm_params(requests, grammar, constrained)
    first_b, outs = run_arm(engine, "B", requests, params_b, warmup)
    lengths = {i: first_b.lengths[i] for i in constrained}
    params = {"A": arm_params(requests), "B": params_b, "C": arm_params(requests, lengths=lengths)}
    runs: dict[str, list[ArmRun]] = {arm: [] for arm in params}
    checks: list[Validation] = []
    texts: dict[int, str] = {}
    length_drift = []
    for r, order in enumerate(rotations(list(params), plan.rounds)):
        for arm in order:
            run, outs = run_arm(engine, arm, requests, params[arm], warmup)
            runs[arm].append(run)
            log(f"round {r + 1} {arm}: {run.wall_s:.2f} s, {run.tokens} tokens, {run.tokens_per_s:.1f} tok/s, "
                f"{run.steps} steps, other load {run.foreign_load:.0%}")
            if arm == "B":
                texts = {i: detok.decode(list(outs[i].token_ids)) for i in constrained}
                checks.append(validate_outputs(texts, {i: outs[i].finish_reason for i in constrained}, W1_SCHEMA))
                drift = [i for i in constrained if run.lengths[i] != lengths[i]]
                if drift:
                    length_drift.append(f"round {r + 1}: #{drift[0]} {run.lengths[drift[0]]} vs {lengths[drift[0]]}")
            else:
                short = [i for i, (n, p) in enumerate(zip(run.lengths, params[arm])) if n != p.max_tokens]
                if short:
                    length_drift.append(f"round {r + 1} {arm}: #{short[0]} gave {run.lengths[short[0]]} tokens")
    log("arm B once more, instrumented (mask_rows and Constraint.advance timed)")
    spans = instrumented_run(engine, requests, params_b, warmup)
    summary = summarize_arms(runs)
    return {"model_dir": str(model_dir), "vocab_size": vocab_size, "threads": threads,
            "num_requests": len(requests), "constrained": constrained,
            "requested_tokens": sum(r.output_len for r in requests),
            "constrained_lengths": lengths,
            "constrained_max_tokens": {i: requests[i].output_len for i in constrained},
            "validation": [asdict(v) for v in checks], "constrained_texts": texts, "length_drift": length_drift,
            "instrumented_B": spans, **summary,
            "runs": {arm: [asdict(r) for r in rs] for arm, rs in runs.items()}}
