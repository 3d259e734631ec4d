"""`python -m bench.structured_output [--quick] [--json PATH]` (`make bench-structured`): the cost of
structured output, side by side in one run.

  (1) Throughput. The engine benchmark's workload W1 (bench/workload.py: 32 requests, random
      prompts of 64-512 tokens, 32-256 output tokens, greedy, EOS ignored) on bench-small, in one
      engine, three ways in alternating rounds, medians reported:
        A  W1 unconstrained, as `make bench` runs it;
        B  W1 with every 4th request constrained by a JSON schema (W1_SCHEMA: four typed fields,
           bounded strings and integers, so every output can end);
        C  W1 unconstrained with each of B's constrained requests given max_tokens = the number of
           tokens its constrained output took in B.
      A constrained request ends `stop` when its JSON is complete (ignore_eos or not), so B
      produces fewer tokens than A, and a batch that thins out sooner runs at a lower tokens/s
      for reasons that have nothing to do with masks. C has B's exact token counts and so B's
      batch shapes step for step: B / C is the cost of the constraints (the target), B / A is
      what a user of W1 sees. Per-step time (wall / engine steps) is reported for each.
      Every constrained output that completes is decoded, parsed and validated with jsonschema.
  (2) Per-step mask time at 32 rows: worker.constraints.mask_rows on [32, V] float32 logits with
      32 matchers walking 32 different valid documents (spread positions, each advanced one token
      per step, a finished one replaced by a new request), on each tokenizer available
      (models/default's real BPE, V = 4096; bench-small's synthetic byte-level BPE, V = 32000);
      its two halves (llguidance filling the bitmasks; applying them to the logits); and the
      sampler's whole call on the same logits with and without the 32 constraints. Also the
      first mask application of a fresh process, ours and llguidance's own kernel (which torch.compile
      builds on its first call).
  (3) Compile time per schema, for five schemas of increasing size: the gateway's check
      (gateway.constraints.ConstraintCompiler.grammar, which has no cache: schema -> grammar and
      a validation against the tokenizer), the worker's cold compile (the first
      worker.constraints.ConstraintCompiler.constraint of a grammar) and cached (the same
      grammar again: a hash and a copy of the compiled matcher).
Target: B >= 0.9x the throughput of C.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bench.contention import busy_other_processes, foreign_load, wait_for_idle
from bench.engine_runs import EngineSettings, blocks_for, load_engine
from bench.results_file import write_results
from bench.serving_model import DEFAULT_MODEL_DIR, is_servable, model_limits, served_bench_small
from bench.structured_output_report import print_report
from bench.workload import FULL, QUICK, Request, make_requests, make_warmup_requests

CONSTRAIN_EVERY = 4  # every 4th request of W1 (0, 4, 8, ...) is constrained
MASK_ROWS = 32
# The walk's first steps visit its lexer states for the first time (llguidance builds its DFA lazily,
# shared by every copy of a compiled grammar): reported apart from the steady state.
MASK_WARMUP_STEPS = 8
DEFAULT_JSON = Path("bench/results/structured_output.json")

# W1's schema: short enough that every constrained request of W1 (max_tokens >= 32) can finish it.
W1_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "active", "role"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Plan:
    workload: object  # bench.workload.WorkloadSpec
    rounds: int  # of each arm, alternating
    mask_steps: int  # steps of the 32-row walk per tokenizer
    compile_repeats: int
    first_mask: bool  # time the first mask of a fresh process (two subprocesses, ~20 s)


FULL_PLAN = Plan(FULL, rounds=3, mask_steps=96, compile_repeats=7, first_mask=True)
# A smoke run of every code path: QUICK's outputs (8-32 tokens) mostly end inside W1_SCHEMA (`length`).
QUICK_PLAN = Plan(QUICK, rounds=1, mask_steps=16, compile_repeats=2, first_mask=False)


def log(msg: str) -> None:
    print(f"[structured-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- schemas and documents ------------------------------------------------------------------


def field_schema(i: int) -> dict:
    """Field i of a generated schema: the types W1_SCHEMA uses, plus arrays and nested objects."""
    kind = i % 6
    if kind == 0:
        return {"type": "string", "minLength": 1, "maxLength": 4 + i % 13}
    if kind == 1:
        return {"type": "integer", "minimum": -i, "maximum": 10 * i + 9}
    if kind == 2:
        return {"type": "boolean"}
    if kind == 3:
        return {"enum": [f"v{i}_{j}" for j in range(3 + i % 4)]}
    if kind == 4:
        return {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 0, "maxItems": 3}
    return object_schema(3, start=i + 1)


def object_schema(num_fields: int, start: int = 0) -> dict:
    names = [f"f{start + i}" for i in range(num_fields)]
    return {"type": "object", "properties": {n: field_schema(start + i) for i, n in enumerate(names)},
            "required": names, "additionalProperties": False}


def compile_schemas() -> list[tuple[str, dict]]:
    """(name, schema) in increasing size: one field, W1's, then generated objects of 16, 64, 256 fields."""
    return [("1 field", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                         "additionalProperties": False}),
            ("W1 (4 fields)", W1_SCHEMA),
            ("16 fields", object_schema(16)),
            ("64 fields", object_schema(64)),
            ("256 fields", object_schema(256))]


