"""The worker's mutable Request and its status enum. Pure Python: no torch.

Only the scheduler changes a request (status, computed tokens, sampled tokens) once it is queued.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shared.sampling_params import PromptLogprob, SamplingParams, TopLogprobs
from worker.speculative import NgramSpeculation


class RequestStatus(enum.IntEnum):
    # Ordered: every terminal status sorts after every live one.
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first
    eos_token_ids: tuple[int, ...] = ()
    arrival_s: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0  # tie-break in arrival order; assigned by the scheduler
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # of tokens sampled here, when params.logprobs
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # likewise, when params.top_logprobs
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = 0  # of the prompt, served by the prefix cache at first schedule
    num_preemptions: int = 0
    error: str | None = None
    # Worker-side timings, on this process's monotonic clock (reported as durations only).
    first_scheduled_s: float | None = None  # set by the scheduler when it first runs
    first_token_s: float | None = None  # set by the scheduler when the first token is sampled here
    peak_num_blocks: int = 0  # the most KV blocks it held at once
    # Structured output: the matcher of its grammar (worker/constraints.Constraint), advanced with every
    # token; None when unconstrained.
    constraint: Any = None
    # Speculative decoding by prompt lookup: its draft proposer, None when the request does not speculate.
    speculation: NgramSpeculation | None = None
    # params.prompt_logprobs: the entries of prompt tokens 1, 2, ... scored so far (worker/prompt_logprobs.py),
    # reported with the first token sampled here.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        # prompt + output, kept as one list so a step never concatenates. Output tokens given at
        # construction resume a request another worker started.
        self.output_token_ids = list(self.output_token_ids)
        self.token_ids: list[int] = list(self.prompt_token_ids) + self.output_token_ids

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt_logprobs and some prompt positions are still to score."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def max_cached_tokens(self) -> int:
        """The most tokens it may take from the prefix cache: all but its last (whose logits give the next
        token), and no position it has still to score."""
        if self.scores_prompt:
            return min(self.num_tokens - 1, len(self.prompt_logprobs))
        return self.num_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Serve order: priority first, then arrival. Preemption victims come from the far end."""
        return (self.priority, self.arrival_seq)

    def append_token(self, token_id: int, logprob: float | None = None, top_logprobs: TopLogprobs | None = None
                     ) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.constraint is not None:
            self.constraint.advance(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def stop_status(self) -> RequestStatus | None:
        """The terminal status the last appended token calls for, if any. A constrained request
        also ends `stop` where its grammar is complete, and `length` (with `error` saying why) where
        it can go no further or max_tokens cuts it inside its structure."""
        if self.constraint is not None:
            if self.constraint.dead_end:
                self.error = f"the output reached a dead end of its constraint: {self.constraint.dead_end}"
                return RequestStatus.FINISHED_LENGTH
            if self.constraint.is_done:
                return RequestStatus.FINISHED_STOPPED
            if self.num_output_tokens >= self.params.max_tokens:
                self.error = "max_tokens ended the output inside the structure its constraint asks for"
                return RequestStatus.FINISHED_LENGTH
        outputs, params = self.output_token_ids, self.params
        last = outputs[-1]
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(outputs) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
