"""The structured-output benchmark's workload (bench/structured_output.py): W1's schema and which of
W1's requests it constrains, the full and quick plans, the schemas of the compile table and random
valid documents of them, the 32-row walk the mask timings step, and the tokenizers (2) and (3) run
on. Definitions only: nothing here is timed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from bench.serving_model import DEFAULT_MODEL_DIR, is_servable, served_bench_small
from bench.workload import FULL, QUICK

CONSTRAIN_EVERY = 4  # every 4th request of W1 (0, 4, 8, ...) is constrained
MASK_ROWS = 32

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


def constrained_indices(num_requests: int, every: int = CONSTRAIN_EVERY) -> list[int]:
    return list(range(0, num_requests, every))


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


# ---- the models and the 32-row walk ---------------------------------------------------------


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


def tokenizers_to_measure() -> list[tuple[str, Path]]:
    out = []
    if is_servable(DEFAULT_MODEL_DIR):
        out.append(("models/default (real BPE)", DEFAULT_MODEL_DIR))
    out.append(("bench-small (synthetic BPE)", served_bench_small()))
    return out