TEXT_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 -_."


def sample_instance(schema: dict, rng: np.random.Generator):
    """A random valid instance of a schema built from the subset above (object, string, integer,
    boolean, enum, array), properties in the schema's order (as the grammar writes them)."""
    if "enum" in schema:
        return schema["enum"][int(rng.integers(len(schema["enum"])))]
    kind = schema["type"]
    if kind == "object":
        return {name: sample_instance(sub, rng) for name, sub in schema["properties"].items()}
    if kind == "string":
        n = int(rng.integers(schema.get("minLength", 0), schema.get("maxLength", 16) + 1))
        return "".join(TEXT_CHARS[int(k)] for k in rng.integers(len(TEXT_CHARS), size=n))
    if kind == "integer":
        return int(rng.integers(schema.get("minimum", -1000), schema.get("maximum", 1000) + 1))
    if kind == "boolean":
        return bool(rng.integers(2))
    if kind == "array":
        n = int(rng.integers(schema.get("minItems", 0), schema.get("maxItems", 4) + 1))
        return [sample_instance(schema["items"], rng) for _ in range(n)]
    raise ValueError(f"sample_instance does not handle {schema!r}")


def as_text(instance) -> str:
    """JSON as the gateway's grammars write it (gateway.constraints.JSON_OPTIONS: ', ' and ': ')."""
    return json.dumps(instance)


# ---- (1) throughput --------------------------------------------------------------------------


def constrained_indices(num_requests: int, every: int = CONSTRAIN_EVERY) -> list[int]:
    return list(range(0, num_requests, every))


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


# ---- (2) per-step mask time --------------------------------------------------------------------


def eos_ids(model_dir: Path) -> tuple[int, ...]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


class Walk:
    """MASK_ROWS matchers of one grammar, each walking its own valid document a token per step, started at
    spread positions; a row whose document is done starts a new one (a new request, a fresh copy)."""

    def __init__(self, compiler, grammar: str, schema: dict, encode: Callable[[str], list[int]],
                 rows: int = MASK_ROWS, seed: int = 0):
        self.compiler, self.grammar, self.schema, self.encode = compiler, grammar, schema, encode
        self.rng = np.random.default_rng(seed)
        self.docs: list[list[int]] = []
        self.pos: list[int] = []
        self.constraints = []
        for j in range(rows):
            doc = self._new_doc()
            start = j * (len(doc) - 1) // rows
            constraint = compiler.constraint(grammar, doc[:start])
            self.docs.append(doc)
            self.pos.append(start)
            self.constraints.append(constraint)

    def _new_doc(self) -> list[int]:
        return self.encode(as_text(sample_instance(self.schema, self.rng)))

    def advance(self) -> None:
        for j, constraint in enumerate(self.constraints):
            constraint.advance(self.docs[j][self.pos[j]])
            self.pos[j] += 1
            if self.pos[j] == len(self.docs[j]):  # complete: the next request of this row
                self.docs[j], self.pos[j] = self._new_doc(), 0
                self.constraints[j] = self.compiler.constraint(self.grammar)
            if self.constraints[j].dead_end:
                raise RuntimeError(f"row {j} refused its document's token: {self.constraints[j].dead_end}")


def percentiles_ms(values: Sequence[float]) -> dict:
    xs = sorted(values)
    pick = lambda q: 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]
    return {"median_ms": 1e3 * statistics.median(xs), "p90_ms": pick(0.9), "min_ms": 1e3 * xs[0],
            "max_ms": 1e3 * xs[-1], "n": len(xs)}


