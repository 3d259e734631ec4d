"""Speculative decoding's share of a step, for the scheduler: the draft a decode brings, and the tokens
it keeps once the step has sampled every draft position. Pure Python.

Called by the scheduler only (it stays the one writer of a Request): `draft_for` while scheduling,
`take_verified` while applying a step's results. The proposer itself is worker/speculative.py.
"""
from __future__ import annotations

from typing import Sequence

from shared.sampling_params import TopLogprobs
from worker.request import Request, RequestStatus

# One sampled position: (token id, raw logprob, top logprobs), the last two None unless asked for.
SampledToken = tuple[int, float | None, TopLogprobs | None]


def draft_budget(num_running: int, max_step_tokens: int, max_num_batched_tokens: int) -> int:
    """Draft tokens a step may take in all: what the step-token cap leaves beside one token per running
    request (0: no cap). Past the cap a forward is compute-bound, and a draft would cost what it saves."""
    return max(0, max_step_tokens - num_running) if max_step_tokens else max_num_batched_tokens


def draft_for(request: Request, num_new: int, limit: int) -> list[int]:
    """The tokens a decode proposes to verify after its one new token: at most `limit` (what the step has
    room for) and what the request may still produce (the last verified position samples a token of its
    own, so a draft of d tokens can yield d + 1: none can pass max_tokens)."""
    speculation = request.speculation
    if speculation is None or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
        return []
    limit = min(limit, request.params.max_tokens - request.num_output_tokens - 1)
    return speculation.propose(request.token_ids, limit) if limit > 0 else []


def take_verified(request: Request, draft: Sequence[int], results: Sequence[SampledToken]
                  ) -> tuple[list[int], int, RequestStatus | None]:
    """Append what a verified draft yields; returns (tokens taken, draft tokens accepted, stop status).

    results[j] was sampled at draft[j]'s position (after the decode's token and draft[:j]), so it is the
    token an unspeculated run would take there; where it equals draft[j], the K/V computed for draft[j]
    is right and the next result holds too. Tokens are taken up to the first that differs from the draft
    (itself included: the sample of its position) or the first that stops the request, so nothing past a
    stop token, EOS or max_tokens is taken. The request's computed count covers the decode's token and
    the accepted draft tokens."""
    params = request.params
    request.num_computed_tokens += 1  # the decode's own token, known before the step
    taken, accepted, status = [], 0, None
    for j, (token_id, logprob, top) in enumerate(results):
        request.append_token(token_id, logprob if params.logprobs else None, top if params.top_logprobs else None)
        taken.append(token_id)
        matched = j < len(draft) and token_id == draft[j]
        if matched:
            request.num_computed_tokens += 1
            accepted += 1
        status = request.stop_status()
        if status is not None or not matched:
            break
    request.speculation.record(len(draft), accepted)
    return taken, accepted, status
