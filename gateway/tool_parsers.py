"""Tool calls in a model's own format, for `tool_choice: "auto"`: the text a model writes when it
decides to call a function, read back as OpenAI's `tool_calls`, whole or as it streams.

Two formats, the ones open models are trained on:
- `hermes`: each call a JSON object `{"name", "arguments"}` between `<tool_call>` and
  `</tool_call>`, with text before or between calls (the templates of Qwen2.5, Qwen3, Hermes and
  SmolLM3 teach it). Text outside the tags is the answer's content (text after a call on a line of
  its own); whitespace that only separates the calls is not. The tags may be special tokens
  (Hermes 2 Pro's), so such answers are decoded with special tokens written out. A call cut off
  before its closing tag still counts where its JSON is whole (a model that ends its turn there),
  and one that does not parse stays in the content as written.
- `llama3_json`: an answer that is nothing but JSON objects `{"name", "parameters"}` (Llama 3.1+,
  optionally after `<|python_tag|>`, several separated by `;`). An answer that starts otherwise
  is text; one that starts as JSON is held until it ends, then read as calls or, failing that,
  given as text.

A `CallReader` is fed the text as it is generated and returns, each time, the content that is
certain to be content and the calls that completed; fed everything, then finished, it gives the
whole answer's. Calls are not checked against the tools' schemas, as vLLM's parsers do not:
`"required"` or a named function constrains the output where that matters.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def parser_for(setting: str, chat_template: str | None) -> str | None:
    """The parser `gateway.tool_call_parser` names; for "auto", the one whose format the chat template
    teaches (None: none, or a template that renders no tools)."""
    if setting != "auto":
        return None if setting == "none" else setting
    if not chat_template or "tools" not in chat_template:
        return None
    if _OPEN in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template:
        return "llama3_json"
    return None


def call_reader(parser: str) -> CallReader:
    return HermesReader() if parser == "hermes" else Llama3JsonReader()


@dataclass
class Read:
    content: str = ""
    calls: list[dict] = field(default_factory=list)
    reasoning: str = ""  # where a reasoning model's thinking is read too (gateway/reasoning_parser.py)

    def __iadd__(self, other: Read) -> Read:
        self.content += other.content
        self.calls += other.calls
        self.reasoning += other.reasoning
        return self


class CallReader:
    """Reads one answer's text (see the module's docstring); `calls` counts the calls read so far."""
    calls = 0

    def feed(self, text: str) -> Read:
        raise NotImplementedError

    def finish(self) -> Read:
        raise NotImplementedError

    def read_all(self, text: str) -> Read:
        read = self.feed(text)
        read += self.finish()
        return read


class HermesReader(CallReader):
    def __init__(self):
        self._pending = ""  # text not yet given out: a call's body, or what may start a tag
        self._in_call = False
        self._searched = 0  # how far into a call's body the closing tag was looked for
        self._gap = ""  # whitespace dropped before the current call, given back if it fails to parse
        self._after_call = False  # whitespace here only separates calls
        self._shown = False  # content was given out: text after a call starts on a new line
        self.calls = 0

    def feed(self, text: str) -> Read:
        self._pending += text
        read = Read()
        while True:
            if self._in_call:
                end = self._pending.find(_CLOSE, max(0, self._searched - len(_CLOSE) + 1))
                if end < 0:
                    self._searched = len(self._pending)
                    return read
                body, self._pending = self._pending[:end], self._pending[end + len(_CLOSE):]
                self._in_call = False
                self._end_call(body, _CLOSE, read)
                continue
            if self._after_call:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return read
                self._after_call = False
                if self._shown and not self._pending.startswith(_OPEN):
                    self._pending = "\n" + self._pending
            start = self._pending.find(_OPEN)
            if start >= 0:
                before = self._pending[:start]
                self._show(before.rstrip(), read)
                self._gap = before[len(before.rstrip()):]
                self._pending, self._in_call, self._searched = self._pending[start + len(_OPEN):], True, 0
                continue
            # Hold back what may yet become a tag, and whitespace that may only lead up to a call.
            held = tag_prefix_len(self._pending, _OPEN)
            ready = self._pending[:len(self._pending) - held]
            shown = ready.rstrip()
            self._show(shown, read)
            self._pending = self._pending[len(shown):]
            return read

    def _show(self, text: str, read: Read) -> None:
        if text:
            read.content += text
            self._shown = True

    def finish(self) -> Read:
        read = Read()
        if self._in_call:
            self._end_call(self._pending, "", read)
        elif not (self.calls and not self._pending.strip()):
            self._show(self._pending, read)
        self._pending, self._in_call = "", False
        return read

    def _end_call(self, body: str, closing: str, read: Read) -> None:
        call = _call(body, "arguments")
        if call is None:
            self._show(self._gap + _OPEN + body + closing, read)
        else:
            read.calls.append(call)
            self.calls += 1
            self._after_call = True
        self._gap = ""


class Llama3JsonReader(CallReader):
    def __init__(self):
        self._pending = ""
        self._mode = ""  # "" undecided, "text", "json"
        self.calls = 0

    def feed(self, text: str) -> Read:
        if self._mode == "text":
            return Read(text)
        self._pending += text
        if self._mode == "json":
            return Read()
        head = self._pending.lstrip()
        if not head or (_PYTHON_TAG.startswith(head) and len(head) < len(_PYTHON_TAG)):
            return Read()  # not yet known
        if head.startswith("{") or head.startswith(_PYTHON_TAG):
            self._mode = "json"
            return Read()
        self._mode, text, self._pending = "text", self._pending, ""
        return Read(text)

    def finish(self) -> Read:
        text, self._pending = self._pending, ""
        if self._mode != "json":
            return Read(text)
        calls = _json_calls(text.strip().removeprefix(_PYTHON_TAG))
        if calls is None:
            return Read(text)
        self.calls = len(calls)
        return Read("", calls)


def _json_calls(text: str) -> list[dict] | None:
    """`{...}; {...}` as calls, or None where any part is not one."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        # A bare object is a call only where it says so: a JSON answer with a "name" is an answer.
        if not isinstance(value, dict) or not ({"parameters", "arguments"} & value.keys()):
            return None
        call = _call_of(value, "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest[1:].lstrip())


def _call(body: str, arguments_key: str) -> dict | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_of(value, arguments_key)


def _call_of(value, arguments_key: str) -> dict | None:
    """One call in OpenAI's form, from `{"name", "arguments"}` (or `parameters`); None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            if not isinstance(json.loads(arguments), dict):
                return None
        except json.JSONDecodeError:
            return None
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return {"id": call_id(), "type": "function", "function": {"name": value["name"], "arguments": arguments}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tag_prefix_len(text: str, tag: str) -> int:
    """How long an end of `text` is that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
