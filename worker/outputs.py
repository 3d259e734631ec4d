"""What the engine reports: a delta per request per step, and a request's final result, built once.

A step's `RequestDelta` carries only what that step added (so a step costs the same whatever
a request's length); the finished delta carries the request's `RequestOutput`, assembled once
from the worker's `Request` when it finishes. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from shared.sampling_params import PromptLogprob, TopLogprobs
from worker.request import FINISH_REASONS, Request


@dataclass(frozen=True)
class RequestOutput:
    """A finished request: every generated token, as `Engine.generate` returns it."""
    request_id: str
    token_ids: list[int]  # every generated token, resumed ones included
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    # Raw log-probabilities (log_softmax of the model's logits, before bias, penalties and temperature), one
    # per token sampled on this worker when requested; top_logprobs likewise when params.top_logprobs > 0.
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    peak_kv_blocks: int = 0  # the most KV blocks the request held at once
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Speculative decoding on this worker: draft tokens verified, and how many sampling confirmed.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # params.prompt_logprobs: one entry per prompt token after the first (raw logprob, rank, top alternatives).
    prompt_logprobs: list[PromptLogprob] | None = None


# Not frozen: a frozen dataclass sets each field through object.__setattr__, and a delta is built
# for every request of every step. Nothing changes one once it is built.
@dataclass(slots=True)
class RequestDelta:
    """One request's share of one step: the tokens it sampled, or that it ended."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    error: str | None = None
    # Worker-side durations, only on the delta carrying the first token sampled here.
    worker_queue_ms: float = 0.0  # arrival on this worker to the first scheduled step
    prefill_ms: float = 0.0  # first scheduled step to the first token
    peak_kv_blocks: int = 0
    final: RequestOutput | None = None  # set on the finished delta
    # Aligned with new_token_ids when params.top_logprobs > 0, else empty (new_logprobs: when params.logprobs).
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Speculative decoding in this step: draft tokens verified, and how many sampling confirmed.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # On the delta of the first token sampled here, when the request asked for prompt_logprobs (and has not
    # reported them): the prompt's entries, one per prompt token after the first.
    prompt_logprobs: list[PromptLogprob] | None = None


def delta_for(request: Request, new_token_ids: Sequence[int] = (), is_first_token: bool = False,
              num_draft_tokens: int = 0, num_accepted_draft_tokens: int = 0) -> RequestDelta:
    """The delta of a step that took `new_token_ids` (the last ones of the request's output)."""
    worker_queue_ms = prefill_ms = 0.0
    if is_first_token and request.first_scheduled_s is not None and request.first_token_s is not None:
        worker_queue_ms = (request.first_scheduled_s - request.arrival_s) * 1e3
        prefill_ms = (request.first_token_s - request.first_scheduled_s) * 1e3
    num_new = len(new_token_ids)
    new_logprobs, new_top_logprobs, prompt_logprobs = [], [], None
    if num_new:
        params = request.params
        if params.logprobs and request.output_logprobs:
            new_logprobs = request.output_logprobs[-num_new:]
        if params.top_logprobs and request.output_top_logprobs:
            new_top_logprobs = request.output_top_logprobs[-num_new:]
        if is_first_token and params.prompt_logprobs is not None:  # once: with the first token sampled here
            prompt_logprobs = request.prompt_logprobs
    status = request.status
    finished = status.is_finished
    # Arguments in the fields' order: keywords would cost every delta of every step more again.
    return RequestDelta(request.request_id, list(new_token_ids), new_logprobs, finished, FINISH_REASONS.get(status),
                        len(request.prompt_token_ids), request.num_cached_tokens, request.num_preemptions,
                        request.error, worker_queue_ms, prefill_ms, request.peak_num_blocks,
                        final_output(request) if finished else None, new_top_logprobs, num_draft_tokens,
                        num_accepted_draft_tokens, prompt_logprobs)


def final_output(request: Request) -> RequestOutput:
    speculation = request.speculation
    return RequestOutput(
        request_id=request.request_id,
        token_ids=list(request.output_token_ids),
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        logprobs=list(request.output_logprobs),
        top_logprobs=list(request.output_top_logprobs),
        error=request.error,
        peak_kv_blocks=request.peak_num_blocks,
        num_draft_tokens=speculation.num_draft_tokens if speculation is not None else 0,
        num_accepted_draft_tokens=speculation.num_accepted_tokens if speculation is not None else 0,
        prompt_logprobs=list(request.prompt_logprobs) if request.params.prompt_logprobs is not None else None,
    )
