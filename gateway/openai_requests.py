"""From an OpenAI request body to the gateway's own GenerateRequest (one per prompt), so the HTTP API
goes through exactly the admission the gRPC API does, and the HTTP status each outcome maps to.

Only what the OpenAI API has and the gRPC request does not (n, echo, streaming options, the
logprobs format, return_token_ids) stays here, in `Presentation`; everything that shapes the
generation travels in the GenerateRequest and is validated by gateway/validation.py.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import grpc

from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, _Constrained, _Sampling
from gateway.tool_schema import placed
from gateway.validation import MAX_SESSION_ID_LEN
from protos import inference_pb2
from shared.config import GatewayConfig
from shared.sampling_params import MAX_SEED, MAX_SPECULATIVE_NGRAM_K, MAX_TOP_LOGPROBS

# OpenAI's completions API takes up to 5 alternatives per token (its chat API 20: MAX_TOP_LOGPROBS).
MAX_COMPLETION_LOGPROBS = 5

# The status an OpenAI client library maps each outcome to (401/403 are the auth layer's).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.CANCELLED: 499,
}
ERROR_TYPE = {400: "invalid_request_error", 405: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
              499: "cancelled", 503: "service_unavailable", 504: "timeout"}


class BadRequest(Exception):
    """A body the HTTP layer itself refuses (before it reaches admission), naming the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class Presentation:
    """How the answer is shaped, beyond what the generation is."""
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # alternatives per token when log-probabilities were asked for
    return_token_ids: bool
    tool_calls: bool = False  # the output is a JSON list of calls, answered as message.tool_calls
    # The body field a constraint came from, which a refusal of it names (admission's messages
    # name the gRPC field, `structured_output.<kind>`).
    constraint_field: str = ""
    # Of tool calls' constraint: each constrained tool's index and parameters schema, checked one
    # by one to name the tool a refusal of the whole comes from (`refused_tool`).
    tool_parameters: tuple[tuple[int, str], ...] = ()
    # tool_choice "auto": the parser (gateway/tool_parsers.py) that reads calls out of the free text.
    tool_parser: str = ""
    max_calls: int | None = None  # of those: parallel_tool_calls false answers the first call only
    reasoning: bool = False  # a reasoning model's thinking is read apart (gateway/reasoning_parser.py)
    # Special tokens are written into the text, so each has its log-probability entry too.
    keep_special_tokens: bool = False
    prompt_logprobs: int | None = None  # vLLM's: the prompt's log-probabilities, with this many alternatives
    # A completion's echo with max_tokens 0 (vLLM's): the answer is the prompt alone. Its one generated token
    # (the forward that scores the prompt samples one anyway) is left out of the text, lists and usage.
    echo_only: bool = False

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt's tokens come with log-probabilities (a completion's echo with logprobs)."""
        return self.echo and self.logprobs is not None


def completion_requests(body: CompletionRequest, limits: GatewayConfig) -> tuple[list[inference_pb2.GenerateRequest],
                                                                                  Presentation]:
    prompts = _prompts(body.prompt, limits)
    echo_only = body.echo and body.max_tokens == 0  # vLLM's: the prompt echoed (and scored), nothing generated
    sampling = _sampling(body, 1 if echo_only else body.max_tokens, "max_tokens", body.logprobs, "logprobs",
                         MAX_COMPLETION_LOGPROBS)
    if body.echo and body.logprobs is not None:  # the echoed prompt's tokens have theirs too
        sampling.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
    constraint, constraint_field = _constraint(body)
    if constraint is not None:
        sampling.structured_output.CopyFrom(constraint)
    requests = []
    for prompt in prompts:
        request = inference_pb2.GenerateRequest(sampling=sampling, priority=body.priority,
                                                truncate_prompt_tokens=_truncate(body), session_id=_session(body))
        if isinstance(prompt, str):
            request.prompt, request.omit_special_tokens = prompt, not body.add_special_tokens
        else:
            if any(not 0 <= t < 2**32 for t in prompt):
                raise BadRequest("prompt token ids must be in [0, 2**32)", "prompt")
            request.prompt_token_ids.extend(prompt)
        requests.append(request)
    presentation = _presentation(body, body.echo, body.logprobs, limits, constraint_field)
    return requests, dataclasses.replace(presentation, echo_only=True) if echo_only else presentation


def chat_request(body: ChatCompletionRequest, limits: GatewayConfig, tool_parser: str | None = None,
                 reasoning: bool = False) -> tuple[inference_pb2.GenerateRequest, Presentation]:
    """`tool_parser`: the model's tool-call format, which tool_choice "auto" needs; `reasoning`: the
    model's thinking is answered apart (where the output is not constrained: a constrained answer
    is that answer)."""
    if not body.messages:
        raise BadRequest("messages must hold at least one message", "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise BadRequest("give max_completion_tokens or max_tokens, not both", "max_completion_tokens")
    limit, limit_name = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None
                         else (body.max_tokens, "max_tokens"))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request = inference_pb2.GenerateRequest(
        sampling=_sampling(body, limit, limit_name, logprobs, "top_logprobs", MAX_TOP_LOGPROBS), priority=body.priority,
        truncate_prompt_tokens=_truncate(body), session_id=_session(body),
        tools_json=json.dumps([t.model_dump(exclude_none=True) for t in body.tools]) if body.tools else "",
        chat_template_kwargs_json=_template_variables(body),
        omit_generation_prompt=not body.add_generation_prompt, continue_final_message=body.continue_final_message)
    if body.continue_final_message and body.add_generation_prompt:
        raise BadRequest("continue_final_message continues the last message, so it takes add_generation_prompt: "
                         "false (as vLLM's)", "continue_final_message")
    (constraint, constraint_field), tool_calls = _constraint(body), _tool_constraint(body, tool_parser)
    if constraint is not None and tool_calls is not None:
        raise BadRequest("tool calls already constrain the output; drop response_format / structured_outputs",
                         "tool_choice")
    if constraint or tool_calls:
        request.sampling.structured_output.CopyFrom(constraint or tool_calls)
    for i, message in enumerate(body.messages):
        content = message.content if message.content is not None else message.refusal
        if content is None and not message.tool_calls:
            raise BadRequest(f"messages[{i}].content is null; give the message's text"
                             + (" or its tool_calls" if message.role == "assistant" else ""), f"messages[{i}].content")
        if content is not None and not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        # "developer" is the newer name OpenAI gives the system role. The roles, tool_call_id and
        # the calls' arguments are checked by gateway/validation.py, for gRPC's chats too.
        request.messages.add(
            role="system" if message.role == "developer" else message.role, content=content or "",
            name=message.name or "", tool_call_id=message.tool_call_id or "",
            tool_calls_json=json.dumps([c.model_dump(include=_CALL_FIELDS) for c in message.tool_calls])
            if message.tool_calls else "", reasoning_content=message.reasoning_content or message.reasoning or "")
    presentation = _presentation(body, False, logprobs, limits, "tools" if tool_calls is not None else constraint_field)
    if reasoning and constraint is None and tool_calls is None:
        presentation = dataclasses.replace(presentation, reasoning=True)
    if tool_calls is not None:
        named = None if body.tool_choice == "required" else body.tool_choice.function.name
        parameters = tuple((i, json.dumps(t.function.parameters or {"type": "object"}))
                           for i, t in enumerate(body.tools) if named in (None, t.function.name))
        presentation = dataclasses.replace(presentation, tool_calls=True, tool_parameters=parameters)
    elif body.tools and body.tool_choice in (None, "auto") and constraint is None:
        # A constrained answer (response_format) is that answer: the tools only inform it.
        presentation = dataclasses.replace(presentation, tool_parser=tool_parser,
                                           max_calls=1 if body.parallel_tool_calls is False else None)
        if tool_parser == "hermes":  # its tags may be special tokens (Hermes 2 Pro's): kept in the text
            request.sampling.skip_special_tokens = False
            presentation = dataclasses.replace(presentation, keep_special_tokens=True)
    return request, presentation


def _template_variables(body: ChatCompletionRequest) -> str:
    """chat_template_kwargs, and reasoning_effort as a variable of its own name (unless they set it)."""
    variables = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", body.reasoning_effort)
    return json.dumps(variables) if variables else ""


def _constraint(body: _Constrained) -> tuple[inference_pb2.StructuredOutput | None, str]:
    """response_format (OpenAI's) or structured_outputs (vLLM's), as the gateway's constraint, and
    the body field it came from ("" for none)."""
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise BadRequest("give response_format or structured_outputs, not both", "structured_outputs")
    if fmt is not None and fmt.type == "json_object":
        return inference_pb2.StructuredOutput(json_object=True), "response_format"
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise BadRequest("response_format json_schema needs json_schema.schema", "response_format.json_schema")
        return (inference_pb2.StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_)),
                "response_format.json_schema.schema")
    if fmt is not None and fmt.json_schema is not None:
        raise BadRequest(f"response_format type {fmt.type!r} takes no json_schema", "response_format.json_schema")
    if so is None:
        return None, ""
    given = [name for name in ("json_", "regex", "grammar", "choice") if getattr(so, name) is not None]
    if len(given) != 1:
        raise BadRequest("structured_outputs takes exactly one of json, regex, grammar or choice",
                         "structured_outputs")
    kind = given[0]
    field = f"structured_outputs.{kind.rstrip('_')}"  # json_ is the body's "json"
    if kind == "json_":
        schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
        return inference_pb2.StructuredOutput(json_schema=schema), field
    if kind == "choice":
        return inference_pb2.StructuredOutput(choice=inference_pb2.Choices(choices=so.choice)), field
    return inference_pb2.StructuredOutput(**{kind: getattr(so, kind)}), field


def _tool_constraint(body: ChatCompletionRequest, tool_parser: str | None) -> inference_pb2.StructuredOutput | None:
    """The constraint that makes the output a list of calls to the request's tools, when its
    tool_choice asks for calls; None when the tools only inform, the model decides (auto), or there
    are none."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if choice == "none":
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise BadRequest("tools name a function twice", "tools")
    if choice == "auto":
        if tool_parser is None:
            raise BadRequest("tool_choice \"auto\" (the default where tools are given) needs a parser of the model's "
                             "tool-call format, and this server has none for this model (gateway.tool_call_parser: "
                             "its chat template names no format it reads, or parsing is off); use \"required\" or "
                             "name a function", "tool_choice")
        return None
    # Each function keeps its index among the tools: its definitions are placed under that name.
    if choice == "required":
        functions = [(i, t.function) for i, t in enumerate(body.tools)]
    else:
        functions = [(i, t.function) for i, t in enumerate(body.tools) if t.function.name == choice.function.name]
        if not functions:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
    defs: dict[str, dict] = {}
    calls = [{"type": "object", "properties": {"name": {"const": f.name},
                                               "arguments": placed(f.parameters or {"type": "object"}, i, defs)},
              "required": ["name", "arguments"], "additionalProperties": False} for i, f in functions]
    single = choice != "required" or body.parallel_tool_calls is False
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if defs:
        schema["$defs"] = defs
    if single:
        schema["maxItems"] = 1
    return inference_pb2.StructuredOutput(json_schema=json.dumps(schema))


