"""The OpenAI API's request and response bodies as pydantic models: what the HTTP front door accepts
and returns, and so the OpenAPI schema it publishes at /openapi.json.

Requests are strict (a string where a number belongs is an error, not a conversion) and refuse
fields they do not know, so a typo or an unsupported option is a 400 naming it instead of being
silently ignored. Beside OpenAI's own fields, the body extensions vLLM accepts (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, priority, min_tokens, return_token_ids,
truncate_prompt_tokens, prompt_logprobs), a request-level `timeout` in seconds, and `speculative_ngram_k`
(prompt lookup).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # what OpenAI accepts as a tool's name


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


def _null_takes_default(*names: str):
    """OpenAI's nullable fields with a default (n, stream, echo, ...): null means the default, as
    OpenAI and vLLM read them, so a client that writes every field out is served alike."""
    def default(cls, value, info: ValidationInfo):
        return cls.model_fields[info.field_name].default if value is None else value
    return field_validator(*names, mode="after")(classmethod(default))


class StreamOptions(_Request):
    include_usage: bool | None = False
    null_usage_flag = _null_takes_default("include_usage")


class _Sampling(_Request):
    """Fields both endpoints take."""
    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    min_tokens: int = 0
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = None
    timeout: float | None = Field(None, description="seconds; the request ends 504 past it, like a gRPC deadline")
    speculative_ngram_k: int | None = Field(None, description="speculative decoding by prompt lookup: up to this "
                                            "many draft tokens a step (0 = off; unset = the server's default)")
    # OpenAI's fields with nothing to do here: nothing is stored, there is one service tier, and a
    # prompt_cache_key is a session as `user` is (the cache-aware router keeps it on one worker).
    store: bool | None = Field(None, description="taken; this server stores nothing")
    metadata: dict[str, str] | None = Field(None, description="taken; this server stores nothing")
    service_tier: str | None = Field(None, description="taken; there is one tier")
    safety_identifier: str | None = Field(None, description="taken")
    prompt_cache_key: str | None = Field(None, description="the request's session, as `user` (cache-aware routing)")
    skip_special_tokens: bool = Field(True, description="false: special tokens' text is written into the output")
    include_stop_str_in_output: bool = Field(False, description="the text keeps the stop string, stop token or EOS "
                                             "that ended it")
    prompt_logprobs: int | None = Field(None, description="vLLM's: the prompt's log-probabilities with this many "
                                        "(0..20) alternatives per token; not with stream")
    null_n_stream = _null_takes_default("n", "stream")


# OpenAI's reasoning efforts.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class JsonSchemaFormat(_Request):
    name: str
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's body extension: exactly one of these."""
    json_: Union[dict, str, None] = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = Field(None, description="a Lark grammar in llguidance's dialect")
    choice: list[str] | None = None


class _Constrained(_Sampling):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_Constrained):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    suffix: None = Field(None, description="only null: no insertion after the output")
    max_tokens: int | None = None
    logprobs: int | None = Field(None, description="alternatives per token, 0..5")
    echo: bool | None = False
    add_special_tokens: bool = Field(True, description="vLLM's: false encodes a text prompt without the "
                                     "tokenizer's special tokens (its BOS)")
    null_echo = _null_takes_default("echo")


class TextPart(_Request):
    type: Literal["text"]
    text: str


# An answer's message goes back into the next request's history as the openai client holds it, so
# the fields its answer (and its stream and parse helpers) add are taken and ignored: the calls'
# `index` and `parsed_arguments`, the message's `parsed` and `annotations`, and a null `audio` and
# `function_call` (neither of which this server ever answers with).
class CalledFunction(_Request):
    name: str
    arguments: str = Field(description="the call's arguments as JSON text")
    parsed_arguments: Any = Field(None, description="ignored (the openai client's parse helpers add it)")


class ToolCall(_Request):
    id: str
    type: Literal["function"]
    function: CalledFunction
    index: int | None = Field(None, description="ignored (a streamed call's position)")


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls (its content may be null)")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    refusal: str | None = Field(None, description="an assistant's refusal, as OpenAI's messages carry it (its text "
                                "when content is null)")
    reasoning: str | None = Field(None, description="an assistant's thinking, as this server answers it; given to "
                                  "the chat template as reasoning_content")
    reasoning_content: str | None = Field(None, description="the same by its older name (vLLM's, DeepSeek's)")
    annotations: list | None = Field(None, description="ignored")
    parsed: Any = Field(None, description="ignored (the openai client's parse helpers add it)")
    audio: None = Field(None, description="only null: this server answers no audio")
    function_call: None = Field(None, description="only null: the deprecated form of tool_calls")


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN, description="letters, digits, _ and -, 1-64 of them (OpenAI's rule)")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON Schema of an object: a call's arguments are one")
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict | None) -> dict | None:
        kind = (parameters or {}).get("type", "object")
        if kind != "object":
            raise ValueError(f"a function's parameters must be a JSON Schema of an object (type \"object\"), "
                             f"not {kind!r}: its arguments are a JSON object")
        return parameters


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Constrained):
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    modalities: list[Literal["text"]] | None = Field(None, description="only text")
    reasoning_effort: ReasoningEffort | None = Field(None, description="given to the chat template as "
                                                     "reasoning_effort (vLLM's way); a template that does not read "
                                                     "it thinks as it does")
    verbosity: str | None = Field(None, description="taken; the model writes as it writes")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables the chat template reads, "
                                                         "e.g. {\"enable_thinking\": false} (vLLM's)")
    add_generation_prompt: bool = Field(True, description="the template's opening of the assistant's turn (vLLM's)")
    continue_final_message: bool = Field(False, description="the output continues the last message, its turn left "
                                         "open; with add_generation_prompt false (vLLM's)")
    null_logprobs = _null_takes_default("logprobs")


# ---- responses ---------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    """vLLM's: a token's log-probability at one prompt position, its rank in the vocabulary and its text."""
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null for the first, else token id -> its entry (the prompt's
# token and the most likely alternatives).
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI's


class MessageToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
