"""Conversions between the shared Python values and the wire's messages, used by both ends.

SamplingParams <-> WireSampling, each sampled token's logprobs <-> TokenDelta.logprobs, and the prompt's
<-> TokenDelta.prompt_logprobs.
Stop strings never travel: the gateway owns the text and applies them itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from protos import worker_pb2
from shared.sampling_params import PromptLogprob, SamplingParams, TopLogprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token with its log-probability under the raw distribution (log_softmax of the model's
    logits before logit bias, penalties and temperature) and, when asked, its most likely alternatives."""
    token_id: int
    logprob: float
    top: TopLogprobs = ()
    rank: int = 0  # of a prompt token: 1 + the tokens more likely than it; 0 where not given



def sampling_to_wire(params: SamplingParams) -> worker_pb2.WireSampling:
    wire = worker_pb2.WireSampling(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        logprobs=params.logprobs, top_logprobs=params.top_logprobs,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        logit_bias=[worker_pb2.LogitBias(token_id=t, bias=b) for t, b in params.logit_bias],
        min_tokens=params.min_tokens, grammar=params.grammar)
    if params.seed is not None:
        wire.seed = params.seed
    if params.speculative_ngram_k is not None:
        wire.speculative_ngram_k = params.speculative_ngram_k
    if params.prompt_logprobs is not None:
        wire.prompt_logprobs = params.prompt_logprobs
    return wire


def sampling_from_wire(wire: worker_pb2.WireSampling) -> SamplingParams:
    """Raises ValueError (from SamplingParams) for values the sender should never have sent."""
    return SamplingParams(
        max_tokens=wire.max_tokens, temperature=wire.temperature, top_p=wire.top_p, top_k=wire.top_k,
        min_p=wire.min_p, repetition_penalty=wire.repetition_penalty,
        seed=wire.seed if wire.HasField("seed") else None,
        stop_token_ids=tuple(wire.stop_token_ids), ignore_eos=wire.ignore_eos,
        logprobs=wire.logprobs, top_logprobs=wire.top_logprobs,
        presence_penalty=wire.presence_penalty, frequency_penalty=wire.frequency_penalty,
        logit_bias=[(b.token_id, b.bias) for b in wire.logit_bias], min_tokens=wire.min_tokens,
        grammar=wire.grammar,
        speculative_ngram_k=wire.speculative_ngram_k if wire.HasField("speculative_ngram_k") else None,
        prompt_logprobs=wire.prompt_logprobs if wire.HasField("prompt_logprobs") else None)


def logprobs_to_wire(logprobs: Sequence[float], top_logprobs: Sequence[TopLogprobs] = ()
                     ) -> list[worker_pb2.TokenLogprob]:
    """TokenDelta.logprobs for a delta's tokens: one chosen-token logprob each, and its alternatives when
    `top_logprobs` is given (one entry per token; empty when the request asked for none)."""
    if top_logprobs and len(top_logprobs) != len(logprobs):
        raise ValueError(f"{len(logprobs)} logprobs but {len(top_logprobs)} top-logprob entries")
    out = []
    for i, logprob in enumerate(logprobs):
        top = top_logprobs[i] if top_logprobs else ()
        out.append(worker_pb2.TokenLogprob(logprob=logprob, top_token_ids=[t for t, _ in top],
                                           top_logprobs=[lp for _, lp in top]))
    return out


def logprobs_from_wire(delta: worker_pb2.TokenDelta) -> list[TokenLogprob]:
    """The delta's tokens with their logprobs, in order; [] when the request did not ask for them.

    Values come back as float32 (the wire's precision: about 1e-7 relative)."""
    if not delta.logprobs:
        return []
    if len(delta.logprobs) != len(delta.new_token_ids):
        raise ValueError(f"delta for {delta.request_id!r} has {len(delta.new_token_ids)} tokens but "
                         f"{len(delta.logprobs)} logprobs")
    out = []
    for token_id, entry in zip(delta.new_token_ids, delta.logprobs):
        if len(entry.top_token_ids) != len(entry.top_logprobs):
            raise ValueError(f"delta for {delta.request_id!r}: {len(entry.top_token_ids)} top token ids but "
                             f"{len(entry.top_logprobs)} top logprobs")
        out.append(TokenLogprob(token_id=token_id, logprob=entry.logprob,
                                top=tuple(zip(entry.top_token_ids, entry.top_logprobs))))
    return out


def prompt_logprobs_to_wire(entries: Sequence[PromptLogprob]) -> list[worker_pb2.TokenLogprob]:
    return [worker_pb2.TokenLogprob(logprob=logprob, rank=rank, top_token_ids=[t for t, _ in top],
                                    top_logprobs=[lp for _, lp in top]) for logprob, rank, top in entries]


def prompt_logprobs_from_wire(delta: worker_pb2.TokenDelta, prompt_ids: Sequence[int]) -> list[TokenLogprob]:
    """The prompt's entries, one per prompt token after the first (`prompt_ids`, the prompt the request
    was sent with); raises ValueError for a count that does not match it."""
    entries = delta.prompt_logprobs
    if len(entries) != len(prompt_ids) - 1:
        raise ValueError(f"delta for {delta.request_id!r} has {len(entries)} prompt logprobs for a prompt of "
                         f"{len(prompt_ids)} tokens")
    out = []
    for token_id, entry in zip(prompt_ids[1:], entries):
        if len(entry.top_token_ids) != len(entry.top_logprobs):
            raise ValueError(f"delta for {delta.request_id!r}: {len(entry.top_token_ids)} top token ids but "
                             f"{len(entry.top_logprobs)} top logprobs")
        out.append(TokenLogprob(token_id=token_id, logprob=entry.logprob, rank=entry.rank,
                                top=tuple(zip(entry.top_token_ids, entry.top_logprobs))))
    return out
