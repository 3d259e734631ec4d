"""The gateway's tokenizer: a model folder's Hugging Face tokenizer files, read without torch.

`transformers.AutoTokenizer` imports torch whenever torch is installed, and the gateway must
never import torch, so this reads the same files AutoTokenizer reads (`tokenizer.json` with the
`tokenizers` library it wraps, `tokenizer_config.json` for special tokens and the chat template,
rendered with jinja2 as transformers does); tests/test_gateway_tokenizer.py checks that both give
identical ids, text and chat prompts. `tokenizer.json` is used as written, BOS by its
post-processor (where transformers reads `add_bos_token` too, it agrees). One known difference:
transformers 5 rebuilds a `LlamaTokenizer`'s SentencePiece-style pipeline (a Metaspace
pre-tokenizer that adds "▁" only before the first piece), so text right after a special token
inside a string (`<s>[INST]` in Llama 2's and Mistral's chat templates) loses the "▁" the file's
Prepend normalizer gives it; the gateway keeps the file's form, which is what transformers 4 and
SentencePiece encoding each piece of text (Meta's reference chat code) produce. Encoding and
rendering may run on several threads at once (gateway/offload.py): the Rust tokenizer is only
read, and two threads rendering a template first at once at worst both compile it. Also the
incremental detokenizer used for streaming, whose work per delta is a window of a few tokens, so
it stays on the event loop.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as RustTokenizer


class TokenizerError(ValueError):
    """The model folder's tokenizer is missing, unusable, or misconfigured; the message says how."""


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "</s>", "lstrip": ...} in older files
        return value.get("content")
    return value


