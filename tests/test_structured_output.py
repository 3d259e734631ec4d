"""Structured output in the engine: on a random tiny checkpoint (whose free output is garbage),
every constrained output that completes parses and validates, regex outputs match, choices are
one of the choices; constraints compose with sampling, leave unconstrained neighbours unchanged,
survive preemption and resumption, and end `length` (saying why) when cut mid-structure."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from gateway.constraints import ConstraintCompiler
from protos import inference_pb2 as pb

pytestmark = pytest.mark.timeout(600)

SCHEMAS = [
    {"type": "boolean"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "string", "maxLength": 6},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
     "required": ["tags"], "additionalProperties": False},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
     "additionalProperties": False, "$defs": {"point": {"type": "object", "properties": {
         "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}}},
    {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"id": {"type": "integer",
     "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}}, "required": ["id", "ok"], "additionalProperties": False}},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
     "required": ["kind", "r"], "additionalProperties": False},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"deep": {"type": "array",
     "items": {"type": "string", "maxLength": 2}, "maxItems": 2}}, "required": ["deep"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
    {"type": "array", "items": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
     "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"],
     "additionalProperties": False},
    {"type": "object", "properties": {"list": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}},
     "required": ["list"], "additionalProperties": False,
     "$defs": {"leaf": {"type": "object", "properties": {"v": {"enum": [1, 2, 3]}}, "required": ["v"],
                        "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def compiler(served_checkpoint, tokenizer):
    return ConstraintCompiler(served_checkpoint, tokenizer.vocab_size, tokenizer.special.eos_ids)


@pytest.fixture(scope="module")
def engine(served_checkpoint):
    from worker.engine import Engine
    return Engine.from_model_dir(served_checkpoint, num_kv_blocks=256)


def params(grammar: str, **fields):
    from worker.engine import SamplingParams
    return SamplingParams(**{"max_tokens": 160, "temperature": 1.0, "grammar": grammar, **fields})


def test_twenty_schemas_give_valid_json_when_sampled(engine, compiler, tokenizer):
    grammars = [compiler.grammar(pb.StructuredOutput(json_schema=json.dumps(s))) for s in SCHEMAS]
    outs = engine.generate([tokenizer.encode("Answer:")] * len(SCHEMAS),
                           [params(g, seed=i) for i, g in enumerate(grammars)], use_tqdm=False)
    completed = 0
    for schema, out in zip(SCHEMAS, outs):
        text = tokenizer.decode(out.token_ids)
        if out.finish_reason == "stop":
            completed += 1
            jsonschema.validate(json.loads(text), schema)
        else:
            assert out.finish_reason == "length" and out.error, (schema, text)
    assert completed >= 15  # all but the ones a random model runs long in


def test_regex_and_choice(engine, compiler, tokenizer):
    regex = compiler.grammar(pb.StructuredOutput(regex=r"[a-z]{2,6}-[0-9]{3}"))
    choices = ["alpha", "beta", "gamma delta"]
    choice = compiler.grammar(pb.StructuredOutput(choice=pb.Choices(choices=choices)))
    outs = engine.generate([tokenizer.encode("x")] * 8, [params(regex, seed=i) for i in range(4)]
                           + [params(choice, seed=i) for i in range(4)], use_tqdm=False)
    for out in outs[:4]:
        assert out.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,6}-[0-9]{3}", tokenizer.decode(out.token_ids))
    for out in outs[4:]:
        assert out.finish_reason == "stop" and tokenizer.decode(out.token_ids) in choices


def test_constraints_compose_with_greedy_penalties_and_bias_and_leave_neighbours_alone(engine, compiler, tokenizer):
    from worker.engine import SamplingParams
    grammar = compiler.grammar(pb.StructuredOutput(json_schema=json.dumps(SCHEMAS[8])))
    prompts = [tokenizer.encode(t) for t in ("one", "two", "three")]
    free = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)]
    alone = engine.generate(prompts[:2], free, use_tqdm=False)
    constrained = [params(grammar, temperature=0.0, presence_penalty=1.0, logit_bias={65: 5.0})]
    mixed = engine.generate(prompts, free + constrained, use_tqdm=False)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert mixed[2].finish_reason == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(mixed[2].token_ids)), SCHEMAS[8])


def test_preemption_and_resumption_keep_a_greedy_constrained_output(served_checkpoint, engine, compiler, tokenizer):
    from worker.engine import Engine
    long_text = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 45}},
                 "required": ["text"], "additionalProperties": False}
    grammar = compiler.grammar(pb.StructuredOutput(json_schema=json.dumps(long_text)))
    prompts = [tokenizer.encode(f"Answer {i} in JSON:") for i in range(4)]
    greedy = params(grammar, temperature=0.0, max_tokens=60)
    expected = engine.generate(prompts, [greedy] * 4, use_tqdm=False)
    # A pool too small for every request at once: the scheduler preempts (recompute) and resumes.
    small = Engine.from_model_dir(served_checkpoint, num_kv_blocks=8, max_num_batched_tokens=16)
    outs = small.generate(prompts, [greedy] * 4, use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    prompt, expected = prompts[0], expected[0]
    # Resumed on another engine from its first tokens, as after a worker's death.
    cut = len(expected.token_ids) // 2
    engine.add_request("resumed", prompt, greedy, output_token_ids=expected.token_ids[:cut])
    final = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == "resumed" and delta.final is not None:
                final = delta.final
    assert final is not None and final.token_ids == expected.token_ids


def test_cut_mid_structure_ends_length_and_says_why(engine, compiler, tokenizer):
    grammar = compiler.grammar(pb.StructuredOutput(json_schema=json.dumps(SCHEMAS[8])))
    [out] = engine.generate([tokenizer.encode("x")], [params(grammar, max_tokens=3, seed=1)], use_tqdm=False)
    assert out.finish_reason == "length" and "structure" in out.error


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},  # no finite value: llguidance's item limit
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}},  # its row limit
])
def test_a_grammar_that_meets_the_matchers_limits_mid_output_ends_length_not_stop(engine, compiler, tokenizer,
                                                                                   schema):
    """These schemas compile, but the matcher meets one of its limits after the first token and
    enters its error state, which llguidance also reports as stopped: the output ("[" or "{") is
    no complete answer, so it must not end `stop`."""
    grammar = compiler.grammar(pb.StructuredOutput(json_schema=json.dumps(schema)))
    [out] = engine.generate([tokenizer.encode("x")], [params(grammar, max_tokens=16, seed=1)], use_tqdm=False)
    assert out.finish_reason == "length", (out.finish_reason, tokenizer.decode(out.token_ids))
    assert "dead end of its constraint" in out.error


def test_tokens_that_do_not_fit_the_grammar_are_refused_at_admission(engine, compiler, tokenizer):
    from worker.engine import RequestRejectedError
    grammar = compiler.grammar(pb.StructuredOutput(regex="[0-9]+"))
    with pytest.raises(RequestRejectedError):
        engine.add_request("misfit", tokenizer.encode("x"), params(grammar), output_token_ids=tokenizer.encode("abc"))


def test_apply_bitmask_forbids_exactly_the_unset_bits_of_the_chosen_rows():
    import torch
    from worker.constraints import apply_bitmask
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word's spare bits are ignored
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=gen)
    logits = torch.randn(4, vocab, generator=gen)
    masked = logits.clone()
    apply_bitmask(masked, [3, 1], bitmask)
    for row, mask_row in ((3, 0), (1, 1)):
        for t in range(vocab):
            allowed = (int(bitmask[mask_row, t // 32]) >> (t % 32)) & 1
            assert masked[row, t] == (logits[row, t] if allowed else float("-inf"))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
