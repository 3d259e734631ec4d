"""Continuous batching: which requests compute how many tokens this step. Pure Python.

Owns every request status change. There is no prefill or decode phase: each scheduled
request gets the tokens that let its computed count catch up with its known tokens,
within a per-step token budget; chunked prefill, decode and resume are the same loop.

Prefix siblings share one prefill. A block enters the prefix cache only once it is computed,
so requests with the same prompt (the API's n > 1, or a burst behind one long system prompt)
admitted together would each compute it. So admission defers a queued request while another
request scheduled in the same step is still to compute one of the full blocks they share
(at least one whole block, within what the waiting one could take from the cache): it keeps
its place and priority, the token budget goes on to the next requests, and it is admitted in
the first step where every shared block is computed, then finds them in the prefix cache.
The leader progresses every step it is scheduled, and one that is preempted, aborted or
finished no longer defers anyone, so no request waits forever. Each request's block hashes
are computed once, as far as a comparison needs them (`_BlockHashes`).

Speculative decoding: a decode of a request with a draft proposer (`Request.speculation`) may bring
a draft after its one new token, verified in the same forward (worker/drafts.py); `update` keeps the
tokens sampling agrees with and gives back the blocks of the rest.
"""
from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass
from typing import Sequence

from shared.block_hash import hash_block
from shared.engine_config import EngineConfig
from worker.block_manager import BlockManager
from worker.drafts import SampledToken, draft_budget, draft_for, take_verified
from worker.request import Request, RequestStatus
from worker.scheduled_step import RequestUpdate, ScheduledRequest, SchedulerOutput, StepFailure, StepResult


