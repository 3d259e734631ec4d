"""What one scheduler step hands the runner and gets back: the requests scheduled with their new
tokens (and drafts), each one's result, and what the step changed in each. Data only; the
scheduler (worker/scheduler.py) makes and consumes them. The per-request ones are slotted rather
than frozen: several are built for every request of every step, and a frozen dataclass sets each
field through object.__setattr__; nothing changes one once it is built."""
from __future__ import annotations

from dataclasses import dataclass

from worker.drafts import SampledToken
from worker.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    # Speculative decoding: tokens proposed after a decode's one known new token, computed (and a token
    # sampled after each) in the same step; num_new_tokens counts them.
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepFailure:
    """A scheduled request whose step could not run (out of memory even alone): it finishes with an error."""
    error: str


# What the runner returns per scheduled request: (token id, logprob, top logprobs) when the step reached
# its last known token and sampled (logprob and top None when the request did not ask for them), None for
# a prompt chunk that did not, or a StepFailure. A request with a draft gets a list of 1 + len(draft) of
# them: entry j was sampled at the position after the decode's token and the draft's first j tokens.
StepResult = SampledToken | list[SampledToken] | None | StepFailure


@dataclass(slots=True)
class RequestUpdate:
    """What one step changed in one request, for the engine to report."""
    request: Request
    new_token_ids: tuple[int, ...]  # taken this step: one, or with a draft up to 1 + len(draft)
    is_first_token: bool = False  # the first token this worker sampled for it
    num_draft_tokens: int = 0  # speculative decoding: tokens of the draft verified this step
    num_accepted_tokens: int = 0  # and how many of them sampling confirmed


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
