"""The HTTP API against its own published schema, fuzzed by schemathesis: whatever body the
schema allows or nearly allows, the gateway answers without a server error, with a status and a
body its /openapi.json documents (so never 422), and keeps serving."""
from __future__ import annotations

import httpx2 as httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from bench.cluster_process import free_port
from gateway_fake_cluster import FakeCluster

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fake_cluster(served_checkpoint):
    # Small bounds keep every generated request short: at most 64 tokens, 1 ms a token.
    gateway = {"http_port": free_port(), "default_max_tokens": 8, "max_n": 2, "max_prompts": 4}
    with FakeCluster(served_checkpoint, step_ms=1, sections={"gateway": gateway,
                                                             "worker": {"max_model_len": 64}}) as c:
        yield c


def operations(cluster) -> list:
    api = schemathesis.openapi.from_url(f"http://127.0.0.1:{cluster.http_port}/openapi.json")
    return [result.ok() for result in api.get_all_operations()]


def check(statuses: list[int], case) -> None:
    # Each request carries a bounded deadline, so a generated long generation cannot stall the run.
    response = case.call(headers={"x-request-timeout": "5"}, timeout=30)
    # A schema-valid body may still be refused 400 for a rule no JSON schema states (a tool message
    # needs its tool_call_id, a prompt its characters within gateway.max_prompt_chars); the statuses
    # and bodies of such refusals are checked like any other.
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    statuses.append(response.status_code)
    assert response.status_code < 500 or response.status_code in (503, 504), response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_every_operation_answers_as_its_schema_says(fake_cluster):
    # schemathesis's strategies under plain hypothesis (its pytest plugin does not load under
    # this pytest): one property per operation of the published schema.
    ops = operations(fake_cluster)
    assert {op.path for op in ops} >= {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                                       "/detokenize"}
    statuses: list[int] = []
    for op in ops:
        # Bodies the schema allows, and (where there is a body to break) bodies it does not.
        for mode in GenerationMode if op.method.upper() == "POST" else [GenerationMode.POSITIVE]:
            run = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck),
                           database=None)(given(case=op.as_strategy(generation_mode=mode))(check))
            run(statuses)
    # Both kinds reached the server: some generations served, some bodies refused.
    assert 200 in statuses and 400 in statuses


def test_still_serving_after_the_fuzzing(fake_cluster):
    r = httpx.post(f"http://127.0.0.1:{fake_cluster.http_port}/v1/completions",
                   json={"model": "llama", "prompt": "Hello", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
