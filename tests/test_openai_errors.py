"""Bad input and refusals over the OpenAI HTTP API, on the real gateway in front of model-free
workers: each answered with the status an OpenAI client maps and OpenAI's error body, naming the
problem; never 422; and the gateway keeps serving. Also 409 for an id in flight, 413 for a body over
the bound, and the request log's line for each (overload and shutdown: test_openai_overload.py)."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx2 as httpx
import pytest

from bench.cluster_process import free_port
from cluster_harness import SERVED_MAX_POSITIONS
from gateway_fake_cluster import FakeCluster

pytestmark = pytest.mark.timeout(300)
MODEL = "llama"
MAX_BODY = 64 * 1024
MAX_PROMPT_CHARS = 32 * 1024  # within MAX_BODY, so a body can pass it
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    gateway = {"http_port": free_port(), "max_body_bytes": MAX_BODY, "max_n": 4, "max_stop_strings": 2,
               "max_prompt_chars": MAX_PROMPT_CHARS}
    with FakeCluster(served_checkpoint, step_ms=5, sections={"gateway": gateway}) as c:
        yield c


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster.http_port}", timeout=30) as client:
        yield client


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BAD_BODIES = [
    # (path, body, status, what the message names)
    ("/v1/completions", completion(prompt=5), 400, "prompt"),
    ("/v1/completions", completion(max_tokens="5"), 400, "max_tokens"),
    ("/v1/completions", completion(stream="yes"), 400, "stream"),
    ("/v1/completions", completion(frobnicate=1), 400, "frobnicate"),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", completion(model="gpt-4"), 404, "gpt-4"),
    ("/v1/completions", completion(n=5), 400, "max_n"),
    ("/v1/completions", completion(logprobs=6), 400, "logprobs"),
    ("/v1/completions", completion(logprobs=1, echo=True, prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("/v1/completions", completion(prompt=""), 400, "empty"),
    ("/v1/completions", completion(prompt=[]), 400, "prompt"),
    ("/v1/completions", completion(prompt=[1, 99999]), 400, "vocabulary"),
    ("/v1/completions", completion(prompt=[-1]), 400, "prompt"),
    ("/v1/completions", completion(max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", completion(max_tokens=SERVED_MAX_POSITIONS + 1), 400, "context"),
    ("/v1/completions", completion(prompt="x " * (SERVED_MAX_POSITIONS + 1)), 400, "context"),
    ("/v1/completions", completion(temperature=-1), 400, "temperature"),
    ("/v1/completions", completion(top_p=1.5), 400, "top_p"),
    ("/v1/completions", completion(top_k=-2), 400, "top_k"),
    ("/v1/completions", completion(seed=-2**63 - 1), 400, "seed"),
    ("/v1/completions", completion(presence_penalty=3), 400, "presence_penalty"),
    ("/v1/completions", completion(stop=["a", "b", "c"]), 400, "max_stop_strings"),
    ("/v1/completions", completion(stop=[""]), 400, "stop"),
    ("/v1/completions", completion(stop_token_ids=[100000]), 400, "vocabulary"),
    ("/v1/completions", completion(logit_bias={"x": 1}), 400, "logit_bias"),
    ("/v1/completions", completion(logit_bias={"5": 101}), 400, "logit_bias"),
    ("/v1/completions", completion(logit_bias={"99999": 1}), 400, "vocabulary"),
    ("/v1/completions", completion(min_tokens=10), 400, "min_tokens"),
    ("/v1/completions", completion(stream_options={"include_usage": True}), 400, "stream_options"),
    ("/v1/completions", completion(timeout=-1), 400, "timeout"),
    ("/v1/completions", completion(user="u" * 257), 400, "user"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "critic", "content": "x"}]), 400, "role"),
    ("/v1/chat/completions", chat(messages=[{"role": "tool", "content": "x"}]), 400, "tool_call_id"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]), 400,
     "tool_call_id"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}]), 400,
     "tool_calls"),
    ("/v1/chat/completions", chat(messages=[{"role": "assistant", "tool_calls": [
        {**TOOL_CALL, "function": {"name": "f", "arguments": "{oops"}}]}]), 400, "arguments"),
    ("/v1/chat/completions", chat(messages=[{"role": "assistant", "content": None}]), 400, "tool_calls"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "type"),
    ("/v1/chat/completions", chat(messages=[{"role": "user"}]), 400, "content"),
    ("/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(max_tokens=4, max_completion_tokens=4), 400, "max_completion_tokens"),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), 400, "tools"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": ""}}]), 400, "function.name"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), 400,
     "function.name"),
    ("/v1/completions", completion(prompt=["a", ""]), 400, "prompt[1]"),
    # A call's arguments are a JSON object, so a function's parameters schema is one (OpenAI's rule).
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "integer"}}}]), 400, "tools.0.function.parameters"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "audio": {"id": "a1"}}]), 400,
     "messages.0.audio"),
    # A tool's dangling reference is named where the body has it, whichever tool the choice picks.
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "ok"}}, {
        "type": "function", "function": {"name": "bad", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}],
        tool_choice={"type": "function", "function": {"name": "bad"}}), 400,
     "tools[1].function.parameters#/$defs/Missing"),
    # A tool whose schema llguidance refuses without naming a place in it is named by its index.
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "ok"}}, {
        "type": "function", "function": {"name": "bad", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "format": "bogus"}}}}}],
        tool_choice="required"), 400, "tools[1].function.parameters cannot be enforced: Unknown format"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "bogus"}}}}}, {
        "type": "function", "function": {"name": "bad2", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}],
        tool_choice={"type": "function", "function": {"name": "bad2"}}), 400, "tools[1].function.parameters cannot"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs cannot set the template's own messages"),
    ("/v1/chat/completions", chat(continue_final_message=True), 400, "takes add_generation_prompt: false"),
    ("/v1/chat/completions", chat(continue_final_message=True, add_generation_prompt=False, messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]), 400, "needs a last message with text"),
    # A constraint admission refuses is named by the body field it came from, not the gRPC one.
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}), 400, "response_format.json_schema.schema cannot"),
    ("/v1/completions", completion(structured_outputs={"regex": "(unclosed"}), 400, "structured_outputs.regex cannot"),
]


@pytest.mark.parametrize("path,body,status,named", BAD_BODIES,
                         ids=[f"{p.split('/')[-1]}-{'-'.join(map(str, b))[:60]}-{i}"
                              for i, (p, b, _, _) in enumerate(BAD_BODIES)])
def test_bad_input_gets_its_status_and_an_openai_error_body(http, path, body, status, named):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS
    assert named in error["message"] or named == error["param"], error


def test_malformed_json_and_unknown_routes(http):
    r = http.post("/v1/completions", content=b'{"model": "llama", "prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "no body" in r.json()["error"]["message"], r.text
    # A JSON body sent as a form (curl -d without a content-type) is not taken for JSON.
    r = http.post("/v1/completions", content=json.dumps(completion()).encode(),
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "content-type: application/json" in r.json()["error"]["message"], r.text
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_KEYS
    r = http.get("/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == ERROR_KEYS
    r = http.post("/v1/completions", json=completion(), headers={"x-request-id": "bad id with spaces"})
    assert r.status_code == 400 and "request_id" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json=completion(), headers={"x-request-timeout": "soon"})
    assert r.status_code == 400 and "x-request-timeout" in r.json()["error"]["message"]


def test_body_over_the_bound_is_413_by_length_and_when_chunked(http):
    big = completion(prompt="x" * MAX_BODY)
    r = http.post("/v1/completions", json=big)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]

    def chunks():
        payload = httpx.Request("POST", "/", json=big).content
        for i in range(0, len(payload), 4096):
            yield payload[i:i + 4096]

    assert r.json()["error"]["code"] == "body_too_large"
    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and set(r.json()["error"]) == ERROR_KEYS
    assert r.json()["error"]["code"] == "body_too_large" and "max_body_bytes" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json=completion()).status_code == 200


def running(http, cluster, request_id: str, n: int = 1) -> threading.Thread:
    """The thread of a long completion under `request_id`, running on the worker once this returns."""
    thread = threading.Thread(target=http.post, args=("/v1/completions",),
                              kwargs=dict(json=completion(max_tokens=200, n=n), headers={"x-request-id": request_id}))
    thread.start()
    deadline = time.monotonic() + 10
    while cluster.status().workers[0].num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread


@pytest.mark.parametrize("first_n", [1, 2])  # n = 2 runs as "twice-0" and "twice-1": "twice" is taken too
def test_a_duplicate_request_id_in_flight_is_409(http, cluster, first_n):
    thread = running(http, cluster, "twice", first_n)
    for n in (1, 2):
        r = http.post("/v1/completions", json=completion(n=n), headers={"x-request-id": "twice"})
        assert r.status_code == 409 and "already in flight" in r.json()["error"]["message"], (first_n, n, r.text)
        assert r.headers["x-should-retry"] == "false"  # the openai client would retry into the same refusal
    thread.join(30)
    assert not thread.is_alive()


def test_an_id_taken_by_one_of_the_sequences_names_the_clients_own_id(http, cluster):
    thread = running(http, cluster, "job-0")
    # n = 2 runs as "job-0" and "job-1": the first is the running request's id.
    r = http.post("/v1/completions", json=completion(n=2), headers={"x-request-id": "job"})
    message = r.json()["error"]["message"]
    assert r.status_code == 409 and message.startswith("request_id 'job' ") and "'job-0'" in message, r.text
    assert "one of its sequences" in message and "already in flight" in message
    thread.join(30)
    assert not thread.is_alive()


def nested(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth


@pytest.mark.parametrize("depth", [200, 900, 960, 1200, 2000])
def test_json_nested_too_deeply_is_400_naming_its_field(http, cluster, depth):
    # However deep, wherever it fails (llguidance, the conversion's walks, or the body's parse
    # already), the field is named and nothing is a 500. llguidance checks the tools' call schema
    # as one, and names only `tools`.
    bodies = [("/v1/chat/completions", "response_format.json_schema.schema", '{"model": "llama", "messages": '
               '[{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": '
               '{"name": "x", "schema": ' + nested(depth) + "}}}"),
              ("/v1/completions", "structured_outputs.json", '{"model": "llama", "prompt": "x", '
               '"structured_outputs": {"json": ' + nested(depth) + "}}"),
              ("/v1/chat/completions", "tools[1].function.parameters", '{"model": "llama", "messages": '
               '[{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [' + json.dumps(WEATHER)
               + ', {"type": "function", "function": {"name": "g", "parameters": {"type": "object", '
               '"properties": {"a": ' + nested(depth) + "}}}}]}")]
    for path, field, body in bodies:
        r = http.post(path, content=body.encode(), headers={"content-type": "application/json",
                                                            "x-request-id": f"deep-{depth}"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] in (field, field.split("[")[0]), (depth, r.text)
        assert error["message"].startswith(f"{error['param']} nests too deeply"), (depth, r.text)
    records = [r for r in cluster.request_records() if r["request_id"] == f"deep-{depth}"]
    assert [r["status_code"] for r in records] == ["INVALID_ARGUMENT"] * len(bodies), records


def test_a_body_nested_too_deeply_to_parse_is_400_saying_so(http):
    r = http.post("/v1/completions", content=b'{"model": "llama", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "nests too deeply" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=b"[" * 5000 + b"]" * 5000, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the body nests too deeply"), r.text


def test_refusals_are_in_the_request_log(http, cluster):
    http.post("/v1/completions", json=completion(temperature=-1), headers={"x-request-id": "logged-refusal"})
    deadline = time.monotonic() + 5
    while not (records := [r for r in cluster.request_records() if r["request_id"] == "logged-refusal"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert records[0]["status_code"] == "INVALID_ARGUMENT" and "temperature" in records[0]["error"]


def test_conversion_edge_cases_are_400_not_500(http):
    for key in ("²", "١٢"):
        r = http.post("/v1/completions", json=completion(logit_bias={key: 1}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = http.post("/v1/completions", json=completion(logit_bias={"12": 1, "0012": 2}))
    assert r.status_code == 400 and "twice" in r.json()["error"]["message"]
    for body in (b'{"model": "llama", "prompt": "\\ud800", "max_tokens": 2}',
                 b'{"model": "llama", "messages": [{"role": "user", "content": "a\\udfff"}], "max_tokens": 2}',
                 b'{"model": "llama", "prompt": "x", "stop": ["\\ud800"], "max_tokens": 2}'):
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    # A lone surrogate where the error message echoes it (the model's name) is written as an escape,
    # not a failed encoding (500); in a field's name it is refused as the body's bad text.
    r = http.post("/v1/completions", content=b'{"model": "\\ud800", "prompt": "x"}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 404 and "\\ud800" in r.json()["error"]["message"], r.text
    r = http.post("/v1/completions", content=b'{"model": "llama", "prompt": "x", "a\\ud800": 1}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS, r.text


def test_openai_nullable_fields_sent_as_null_take_their_defaults(http):
    r = http.post("/v1/chat/completions", json=chat(n=None, stream=None, logprobs=None, stream_options=None))
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["logprobs"] is None and choice["message"]["content"] is not None
    r = http.post("/v1/completions", json=completion(n=None, stream=None, echo=None))
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


def test_a_negative_seed_is_taken_as_openai_takes_any_int64(http):
    def sampled(seed: int) -> list[int]:
        r = http.post("/v1/completions", json=completion(seed=seed, temperature=1.0, max_tokens=12,
                                                         return_token_ids=True))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    assert sampled(-1) == sampled(-1)
    assert sampled(-2**63) == sampled(-2**63)


def test_admission_refusals_name_their_field_as_param(http):
    for fields, param in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                          (dict(min_tokens=10), "min_tokens"),
                          (dict(structured_outputs={"regex": "(unclosed"}), "structured_outputs.regex")):
        r = http.post("/v1/completions", json=completion(**fields))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    for fields, param in ((dict(response_format=schema), "response_format.json_schema.schema"),
                          # a chat has no prompt field: its prompt is its rendered messages
                          (dict(messages=[{"role": "user", "content": "x " * (SERVED_MAX_POSITIONS + 1)}]),
                           "messages")):
        r = http.post("/v1/chat/completions", json=chat(**fields))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # Over max_prompt_chars by its tools: named as the body has them (the gRPC field is tools_json).
    tools = [{**WEATHER, "function": {**WEATHER["function"], "description": "d" * MAX_PROMPT_CHARS}}]
    r = http.post("/v1/chat/completions", json=chat(tools=tools, tool_choice="none"))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "tools", r.text
    assert error["message"].startswith("tools and messages are") and "max_prompt_chars" in error["message"]


def test_http_layer_refusals_are_logged_and_counted(http, cluster):
    from gateway_fake_cluster import metric
    before = metric(cluster.metrics(), "inference_request_rejections_total", reason="not_found")
    for request_id, path, body in (("log-404", "/v1/completions", completion(model="other")),
                                   ("log-400", "/v1/chat/completions", chat(frobnicate=1)),
                                   ("log-413", "/v1/completions", completion(prompt="x" * MAX_BODY))):
        assert http.post(path, json=body, headers={"x-request-id": request_id}).status_code >= 400
    deadline = time.monotonic() + 5
    while True:
        records = {r["request_id"]: r for r in cluster.request_records()}
        if {"log-404", "log-400", "log-413"} <= set(records):
            break
        assert time.monotonic() < deadline, sorted(records)
        time.sleep(0.05)
    assert records["log-404"]["status_code"] == "NOT_FOUND"
    assert records["log-400"]["status_code"] == "INVALID_ARGUMENT" and "frobnicate" in records["log-400"]["error"]
    assert records["log-413"]["status_code"] == "RESOURCE_EXHAUSTED"
    after = metric(cluster.metrics(), "inference_request_rejections_total", reason="not_found")
    assert after == before + 1


def test_a_client_gone_while_sending_its_body_is_cancelled_not_a_bad_request(cluster):
    from gateway_fake_cluster import metric
    before = {reason: metric(cluster.metrics(), "inference_request_rejections_total", reason=reason)
              for reason in ("cancelled", "invalid_argument")}
    body = json.dumps(completion(prompt="x" * 4000)).encode()
    with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=10) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                    b"x-request-id: half-a-body\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                    + body[: len(body) // 2])
    deadline = time.monotonic() + 10
    while not (records := [r for r in cluster.request_records() if r["request_id"] == "half-a-body"]):
        assert time.monotonic() < deadline, "no request-log line for the abandoned body"
        time.sleep(0.05)
    assert [r["status_code"] for r in records] == ["CANCELLED"]
    after = {reason: metric(cluster.metrics(), "inference_request_rejections_total", reason=reason)
             for reason in before}
    assert after == {"cancelled": before["cancelled"] + 1, "invalid_argument": before["invalid_argument"]}


def test_n_choices_answer_under_the_clients_request_id(http):
    r = http.post("/v1/completions", json=completion(n=2), headers={"x-request-id": "both-choices"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "both-choices" == r.json()["id"]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    long_id = "i" * 128
    r = http.post("/v1/completions", json=completion(n=2), headers={"x-request-id": long_id})
    assert r.status_code == 200 and r.json()["id"] == long_id
