"""Each token id's own text, decoded once: what log-probability entries name their tokens by."""
from __future__ import annotations

import copy

from gateway.tokenizer import Tokenizer


class TokenTexts:
    """Each token id's own text, decoded once."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._shown: dict[int, bool] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def shown(self, token_id: int) -> bool:
        """Whether the token is part of the answer's text: a special token (EOS among them) is not,
        so it has no log-probability entry, and the entries' texts join to the answer's."""
        shown = self._shown.get(token_id)
        if shown is None:
            shown = self._shown[token_id] = self._tokenizer.decode([token_id]) != "" or self(token_id) == ""
        return shown

    def showing_special(self) -> TokenTexts:
        """A view of these texts (the same caches) where every token has its log-probability entry:
        for answers whose text writes special tokens out."""
        view = copy.copy(self)
        view.shown = lambda token_id: True
        return view

    def prompt_tail(self, prompt_ids) -> str:
        """The last characters of a prompt, special tokens written out."""
        return self._tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False)

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's raw bytes (a part of a character where its text alone is U+FFFD)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = list(self._tokenizer.token_bytes(token_id))
        return raw
