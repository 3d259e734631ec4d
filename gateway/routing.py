"""The routing policy: which worker a queued request goes to (`[dispatch]` in the config).

`cache_aware` sends a request to the worker whose prefix cache holds the longest prefix of its
prompt (exactly, from the workers' own reports: gateway/prefix_index.py), ties to the least
loaded, unless that worker is overloaded against the least-loaded one by both thresholds, in
which case balance wins. A request whose prefix no worker holds goes to its session's worker
(sticky) while that one is not overloaded, else spreads to the worker with the most room (ties
to the one caching least), as `least_loaded` does for every request. `round_robin` takes the workers in turn per batch.
Only workers that can take the request now (ready, a free slot, blocks for its prompt) are
candidates, so no policy routes beyond what a worker said it can take.
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
        loads = {w.worker_id: w.load_tokens() + pending.get(w.worker_id, 0) for w in candidates}
        least = min(candidates, key=lambda w: (loads[w.worker_id], -w.free_slots(), w.worker_id))
        if policy == "cache_aware":
            best_blocks = max(matched.values())
            if best_blocks > 0:
                best = min((w for w in candidates if matched[w.worker_id] == best_blocks),
                           key=lambda w: (loads[w.worker_id], w.worker_id))
                if self._overloaded(loads[best.worker_id], loads[least.worker_id]):
                    return Route(least, "balanced", self._predicted(state, least, matched[least.worker_id]))
                return Route(best, "cache_hit", self._predicted(state, best, best_blocks))
        home = self._session_worker(state, candidates)
        if home is not None and not self._overloaded(loads[home.worker_id], loads[least.worker_id]):
            return Route(home, "sticky", self._predicted(state, home, matched[home.worker_id]))
        worker = self._spread(candidates)
        return Route(worker, "spread", self._predicted(state, worker, matched[worker.worker_id]))

    def committed(self, states: list[RequestState], worker: WorkerHandle) -> None:
        """`states` were sent to `worker`: remember their sessions, and move round_robin on."""
        self._turn += 1
        for state in states:
            if state.session_id:
                self._sessions[state.session_id] = worker.worker_id
                self._sessions.move_to_end(state.session_id)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    # ---- internals -----------------------------------------------------------------------------
    def _spread(self, candidates: list[WorkerHandle]) -> WorkerHandle:
        """The most room; under cache_aware, ties go to the worker caching the least, so new
        conversations spread their caches over idle workers rather than all landing on the first."""
        if self.config.policy != "cache_aware":
            return most_room(candidates)
        return max(candidates, key=lambda w: (w.free_slots(), w.free_blocks(), -len(w.assigned),
                                              -self.index.num_blocks(w.worker_id)))

    def _overloaded(self, load: int, least_load: int) -> bool:
        c = self.config
        return load - least_load > c.balance_abs_tokens and load > least_load * c.balance_rel

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
        return matched

    def _block_size(self, worker: WorkerHandle) -> int:
        return self.index.block_size(worker.worker_id) or (worker.heartbeat.block_size if worker.heartbeat else 0) or 16

    def _predicted(self, state: RequestState, worker: WorkerHandle, blocks: int) -> int:
        # The worker computes at least the last token itself, so it uses only the blocks before it.
        block_size = self._block_size(worker)
        usable = (len(state.prompt_ids) + len(state.output_ids) - 1) // block_size
        return min(blocks, usable) * block_size


def block_hashes(state: RequestState, block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks the worker will prefill for `state` (its prompt and
    any tokens already streamed, on a resume), computed once per block size and length."""
    key = (block_size, len(state.output_ids))
    cached = state.block_hashes
    if cached is None or cached[0] != key:
        cached = state.block_hashes = (key, chain_hashes(state.prompt_ids + state.output_ids, block_size))
    return cached[1]
