"""One client stream's state: tokens received, text sent, stop strings, timings, its events.

`request_id` is the client's name for the request; `internal_id` is the gateway's own, unique
per admission, and the only one on the wire and in the worker, so nothing a finished request
left behind (a late token, an abort) can reach a newer request that reuses the client's id.

The dispatcher feeds worker deltas in (`on_tokens`); the servicer drains `events` and turns
them into GenerateResponse messages. With `stream_interval` N > 1, tokens are grouped here,
where they are produced, so a held token costs no event, no relay wake-up and no message: the
first token goes at once, then one event per N tokens, or when `hold_s` has passed, or at the
end. Tokens already streamed are kept so that a request whose worker died can resume elsewhere
from exactly that point.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from gateway.stop_strings import StopMatcher
from gateway.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.sampling_params import SamplingParams
from protos import worker_pb2
from shared.wire import TokenLogprob, logprobs_from_wire, prompt_logprobs_from_wire, sampling_to_wire


@dataclass
class StreamEvent:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when the request asked
    # On the first event with tokens, when the request asked for prompt_logprobs: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" on the last event
    error: str = ""
    status: grpc.StatusCode | None = None  # set: end the RPC with this status instead


@dataclass
class RequestState:
    request_id: str  # the client's
    internal_id: str  # the gateway's: on the wire, in the worker, in the dispatcher's tables
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    tokenizer: Tokenizer
    deadline_s: float | None = None  # monotonic; the client's deadline
    session_id: str = ""  # requests of one session go to one worker while it has room
    owner: str = ""  # the name of the API key that sent it ("" without keys)
    group_id: str = ""  # the client's id of the request this is one sequence of (several prompts or n > 1)
    arrival_s: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    worker_id: str | None = None
    dispatch_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    num_cached_tokens: int = 0
    num_resumes: int = 0
    bucket: int = 0  # the queue bucket its prompt length picked
    last_token_s: float | None = None
    worker_queue_ms: float = 0.0  # reported by the worker (its own clock)
    prefill_ms: float = 0.0  # reported by the worker (its own clock)
    num_preemptions: int = 0
    peak_kv_blocks: int = 0
    # Speculative decoding, summed over the deltas of every worker that served it: draft tokens
    # verified, and how many of them sampling confirmed.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    finish_reason: str | None = None
    stream_interval: int = 1  # tokens per event (the gateway's stream_interval)
    hold_s: float = 0.05  # the longest a token waits for its group to fill
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # The gRPC status this stream ended with when the gateway ended it with one (a deadline,
    # no live worker): what the status metric and the request log record.
    status_code: grpc.StatusCode | None = None
    # Routing (gateway/routing.py): the prompt's block hashes, keyed by (block size, tokens
    # streamed), and the cached tokens predicted at the last dispatch, until the worker reports.
    block_hashes: tuple[tuple[int, int], list[bytes]] | None = None
    predicted_cached_tokens: int | None = None
    # Told the tokens it generated, once, when it ends however it ends (the caller's rate limit
    # takes back what it did not use: gateway/rate_limit.py TokenCharge).
    on_finished: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        self._held = StreamEvent()  # tokens waiting for stream_interval
        self._hold_timer: asyncio.TimerHandle | None = None
        self._emitted = False
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids, self.params.skip_special_tokens)
        self._stops = StopMatcher(self.params.stop, self.params.include_stop_str_in_output)
        # The ids whose token ends the output where it is generated: its text is not the output's
        # (vLLM's rule), unless include_stop_str_in_output.
        p = self.params
        eos = () if p.ignore_eos or self.tokenizer is None else self.tokenizer.special.eos_ids
        self._ending_ids = frozenset() if p.include_stop_str_in_output else frozenset((*p.stop_token_ids, *eos))

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def note_worker_report(self, delta) -> None:
        """Take the accounting a worker's delta (a worker.proto TokenDelta) carries: the highest
        figures any of its workers reported, its own prefill timing, and the drafts summed."""
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prefill_ms:
            self.prefill_ms, self.worker_queue_ms = delta.prefill_ms, delta.worker_queue_ms
        self.num_preemptions = max(self.num_preemptions, delta.num_preemptions)
        self.peak_kv_blocks = max(self.peak_kv_blocks, delta.peak_kv_blocks)
        self.num_draft_tokens += delta.num_draft_tokens
        self.num_accepted_draft_tokens += delta.num_accepted_draft_tokens

    def wire_sampling(self) -> worker_pb2.WireSampling:
        """Its sampling as a worker takes it; resumed, without prompt_logprobs (they came with its first token)."""
        sampling = sampling_to_wire(self.params)
        if self.output_ids:
            sampling.ClearField("prompt_logprobs")
        return sampling

    def prompt_logprobs_of(self, delta: worker_pb2.TokenDelta) -> list[TokenLogprob] | None:
        """The prompt's log-probabilities, from its worker's first delta with tokens (None from any other, or
        where the request did not ask)."""
        if self.params.prompt_logprobs is not None and delta.new_token_ids and not self.output_ids:
            return prompt_logprobs_from_wire(delta, self.prompt_ids)
        return None

    def on_delta(self, delta: worker_pb2.TokenDelta, now_s: float) -> bool:
        """A worker's delta taken (its tokens, their log-probabilities and the prompt's); True if it ended
        the request here: a stop string, or a delta that cannot be read (an error, not the gateway's end)."""
        try:
            logprobs = logprobs_from_wire(delta) if delta.logprobs else None
            prompt_logprobs = self.prompt_logprobs_of(delta)
        except ValueError as e:
            # _finish, not finish: a held tail completing a stop string must not turn the error into an answer.
            self._finish("error", now_s, "", f"its worker sent a delta that cannot be read: {e}"
                         + (f" (and said: {delta.error})" if delta.error else ""))
            return True
        return self.on_tokens(list(delta.new_token_ids), now_s, logprobs, prompt_logprobs)

    def on_tokens(self, token_ids: list[int], now_s: float, logprobs: list[TokenLogprob] | None = None,
                  prompt_logprobs: list[TokenLogprob] | None = None) -> bool:
        """Record new tokens (and their log-probabilities, and with the first the prompt's) and queue their
        text; True if a stop string ended the request."""
        if self.is_finished or not token_ids:
            return False
        if prompt_logprobs is not None:
            self._held.prompt_logprobs = prompt_logprobs
        if self.first_token_s is None:
            self.first_token_s = now_s
        self.last_token_s = now_s
        if len(token_ids) > 1 and self.params.stop:
            # Several tokens in one delta (speculative decoding confirms a few per step): taken one at a
            # time, so none past the token whose text completes a stop string is kept or sent, as when
            # they come one per delta.
            for i in range(len(token_ids)):
                if self._take(token_ids[i:i + 1], logprobs[i:i + 1] if logprobs else None, now_s):
                    return True
            return False
        return self._take(token_ids, logprobs, now_s)

    def _take(self, token_ids: list[int], logprobs: list[TokenLogprob] | None, now_s: float) -> bool:
        self.output_ids.extend(token_ids)
        shown = token_ids[:-1] if token_ids[-1] in self._ending_ids else token_ids
        text, stopped = self._detok.push(shown), False
        if len(self.output_ids) >= self.params.min_tokens:
            # Stop strings, like EOS, count from the min_tokens-th token on (vLLM's rule).
            text, stopped = self._stops.push(text)
        self._emit(text, token_ids, logprobs)
        if stopped:
            self._finish("stop", now_s, tail="")
        return stopped

    def _emit(self, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        held = self._held
        held.text += text
        held.token_ids.extend(token_ids)
        if logprobs:
            held.logprobs.extend(logprobs)
        if not self._emitted or len(held.token_ids) >= self.stream_interval:
            self._flush_held()
        elif self._hold_timer is None:
            self._hold_timer = asyncio.get_running_loop().call_later(self.hold_s, self._flush_held)

    def _flush_held(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if self._held.text or self._held.token_ids:
            self.events.put_nowait(self._held)
            self._held = StreamEvent()
            self._emitted = True

    def finish(self, reason: str, now_s: float, error: str = "") -> None:
        """The final event: any held-back text, then the finish reason."""
        if self.is_finished:
            return
        tail, stopped = self._stops.push(self._detok.flush())
        if stopped:
            reason = "stop"
        else:
            tail += self._stops.flush()
        self._finish(reason, now_s, tail, error)

    def _finish(self, reason: str, now_s: float, tail: str, error: str = "",
                status: grpc.StatusCode | None = None) -> None:
        self.finish_reason = reason
        self.finished_s = now_s
        if self.on_finished is not None:
            self.on_finished(len(self.output_ids))
        self._flush_held()
        self.events.put_nowait(StreamEvent(text=tail, finish_reason=reason, error=error, status=status))

    def fail(self, status: grpc.StatusCode, message: str, now_s: float) -> None:
        """End the RPC with a gRPC error status (e.g. DEADLINE_EXCEEDED, UNAVAILABLE)."""
        if self.is_finished:
            return
        self.status_code = status
        self._finish("error", now_s, "", message, status=status)

    @property
    def queue_ms(self) -> float:
        end = self.dispatch_s if self.dispatch_s is not None else (self.finished_s or time.monotonic())
        return (end - self.arrival_s) * 1e3

    @property
    def ttft_ms(self) -> float:
        return 0.0 if self.first_token_s is None else (self.first_token_s - self.arrival_s) * 1e3