# What of a tool call in the history reaches the chat template (the rest is the client's own).
_CALL_FIELDS = {"id": True, "type": True, "function": {"name", "arguments"}}
def _prompts(prompt, limits: GatewayConfig) -> list[str | list[int]]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise BadRequest("prompt is an empty list; give a string, a list of strings or token ids", "prompt")
    if len(prompts) > 1:
        for i, one in enumerate(prompts):
            if not one:
                raise BadRequest(f"prompt[{i}] is empty; every prompt of a list needs text or token ids", "prompt")
    if len(prompts) > limits.max_prompts:
        raise BadRequest(f"{len(prompts)} prompts in one request; the gateway takes at most {limits.max_prompts} "
                         f"(gateway.max_prompts)", "prompt")
    return prompts


def _sampling(body: _Sampling, max_tokens: int | None, max_tokens_name: str, logprobs: int | None,
              logprobs_name: str, logprobs_limit: int) -> inference_pb2.SamplingOptions:
    if body.seed is not None and not -MAX_SEED <= body.seed < MAX_SEED:
        raise BadRequest(f"seed must be a signed 64-bit integer, got {body.seed}", "seed")
    if logprobs is not None and not 0 <= logprobs <= logprobs_limit:
        raise BadRequest(f"{logprobs_name} must be in [0, {logprobs_limit}], got {logprobs}", logprobs_name)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"{max_tokens_name} must be >= 1, got {max_tokens}", max_tokens_name)
    if not 0 <= body.min_tokens < 2**31:
        raise BadRequest(f"min_tokens must be in [0, 2**31), got {body.min_tokens}", "min_tokens")
    if not -2**31 <= body.priority < 2**31:
        raise BadRequest(f"priority must be a 32-bit integer, got {body.priority}", "priority")
    options = inference_pb2.SamplingOptions(ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                                            include_stop_str_in_output=body.include_stop_str_in_output)
    if not body.skip_special_tokens:
        options.skip_special_tokens = False
    if max_tokens is not None:
        options.max_tokens = min(max_tokens, 2**31 - 1)
    if body.speculative_ngram_k is not None and not 0 <= body.speculative_ngram_k <= MAX_SPECULATIVE_NGRAM_K:
        raise BadRequest(f"speculative_ngram_k must be in [0, {MAX_SPECULATIVE_NGRAM_K}], got "
                         f"{body.speculative_ngram_k}", "speculative_ngram_k")
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "presence_penalty",
                 "frequency_penalty", "speculative_ngram_k"):
        value = getattr(body, name)
        if value is not None:
            if name == "seed":
                # OpenAI's seed is any int64; the engine's are [0, 2**63), where a negative one folds.
                value %= MAX_SEED
            if name == "top_k" and value == -1:  # vLLM's "off"
                value = 0
            if name == "top_k" and value < 0:
                raise BadRequest(f"top_k must be -1 or 0 (off) or >= 1, got {value}", "top_k")
            try:
                setattr(options, name, value)
            except ValueError:
                raise BadRequest(f"{name} = {value} is out of range", name) from None
    if logprobs is not None:
        options.logprobs = logprobs
    if body.prompt_logprobs is not None:
        if not 0 <= body.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.prompt_logprobs}",
                             "prompt_logprobs")
        options.prompt_logprobs = body.prompt_logprobs
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    options.stop.extend(stops)
    if body.stop_token_ids:
        if any(not 0 <= t < 2**32 for t in body.stop_token_ids):
            raise BadRequest("stop_token_ids must be in [0, 2**32)", "stop_token_ids")
        options.stop_token_ids.extend(body.stop_token_ids)
    for key, bias in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10 or int(key) >= 2**32:
            raise BadRequest(f"logit_bias keys are token ids; got {key[:40]!r}", "logit_bias")
        if not -100 <= bias <= 100:
            raise BadRequest(f"logit_bias[{key}] = {bias} is outside [-100, 100]", "logit_bias")
        if int(key) in options.logit_bias:
            raise BadRequest(f"logit_bias names token {int(key)} twice", "logit_bias")
        options.logit_bias[int(key)] = bias
    return options