def measure_masks(model_dir: Path, label: str, steps: int) -> dict:
    import torch
    from tokenizers import Tokenizer

    import worker.constraints as wc
    from gateway.constraints import ConstraintCompiler as GatewayCompiler
    from protos import inference_pb2 as pb
    from shared.sampling_params import SamplingParams
    from worker.sampler import Sampler, SamplingBatch

    llg_torch = wc.llg_torch
    vocab_size, _ = model_limits(model_dir)
    eos = eos_ids(model_dir)
    grammar = GatewayCompiler(model_dir, vocab_size, eos).grammar(pb.StructuredOutput(json_schema=json.dumps(W1_SCHEMA)))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
    compiler = wc.ConstraintCompiler(model_dir, vocab_size, eos)
    walk = Walk(compiler, grammar, W1_SCHEMA, encode)
    rows = list(range(MASK_ROWS))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(MASK_ROWS, vocab_size, generator=gen)  # [32, V] float32
    sampler = Sampler("cpu", seed=0)
    params = [SamplingParams(max_tokens=16, temperature=0.0)] * MASK_ROWS
    plain = SamplingBatch(params=params, generators=[None] * MASK_ROWS, token_histories=[[]] * MASK_ROWS)
    # Untimed: the first masks of the lexer, and llguidance's kernel's torch.compile (measured in `first_mask`).
    wc.mask_rows(logits.clone(), rows, walk.constraints)
    llg_torch.apply_token_bitmask_inplace(logits.clone(), wc.fill_bitmask(walk.constraints, vocab_size))
    times = {k: [] for k in ("mask_rows", "fill", "apply", "advance", "sampler_plain", "sampler_constrained",
                             "apply_kernel", "mask_rows_8", "mask_rows_1")}
    for step in range(steps):
        constrained = SamplingBatch(params=params, generators=[None] * MASK_ROWS, token_histories=[[]] * MASK_ROWS,
                                    constraints=list(walk.constraints))
        x = logits.clone()
        t0 = time.perf_counter()
        wc.mask_rows(x, rows, walk.constraints)
        times["mask_rows"].append(time.perf_counter() - t0)
        # The same two halves by hand: llguidance filling the bitmasks, then torch applying them.
        t0 = time.perf_counter()
        bitmask = wc.fill_bitmask(walk.constraints, vocab_size)
        t1 = time.perf_counter()
        y = logits.clone()
        t2 = time.perf_counter()
        wc.apply_bitmask(y, rows, bitmask)
        t3 = time.perf_counter()
        times["fill"].append(t1 - t0)
        times["apply"].append(t3 - t2)
        z = logits.clone()
        t0 = time.perf_counter()
        llg_torch.apply_token_bitmask_inplace(z, bitmask)  # llguidance's own kernel, for comparison
        times["apply_kernel"].append(time.perf_counter() - t0)
        for n in (8, 1):  # the same states, fewer rows: what a step with fewer constrained rows pays
            z = logits.clone()
            t0 = time.perf_counter()
            wc.mask_rows(z, rows[:n], walk.constraints[:n])
            times[f"mask_rows_{n}"].append(time.perf_counter() - t0)
        if not torch.equal(torch.isinf(x), torch.isinf(y)):
            raise RuntimeError("the hand-made mask differs from mask_rows'")
        pair = [("sampler_plain", plain), ("sampler_constrained", constrained)]
        for name, batch in (pair if step % 2 else pair[::-1]):
            t0 = time.perf_counter()
            out = sampler(logits, batch)
            times[name].append(time.perf_counter() - t0)
            if name == "sampler_constrained":
                allowed = [bool(torch.isfinite(x[i, t])) for i, t in enumerate(out.token_ids)]
                if not all(allowed):
                    raise RuntimeError("the constrained sampler chose a masked token")
        t0 = time.perf_counter()
        walk.advance()
        times["advance"].append(time.perf_counter() - t0)
    warm = min(MASK_WARMUP_STEPS, steps // 2)
    return {"label": label, "model_dir": str(model_dir), "vocab_size": vocab_size, "rows": MASK_ROWS,
            "steps": steps, "warmup_steps": warm, **{k: percentiles_ms(v[warm:]) for k, v in times.items()},
            "warmup": {k: percentiles_ms(v[:warm]) for k, v in times.items()}}


FIRST_MASK_SNIPPET = """
import time, torch
torch.set_num_threads({threads})
import worker.constraints as wc
x = torch.randn({rows}, {vocab}); m = wc.llg_torch.allocate_token_bitmask({rows}, {vocab})
t0 = time.perf_counter(); wc.apply_bitmask(x, list(range({rows})), m); t1 = time.perf_counter()
t2 = time.perf_counter(); wc.llg_torch.apply_token_bitmask_inplace(x, m); t3 = time.perf_counter()
print(t1 - t0, t3 - t2)
"""


def measure_first_mask(vocab_size: int, threads: int) -> dict:
    """The first mask application of a fresh process: the worker's (numpy unpack), and llguidance's own
    kernel, which torch.compile builds then, with the inductor cache left by earlier runs and with an
    empty one (a fresh host)."""
    code = FIRST_MASK_SNIPPET.format(threads=threads, rows=MASK_ROWS, vocab=vocab_size)
    out = {}
    with tempfile.TemporaryDirectory() as empty:
        for name, env in (("warm_cache", {}), ("empty_cache", {"TORCHINDUCTOR_CACHE_DIR": empty})):
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                                 env={**os.environ, **env}, cwd=Path(__file__).resolve().parent.parent)
            if res.returncode != 0:
                out[name] = {"error": res.stderr.strip()[-500:]}
                continue
            ours, theirs = (float(v) for v in res.stdout.split()[-2:])
            out[name] = {"first_s": ours, "llguidance_kernel_first_s": theirs}
    return out


