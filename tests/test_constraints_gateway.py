"""Structured output, the gateway's half: each kind of constraint becomes an llguidance grammar,
and what llguidance cannot enforce is refused with a message naming it, over gRPC and HTTP. JSON
a request carries (a schema, tools, tool calls) nested too deeply is refused naming its field."""
from __future__ import annotations

import json

import pytest

from gateway.constraints import ConstraintCompiler, ConstraintError
from gateway.openai_requests import BadRequest, chat_request, completion_requests
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from protos import inference_pb2 as pb
from shared.config import GatewayConfig


@pytest.fixture(scope="module")
def compiler(served_checkpoint, tokenizer):
    return ConstraintCompiler(served_checkpoint, tokenizer.vocab_size, tokenizer.special.eos_ids)


GOOD = [
    pb.StructuredOutput(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    pb.StructuredOutput(json_schema=json.dumps({"$defs": {"x": {"type": "string", "maxLength": 4}},
                                                "type": "array", "items": {"$ref": "#/$defs/x"}})),
    pb.StructuredOutput(json_object=True),
    pb.StructuredOutput(regex="[a-z]{2,5}"),
    pb.StructuredOutput(grammar='start: "ab"+'),
    pb.StructuredOutput(choice=pb.Choices(choices=["yes", 'say "no"'])),
]


def nested_schema(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth


BAD = [
    (pb.StructuredOutput(json_schema="{not json"), "not valid JSON"),
    # Deeper than llguidance's JSON parser follows, and than Python's (a RecursionError before).
    (pb.StructuredOutput(json_schema=nested_schema(200)), "nests too deeply to be enforced"),
    (pb.StructuredOutput(json_schema=nested_schema(1200)), "nests too deeply"),
    (pb.StructuredOutput(json_schema="[1, 2]"), "must be a JSON object"),
    (pb.StructuredOutput(json_schema=json.dumps({"not": {"type": "string"}})), "not"),
    (pb.StructuredOutput(json_schema=json.dumps({"type": "array", "uniqueItems": True})), "uniqueItems"),
    (pb.StructuredOutput(json_schema=json.dumps({"type": "string", "format": "zipcode"})), "zipcode"),
    (pb.StructuredOutput(regex="(unclosed"), "unclosed"),
    (pb.StructuredOutput(grammar="start: missing_rule"), "missing_rule"),
    (pb.StructuredOutput(choice=pb.Choices(choices=[])), "at least one"),
]


@pytest.mark.parametrize("constraint", GOOD, ids=[c.WhichOneof("kind") + str(i) for i, c in enumerate(GOOD)])
def test_each_kind_compiles(compiler, constraint):
    import llguidance
    matcher = llguidance.LLMatcher(compiler.tokenizer, compiler.grammar(constraint))
    assert not matcher.is_error() and not matcher.is_accepting()  # something must still be written


@pytest.mark.parametrize("constraint,named", BAD, ids=[n for _, n in BAD])
def test_what_cannot_be_enforced_is_refused_naming_it(compiler, constraint, named):
    with pytest.raises(ConstraintError) as e:
        compiler.grammar(constraint)
    assert named in str(e.value) and constraint.WhichOneof("kind") in str(e.value)


@pytest.mark.parametrize("field", ["structured_output.json_schema", "tools_json", "messages[1].tool_calls",
                                   "messages[1].tool_calls[0].function.arguments"])
def test_json_nested_too_deeply_is_invalid_argument_naming_its_field(compiler, tokenizer, field):
    from gateway.validation import InvalidRequest, validate

    deep = "[" * 5000 + "]" * 5000
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x"),
                                           pb.ChatMessage(role="assistant", tool_calls_json=json.dumps(calls))])
    if field == "structured_output.json_schema":
        request.sampling.structured_output.json_schema = deep
    elif field == "tools_json":
        request.tools_json = deep
    elif field == "messages[1].tool_calls":
        request.messages[1].tool_calls_json = deep
    else:
        calls[0]["function"]["arguments"] = deep
        request.messages[1].tool_calls_json = json.dumps(calls)
    with pytest.raises(InvalidRequest) as e:
        validate(request, tokenizer, 512, 4, compiler)
    assert e.value.message.startswith(f"{field} nests too deeply"), e.value.message


def chat_body(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 **fields})


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}


def test_openai_forms_map_to_the_constraint():
    limits = GatewayConfig()
    request, _ = chat_request(chat_body(response_format={"type": "json_object"}), limits)
    assert request.sampling.structured_output.json_object
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    request, _ = chat_request(chat_body(response_format={"type": "json_schema",
                                                         "json_schema": {"name": "s", "schema": schema}}), limits)
    assert json.loads(request.sampling.structured_output.json_schema) == schema
    [request], _ = completion_requests(CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}), limits)
    assert list(request.sampling.structured_output.choice.choices) == ["a", "b"]
    [request], _ = completion_requests(CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "structured_outputs": {"regex": "a+"}}), limits)
    assert request.sampling.structured_output.regex == "a+"
    request, _ = chat_request(chat_body(response_format={"type": "text"}), limits)
    assert not request.sampling.HasField("structured_output")