def _session(body: _Sampling) -> str:
    """The OpenAI API's `prompt_cache_key`, else its `user`, is the request's session
    (gateway/routing.py's sticky sessions)."""
    for name in ("prompt_cache_key", "user"):
        value = getattr(body, name)
        if value is not None and len(value) > MAX_SESSION_ID_LEN:
            raise BadRequest(f"{name} is {len(value)} characters; at most {MAX_SESSION_ID_LEN}", name)
    return body.prompt_cache_key or body.user or ""


def _truncate(body: _Sampling) -> int:
    if body.truncate_prompt_tokens is not None and not 1 <= body.truncate_prompt_tokens < 2**32:
        raise BadRequest(f"truncate_prompt_tokens must be in [1, 2**32), got {body.truncate_prompt_tokens}",
                         "truncate_prompt_tokens")
    return body.truncate_prompt_tokens or 0


def _presentation(body: _Sampling, echo: bool, logprobs: int | None, limits: GatewayConfig,
                  constraint_field: str) -> Presentation:
    if not 1 <= body.n <= limits.max_n:
        raise BadRequest(f"n must be in [1, {limits.max_n}] (gateway.max_n), got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options needs stream: true", "stream_options")
    if body.stream and body.prompt_logprobs is not None:  # as vLLM: they are in the whole answer only
        raise BadRequest("prompt_logprobs are not available with stream: true", "prompt_logprobs")
    return Presentation(n=body.n, stream=body.stream,
                        include_usage=bool(body.stream_options and body.stream_options.include_usage), echo=echo,
                        logprobs=logprobs, return_token_ids=body.return_token_ids, constraint_field=constraint_field,
                        keep_special_tokens=not body.skip_special_tokens, prompt_logprobs=body.prompt_logprobs)