class RequestRejectedError(ValueError):
    """A request that can never be served (too long for the model or the pool)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's slice of the engine config (shared/engine_config.py, where each setting is
    defined and checked), with max_model_len resolved against the model."""
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    max_model_len: int = 2048
    max_prefill_chunk_tokens: int = EngineConfig.max_prefill_chunk_tokens  # 0: the whole step budget
    # Admission keeps this fraction of the pool free, so new requests do not force
    # preemptions of running ones on their next decode.
    admission_watermark: float = 0.01
    # Speculative decoding: drafts fill a step only up to this many tokens, decodes included (0: no cap).
    max_step_tokens_with_drafts: int = EngineConfig.speculative_ngram_max_step_tokens

    @classmethod
    def from_engine(cls, config: EngineConfig, max_model_len: int) -> "SchedulerConfig":
        return cls(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                   max_model_len=max_model_len, max_prefill_chunk_tokens=config.max_prefill_chunk_tokens,
                   max_step_tokens_with_drafts=config.speculative_ngram_max_step_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Request] = []  # kept sorted by _waiting_key
        self.running: list[Request] = []  # kept sorted by Request.sort_key
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._watermark_blocks = int(config.admission_watermark * block_manager.num_blocks)
        # Request id -> the chain hashes of its full blocks, as far as they were needed (prefix siblings).
        self._block_hashes: dict[str, _BlockHashes] = {}
        self.num_preemptions = 0
        # Speculative decoding, since the start: drafts verified, their tokens, and the tokens confirmed.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        # Set by the worker loop while memory is HIGH or worse: waiting requests stay waiting,
        # except one when nothing runs (so the worker always makes progress).
        self.admission_paused = False

    # ---- admission -------------------------------------------------------------------
    def check_can_serve(self, prompt_len: int, max_tokens: int) -> None:
        """Raise RequestRejectedError if a request of this size can never run."""
        if prompt_len < 1:
            raise RequestRejectedError("prompt is empty: at least one token is required")
        total = prompt_len + max_tokens
        if total > self.config.max_model_len:
            raise RequestRejectedError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_model_len {self.config.max_model_len}")
        blocks = -(-total // self.blocks.block_size)
        if blocks > self.blocks.num_blocks:
            raise RequestRejectedError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {blocks} KV blocks "
                f"but the pool has only {self.blocks.num_blocks}")

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_can_serve(request.num_prompt_tokens, request.params.max_tokens)
        request.arrival_seq = next(self._arrivals)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_waiting_key)

    # ---- the step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        config, blocks = self.config, self.blocks
        budget = config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[Request] = []
        # Decodes first, then unfinished prompt chunks: a running decode never waits
        # behind more than one chunk.
        running = self.running
        order = [r for r in running if len(r.token_ids) - r.num_computed_tokens <= 1]
        if len(order) < len(running):
            order += [r for r in running if len(r.token_ids) - r.num_computed_tokens > 1]
        spare = draft_budget(len(order), config.max_step_tokens_with_drafts, config.max_num_batched_tokens)
        for request in order:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, budget)
            draft = draft_for(request, num_new, min(budget - 1, spare)) if request.speculation is not None else ()
            # A draft never preempts anyone: with the pool short the request decodes one token as usual.
            if draft and blocks.allocate_slots(request.request_id, request.num_computed_tokens + 1 + len(draft)):
                scheduled[request.request_id] = ScheduledRequest(request, 1 + len(draft), tuple(draft))
                budget -= 1 + len(draft)
                spare -= len(draft)
                continue
            while not blocks.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                victim = self._pick_victim(request, scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = ScheduledRequest(request, num_new)
                budget -= num_new
        if not preempted and self.waiting:
            max_running = config.max_num_seqs
            if self.admission_paused:
                max_running = 0 if self.running else 1
            budget = self._admit(budget, scheduled, max_running)
        return SchedulerOutput(list(scheduled.values()), preempted)

    def _admit(self, budget: int, scheduled: dict[str, ScheduledRequest], max_running: int) -> int:
        # First block hash -> the requests of this step that still have a full block to compute:
        # the leaders a queued request with the same prompt start waits for. Built only when needed.
        leaders: dict[bytes, list[Request]] | None = None
        position = 0  # deferred requests keep their place: admission goes on behind them
        while position < len(self.waiting) and budget > 0 and len(self.running) < max_running:
            request = self.waiting[position]
            if self.blocks.enable_prefix_caching:
                if leaders is None:
                    leaders = {}
                    for item in scheduled.values():
                        self._add_leader(leaders, item.request)
                if self._waits_for_leader(request, leaders):
                    position += 1
                    continue
            if not self.blocks.has_request(request.request_id):
                cached = self.blocks.allocate_prefix(request.request_id, request.token_ids, request.max_cached_tokens)
                request.num_computed_tokens = cached
                if request.status == RequestStatus.WAITING:
                    request.num_cached_tokens = cached
            num_new = self._num_new_tokens(request, budget)
            if not self._try_allocate(request, num_new):
                self.blocks.free(request.request_id)  # give back its prefix-cache hits
                request.num_computed_tokens = 0
                break
            self._start(position, num_new, scheduled)
            budget -= num_new
            if leaders is not None:
                self._add_leader(leaders, request)
        return budget

    # ---- prefix siblings (see the module docstring) -------------------------------------
    def _hashes(self, request: Request) -> "_BlockHashes":
        hashes = self._block_hashes.get(request.request_id)
        if hashes is None:
            hashes = self._block_hashes[request.request_id] = _BlockHashes(request.token_ids, self.blocks.block_size)
        return hashes

    def _add_leader(self, leaders: dict[bytes, list[Request]], request: Request) -> None:
        """Index a request scheduled this step by its first block hash, if it still has a full block
        of its known tokens to compute (this step or later)."""
        block_size = self.blocks.block_size
        if request.num_tokens // block_size > request.num_computed_tokens // block_size:
            leaders.setdefault(self._hashes(request).get(0), []).append(request)

    def _waits_for_leader(self, request: Request, leaders: dict[bytes, list[Request]]) -> bool:
        """Whether a queued request should wait: a leader of this step has still to compute a full block
        that the two share and that the request could take from the prefix cache once computed."""
        if not leaders:
            return False
        block_size = self.blocks.block_size
        # The blocks allocate_prefix may hand it.
        num_cacheable = request.max_cached_tokens // block_size
        if num_cacheable == 0:
            return False
        hashes = self._hashes(request)
        for leader in leaders.get(hashes.get(0), ()):
            # The leader's first block not yet computed (so not cached by it). The hash chain makes a
            # match there a match on every block before it, so this one block decides.
            index = leader.num_computed_tokens // block_size
            if index < num_cacheable and index < leader.num_tokens // block_size and (
                    index == 0 or hashes.get(index) == self._hashes(leader).get(index)):
                return True
        return False

    def _try_allocate(self, request: Request, num_new: int) -> bool:
        total = request.num_computed_tokens + num_new
        needed = self.blocks.num_new_blocks_needed(request.request_id, total)
        # With nothing running, nothing will ever free blocks: the watermark may be spent.
        reserve = self._watermark_blocks if self.running else 0
        if needed + reserve > self.blocks.num_free_blocks:
            return False
        return self.blocks.allocate_slots(request.request_id, total)

    def _start(self, position: int, num_new: int, scheduled: dict[str, ScheduledRequest]) -> None:
        request = self.waiting.pop(position)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_s is None:
            request.first_scheduled_s = time.monotonic()
        bisect.insort(self.running, request, key=lambda r: r.sort_key)
        scheduled[request.request_id] = ScheduledRequest(request, num_new)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = min(len(request.token_ids) - request.num_computed_tokens, budget)
        chunk_cap = self.config.max_prefill_chunk_tokens
        return min(num_new, chunk_cap) if chunk_cap else num_new

    def _pick_victim(self, request: Request, scheduled: dict[str, ScheduledRequest]) -> Request:
        """Lowest priority, then newest, among running requests not already given work
        this step; the requester itself when it ranks lowest."""
        candidates = [r for r in self.running if r.request_id not in scheduled and r.status == RequestStatus.RUNNING]
        return max(candidates, key=lambda r: r.sort_key)  # `request` is always a candidate

    def preempt_lowest(self) -> Request | None:
        """Preempt (recompute) the lowest-priority running request, newest first among equals,
        as the loop asks under memory pressure. Never the last running request: preempting it
        could not relieve pressure that the pool does not cause, and would stop all progress."""
        if len(self.running) <= 1:
            return None
        victim = self.running[-1]  # kept sorted by sort_key: the far end is the lowest priority
        self._preempt(victim)
        return victim

    def _preempt(self, request: Request) -> None:
        # Recompute: drop the K/V, keep the tokens, go back to the front of the queue.
        self.blocks.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    # ---- after the step ---------------------------------------------------------------
    def update(self, scheduled: list[ScheduledRequest], results: Sequence[StepResult]) -> list[RequestUpdate]:
        """Apply a step's results: advance each request's computed tokens, register its newly full
        blocks in the prefix cache, append the sampled token, and finish the requests that hit a
        stop condition or failed. Returns an update for each request that sampled or finished."""
        updates = []
        blocks = self.blocks
        for item, result in zip(scheduled, results, strict=True):
            request = item.request
            request.peak_num_blocks = max(request.peak_num_blocks, blocks.num_blocks_held(request.request_id))
            if isinstance(result, StepFailure):
                self.finish(request, RequestStatus.FINISHED_ERROR, result.error)
                updates.append(RequestUpdate(request, ()))
                continue
            if item.draft_token_ids:
                updates.append(self._apply_verified(item, result))
                continue
            request.num_computed_tokens += item.num_new_tokens
            blocks.cache_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
            if result is None:
                continue
            token_id, logprob, top = result
            params = request.params
            request.append_token(token_id, logprob if params.logprobs else None, top if params.top_logprobs else None)
            is_first = request.first_token_s is None and self._note_first_token(request)
            status = request.stop_status()
            if status is not None:
                self.finish(request, status)
            updates.append(RequestUpdate(request, (token_id,), is_first))
        return updates

    def _apply_verified(self, item: ScheduledRequest, results: list[SampledToken]) -> RequestUpdate:
        """A decode that verified a draft: take the tokens sampling confirmed (worker/drafts.py), then
        register the computed blocks, and finish the request or give back the blocks of the rest."""
        request, draft = item.request, item.draft_token_ids
        new_token_ids, accepted, status = take_verified(request, draft, results)
        self.num_drafts += 1
        self.num_draft_tokens += len(draft)
        self.num_accepted_draft_tokens += accepted
        self.blocks.cache_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
        is_first = self._note_first_token(request)
        if status is not None:
            self.finish(request, status)
        else:
            # The slots past the computed tokens hold only rejected drafts' K/V: their blocks go back.
            self.blocks.trim_slots(request.request_id, request.num_computed_tokens)
        return RequestUpdate(request, tuple(new_token_ids), is_first, len(draft), accepted)

    @staticmethod
    def _note_first_token(request: Request) -> bool:
        """Stamp the first token sampled on this worker; True if it is that one."""
        if request.first_token_s is not None:
            return False
        request.first_token_s = time.monotonic()
        return True

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Move a live request to a terminal status and free everything it holds."""
        assert status.is_finished
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        if error is not None or status == RequestStatus.FINISHED_ERROR:
            request.error = error  # else keep what stop_status said (a constraint's cut)
        self.blocks.free(request.request_id)
        del self.requests[request.request_id]
        self._block_hashes.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        """Abort from any state; unknown or already finished ids are a no-op."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)


def _waiting_key(request: Request) -> tuple[int, int, int]:
    # Preempted requests resume before anything new, then priority, then arrival.
    return (0 if request.status == RequestStatus.PREEMPTED else 1, *request.sort_key)


class _BlockHashes:
    """One request's chain of full-block hashes (the block manager's), computed lazily and once: the
    tokens of a full block never change, so the hashes found so far stay valid as the request grows."""

    __slots__ = ("_token_ids", "_block_size", "_hashes")

    def __init__(self, token_ids: list[int], block_size: int):
        self._token_ids = token_ids  # the request's own list (it only grows), read when a hash is needed
        self._block_size = block_size
        self._hashes: list[bytes] = []

    def get(self, index: int) -> bytes:
        """The hash of full block `index`; the caller checks the block is full."""
        hashes, size = self._hashes, self._block_size
        while len(hashes) <= index:
            start = len(hashes) * size
            hashes.append(hash_block(hashes[-1] if hashes else b"", self._token_ids[start:start + size]))
        return hashes[index]