# ---- (3) compile time ----------------------------------------------------------------------------


def measure_compiles(model_dir: Path, label: str, repeats: int) -> dict:
    from gateway.constraints import ConstraintCompiler as GatewayCompiler
    from protos import inference_pb2 as pb
    from worker.constraints import ConstraintCompiler

    vocab_size, _ = model_limits(model_dir)
    eos = eos_ids(model_dir)
    gateway = GatewayCompiler(model_dir, vocab_size, eos)
    t0 = time.perf_counter()
    gateway.tokenizer  # built on first use; once per gateway
    gateway_tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cold = ConstraintCompiler(model_dir, vocab_size, eos, cache_size=0)  # no cache: every call compiles
    worker_tokenizer_s = time.perf_counter() - t0
    cached = ConstraintCompiler(model_dir, vocab_size, eos)
    rows = []
    for name, schema in compile_schemas():
        proto = pb.StructuredOutput(json_schema=json.dumps(schema))
        check = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            grammar = gateway.grammar(proto)
            check.append(time.perf_counter() - t0)
        compiles = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cold.constraint(grammar)
            compiles.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cached.constraint(grammar)
        first_cached_compiler = time.perf_counter() - t0
        hits = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cached.constraint(grammar)
            hits.append(time.perf_counter() - t0)
        rows.append({"schema": name, "schema_bytes": len(json.dumps(schema)), "grammar_bytes": len(grammar),
                     "gateway_check_first_ms": 1e3 * check[0], "gateway_check_ms": 1e3 * statistics.median(check),
                     "worker_cold_first_ms": 1e3 * compiles[0],
                     "worker_cold_ms": 1e3 * statistics.median(compiles),
                     "worker_cold_in_cached_compiler_ms": 1e3 * first_cached_compiler,
                     "worker_cached_ms": 1e3 * statistics.median(hits)})
    return {"label": label, "model_dir": str(model_dir), "vocab_size": vocab_size, "repeats": repeats,
            "gateway_tokenizer_ms": 1e3 * gateway_tokenizer_s, "worker_tokenizer_ms": 1e3 * worker_tokenizer_s,
            "schemas": rows}


# ---- the tokenizers (2) and (3) run on -----------------------------------------------------------


def tokenizers_to_measure() -> list[tuple[str, Path]]:
    out = []
    if is_servable(DEFAULT_MODEL_DIR):
        out.append(("models/default (real BPE)", DEFAULT_MODEL_DIR))
    out.append(("bench-small (synthetic BPE)", served_bench_small()))
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.structured_output", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="W1's 8-request quick workload, one round, fewer steps")
    p.add_argument("--json", metavar="PATH", default="",
                   help=f"where to write every result (default {DEFAULT_JSON}, or *_quick.json with --quick)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2, as `make bench`)")
    p.add_argument("--only", choices=("throughput", "masks", "compile"), action="append",
                   help="run only these parts (repeatable)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for other processes to stop using the CPU first")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    parts = set(args.only or ("throughput", "masks", "compile"))
    busy = wait_for_idle(args.wait_idle) if args.wait_idle else busy_other_processes()
    if busy:
        log(f"other processes busy: {busy}")
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": args.quick,
                    "threads": args.threads, "busy_before": busy}
    t_start = time.perf_counter()
    if "throughput" in parts:
        log("(1) throughput: W1 unconstrained / 1/4 constrained / unconstrained at the constrained lengths")
        report["throughput"] = measure_throughput(plan, args.threads)
    if "masks" in parts:
        report["masks"] = []
        for label, model_dir in tokenizers_to_measure():
            log(f"(2) masks at {MASK_ROWS} rows: {label}")
            report["masks"].append(measure_masks(model_dir, label, plan.mask_steps))
        if plan.first_mask:
            vocab = max(m["vocab_size"] for m in report["masks"])
            log("(2) the first mask of a fresh process (warm and empty inductor cache)")
            report["first_mask_vocab"] = vocab
            report["first_mask"] = measure_first_mask(vocab, args.threads)
    if "compile" in parts:
        report["compiles"] = []
        for label, model_dir in tokenizers_to_measure():
            log(f"(3) compile times: {label}")
            report["compiles"].append(measure_compiles(model_dir, label, plan.compile_repeats))
    report["busy_after"] = busy_other_processes()
    report["total_s"] = time.perf_counter() - t_start
    print_report(report, CONSTRAIN_EVERY)
    path = write_results(report, args.json, DEFAULT_JSON, args.quick)
    log(f"wrote {path} ({report['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
