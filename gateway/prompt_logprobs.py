"""The prompt's log-probabilities in the OpenAI API's answers: the echoed prompt's share of a
completion's `logprobs` (echo with logprobs, what lm-evaluation-harness scores with), and vLLM's
`prompt_logprobs` field.

The worker sends one entry per prompt token after the first (worker/prompt_logprobs.py); the first
token has nothing before it, so both forms give it null. Every prompt token has its place, special
ones included, so position i is prompt token i, as the client's own token ids count them.
"""
from __future__ import annotations

from typing import Sequence

from gateway.token_texts import TokenTexts
from shared.wire import TokenLogprob


def top_by_text(entry: TokenLogprob, texts: TokenTexts, num_top: int | None = None) -> dict[str, float]:
    """The completions format's alternatives of `entry` (its first `num_top`, all by default), keyed by text
    (of tokens with the same text, the most likely one's), and the token's own: OpenAI's API "always
    returns the logprob of the sampled token", so there are up to logprobs + 1 of them."""
    out: dict[str, float] = {}
    for token_id, logprob in entry.top[:num_top]:
        out.setdefault(texts(token_id), logprob)
    out.setdefault(texts(entry.token_id), entry.logprob)
    return out


def echoed_logprobs(prompt_ids: Sequence[int], entries: list[TokenLogprob] | None, num_top: int,
                    texts: TokenTexts, echo: str) -> dict:
    """The completions format's lists for the echoed prompt, one place per prompt token (null where
    there is no entry). `text_offset` counts from 0 over the tokens' texts as `echo`, the echoed text,
    holds them: a special token's text takes room only where the echo writes it (a prompt's text that
    spells it out), not where the tokenizer added it (a BOS)."""
    tokens, logprobs, tops, offsets = [], [], [], []
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        text = texts(token_id)
        tokens.append(text)
        offsets.append(offset)
        if texts.shown(token_id) or echo.startswith(text, offset):
            offset += len(text)
        entry = entries[i - 1] if entries and i > 0 else None
        logprobs.append(entry.logprob if entry is not None else None)
        tops.append(top_by_text(entry, texts, num_top) if entry is not None else None)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def joined(echoed: dict, generated: dict) -> dict:
    """The echoed prompt's lists, then the generated text's."""
    return {name: echoed[name] + generated[name] for name in echoed}


def vllm_prompt_logprobs(prompt_ids: Sequence[int], entries: list[TokenLogprob] | None, num_top: int,
                         texts: TokenTexts) -> list[dict | None]:
    """vLLM's form: per prompt token, null for the first, else token id -> {logprob, rank, decoded_token}
    for the prompt's token and the `num_top` most likely ones (ranked 1, 2, ...)."""
    out: list[dict | None] = [None]
    if entries is None:  # none came (the request ended before its first token)
        return out * len(prompt_ids)
    for token_id, entry in zip(prompt_ids[1:], entries):
        place = {str(token_id): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": texts(token_id)}}
        for rank, (top_id, logprob) in enumerate(entry.top[:num_top], 1):
            place.setdefault(str(top_id), {"logprob": logprob, "rank": rank, "decoded_token": texts(top_id)})
        out.append(place)
    return out
