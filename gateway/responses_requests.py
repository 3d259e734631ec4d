"""OpenAI's Responses API (`POST /v1/responses`), the request half: its body, and that body as the
chat request it amounts to, so a response is generated, checked and bounded exactly as a chat is.

`input` is a text (one user message) or a list of items: messages (text parts only), a model's
earlier `function_call`s and the `function_call_output`s that answer them, and its earlier
thinking (`reasoning` items, given to the chat template as the next assistant turn's
`reasoning_content`); `instructions` is a system message before them. Function tools,
`tool_choice`, `text.format` (text, json_object, json_schema), `reasoning.effort` and the sampling
fields map one to one. What needs state this server does not keep (`previous_response_id`,
`conversation`, `background`) and tools or inputs it cannot serve (built-in tools, images, files)
are refused 400 naming the field, never silently ignored.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal, Union

from pydantic import Field, ValidationError

from gateway.openai_requests import BadRequest
from gateway.openai_schema import FUNCTION_NAME_PATTERN, ChatCompletionRequest, ReasoningEffort, _Request


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = Field(None, description="ignored (an earlier answer's)")
    logprobs: list | None = Field(None, description="ignored (an earlier answer's)")


class _Item(_Request):
    """An input item; one an earlier answer gave back carries its id and status, which are taken."""
    id: str | None = Field(None, description="ignored (an earlier answer's)")
    status: str | None = Field(None, description="ignored (an earlier answer's)")


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputText]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the call's arguments as JSON text")


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningText(_Request):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = Field(None, description="only null: this server encrypts no thinking")


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, description="json_schema: the schema's name")
    schema_: dict | None = Field(None, alias="schema", description="json_schema: the JSON Schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Request):
    format: TextFormat | None = None
    verbosity: str | None = Field(None, description="taken; the model writes as it writes")


class ReasoningOptions(_Request):
    """The effort goes to the chat template as reasoning_effort; the thinking is answered whole, so a
    summary asked for is taken and not made."""
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    model: str
    input: Union[str, list[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool | None = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = Field(None, description="taken; this server keeps no responses")
    truncation: Literal["disabled"] | None = None
    timeout: float | None = Field(None, description="seconds; the request ends 504 past it")
    # What OpenAI's clients send that asks nothing of this server: an empty `include`, no
    # reasoning, no log-probabilities, a service tier, stream options; a prompt_cache_key is the
    # request's session (cache-aware routing), as `user` is.
    include: list[str] | None = Field(None, description="only empty: no extra output is served")
    reasoning: ReasoningOptions | None = None
    top_logprobs: Literal[0] | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    stream_options: dict | None = Field(None, description="taken")
    # State this server does not keep: refused by name (a 400 saying why) rather than as unknown.
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None


_STATEFUL = ("previous_response_id", "conversation", "background", "prompt")


def chat_of(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses body amounts to; BadRequest names what cannot be served."""
    for name in _STATEFUL:
        if getattr(body, name) not in (None, False):
            raise BadRequest(f"{name}: this server keeps no responses, conversations or prompts; send the whole "
                             f"input each time", name)
    if body.include:
        raise BadRequest(f"include: this server adds nothing to a response's output ({body.include[0]!r} asked)",
                         "include")
    # Only echoed back, so never encoded on their way to the model: a lone surrogate in them is found here.
    json.dumps([body.metadata, [t.description for t in body.tools or []],
                body.text.format.description if body.text and body.text.format else None],
               ensure_ascii=False).encode()
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    thinking = None  # a reasoning item's text, for the assistant turn it preceded
    for item in items:
        if isinstance(item, ReasoningItem):
            thinking = "\n".join(p.text for p in (item.content or item.summary))
            continue
        if isinstance(item, MessageItem):
            content = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # A model's text and calls of one turn: one assistant message, as it was written.
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if thinking is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = thinking
        thinking = None
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream, "user": body.user,
                              "prompt_cache_key": body.prompt_cache_key,
                              "temperature": body.temperature, "top_p": body.top_p, "timeout": body.timeout,
                              "max_completion_tokens": body.max_output_tokens,
                              "parallel_tool_calls": body.parallel_tool_calls,
                              "reasoning_effort": body.reasoning.effort if body.reasoning else None}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in body.tools]
    if isinstance(body.tool_choice, NamedFunction):
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    else:
        fields["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise BadRequest("text.format of type json_schema needs its schema", "text.format.schema")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(fields, strict=False)
    except ValidationError as e:  # a rule of the chat's fields the Responses body's did not state
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]).replace(".function.", ".")  # a tool's own fields
        raise BadRequest(f"{where}: {first['msg']}", where) from None


# A refusal of the chat a Responses body amounts to, in the Responses body's own words.
_RENAMES = ((re.compile(r"response_format\.json_schema\.schema"), "text.format.schema"),
            (re.compile(r"response_format / structured_outputs|response_format|structured_outputs"), "text.format"),
            (re.compile(r"\bmax_completion_tokens\b|\bmax_tokens\b"), "max_output_tokens"),
            (re.compile(r"\bmessages(?:\[\d+\])?\.tool_calls\[\d+\]\.function\.arguments"),
             "input (a function_call's arguments)"),
            (re.compile(r"\bmessages(?:\[\d+\])?"), "input"),
            (re.compile(r" or set truncate_prompt_tokens"), ""))


def in_responses_words(text: str | None) -> str | None:
    if text is None:
        return None
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return text
