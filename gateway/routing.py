"""The routing policy: which worker a queued request goes to (`[dispatch]` in the config).

`cache_aware` estimates what the request would cost on each candidate, in prefill tokens, and picks
the cheapest (ties: the least loaded, then the one caching least):
    its tokens not in that worker's prefix cache (exactly, from the workers' own reports:
    gateway/prefix_index.py)
  + a load term: C x (tokens the worker holds, queued or running, with this one's) / (its KV
    cache in tokens), the worker's busy share priced in the same unit.
C depends on what the request's longest cached prefix is. The history of its own conversation (no
other routed prompt went on from where the match ends): C = load_cost_tokens, small, so the turn
stays with the worker holding its history unless the load there outweighs recomputing it. A prefix
other conversations share (a system prompt: other routed prompts branch where the match ends), or
none: C = new_conversation_load_cost_tokens, larger, since the request starts a conversation whose
later turns follow it; new conversations spread over the workers, each computing the shared
prefix once, instead of all joining the few that already hold it. The load counts each request's
prompt and the tokens it has streamed. A worker where the request would start at once (a running
slot free, counting those routed to it in this pass) comes before one where it would queue behind
running requests, whatever either caches: waiting for a slot costs more than recomputing a prefix.
A request cached nowhere that names a session, and continues the session's last routed prompt (its
blocks begin with all of that prompt's full blocks: a conversation's next turn, another choice of
the same prompt), counts the session's worker as holding that prompt before the worker has reported
it (`sticky`); a request of the session that does not continue it is routed like any other, so one
`user` shared by unrelated requests does not pin them to one worker. `least_loaded` takes the most
room (sessions still sticky); `round_robin` the workers in turn per batch. Only workers that can
take the request now are candidates (the dispatcher's filter: ready, a free slot, blocks for its
prompt), so no policy routes beyond what a worker said it can take.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gateway.prefix_index import PrefixIndex
from gateway.streams import RequestState
from gateway.workers import WorkerHandle
from shared.block_hash import chain_hashes
from shared.config import DispatchConfig

MAX_SESSIONS = 1 << 16  # sessions remembered (least recently routed forgotten first)
OUTCOMES = ("cache_hit", "balanced", "sticky", "spread")
DEFAULT_BLOCK_SIZE = 16  # a worker that has not reported one yet


@dataclass(frozen=True, slots=True)
class SessionMark:
    """Where a session's last request went, and the last full block of its prompt there."""
    worker_id: str
    block_size: int
    num_blocks: int
    last_hash: bytes


@dataclass(frozen=True)
class Route:
    worker: WorkerHandle
    outcome: str  # one of OUTCOMES
    predicted_cached_tokens: int  # prompt tokens the worker should find in its prefix cache


def most_room(workers: list[WorkerHandle]) -> WorkerHandle:
    return max(workers, key=lambda w: (w.free_slots(), w.free_blocks(), -len(w.assigned)))


