"""OpenAI's Responses API (/v1/responses) through the real cluster with the official `openai`
client: the same generation as the chat it amounts to (text, instructions, usage), its stream as
the client's own stream helper accumulates it, function calls and their outputs sent back,
`text.format` and the client's `parse`, and what it cannot serve refused by name."""
from __future__ import annotations

import json

import httpx2 as httpx
import jsonschema
import openai
import pydantic
import pytest

from bench.cluster_process import free_port
from cluster_harness import Cluster
from protos import inference_pb2

pytestmark = pytest.mark.timeout(300)
MODEL = "llama"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=1, sections={"gateway": {"http_port": free_port()}}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="x", max_retries=0) as c:
        yield c


def test_a_response_is_the_chat_it_amounts_to(client, cluster):
    r = client.responses.create(model=MODEL, input="Once upon a time", instructions="Be brief.",
                                max_output_tokens=12, temperature=0, metadata={"k": "v"})
    chat = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}],
        max_completion_tokens=12, temperature=0)
    assert r.object == "response" and r.model == MODEL and r.metadata == {"k": "v"}
    assert r.id.startswith("resp_") and chat.id.startswith("chatcmpl-")  # OpenAI's forms
    assert r.output_text == chat.choices[0].message.content
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details and r.incomplete_details.reason) == ("max_output_tokens" if cut else None)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert any(f'"request_id":"{r.id}"' in line for line in cluster.logs("gateway").splitlines()), "one log line"


def test_its_stream_is_what_the_clients_stream_helper_accumulates(client):
    whole = client.responses.create(model=MODEL, input=[{"role": "user", "content": "The quick"}],
                                    max_output_tokens=16, temperature=0)
    with client.responses.stream(model=MODEL, input=[{"role": "user", "content": "The quick"}],
                                 max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
    final = events[-1].response  # get_final_response() reads response.completed only, not .incomplete
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_function_calls_and_their_outputs_go_back_to_the_model(client):
    # One call (a random model's list of calls may outrun any max_output_tokens), of bounded arguments.
    r = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=200, temperature=1.0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and len(calls) == len(r.output) and r.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    history = ["Weather?", *calls, *({"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                                     for c in calls)]
    follow = client.responses.create(model=MODEL, input=[{"role": "user", "content": history[0]}, *history[1:]],
                                     max_output_tokens=4, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_completion_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]},
        *({"role": "tool", "tool_call_id": c.call_id, "content": "sunny"} for c in calls)])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == chat.choices[0].message.content
    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=200,
                                 temperature=1.0, tool_choice={"type": "function", "name": "get_weather"}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and "response.function_call_arguments.done" in kinds
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_lone_surrogate_in_a_field_only_echoed_back_is_refused_before_generating(cluster):
    body = ('{"model": "llama", "input": "hi", "max_output_tokens": 2, "metadata": {"k": "\\ud800"}}').encode()
    for stream in (False, True):
        r = httpx.post(f"http://127.0.0.1:{cluster.http_port}/v1/responses", timeout=30,
                       content=body.replace(b'"hi"', b'"hi", "stream": %s' % (b"true" if stream else b"false")),
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "valid Unicode" in r.json()["error"]["message"], r.text


def test_what_openai_clients_send_by_default_is_taken(client):
    # The Agents SDK sends include=[] on every call; others send reasoning=null and the like.
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there"}]}], max_output_tokens=2,
        include=[], reasoning=None, prompt_cache_key="conversation-7", service_tier="auto",
        extra_body={"reasoning": {"effort": None}, "text": {"verbosity": "low"}, "top_logprobs": 0})
    chat = client.chat.completions.create(model=MODEL, max_completion_tokens=2, store=False, metadata={"a": "b"},
                                          messages=[{"role": "user", "content": [
                                              {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}],
                                          prompt_cache_key="conversation-7", service_tier="auto",
                                          extra_body={"skip_special_tokens": True, "add_generation_prompt": True})
    assert r.usage.input_tokens == chat.usage.prompt_tokens  # text parts joined as a chat joins them


def test_an_aborted_response_is_cancelled_not_completed(client, cluster):
    # A long string the grammar will not let end early: the answer is still running when the abort comes.
    long_text = {"format": {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 1500}}}
    stream = client.responses.create(model=MODEL, input="Once", max_output_tokens=4000, stream=True, text=long_text,
                                     extra_headers={"x-request-id": "resp-to-abort"})
    for event in stream:
        if event.type == "response.output_text.delta":
            cluster.stub.Abort(inference_pb2.AbortRequest(request_id="resp-to-abort"), timeout=5)
            break
    last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    assert last.response.output[0].status == "incomplete" and last.response.incomplete_details is None


def test_text_format_constrains_the_output_and_parse_reads_it(client):
    parsed = client.responses.parse(model=MODEL, input="Who?", text_format=Person, max_output_tokens=200,
                                    temperature=1.0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    schema = WEATHER["parameters"]
    r = client.responses.create(model=MODEL, input="Where?", max_output_tokens=200, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(model=MODEL, input="Who?", max_output_tokens=400,
                                text={"format": {"type": "json_object"}})
    assert r.text.format.type == "json_object"
    if r.status == "completed":  # an object of unbounded size may be cut by max_output_tokens
        assert isinstance(json.loads(r.output_text), dict)


@pytest.mark.parametrize("fields,error,named", [
    ({"previous_response_id": "resp_1"}, openai.BadRequestError, "previous_response_id"),
    ({"background": True}, openai.BadRequestError, "background"),
    ({"tools": [{"type": "web_search"}]}, openai.BadRequestError, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, openai.BadRequestError,
     "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, openai.BadRequestError, "needs its schema"),
    ({"tools": [{**WEATHER, "parameters": {"type": "integer"}}]}, openai.BadRequestError,
     "tools.0.parameters: Value error, a function's parameters must be a JSON Schema of an object"),
    ({"model": "other"}, openai.NotFoundError, "other"),
    ({"include": ["message.output_text.logprobs"]}, openai.BadRequestError, "include"),
    ({"reasoning": {"effort": "extreme"}}, openai.BadRequestError, "reasoning.effort"),
    ({"prompt": {"id": "pmpt_1"}}, openai.BadRequestError, "keeps no responses, conversations or prompts"),
    # Refusals of the chat it amounts to name the Responses body's fields.
    ({"max_output_tokens": 0}, openai.BadRequestError, "max_output_tokens must be >= 1"),
    ({"input": []}, openai.BadRequestError, "input"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"},
     openai.BadRequestError, "drop text.format"),
])
def test_what_it_cannot_serve_is_refused_by_name(client, fields, error, named):
    with pytest.raises(error) as refused:
        client.responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields})
    assert named in refused.value.message
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).usage.output_tokens >= 1