def test_tool_choice_constrains_to_calls_of_the_named_or_any_tool():
    limits = GatewayConfig()
    request, presentation = chat_request(chat_body(tools=[WEATHER, TIME], tool_choice="required"), limits)
    schema = json.loads(request.sampling.structured_output.json_schema)
    assert presentation.tool_calls and schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["weather", "time"]
    request, _ = chat_request(chat_body(tools=[WEATHER, TIME],
                                        tool_choice={"type": "function", "function": {"name": "time"}}), limits)
    schema = json.loads(request.sampling.structured_output.json_schema)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["const"] == "time"
    request, presentation = chat_request(chat_body(tools=[WEATHER], tool_choice="none"), limits)
    assert not request.sampling.HasField("structured_output") and not presentation.tool_calls


def test_tools_whose_parameters_refer_to_their_own_definitions_are_enforced(compiler):
    """pydantic writes nested models as `$defs` with "#/$defs/..." references (what
    openai.pydantic_function_tool sends): inside the call schema they must still resolve, and two
    tools' definitions of one name must not meet."""
    import jsonschema
    import llguidance
    import openai
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: int

    class Route(BaseModel):
        start: Point
        end: Point

    def tool(name, inner):
        return {"type": "function", "function": {"name": name, "parameters": {
            "$defs": {"Inner": inner}, "type": "object", "properties": {"inner": {"$ref": "#/$defs/Inner"}},
            "required": ["inner"], "additionalProperties": False}}}

    tools = [tool("a", {"type": "integer"}), tool("b", {"type": "string", "maxLength": 3}),
             openai.pydantic_function_tool(Route)]
    request, _ = chat_request(chat_body(tools=tools, tool_choice="required"), GatewayConfig())
    schema = json.loads(request.sampling.structured_output.json_schema)
    jsonschema.validate([{"name": "a", "arguments": {"inner": 1}}, {"name": "b", "arguments": {"inner": "abc"}},
                         {"name": "Route", "arguments": {"start": {"x": 1, "y": 2}, "end": {"x": 3, "y": 4}}}],
                        schema)
    for wrong in ({"name": "a", "arguments": {"inner": "abc"}}, {"name": "b", "arguments": {"inner": 1}},
                  {"name": "Route", "arguments": {"start": {"x": 1}, "end": {"x": 3, "y": 4}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([wrong], schema)
    matcher = llguidance.LLMatcher(compiler.tokenizer, compiler.grammar(request.sampling.structured_output))
    assert not matcher.is_error()
    # Parameters with no references of their own stay in place.
    request, _ = chat_request(chat_body(tools=[WEATHER], tool_choice="required"), GatewayConfig())
    schema = json.loads(request.sampling.structured_output.json_schema)
    assert schema["items"]["properties"]["arguments"] == WEATHER["function"]["parameters"] and "$defs" not in schema


@pytest.mark.parametrize("fields,param", [
    (dict(tools=[WEATHER]), "tool_choice"),  # auto, the default with tools
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "tools"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "structured_outputs"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
])
def test_contradictory_or_unsupported_tool_and_format_requests_are_400(fields, param):
    with pytest.raises(BadRequest) as e:
        chat_request(chat_body(**fields), GatewayConfig())
    assert e.value.param == param


def test_an_object_that_names_its_properties_is_closed_to_other_keys(compiler):
    """As vLLM's default engine reads a schema: keys nobody declared are not written, unless the
    schema allows them; an object that declares no properties stays open."""
    import llguidance

    def accepts(schema: dict, text: str) -> bool:
        matcher = llguidance.LLMatcher(compiler.tokenizer, compiler.grammar(pb.StructuredOutput(
            json_schema=json.dumps(schema))))
        ids = compiler.tokenizer.tokenize_str(text)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    inner = {"type": "object", "properties": {"b": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "n": inner}, "required": ["a"],
              "$defs": {"unused": inner}}
    assert accepts(schema, '{"a": 1}') and accepts(schema, '{"a": 1, "n": {"b": 2}}')
    assert not accepts(schema, '{"a": 1, "c": 2}') and not accepts(schema, '{"a": 1, "n": {"b": 2, "c": 3}}')
    assert accepts({**schema, "additionalProperties": True}, '{"a": 1, "c": 2}')
    assert accepts({**schema, "additionalProperties": {"type": "integer"}}, '{"a": 1, "c": 2}')
    assert accepts({"type": "object"}, '{"c": 2}')
    assert "additionalProperties" not in schema and "additionalProperties" not in inner  # the client's, untouched