class Router:
    def __init__(self, config: DispatchConfig, index: PrefixIndex):
        self.config = config
        self.index = index
        self._sessions: OrderedDict[str, SessionMark] = OrderedDict()  # by session id, least recently routed first
        self._turn = 0  # round_robin: the next worker, by position among the candidates
        # Block hashes routed to each worker in this dispatch pass: a worker that will compute a
        # prefix for one request counts as holding it for the next ones (n choices of a prompt, a
        # burst sharing a preamble), before any report of it can arrive.
        self._pass_routed: dict[str, set[bytes]] = {}
        self._pass_count: dict[str, int] = {}  # requests routed to each worker in this pass

    def route(self, state: RequestState, candidates: list[WorkerHandle], pending: dict[str, int]) -> Route | None:
        """The worker for `state` among `candidates` (those that can take it now); `pending`: tokens
        already routed to each worker in this pass and not yet counted in its load."""
        if not candidates:
            return None
        policy = self.config.policy
        matched = self._matched_blocks(state, candidates)  # for the prediction under every policy
        if policy == "round_robin":
            worker = sorted(candidates, key=lambda w: w.worker_id)[self._turn % len(candidates)]
            return Route(worker, "spread", self._predicted(state, worker, matched[worker.worker_id]))
        home = self._session_worker(state, candidates)
        if policy == "least_loaded":
            worker = most_room(candidates)
            new_cost = self.config.new_conversation_load_cost_tokens
            held = self._sticky_cached(state, home) if home is not None else None
            if held is not None and (self._runs_now(home) or not self._runs_now(worker)) and \
                    self._sticky_cost(state, home, pending, held) <= self._cost(state, worker, pending, 0, new_cost):
                return Route(home, "sticky", max(held, self._predicted(state, home, matched[home.worker_id])))
            return Route(worker, "spread", self._predicted(state, worker, matched[worker.worker_id]))
        return self._cache_aware(state, candidates, pending, matched, home)

    def begin_pass(self) -> None:
        self._pass_routed.clear()
        self._pass_count.clear()

    def note_routed(self, state: RequestState, worker: WorkerHandle) -> None:
        """`state` goes to `worker` in this pass (before `committed`, which ends the batch)."""
        self._pass_routed.setdefault(worker.worker_id, set()).update(block_hashes(state, self._block_size(worker)))
        self._pass_count[worker.worker_id] = self._pass_count.get(worker.worker_id, 0) + 1

    def committed(self, states: list[RequestState], worker: WorkerHandle) -> None:
        """`states` were sent to `worker`: remember their sessions and where their prompts branch, and
        move round_robin on."""
        self._turn += 1
        block_size = self._block_size(worker)
        for state in states:
            hashes = block_hashes(state, block_size)
            if state.session_id:
                self._sessions[state.session_id] = SessionMark(worker.worker_id, block_size, len(hashes),
                                                               hashes[-1] if hashes else b"")
                self._sessions.move_to_end(state.session_id)
            self.index.note_chain(hashes)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    # ---- cache_aware ---------------------------------------------------------------------------
    def _cache_aware(self, state: RequestState, candidates: list[WorkerHandle], pending: dict[str, int],
                     matched: dict[str, int], home: WorkerHandle | None) -> Route:
        best_blocks = max(matched.values())
        load_cost = self.config.new_conversation_load_cost_tokens
        if best_blocks > 0:
            best = next(w for w in candidates if matched[w.worker_id] == best_blocks)
            if not self.index.is_shared(block_hashes(state, self._block_size(best)), best_blocks):
                load_cost = self.config.load_cost_tokens  # its own conversation's history
        cached = {w.worker_id: self._predicted(state, w, matched[w.worker_id]) for w in candidates}
        costs = {w.worker_id: self._cost(state, w, pending, cached[w.worker_id], load_cost) for w in candidates}
        held = self._sticky_cached(state, home) if best_blocks == 0 and home is not None else None
        if held is not None:
            cached[home.worker_id] = held
            costs[home.worker_id] = self._sticky_cost(state, home, pending, held)
        worker = min(candidates, key=lambda w: (not self._runs_now(w), costs[w.worker_id], self._load(w, pending),
                                                -w.free_slots(), self.index.num_blocks(w.worker_id), w.worker_id))
        if best_blocks == 0:
            outcome = "sticky" if held is not None and worker is home else "spread"
        else:
            outcome = "cache_hit" if matched[worker.worker_id] == best_blocks else "balanced"
        return Route(worker, outcome, cached[worker.worker_id])

    def _cost(self, state: RequestState, worker: WorkerHandle, pending: dict[str, int], cached_tokens: int,
              load_cost: float) -> float:
        """What `state` would cost on `worker`, in prefill tokens (the module's docstring)."""
        tokens = num_tokens(state)
        capacity = max(1, worker.heartbeat.kv_blocks_total if worker.heartbeat else 0) * self._block_size(worker)
        return tokens - cached_tokens + load_cost * (self._load(worker, pending) + tokens) / capacity

    def _sticky_cached(self, state: RequestState, home: WorkerHandle) -> int | None:
        """When `state` continues its session's last routed prompt: the tokens of that prompt the
        session's worker counts as holding. Else None."""
        mark = self._sessions[state.session_id]
        hashes = block_hashes(state, mark.block_size)
        if not mark.num_blocks or len(hashes) < mark.num_blocks or hashes[mark.num_blocks - 1] != mark.last_hash:
            return None
        return self._predicted(state, home, mark.num_blocks)

    def _sticky_cost(self, state: RequestState, home: WorkerHandle, pending: dict[str, int], cached: int) -> float:
        """The session's worker holds the conversation's own history: load weighed as for a cached
        history (n choices of a prompt stay together even on a small KV cache)."""
        return self._cost(state, home, pending, cached, self.config.load_cost_tokens)

    def _runs_now(self, worker: WorkerHandle) -> bool:
        """A request sent to `worker` now would start at once: a running slot is free beyond the
        requests it holds and those routed to it in this pass."""
        hb = worker.heartbeat
        return hb is None or len(worker.assigned) + self._pass_count.get(worker.worker_id, 0) < hb.max_num_seqs

    @staticmethod
    def _load(worker: WorkerHandle, pending: dict[str, int]) -> int:
        return worker.load_tokens() + pending.get(worker.worker_id, 0)

    # ---- internals -----------------------------------------------------------------------------
    def _session_worker(self, state: RequestState, candidates: list[WorkerHandle]) -> WorkerHandle | None:
        mark = self._sessions.get(state.session_id) if state.session_id else None
        return next((w for w in candidates if mark is not None and w.worker_id == mark.worker_id), None)

    def _matched_blocks(self, state: RequestState, candidates: list[WorkerHandle]) -> dict[str, int]:
        if state.params.prompt_logprobs is not None and not state.output_ids:
            # It scores its prompt, so every position is computed (worker/prompt_logprobs.py): no cache
            # draws it, and it spreads like a prefix cached nowhere.
            return dict.fromkeys((w.worker_id for w in candidates), 0)
        matched: dict[str, int] = {}
        by_size: dict[int, list[str]] = {}
        for w in candidates:
            by_size.setdefault(self._block_size(w), []).append(w.worker_id)
        for block_size, worker_ids in by_size.items():
            matched.update(self.index.match(block_hashes(state, block_size), worker_ids))
        for w in candidates:
            routed = self._pass_routed.get(w.worker_id)
            if routed:
                hashes = block_hashes(state, self._block_size(w))
                leading = next((i for i, h in enumerate(hashes) if h not in routed), len(hashes))
                matched[w.worker_id] = max(matched[w.worker_id], leading)
        return matched

    def _block_size(self, worker: WorkerHandle) -> int:
        return (self.index.block_size(worker.worker_id) or (worker.heartbeat.block_size if worker.heartbeat else 0)
                or DEFAULT_BLOCK_SIZE)

    def _predicted(self, state: RequestState, worker: WorkerHandle, blocks: int) -> int:
        # The worker computes at least the last token itself, so it uses only the blocks before it.
        block_size = self._block_size(worker)
        usable = (num_tokens(state) - 1) // block_size
        return min(blocks, usable) * block_size


def num_tokens(state: RequestState) -> int:
    """The tokens a worker prefills for `state`: its prompt and any tokens already streamed (a resume)."""
    return len(state.prompt_ids) + len(state.output_ids)


def block_hashes(state: RequestState, block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks the worker will prefill for `state` (its prompt and
    any tokens already streamed, on a resume), computed once per block size and length."""
    key = (block_size, len(state.output_ids))
    cached = state.block_hashes
    if cached is None or cached[0] != key:
        cached = state.block_hashes = (key, chain_hashes(state.prompt_ids + state.output_ids, block_size))
    return cached[1]
