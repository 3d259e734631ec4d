"""The OpenAI API's answers: completion and chat bodies, their streamed chunks, usage and
log-probabilities, built from the gateway's stream events.

Streamed chunks are plain dicts serialised once (a chunk per token is the hot path); their shape
is the one openai_schema.py declares for whole responses, and the tests parse them with the
official client. Each token's text in log-probabilities is its own decode (cached per id), so
`tokens` joined may differ from `text` where a character spans tokens, as in OpenAI's API.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from gateway.openai_requests import Presentation
from gateway.prompt_logprobs import echoed_logprobs, joined, top_by_text, vllm_prompt_logprobs
from gateway.reasoning_parser import CLOSE, ThinkReader, prompt_opens_thinking
from gateway.streams import RequestState, StreamEvent
from gateway.token_texts import TokenTexts
from gateway.tool_parsers import CallReader, Read, call_id, call_reader
from shared.wire import TokenLogprob


@dataclass
class Choice:
    """One sequence's answer as it accumulates."""
    index: int
    state: RequestState
    prefix: str = ""  # the echoed prompt
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    logprob_offset: int = -1  # where the next token's text_offset counts from (streamed answers)
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked for: one per prompt token after the first

    def add(self, events: list[StreamEvent]) -> tuple[str, list[int], list[TokenLogprob]]:
        """Take a batch of events; returns what it added (text, token ids, log-probabilities)."""
        text = "".join(e.text for e in events)
        ids = [t for e in events for t in e.token_ids]
        logprobs = [lp for e in events for lp in e.logprobs]
        if events[0].prompt_logprobs is not None:  # only ever on a choice's first event
            self.prompt_logprobs = events[0].prompt_logprobs
        self.text += text
        self.token_ids += ids
        self.logprobs += logprobs
        if events[-1].finish_reason is not None:
            self.finish_reason = events[-1].finish_reason
        return text, ids, logprobs


def _finish(c: Choice, called: bool) -> str | None:
    """A chat choice's finish reason: an answer that ended by itself with calls ended to call them."""
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


def usage(choices: list[Choice], n: int, reasoning_tokens: int | None = None) -> dict:
    """Prompt tokens count once per prompt (its n choices share it), completion tokens per choice
    (of them, where thinking is read, `reasoning_tokens` the thinking's)."""
    firsts = [c for c in choices if c.index % n == 0]
    prompt = sum(len(c.state.prompt_ids) for c in firsts)
    completion = sum(len(c.state.output_ids) for c in choices)
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.state.num_cached_tokens for c in firsts)}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def completion_logprobs(logprobs: list[TokenLogprob], texts: TokenTexts, offset: int) -> dict:
    """The legacy completions format: parallel lists, `text_offset` counted from `offset` over each
    token's own text (as OpenAI's: where a character spans tokens, those texts are U+FFFD and the
    offsets run ahead of the joined text)."""
    logprobs = [e for e in logprobs if texts.shown(e.token_id)]
    tokens, offsets = [], []
    for entry in logprobs:
        offsets.append(offset)
        token = texts(entry.token_id)
        tokens.append(token)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in logprobs],
            "top_logprobs": [top_by_text(e, texts) for e in logprobs], "text_offset": offsets}


def chat_logprobs(logprobs: list[TokenLogprob], texts: TokenTexts) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": texts(token_id), "logprob": logprob, "bytes": texts.bytes_of(token_id)}

    return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, p) for t, p in e.top]}
                        for e in logprobs if texts.shown(e.token_id)]}


