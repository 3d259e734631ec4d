"""The structured-output benchmark's own helpers (bench/structured_output_workload.py and
bench/structured_output_arms.py): its schemas and documents are valid, its arms differ only where
they should, its counting and ratios are right, and its 32-row walk feeds the matchers only tokens
their grammar allows."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from bench import structured_output_arms as arms
from bench import structured_output_workload as workload
from bench.serving_model import DEFAULT_MODEL_DIR, is_servable, model_limits
from bench.workload import QUICK, make_requests


def test_schemas_grow_and_their_sampled_documents_validate():
    schemas = workload.compile_schemas()
    sizes = [len(json.dumps(s)) for _, s in schemas]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    rng = np.random.default_rng(0)
    for _, schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
        for _ in range(5):
            instance = workload.sample_instance(schema, rng)
            jsonschema.validate(instance, schema)
            assert json.loads(workload.as_text(instance)) == instance


def test_arms_differ_only_in_the_constrained_requests():
    requests = make_requests(QUICK, 1000)
    constrained = workload.constrained_indices(len(requests))
    assert constrained == [0, 4]
    a = arms.arm_params(requests)
    b = arms.arm_params(requests, "GRAMMAR", constrained)
    c = arms.arm_params(requests, lengths={0: 5, 4: 7})
    for i, r in enumerate(requests):
        assert a[i].temperature == b[i].temperature == c[i].temperature == 0.0
        assert a[i].ignore_eos and b[i].ignore_eos and c[i].ignore_eos
        assert a[i].max_tokens == b[i].max_tokens == r.output_len
        assert b[i].grammar == ("GRAMMAR" if i in constrained else "")
        assert a[i].grammar == c[i].grammar == ""
        assert c[i].max_tokens == {0: 5, 4: 7}.get(i, r.output_len)


def test_validation_counts_completed_and_valid_outputs():
    schema = workload.W1_SCHEMA
    good = workload.as_text({"name": "x", "age": 3, "active": True, "role": "user"})
    bad = workload.as_text({"name": "x", "age": 300, "active": True, "role": "user"})
    v = arms.validate_outputs({0: good, 4: good[:10], 8: bad, 12: "{not json"},
                              {0: "stop", 4: "length", 8: "stop", 12: "stop"}, schema)
    assert (v.constrained, v.completed, v.valid) == (4, 3, 1)
    assert len(v.failures) == 3 and "#4 ended length" in v.failures[0]


def test_rounds_rotate_and_ratios_pair_rounds():
    assert arms.rotations(["A", "B", "C"], 4) == [["A", "B", "C"], ["B", "C", "A"], ["C", "A", "B"], ["A", "B", "C"]]
    runs = {"A": [arms.ArmRun("A", 2.0, 100, 400, 0.0), arms.ArmRun("A", 4.0, 100, 400, 0.01)],
            "B": [arms.ArmRun("B", 2.0, 100, 300, 0.0), arms.ArmRun("B", 3.0, 100, 300, 0.02)],
            "C": [arms.ArmRun("C", 1.5, 100, 300, 0.0), arms.ArmRun("C", 3.0, 100, 300, 0.0)]}
    s = arms.summarize_arms(runs)
    assert s["arms"]["B"]["tokens_per_s"] == pytest.approx(125.0)  # median of 150 and 100
    assert s["arms"]["B"]["ms_per_step"] == pytest.approx(25.0)
    assert s["arms"]["B"]["foreign_load_max"] == 0.02
    assert s["ratios"]["B/C"]["rounds"] == pytest.approx([0.75, 1.0])
    assert s["ratios"]["B/C"]["tokens_per_s"] == pytest.approx(125.0 / 150.0)
    assert s["ratios"]["B/A"]["ms_per_step"] == pytest.approx(25.0 / 30.0)


@pytest.mark.skipif(not is_servable(DEFAULT_MODEL_DIR), reason="models/default is not complete")
def test_walk_keeps_every_row_inside_its_grammar():
    from tokenizers import Tokenizer

    from gateway.constraints import ConstraintCompiler as GatewayCompiler
    from protos import inference_pb2 as pb
    from worker.constraints import ConstraintCompiler, mask_rows

    vocab, _ = model_limits(DEFAULT_MODEL_DIR)
    eos = workload.eos_ids(DEFAULT_MODEL_DIR)
    grammar = GatewayCompiler(DEFAULT_MODEL_DIR, vocab, eos).grammar(
        pb.StructuredOutput(json_schema=json.dumps(workload.W1_SCHEMA)))
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
    walk = workload.Walk(ConstraintCompiler(DEFAULT_MODEL_DIR, vocab, eos), grammar, workload.W1_SCHEMA, encode, rows=8)
    assert len(set(walk.pos)) > 1  # spread positions
    restarted = False
    for _ in range(40):
        logits = torch.zeros(8, vocab)
        mask_rows(logits, list(range(8)), walk.constraints)
        for j in range(8):  # each row's next document token is allowed, and not everything is
            assert torch.isfinite(logits[j, walk.docs[j][walk.pos[j]]])
            assert torch.isinf(logits[j]).any()
        walk.advance()
        restarted |= 0 in walk.pos
    assert restarted
