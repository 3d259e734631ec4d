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
prefix once, instead of all joining the few that already hold it. A request cached nowhere that
names a session counts its session's worker as holding all but its last block (`sticky`).
`least_loaded` takes the most room (sessions still sticky); `round_robin` the workers in turn per
batch. Only workers that can take the request now are candidates (the dispatcher's filter: ready, a
free slot, blocks for its prompt), so no policy routes beyond what a worker said it can take.
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
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> the worker that served it last
        self._turn = 0  # round_robin: the next worker, by position among the candidates
        # Block hashes routed to each worker in this dispatch pass: a worker that will compute a
        # prefix for one request counts as holding it for the next ones (n choices of a prompt, a
        # burst sharing a preamble), before any report of it can arrive.
        self._pass_routed: dict[str, set[bytes]] = {}

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
            if home is not None and self._sticky_cost(state, home, pending) <= self._cost(state, worker, pending, 0,
                                                                                          new_cost):
                worker = home
            return Route(worker, "sticky" if worker is home else "spread",
                         self._predicted(state, worker, matched[worker.worker_id]))
        return self._cache_aware(state, candidates, pending, matched, home)

    def begin_pass(self) -> None:
        self._pass_routed.clear()

    def note_routed(self, state: RequestState, worker: WorkerHandle) -> None:
        """`state` goes to `worker` in this pass (before `committed`, which ends the batch)."""
        self._pass_routed.setdefault(worker.worker_id, set()).update(block_hashes(state, self._block_size(worker)))

    def committed(self, states: list[RequestState], worker: WorkerHandle) -> None:
        """`states` were sent to `worker`: remember their sessions and where their prompts branch, and
        move round_robin on."""
        self._turn += 1
        for state in states:
            if state.session_id:
                self._sessions[state.session_id] = worker.worker_id
                self._sessions.move_to_end(state.session_id)
            self.index.note_chain(block_hashes(state, self._block_size(worker)))
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
        if best_blocks == 0 and home is not None:
            costs[home.worker_id] = self._sticky_cost(state, home, pending)
        worker = min(candidates, key=lambda w: (costs[w.worker_id], self._load(w, pending), -w.free_slots(),
                                                self.index.num_blocks(w.worker_id), w.worker_id))
        if best_blocks == 0:
            outcome = "sticky" if worker is home else "spread"
        else:
            outcome = "cache_hit" if matched[worker.worker_id] == best_blocks else "balanced"
        return Route(worker, outcome, cached[worker.worker_id])

    def _cost(self, state: RequestState, worker: WorkerHandle, pending: dict[str, int], cached_tokens: int,
              load_cost: float) -> float:
        """What `state` would cost on `worker`, in prefill tokens (the module's docstring)."""
        tokens = num_tokens(state)
        capacity = max(1, worker.heartbeat.kv_blocks_total if worker.heartbeat else 0) * self._block_size(worker)
        return tokens - cached_tokens + load_cost * (self._load(worker, pending) + tokens) / capacity

    def _sticky_cost(self, state: RequestState, home: WorkerHandle, pending: dict[str, int]) -> float:
        """The session's worker is computing the conversation so far: it counts as holding the prompt,
        the conversation's own history (load weighed as for a cached history: n choices of a prompt
        stay together even on a small KV cache)."""
        usable = (num_tokens(state) - 1) // self._block_size(home) * self._block_size(home)
        return self._cost(state, home, pending, usable, self.config.load_cost_tokens)

    @staticmethod
    def _load(worker: WorkerHandle, pending: dict[str, int]) -> int:
        return worker.load_tokens() + pending.get(worker.worker_id, 0)

    # ---- internals -----------------------------------------------------------------------------
    def _session_worker(self, state: RequestState, candidates: list[WorkerHandle]) -> WorkerHandle | None:
        worker_id = self._sessions.get(state.session_id) if state.session_id else None
        return next((w for w in candidates if w.worker_id == worker_id), None)

    def _matched_blocks(self, state: RequestState, candidates: list[WorkerHandle]) -> dict[str, int]:
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