class ResponseBuilder:
    """Bodies and chunks of one request's answer (one id, one creation time, one model name)."""

    def __init__(self, request_id: str, model: str, chat: bool, presentation: Presentation, texts: TokenTexts):
        self.request_id, self.model, self.chat = request_id, model, chat
        self.presentation = presentation
        self.texts = texts.showing_special() if presentation.keep_special_tokens else texts
        # The echoed prompt's offsets count what the echo writes (its special tokens are not); the generated
        # tokens' lists, with an echo's scores, keep a place for every token (EOS too), as the prompt's do,
        # so place i is token i of prompt + output (lm-evaluation-harness indexes them so).
        self._echo_texts = texts
        self._output_texts = texts.showing_special() if presentation.echo_logprobs else self.texts
        self.created = int(time.time())
        self._started: set[int] = set()
        self._readers: dict[int, CallReader] = {}  # tool_choice "auto": each streamed choice's calls
        self._thinkers: dict[int, ThinkReader] = {}  # each streamed choice's thinking
        self.carries_tokens = presentation.return_token_ids or presentation.logprobs is not None

    # ---- whole responses ----------------------------------------------------------------------------
    def response(self, choices: list[Choice]) -> dict:
        p = self.presentation
        body = {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [self._choice(c) for c in choices],
                "usage": self._usage(choices)}
        if self.chat and p.return_token_ids:
            body["prompt_token_ids"] = list(choices[0].state.prompt_ids)
        if self.chat and p.prompt_logprobs is not None:  # vLLM's place for a chat's
            body["prompt_logprobs"] = self._prompt_logprobs(choices[0])
        return body

    def _prompt_logprobs(self, c: Choice) -> list[dict | None]:
        return vllm_prompt_logprobs(c.state.prompt_ids, c.prompt_logprobs, self.presentation.prompt_logprobs,
                                    self.texts)

    def _echoed(self, c: Choice) -> dict:
        return echoed_logprobs(c.state.prompt_ids, c.prompt_logprobs, self.presentation.logprobs, self._echo_texts,
                               c.prefix)

    def _choice(self, c: Choice) -> dict:
        p = self.presentation
        if self.chat:
            content, calls, reasoning = self.answer(c)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            if p.reasoning:  # vLLM's name for it, and its older one (DeepSeek's API's)
                message["reasoning"] = message["reasoning_content"] = reasoning
            out = {"index": c.index, "message": message,
                   "logprobs": chat_logprobs(c.logprobs, self.texts) if p.logprobs is not None else None,
                   "finish_reason": _finish(c, bool(calls))}
        else:
            generated = not p.echo_only
            logprobs = (completion_logprobs(c.logprobs if generated else [], self._output_texts, len(c.prefix))
                        if p.logprobs is not None else None)
            out = {"index": c.index, "text": c.prefix + (c.text if generated else ""),
                   "logprobs": joined(self._echoed(c), logprobs) if p.echo_logprobs else logprobs,
                   "finish_reason": c.finish_reason if generated else "length"}
            if p.return_token_ids:
                out["prompt_token_ids"] = list(c.state.prompt_ids)
            if p.prompt_logprobs is not None:
                out["prompt_logprobs"] = self._prompt_logprobs(c)
        if p.return_token_ids:
            out["token_ids"] = [] if p.echo_only and not self.chat else list(c.token_ids)
        return out

    # ---- streamed chunks ----------------------------------------------------------------------------
    def opening(self, choices: list[Choice]) -> list[str]:
        """What a stream starts with: the assistant role (chat) or the echoed prompt (completions)."""
        if self.chat:
            # An answer of tool calls has no content, as the whole answer's message says (null).
            content = None if self.presentation.tool_calls else ""
            return [self._chunk({"index": c.index, "delta": {"role": "assistant", "content": content},
                                 "logprobs": None, "finish_reason": None}, first_of=c) for c in choices]
        if self.presentation.echo and not self.presentation.echo_logprobs:  # with them: in the first delta, as vLLM
            return [self._chunk({"index": c.index, "text": c.prefix, "logprobs": None, "finish_reason": None},
                                first_of=c) for c in choices]
        return []

    def delta(self, c: Choice, text: str, token_ids: list[int], logprobs: list[TokenLogprob]) -> str | None:
        """One chunk for what a batch of events added to choice `c` (its finish reason when it ended);
        None while a choice answered as tool calls is still being generated."""
        p = self.presentation
        if self.chat and (p.tool_parser or p.reasoning):
            return self._read_delta(c, text, token_ids, logprobs)
        if self.chat and p.tool_calls:
            if c.finish_reason is None:
                return None  # the calls leave whole, once they parse
            calls = self._tool_calls(c)
            if calls is not None:
                delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
            else:
                delta = {"content": c.text}
            entry = {"index": c.index, "delta": delta,
                     "logprobs": chat_logprobs(c.logprobs, self.texts) if p.logprobs is not None else None,
                     "finish_reason": None if calls is not None else c.finish_reason}
            if p.return_token_ids:
                entry["token_ids"] = list(c.token_ids)
            if calls is None:
                return self._chunk(entry, first_of=c)
            # The finish in a chunk of its own, as OpenAI sends it: the openai client's stream helper
            # reads a chunk's finish before its calls, and would not report them done.
            return self._chunk(entry, first_of=c) + self._chunk(
                {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}, first_of=c)
        if self.chat:
            entry = {"index": c.index, "delta": {"content": text} if text or not c.finish_reason else {},
                     "logprobs": chat_logprobs(logprobs, self.texts) if p.logprobs is not None else None,
                     "finish_reason": c.finish_reason}
        else:
            if p.echo_only:  # its one token is not the answer's (see Presentation.echo_only)
                text, token_ids, logprobs = "", [], []
            entry = {"index": c.index, "text": text, "logprobs": None,
                     "finish_reason": "length" if p.echo_only and c.finish_reason else c.finish_reason}
            if p.logprobs is not None:
                # Counted the way the whole answer counts it: the echo, then each token's own text.
                first = c.logprob_offset < 0
                offset = len(c.prefix) if first else c.logprob_offset
                entry["logprobs"] = completion_logprobs(logprobs, self._output_texts, offset)
                c.logprob_offset = offset + sum(len(t) for t in entry["logprobs"]["tokens"])
                if first and p.echo_logprobs:
                    entry["text"], entry["logprobs"] = c.prefix + text, joined(self._echoed(c), entry["logprobs"])
        if p.return_token_ids:
            entry["token_ids"] = token_ids
        return self._chunk(entry, first_of=c)

    def _read_delta(self, c: Choice, text: str, token_ids: list[int], logprobs: list[TokenLogprob]) -> str | None:
        """tool_choice "auto" or thinking, streamed: the thinking and the text that are certain, and
        each call once it is whole; the finish, after calls, in a chunk of its own (see delta)."""
        p = self.presentation
        before = self._reader(c).calls if p.tool_parser else 0
        read = self.read(c, text)
        delta: dict = {"reasoning": read.reasoning, "reasoning_content": read.reasoning} if read.reasoning else {}
        if read.content:
            delta["content"] = read.content
        if read.calls:
            delta["tool_calls"] = [{"index": before + k, **call} for k, call in enumerate(read.calls)]
        finish = None if c.finish_reason is None else _finish(c, bool(p.tool_parser) and self._reader(c).calls > 0)
        carried = (p.logprobs is not None and logprobs) or (p.return_token_ids and token_ids)
        if not (delta or finish or carried):
            return None
        entry = {"index": c.index, "delta": delta,
                 "logprobs": chat_logprobs(logprobs, self.texts) if p.logprobs is not None else None,
                 "finish_reason": None if read.calls else finish}
        if p.return_token_ids:
            entry["token_ids"] = token_ids
        chunk = self._chunk(entry, first_of=c)
        if read.calls and finish:
            chunk += self._chunk({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish}, first_of=c)
        return chunk

    def read(self, c: Choice, text: str) -> Read:
        """What `text`, the next of choice `c`'s streamed answer, adds to its thinking, content and calls."""
        p, done = self.presentation, c.finish_reason is not None
        reasoning = ""
        if p.reasoning:
            thinker = self._thinkers.get(c.index)
            if thinker is None:
                thinker = self._thinkers[c.index] = ThinkReader(self._opens_thinking(c))
            reasoning, text = thinker.feed(text)
            if done:
                more_reasoning, more_text = thinker.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        read = Read(text)
        if p.tool_parser:
            reader = self._reader(c)
            before = reader.calls
            read = reader.feed(text)
            if done:
                read += reader.finish()
            if p.max_calls is not None:
                read.calls = read.calls[:max(0, p.max_calls - before)]
        read.reasoning = reasoning
        return read

    def _usage(self, choices: list[Choice]) -> dict:
        thinking = sum(map(self.reasoning_tokens, choices)) if self.presentation.reasoning else None
        body = usage(choices, self.presentation.n, thinking)
        if self.presentation.echo_only:
            body.update(completion_tokens=0, total_tokens=body["prompt_tokens"])
        return body

    def reasoning_tokens(self, c: Choice) -> int:
        """How many of a finished choice's tokens are its thinking: those up to the one that
        completes </think>, or all where it never closes; 0 where it did not think."""
        if not self.presentation.reasoning or not ThinkReader(self._opens_thinking(c)).read_all(c.text)[0]:
            return 0
        text = ""
        for k, token_id in enumerate(c.token_ids):
            piece = self.texts(token_id)
            text += piece
            if CLOSE in text[-len(CLOSE) - len(piece):]:
                return k + 1
        return len(c.token_ids)

    def _opens_thinking(self, c: Choice) -> bool:
        return prompt_opens_thinking(self.texts.prompt_tail(c.state.prompt_ids))

    def _reader(self, c: Choice) -> CallReader:
        reader = self._readers.get(c.index)
        if reader is None:
            reader = self._readers[c.index] = call_reader(self.presentation.tool_parser)
        return reader

    def answer(self, c: Choice) -> tuple[str | None, list[dict] | None, str | None]:
        """A finished chat choice's content, tool calls and thinking (content None beside calls or
        thinking where there is no text; calls and thinking None where there are none)."""
        calls = self._tool_calls(c)
        if calls is not None:
            return None, calls, None
        p, reasoning, text = self.presentation, None, c.text
        if p.reasoning:
            reasoning, text = ThinkReader(self._opens_thinking(c)).read_all(c.text)
            reasoning = reasoning or None
        if p.tool_parser:
            read = call_reader(p.tool_parser).read_all(text)
            if read.calls:
                return read.content or None, read.calls[:p.max_calls], reasoning
        return (text if text or reasoning is None else None), None, reasoning

    def _tool_calls(self, c: Choice) -> list[dict] | None:
        """A finished tool-call choice's calls in OpenAI's form; None when the answer is not tool
        calls or its text did not become a whole list of calls (cut off by max_tokens)."""
        if not (self.presentation.tool_calls and c.finish_reason == "stop"):
            return None
        try:
            calls = json.loads(c.text)
        except json.JSONDecodeError:
            return None
        if not isinstance(calls, list) or not all(isinstance(x, dict) and {"name", "arguments"} <= set(x)
                                                  for x in calls):
            return None
        return [{"id": call_id(), "type": "function",
                 "function": {"name": x["name"], "arguments": json.dumps(x["arguments"], ensure_ascii=False)}}
                for x in calls]

    def usage_chunk(self, choices: list[Choice]) -> str:
        return self._sse({"id": self.request_id, "object": self._chunk_object(), "created": self.created,
                          "model": self.model, "choices": [], "usage": self._usage(choices)})

    def closing(self, choices: list[Choice]) -> list[str]:
        """What a stream ends with: the usage chunk when asked for, then [DONE]."""
        return ([self.usage_chunk(choices)] if self.presentation.include_usage else []) + [SSE_DONE]

    @staticmethod
    def failure(error: dict) -> str:
        return sse_error(error)

    def _chunk(self, choice: dict, first_of: Choice) -> str:
        if self.presentation.return_token_ids and first_of.index not in self._started and not self.chat:
            choice["prompt_token_ids"] = list(first_of.state.prompt_ids)
        body = {"id": self.request_id, "object": self._chunk_object(), "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.presentation.include_usage:
            body["usage"] = None
        if self.chat and self.presentation.return_token_ids and not self._started:
            body["prompt_token_ids"] = list(first_of.state.prompt_ids)
        self._started.add(first_of.index)
        return self._sse(body)

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @staticmethod
    def _sse(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_body(message: str, error_type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": _encodable(message), "type": error_type,
                      "param": None if param is None else _encodable(param), "code": code}}


def _encodable(text: str) -> str:
    """`text` with any lone surrogate (a client's bad \\ud800 echoed in a message) written out as
    an escape, so the answer can be encoded as UTF-8 at all."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def sse_error(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
