"""Structured output, the gateway's half: a request's constraint (JSON schema, any JSON object,
regex, Lark grammar, choice) turned into the llguidance grammar the worker enforces, and checked
against the served tokenizer before the request queues.

llguidance (Rust, no Python dependencies, the engine vLLM and llama.cpp use) compiles JSON schemas,
regexes and Lark grammars to one grammar format; its checker refuses what it cannot enforce (an
unimplemented JSON Schema keyword, an unknown string format, a bad regex) with a message naming it,
so nothing is silently ignored. The check builds the grammar's lexer against the real vocabulary,
which is most of a compile; the worker compiles the same text again (cached by its hash) into the
matcher it advances token by token.
"""
from __future__ import annotations

import json
from pathlib import Path

import llguidance

from gateway.json_nesting import loads, too_deep
from protos import inference_pb2


# JSON as json.dumps writes it: no free whitespace for a random model to wander in, keys in the
# schema's `properties` order.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """The constraint cannot be enforced; the message names the problem."""


class ConstraintCompiler:
    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: tuple[int, ...]):
        self._path = str(Path(model_dir) / "tokenizer.json")
        self._vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:  # built on first use: a gateway that never sees a constraint pays nothing
            self._tokenizer = llguidance.LLTokenizer(self._path, n_vocab=self._vocab_size, eos_token=self._eos_ids)
        return self._tokenizer

    def grammar(self, constraint: inference_pb2.StructuredOutput) -> str:
        """The llguidance grammar of `constraint`, checked; raises ConstraintError."""
        grammar = grammar_of(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error or messages:
            kind = constraint.WhichOneof("kind")
            # llguidance's words for text nested past the 128 levels its JSON parser follows
            why = ("nests too deeply to be enforced" if any("recursion limit exceeded" in m for m in messages)
                   else "cannot be enforced")
            raise ConstraintError(f"structured_output.{kind} {why}: {'; '.join(messages)}")
        return grammar


def grammar_of(constraint: inference_pb2.StructuredOutput) -> str:
    kind = constraint.WhichOneof("kind")
    if kind == "json_schema":
        schema = loads(constraint.json_schema, "structured_output.json_schema", ConstraintError)
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError("structured_output.json_schema must be a JSON object (a schema)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ConstraintError(f"structured_output.json_schema: {e}") from None
        except RecursionError:  # written back as text, a few calls deeper than it was parsed
            raise ConstraintError(too_deep("structured_output.json_schema")) from None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)
    if kind == "choice":
        choices = list(constraint.choice.choices)
        if not choices or any(c == "" for c in choices):
            raise ConstraintError("structured_output.choice needs at least one choice, none of them empty")
        # A Lark string literal takes JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    raise ConstraintError("structured_output is set but names no constraint")


# Where a schema holds subschemas: a map of them, a list of them, or one.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def closed_objects(schema):
    """`schema` with every object that names its `properties` and says nothing of others closed to
    them (`additionalProperties: false`), as vLLM's default grammar engine reads a schema: a random
    or small model otherwise writes keys nobody asked for and runs out of tokens doing so. A schema
    that allows other keys says so (`additionalProperties: true` or a schema); an object with no
    `properties` stays open."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS + _SUBSCHEMAS:
        if key in out:
            out[key] = closed_objects(out[key])
    return out


def constraint_size(constraint: inference_pb2.StructuredOutput) -> int:
    """The characters a constraint's text holds: what checking and compiling it costs."""
    kind = constraint.WhichOneof("kind")
    if kind == "choice":
        return sum(len(c) for c in constraint.choice.choices)
    if kind in ("json_schema", "regex", "grammar"):
        return len(getattr(constraint, kind))
    return 0
