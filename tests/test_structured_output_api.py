"""Structured output through the real cluster: the `openai` client's response_format, vLLM's
structured_outputs, tool calls (named and required, streamed and not), the gRPC StructuredOutput,
bad constraints refused before they queue, and a constrained stream resumed on another worker
after a kill -9 still valid."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import jsonschema
import openai
import pydantic
import pytest

from bench.cluster_process import free_port
from cluster_harness import Cluster
from protos import inference_pb2

pytestmark = pytest.mark.timeout(300)
MODEL = "llama"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=2, supervised=True,
                 sections={"gateway": {"http_port": free_port()}}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="x", max_retries=0) as c:
        yield c


def ask(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Who?"}], "max_tokens": 400,
            "temperature": 1.0, **fields}


def test_response_format_json_schema_and_json_object(client):
    for seed in range(4):
        r = client.chat.completions.create(**ask(seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}))
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(**ask(seed=9, response_format={"type": "json_object"}))
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random model may write a long object; it is never invalid, only unfinished
        assert r.choices[0].finish_reason == "length"


def test_structured_outputs_regex_and_choice_streamed(client):
    stream = client.completions.create(model=MODEL, prompt="Code:", max_tokens=30, temperature=1.0, seed=1,
                                       stream=True, extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert len(text) == 8 and text[3] == "-" and text[:3].isupper() and text[4:].isdigit()
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, n=3, seed=2,
                                  extra_body={"structured_outputs": {"choice": ["left", "right", "up"]}})
    assert all(c.text in ("left", "right", "up") for c in r.choices)


def test_named_and_required_tool_calls(client):
    named = client.chat.completions.create(**ask(seed=3, tools=[WEATHER, CLOCK], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(**ask(seed=4, tools=[WEATHER, CLOCK], tool_choice="required"))
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(client.chat.completions.create(**ask(seed=3, stream=True, tools=[WEATHER, CLOCK], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})))
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed] == ["get_weather"]
    assert streamed[0].function.arguments == call_arguments(named)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The client's stream helper reports each call's arguments done (it reads a finish before calls).
    with client.chat.completions.stream(**ask(seed=3, tools=[WEATHER, CLOCK], tool_choice={
            "type": "function", "function": {"name": "get_weather"}})) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [("get_weather", call_arguments(named))]


def test_a_tool_call_and_its_result_go_back_to_the_model(client, tokenizer):
    """The openai client's tool loop: the assistant's message with its calls (content null) goes
    back as it came, with the tool's result, and the model reads both. This checkpoint's template
    does not render tool calls, so the call is written into the assistant's turn as the model
    wrote it."""
    first = client.chat.completions.create(**ask(seed=3, tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    message = first.choices[0].message
    [call] = message.tool_calls
    messages = [{"role": "user", "content": "Who?"}, message,
                {"role": "tool", "tool_call_id": call.id, "content": "12 C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
    assert second.choices[0].finish_reason in ("stop", "length")
    written = json.dumps([{"name": "get_weather", "arguments": json.loads(call.function.arguments)}],
                         ensure_ascii=False)
    assert second.prompt_token_ids == tokenizer.encode_chat([
        {"role": "user", "content": "Who?"}, {"role": "assistant", "content": written},
        {"role": "tool", "content": "12 C"}])


def test_messages_of_the_clients_stream_and_parse_helpers_go_back_as_they_came(client):
    """The openai client's helpers return messages with fields of their own (`parsed`,
    `parsed_arguments`, `annotations`, a call's `index`, null `audio` and `function_call`): the
    tool loop appends them to the history as they came, and the next request takes them."""
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    fields = ask(seed=3, tools=[strict_weather], tool_choice="required", max_tokens=200)
    with client.chat.completions.stream(**fields) as stream:
        chunks = list(stream)
        streamed = stream.get_final_completion().choices[0].message
    opening = next(c for c in chunks if c.type == "chunk").chunk.choices[0].delta
    assert opening.role == "assistant" and opening.content is None  # as the whole answer's: no content
    parsed = client.chat.completions.parse(**fields).choices[0].message
    for message in (streamed, parsed):
        assert message.content is None and message.tool_calls
        history = [fields["messages"][0], message] + [{"role": "tool", "tool_call_id": call.id, "content": "12 C"}
                                                      for call in message.tool_calls]
        r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)

    answer = client.chat.completions.parse(model=MODEL, messages=fields["messages"], response_format=Person,
                                           max_tokens=60, temperature=0).choices[0].message
    assert answer.parsed is not None
    r = client.chat.completions.create(model=MODEL, messages=[*fields["messages"], answer,
                                                              {"role": "user", "content": "Another?"}], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_an_assistant_message_of_only_a_refusal_is_read_as_its_text(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": "Who?"}, {"role": "assistant", "content": None, "refusal": "I cannot say."},
        {"role": "user", "content": "Why?"}], extra_body={"return_token_ids": True})
    assert r.prompt_token_ids == tokenizer.encode_chat([
        {"role": "user", "content": "Who?"}, {"role": "assistant", "content": "I cannot say."},
        {"role": "user", "content": "Why?"}])


def call_arguments(response) -> str:
    return response.choices[0].message.tool_calls[0].function.arguments


def test_bad_constraints_are_refused_before_queueing(client, cluster):
    for fields, named in ((dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}), "uniqueItems"),
            (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "unclosed"),
            (dict(extra_body={"structured_outputs": {"grammar": "start: nothing"}}), "nothing")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**ask(**fields))
        assert named in e.value.message
    request = inference_pb2.GenerateRequest(prompt="x", sampling=inference_pb2.SamplingOptions(
        max_tokens=4, structured_output=inference_pb2.StructuredOutput(json_schema='{"not": {}}')))
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.stub.Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not" in e.value.details()


def test_grpc_constrained_stream_survives_a_worker_kill(cluster):
    long_text = {"type": "object", "properties": {"text": {"type": "string", "minLength": 300, "maxLength": 320}},
                 "required": ["text"], "additionalProperties": False}
    request = inference_pb2.GenerateRequest(prompt="Write:", sampling=inference_pb2.SamplingOptions(
        max_tokens=600, temperature=1.0, seed=11,
        structured_output=inference_pb2.StructuredOutput(json_schema=json.dumps(long_text))))
    result: dict = {}

    def run():
        text, last = "", None
        for response in cluster.stub.Generate(request, timeout=120):
            text += response.text
            last = response
            result.setdefault("worker", response.worker_id)
        result.update(text=text, last=last)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while "worker" not in result or not result["worker"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # some tokens in
    for pid in cluster.model_pids(result["worker"]):
        os.kill(pid, signal.SIGKILL)
    thread.join(120)
    last = result["last"]
    assert last.finish_reason == inference_pb2.FINISH_REASON_STOP, last
    jsonschema.validate(json.loads(result["text"]), long_text)


def test_the_cli_client_sends_constraints_sessions_and_prints_logprobs(cluster):
    import subprocess
    import sys
    from pathlib import Path
    result = subprocess.run(
        [sys.executable, "-m", "gateway.client", "Pick one", "--address", cluster.address, "--max-tokens", "8",
         "--temperature", "1.0", "--seed", "5", "--choice", "yes", "--choice", "no way", "--logprobs", "2",
         "--session", "cli-session", "-v"],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("yes", "no way")
    lines = [line.split("\t") for line in result.stderr.splitlines() if line.count("\t") == 2]
    assert lines and all(float(lp) <= 0 and len(alts.split()) == 2 for _, lp, alts in lines)
    bad = subprocess.run([sys.executable, "-m", "gateway.client", "x", "--address", cluster.address,
                          "--regex", "(unclosed"], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "unclosed" in bad.stderr