@dataclass(frozen=True)
class SpecialTokens:
    bos: str | None
    eos: str | None
    pad: str | None
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not self.model_dir.is_dir():
            raise TokenizerError(f"the model folder {self.model_dir} (model_dir) does not exist")
        if not path.is_file():
            raise TokenizerError(f"{self.model_dir} has no tokenizer.json; the gateway needs a fast (tokenizers) "
                                 f"tokenizer saved beside the model")
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception
            raise TokenizerError(f"{path} does not load as a tokenizers tokenizer: {e}") from e
        self._tok.no_padding()
        self._tok.no_truncation()
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # tokenizers < 0.21
        self._config = _read_json(self.model_dir / "tokenizer_config.json")
        self.model_config = _read_json(self.model_dir / "config.json")
        self.chat_template = self._load_chat_template()
        self.special = self._special_tokens()
        decoder = _read_json(path).get("decoder") or {}
        decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        self._byte_level = any(d.get("type") == "ByteLevel" for d in decoders)
        self.vocab_size = int(self.model_config.get("vocab_size") or self._tok.get_vocab_size(with_added_tokens=True))
        self.warnings = self.check_special_tokens()

    # ---- loading ---------------------------------------------------------------------------
    def _load_chat_template(self) -> str | None:
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = self._config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    def _special_tokens(self) -> SpecialTokens:
        generation = _read_json(self.model_dir / "generation_config.json")
        bos = _token_content(self._config.get("bos_token"))
        eos = _token_content(self._config.get("eos_token"))
        pad = _token_content(self._config.get("pad_token"))
        eos_ids: list[int] = []
        for source in (generation.get("eos_token_id"), self.model_config.get("eos_token_id")):
            for value in source if isinstance(source, list) else [source]:
                if isinstance(value, int) and value not in eos_ids:
                    eos_ids.append(value)
        if eos is not None and (eos_id := self._tok.token_to_id(eos)) is not None and eos_id not in eos_ids:
            eos_ids.insert(0, eos_id)
        return SpecialTokens(bos=bos, eos=eos, pad=pad,
                             bos_id=self._tok.token_to_id(bos) if bos else None, eos_ids=tuple(eos_ids),
                             pad_id=self._tok.token_to_id(pad) if pad else None)

    def check_special_tokens(self) -> list[str]:
        """Refuse a tokenizer with no EOS; return warnings for softer problems."""
        s = self.special
        if not s.eos_ids:
            raise TokenizerError(f"{self.model_dir}: no EOS token is defined (eos_token in tokenizer_config.json "
                                 f"or eos_token_id in generation_config.json / config.json): generation "
                                 f"could never stop before max_tokens")
        warnings = []
        if s.eos is not None and self._tok.token_to_id(s.eos) is None:
            warnings.append(f"eos_token {s.eos!r} is not in the vocabulary")
        if s.pad_id is None:
            warnings.append("no pad token is defined (not needed by this server, which never pads)")
        elif s.pad_id in s.eos_ids:
            warnings.append(f"pad token {s.pad!r} is also an EOS token: padding would read as end of text")
        return warnings

    # ---- encode / decode -------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch API, because it releases the GIL while it encodes (`encode` holds it): a large
        # prompt tokenized on a pool thread then leaves the event loop running. The fast variant
        # skips character offsets, which the gateway never reads.
        [encoding] = self._encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_piece(self, token_id: int) -> str | None:
        """The token's entry in the vocabulary as written there (None for an id past the
        tokenizer's own vocabulary, in a model's padded embedding rows)."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for, even where it is a part of a multi-byte character
        (its decode alone would be U+FFFD): byte-level BPE vocabularies spell bytes with GPT-2's
        printable characters, byte-fallback vocabularies as `<0xAB>`."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return self.decode([token_id], skip_special_tokens=False).encode()
        if _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """`messages` as transformers' templates read them (an assistant's `tool_calls` with their
        arguments as objects, a tool's `tool_call_id`); `tools` in OpenAI's form; `variables`, more
        the template may read (none of its own: see TEMPLATE_VARIABLES)."""
        if not self.chat_template:
            raise TokenizerError(f"{self.model_dir}: the tokenizer has no chat template, so chat messages "
                                 f"cannot be rendered; send a plain prompt instead")
        if "tool_calls" not in self.chat_template:
            messages = [_calls_as_content(m) for m in messages]
        try:
            # A sandbox, as transformers renders them: a template from a model folder reaches no
            # Python internals (attributes starting with _, callables that mutate, ...).
            return _compile(self.chat_template).render(
                **(variables or {}), messages=list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.special.bos or "", eos_token=self.special.eos or "", pad_token=self.special.pad or "")
        except jinja2.exceptions.SecurityError as e:
            raise TokenizerError(f"{self.model_dir}: the chat template tried what its sandbox forbids: {e}") from None
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.model_dir}: the chat template failed to render: {e}") from None

    def encode_chat(self, messages: Sequence[dict], tools: list[dict] | None = None, variables: dict | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        """`continue_final_message`: the text ends where the last message's content does, its turn
        left open (what the template writes after it, its end-of-turn, is cut), as transformers'
        apply_chat_template(continue_final_message=True) does."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
                                tools=tools, variables=variables)
        if continue_final_message:
            final = messages[-1]["content"] if messages else ""
            end = text.rfind(final) if final else -1
            if end < 0:
                raise TokenizerError("continue_final_message needs a last message with text the chat template "
                                     "writes out")
            text = text[:end + len(final)]
        # The template writes any BOS itself, as apply_chat_template(tokenize=True) assumes.
        return self.encode(text, add_special_tokens=False)


def _calls_as_content(message: dict) -> dict:
    """For a template that does not render tool calls: an assistant's calls written into its
    content as this server's tool-call output is written (a JSON list of {"name", "arguments"}),
    so the model reads back what it generated."""
    if not message.get("tool_calls"):
        return message
    calls = json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                        for c in message["tool_calls"]], ensure_ascii=False)
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": f"{message['content']}\n{calls}" if message["content"] else calls}


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    It decodes a short window that starts a few tokens back (so tokenizers that strip a
    leading space see the same context as a full decode) and holds back text that ends in
    U+FFFD, which is how a byte-level tokenizer shows an incomplete multi-byte character.
    """
    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-self.CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix_offset:], self._skip)
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end of a stream: whatever is held back, even an incomplete character."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix_offset:], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix_text):] if len(text) > len(prefix_text) else ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, which byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# The chat template's own variables, which a request's chat_template_kwargs cannot replace.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "pad_token"})
_TEMPLATES: dict[str, jinja2.Template] = {}


def _raise_exception(message: str):
    raise TokenizerError(f"chat template: {message}")


def _compile(source: str) -> jinja2.Template:
    template = _TEMPLATES.get(source)
    if template is None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = _TEMPLATES[source] = env.from_string(source)
    return template
