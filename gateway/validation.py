"""Turn a public GenerateRequest into a validated prompt and SamplingParams, or a clear error.

Every problem raises InvalidRequest with the gRPC status to return and a message that
names the field and the value; nothing here touches queues or workers. `check_sizes` is cheap
(it reads lengths only) and runs first, so no work is done on anything over a bound; `validate`
tokenizes and may be run on a pool thread (gateway/offload.py).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import grpc

from gateway.constraints import ConstraintCompiler, ConstraintError, constraint_size
from gateway.json_nesting import loads
from gateway.rate_limit import TokenCharge
from gateway.tokenizer import TEMPLATE_VARIABLES, Tokenizer, TokenizerError
from protos import inference_pb2
from shared.config import GatewayConfig
from shared.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

MAX_REQUEST_ID_LEN = 128
MAX_SESSION_ID_LEN = 256
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/@+=-]+$")


class InvalidRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class ValidatedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    num_truncated_tokens: int
    session_id: str = ""
    # What it took from the caller's tokens per minute (gateway/admission.py), None without a limit.
    charge: TokenCharge | None = None


def check_sizes(request: inference_pb2.GenerateRequest, limits: GatewayConfig) -> int:
    """Refuse a request over any of the gateway's size bounds; returns the characters the prompt
    (or the chat's messages) has, which is what tokenizing or rendering it costs."""
    num_chars = len(request.prompt)
    if num_chars > limits.max_prompt_chars:
        raise _invalid(f"the prompt is {num_chars} characters; the gateway takes at most "
                       f"{limits.max_prompt_chars} (gateway.max_prompt_chars)")
    if len(request.messages) > limits.max_chat_messages:
        raise _invalid(f"{len(request.messages)} chat messages; the gateway takes at most "
                       f"{limits.max_chat_messages} (gateway.max_chat_messages)")
    if request.messages:
        num_tools = len(request.tools_json) + len(request.chat_template_kwargs_json)
        num_chars = num_tools + sum(len(m.content) + len(m.role) + len(m.tool_calls_json) + len(m.name)
                                    + len(m.tool_call_id) + len(m.reasoning_content) for m in request.messages)
        if num_chars > limits.max_prompt_chars:
            # Named by the larger part first: the field the client would shorten.
            what = ("messages are" if not num_tools else "tools_json and messages are" if 2 * num_tools > num_chars
                    else "messages and tools_json are")
            raise _invalid(f"{what} {num_chars} characters together"
                           + (f" ({num_tools} of them tools_json)" if num_tools else "")
                           + f"; the gateway takes at most {limits.max_prompt_chars} (gateway.max_prompt_chars)")
    if len(request.session_id) > MAX_SESSION_ID_LEN:
        raise _invalid(f"session_id is {len(request.session_id)} characters; at most {MAX_SESSION_ID_LEN}")
    stops = request.sampling.stop
    if len(stops) > limits.max_stop_strings:
        raise _invalid(f"{len(stops)} stop strings; the gateway takes at most {limits.max_stop_strings} "
                       f"(gateway.max_stop_strings)")
    for i, stop in enumerate(stops):
        if len(stop) > limits.max_stop_chars:
            raise _invalid(f"stop[{i}] is {len(stop)} characters; the gateway takes at most "
                           f"{limits.max_stop_chars} per stop string (gateway.max_stop_chars)")
    if len(request.sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise _invalid(f"{len(request.sampling.stop_token_ids)} stop_token_ids; the gateway takes at most "
                       f"{limits.max_stop_token_ids} (gateway.max_stop_token_ids)")
    if request.sampling.HasField("structured_output"):
        size = constraint_size(request.sampling.structured_output)
        if size > limits.max_schema_bytes:
            raise _invalid(f"structured_output is {size} characters; the gateway takes at most "
                           f"{limits.max_schema_bytes} (gateway.max_schema_bytes)")
        num_chars += size  # checking it costs about as much as tokenizing that much
    if len(request.sampling.logit_bias) > limits.max_logit_bias:
        raise _invalid(f"logit_bias has {len(request.sampling.logit_bias)} entries; the gateway takes at most "
                       f"{limits.max_logit_bias} (gateway.max_logit_bias)")
    return num_chars


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LEN or not _REQUEST_ID.match(request_id):
        raise _invalid(f"request_id {request_id[:40]!r} must be 1-{MAX_REQUEST_ID_LEN} characters of letters, "
                       f"digits and ._:/@+=-")


def validate(request: inference_pb2.GenerateRequest, tokenizer: Tokenizer, max_model_len: int,
             default_max_tokens: int, constraints: ConstraintCompiler | None = None,
             default_room: int | None = None) -> ValidatedRequest:
    """`default_room`: the most prompt + output tokens a request that sets no max_tokens is fitted
    into (a worker's KV pool), beside the model's context."""
    prompt_ids, num_truncated = _prompt_ids(request, tokenizer, max_model_len)
    vocab = tokenizer.vocab_size
    params = _sampling(request.sampling, default_max_tokens, vocab)
    if request.sampling.HasField("structured_output"):
        if constraints is None:
            raise _invalid("structured_output is not served by this gateway")
        try:
            grammar = constraints.grammar(request.sampling.structured_output)
        except ConstraintError as e:
            raise _invalid(str(e)) from None
        params = dataclasses.replace(params, grammar=grammar)
    if not request.sampling.HasField("max_tokens"):
        # The default shrinks to fit the context; an explicit value never silently does.
        room = min(max_model_len, default_room or max_model_len)
        fitted = max(1, min(params.max_tokens, room - len(prompt_ids)))
        if fitted < params.min_tokens:
            raise _invalid(f"min_tokens ({params.min_tokens}) does not fit the model's context of {max_model_len} "
                           f"tokens after the prompt's {len(prompt_ids)}")
        params = dataclasses.replace(params, max_tokens=fitted)
    if len(prompt_ids) >= max_model_len:
        raise _context_error(len(prompt_ids), max_model_len)
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise _invalid(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                       f"{len(prompt_ids) + params.max_tokens} exceeds the model's context of {max_model_len} "
                       f"tokens")
    return ValidatedRequest(prompt_ids, params, request.priority, num_truncated, request.session_id)


def _prompt_ids(request: inference_pb2.GenerateRequest, tokenizer: Tokenizer, max_model_len: int
                ) -> tuple[list[int], int]:
    """The prompt's token ids after truncate_prompt_tokens, and how many were cut."""
    keep = request.truncate_prompt_tokens
    if len(request.prompt_token_ids) > 0 and not (request.prompt or request.messages):
        # Given ids: cut before copying or checking them (a request may carry a million), and
        # refuse an over-long prompt before reading its ids.
        num_given = len(request.prompt_token_ids)
        num_truncated = _num_cut(num_given, keep)
        if num_given - num_truncated >= max_model_len:
            raise _context_error(num_given - num_truncated, max_model_len)
        ids = list(request.prompt_token_ids[num_truncated:])
        bad = [t for t in ids if t >= tokenizer.vocab_size]
        if bad:
            raise _invalid(f"prompt_token_ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})")
        return ids, num_truncated
    ids = encoded_prompt(request, tokenizer)
    num_truncated = _num_cut(len(ids), keep)
    return ids[num_truncated:], num_truncated


def _num_cut(num_tokens: int, keep: int) -> int:
    """Leading tokens truncate_prompt_tokens=keep drops (0 keeps them all)."""
    return num_tokens - keep if keep and num_tokens > keep else 0


def _context_error(num_tokens: int, max_model_len: int) -> InvalidRequest:
    return _invalid(f"the prompt is {num_tokens} tokens, but the model's context is {max_model_len} "
                    f"tokens and at least one must be left to generate; shorten it or set truncate_prompt_tokens")


def encoded_prompt(request: inference_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    given = [name for name, present in (("prompt", request.prompt != ""),
                                         ("prompt_token_ids", len(request.prompt_token_ids) > 0),
                                         ("messages", len(request.messages) > 0)) if present]
    if len(given) > 1:
        raise _invalid(f"give exactly one of prompt, prompt_token_ids or messages; got {' and '.join(given)}")
    if not given:
        raise _invalid("the prompt is empty: give a non-empty prompt, prompt_token_ids or messages")
    for name in ("tools_json", "chat_template_kwargs_json", "omit_generation_prompt", "continue_final_message"):
        if getattr(request, name) and given[0] != "messages":
            raise _invalid(f"{name} goes with messages (the chat template renders it), not with a plain prompt")
    if request.omit_special_tokens and given[0] != "prompt":
        raise _invalid("omit_special_tokens goes with prompt (text the gateway encodes), not with "
                       f"{given[0]}")
    if given[0] == "prompt":
        ids = tokenizer.encode(request.prompt, add_special_tokens=not request.omit_special_tokens)
        if not ids:
            raise _invalid("the prompt encodes to no tokens")
        return ids
    messages = [_template_message(i, m) for i, m in enumerate(request.messages)]
    if request.continue_final_message and not messages[-1]["content"]:
        raise _invalid("continue_final_message needs a last message with text to continue")
    try:
        ids = tokenizer.encode_chat(messages, tools=_template_tools(request.tools_json),
                                    variables=_template_variables(request.chat_template_kwargs_json),
                                    add_generation_prompt=not request.omit_generation_prompt,
                                    continue_final_message=request.continue_final_message)
    except TokenizerError as e:
        raise InvalidRequest(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
    if not ids:
        raise _invalid("the chat messages render to no tokens")
    return ids


def _template_message(i: int, m: inference_pb2.ChatMessage) -> dict:
    """A chat message as chat templates read it (transformers' convention: a call's arguments an
    object, not JSON text)."""
    if m.role not in ("system", "user", "assistant", "tool"):
        raise _invalid(f"messages[{i}].role must be system, user, assistant or tool, got {m.role!r}")
    message = {"role": m.role, "content": m.content}
    if m.name:
        message["name"] = m.name
    if m.reasoning_content:
        if m.role != "assistant":
            raise _invalid(f"messages[{i}].reasoning_content: only an assistant message has thinking")
        message["reasoning_content"] = m.reasoning_content
    if m.role == "tool":
        if not m.tool_call_id:
            raise _invalid(f"messages[{i}] is a tool result: give its tool_call_id, the id of the call it answers")
        message["tool_call_id"] = m.tool_call_id
    elif m.tool_call_id:
        raise _invalid(f"messages[{i}].tool_call_id belongs to a tool message, not to a {m.role} one")
    if m.tool_calls_json:
        if m.role != "assistant":
            raise _invalid(f"messages[{i}].tool_calls: only an assistant message calls tools")
        message["tool_calls"] = _template_calls(i, m.tool_calls_json)
    return message


def _template_calls(i: int, text: str) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    calls = loads(text, where, _invalid)
    if not isinstance(calls, list) or not calls:
        raise _invalid(f"{where} must be a non-empty list of calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str) and isinstance(call.get("id", ""), str)):
            raise _invalid(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                           f"\"arguments\": JSON text}}}}")
        arguments = loads(function["arguments"], f"{where}[{j}].function.arguments", _invalid)
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _template_variables(text: str) -> dict | None:
    if not text:
        return None
    variables = loads(text, "chat_template_kwargs", _invalid)
    if not isinstance(variables, dict):
        raise _invalid("chat_template_kwargs must be a JSON object of the variables the chat template reads")
    if taken := sorted(TEMPLATE_VARIABLES & variables.keys()):
        raise _invalid(f"chat_template_kwargs cannot set the template's own {', '.join(taken)}")
    return variables


def _template_tools(text: str) -> list[dict] | None:
    if not text:
        return None
    tools = loads(text, "tools_json", _invalid)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _invalid("tools_json must be a JSON list of tools")
    return tools


def _sampling(options: inference_pb2.SamplingOptions, default_max_tokens: int, vocab: int) -> SamplingParams:
    fields = {"max_tokens": options.max_tokens if options.HasField("max_tokens") else default_max_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "presence_penalty",
                 "frequency_penalty", "speculative_ngram_k"):
        if options.HasField(name):
            fields[name] = getattr(options, name)
    if options.HasField("logprobs"):
        if options.logprobs > MAX_TOP_LOGPROBS:
            raise _invalid(f"logprobs asks for {options.logprobs} alternatives per token; at most "
                           f"{MAX_TOP_LOGPROBS}")
        fields.update(logprobs=True, top_logprobs=options.logprobs)
    if options.HasField("prompt_logprobs"):
        if options.prompt_logprobs > MAX_TOP_LOGPROBS:
            raise _invalid(f"prompt_logprobs asks for {options.prompt_logprobs} alternatives per token; at most "
                           f"{MAX_TOP_LOGPROBS}")
        fields["prompt_logprobs"] = options.prompt_logprobs
    if options.logit_bias:
        bad = sorted(t for t in options.logit_bias if t >= vocab)
        if bad:
            raise _invalid(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        fields["logit_bias"] = dict(options.logit_bias)
    fields["min_tokens"] = options.min_tokens
    if options.HasField("temperature") and options.temperature == 0:
        fields["temperature"] = 0.0
    if any(s == "" for s in options.stop):
        raise _invalid("stop strings must be non-empty")
    bad = [t for t in options.stop_token_ids if t >= vocab]
    if bad:
        raise _invalid(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    fields.update(stop=tuple(options.stop), stop_token_ids=tuple(options.stop_token_ids),
                  ignore_eos=options.ignore_eos, include_stop_str_in_output=options.include_stop_str_in_output,
                  skip_special_tokens=not options.HasField("skip_special_tokens") or options.skip_special_tokens)
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise _invalid(str(e)) from None
