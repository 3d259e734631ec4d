"""What the gateway knows of each worker: its last heartbeat, liveness and the work it holds.

The registry is the only writer of a `WorkerHandle`: the dispatcher says what it sent
(`assign`) and what ended (`release`), and reads handles for their room. Liveness is judged
only on this process's clock: the time a heartbeat arrived here, and the durations the worker
reports. Silence counts only from when the gateway's loop could read heartbeats as they came
(`heard_since`, from gateway/loop_lag.py): a worker is dead for missing heartbeats, never for a
busy gateway. A new incarnation id means the worker process restarted, so everything the old
one held is lost.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from protos import worker_pb2


@dataclass
class WorkerHandle:
    worker_id: str
    incarnation: str = ""
    heartbeat: worker_pb2.Heartbeat | None = None
    last_seen_s: float = -math.inf  # monotonic, on the gateway's clock
    assigned: set[str] = field(default_factory=set)  # request ids sent and not finished
    assigned_tokens: dict[str, int] = field(default_factory=dict)  # their tokens: prompt + streamed, as they stream
    blocks_reserved: int = 0  # prompt blocks of requests sent since the last heartbeat
    num_incarnations: int = 0
    was_alive: bool = False
    # Its latest heartbeat said it is stopping (SIGTERM): once gone it left on purpose, and no
    # supervisor brings this process back.
    stopping: bool = False
    # Why its last process exited, as its WorkerExit said (cleared by its next heartbeat), and when.
    exit_reason: str = ""
    exited_s: float = -math.inf
    exited_incarnation: str = ""  # its frames that arrive later (heartbeats travel apart) are dropped

    def heartbeat_age_s(self, now_s: float | None = None) -> float:
        return (time.monotonic() if now_s is None else now_s) - self.last_seen_s

    def is_alive(self, timeout_s: float, now_s: float | None = None, heard_since_s: float = -math.inf) -> bool:
        """Heartbeats fresh: none missed for `timeout_s`, counting from `heard_since_s` at the earliest."""
        now_s = time.monotonic() if now_s is None else now_s
        return self.heartbeat is not None and now_s - max(self.last_seen_s, heard_since_s) <= timeout_s

    def is_ready(self, timeout_s: float, now_s: float | None = None, heard_since_s: float = -math.inf) -> bool:
        return self.is_alive(timeout_s, now_s, heard_since_s) and self.heartbeat.ready

    def can_take(self) -> bool:
        """Dispatchable: ready and below the HIGH memory level, or at HIGH with nothing to do. An
        idle worker has nothing it can free, so it may sit at HIGH for good (its model alone near
        the limit); it gets one request at a time, which its scheduler lets in when nothing runs,
        as it does for its own queue, so it always progresses."""
        hb = self.heartbeat
        if hb is None or not hb.ready:
            return False
        return hb.memory_level == "OK" or (hb.memory_level == "HIGH" and self._idle())

    def _idle(self) -> bool:
        hb = self.heartbeat
        return not self.assigned and hb.num_running == 0 and hb.num_waiting == 0

    def free_slots(self) -> int:
        hb = self.heartbeat
        if hb is None:
            return 0
        slots = max(0, hb.max_num_seqs + hb.max_queued - len(self.assigned))
        return min(slots, 1) if hb.memory_level != "OK" else slots

    def pool_tokens(self) -> int:
        """The prompt + output tokens one request can hold here: its whole KV pool (0 before it reports one)."""
        hb = self.heartbeat
        return hb.kv_blocks_total * hb.block_size if hb is not None and hb.block_size else 0

    def pool_holds(self, num_tokens: int) -> bool:
        """Whether its whole KV pool holds a sequence of `num_tokens` (yes while it reports none)."""
        pool = self.pool_tokens()
        return not pool or pool >= num_tokens

    def free_blocks(self) -> int:
        hb = self.heartbeat
        return 0 if hb is None else max(0, hb.kv_blocks_free - self.blocks_reserved)

    def load_tokens(self) -> int:
        """The tokens of the requests this worker holds (queued or running): its load for routing."""
        return sum(self.assigned_tokens.values())

    def blocks_for(self, num_tokens: int) -> int:
        size = self.heartbeat.block_size if self.heartbeat and self.heartbeat.block_size else 16
        return -(-num_tokens // size)


class WorkerRegistry:
    def __init__(self, worker_ids: list[str], heartbeat_timeout_s: float,
                 heard_since: Callable[[float], float] = lambda now_s: -math.inf):
        """`heard_since(now)`: the time from which a missed heartbeat counts (LoopLag.heard_since)."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers: dict[str, WorkerHandle] = {w: WorkerHandle(w) for w in worker_ids}
        self.local_ids = frozenset(worker_ids)  # launched with the cluster: listed even while down
        self._heard_since = heard_since

    def is_alive(self, worker: WorkerHandle, now_s: float) -> bool:
        return worker.is_alive(self.heartbeat_timeout_s, now_s, self._heard_since(now_s))

    def is_ready(self, worker: WorkerHandle, now_s: float) -> bool:
        return worker.is_ready(self.heartbeat_timeout_s, now_s, self._heard_since(now_s))

    def get(self, worker_id: str) -> WorkerHandle:
        if worker_id not in self.workers:  # a worker the config did not name: accept it
            self.workers[worker_id] = WorkerHandle(worker_id)
        return self.workers[worker_id]

    def has_exited(self, envelope: worker_pb2.Envelope) -> bool:
        """The frame comes from a process that said it exited (a heartbeat sent before its exit
        that arrived after it): it must not bring the worker back to life."""
        worker = self.workers.get(envelope.worker_id)
        return worker is not None and worker.exited_incarnation == envelope.incarnation

    def on_message(self, envelope: worker_pb2.Envelope, now_s: float) -> set[str]:
        """Record that the worker is alive; returns the requests lost if it restarted."""
        worker = self.get(envelope.worker_id)
        lost: set[str] = set()
        if envelope.incarnation != worker.incarnation:
            if worker.incarnation:
                lost = set(worker.assigned)
                worker.assigned.clear()
                worker.assigned_tokens.clear()
            worker.incarnation = envelope.incarnation
            worker.num_incarnations += 1
            worker.heartbeat = None
            worker.blocks_reserved = 0
        worker.last_seen_s = now_s
        if envelope.WhichOneof("body") == "heartbeat":
            worker.exit_reason = ""
            worker.heartbeat = envelope.heartbeat
            worker.blocks_reserved = 0
            worker.stopping = envelope.heartbeat.is_draining
        return lost

    def assign(self, worker_id: str, request_id: str, num_tokens: int) -> None:
        """`request_id` was sent to the worker with `num_tokens` tokens to prefill: it holds a slot,
        and its prompt's blocks are reserved until the next heartbeat reports them."""
        worker = self.get(worker_id)
        worker.assigned.add(request_id)
        worker.assigned_tokens[request_id] = num_tokens
        worker.blocks_reserved += worker.blocks_for(num_tokens)

    def note_tokens(self, worker_id: str, request_id: str, num_tokens: int) -> None:
        """The request generated `num_tokens` more on the worker: they hold its KV as the prompt does."""
        tokens = self.get(worker_id).assigned_tokens
        if request_id in tokens:
            tokens[request_id] += num_tokens

    def release(self, worker_id: str, request_id: str) -> None:
        """The request ended, moved or was cancelled: its slot is free again."""
        worker = self.get(worker_id)
        worker.assigned.discard(request_id)
        worker.assigned_tokens.pop(request_id, None)

    def release_reservations(self, worker_id: str) -> None:
        """A request finished on the worker, so its reported free blocks are about to rise: stop
        holding back the blocks reserved since its last heartbeat rather than wait for the next."""
        self.get(worker_id).blocks_reserved = 0

    def mark_unreachable(self, worker_id: str) -> None:
        """A send found the worker disconnected: nothing more goes to it until it heartbeats again."""
        self.get(worker_id).heartbeat = None

    def note_heard(self, worker_id: str, now_s: float) -> None:
        """A heartbeat from `worker_id` just arrived: it counts as alive for reap_dead's next pass
        even if it dies before that pass, so the requests routed to it meanwhile are reaped too."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.was_alive = worker.was_alive or self.is_alive(worker, now_s)

    def reap_dead(self, now_s: float) -> dict[str, set[str]]:
        """Workers whose heartbeats stopped: worker id -> the requests they held (now lost)."""
        dead = {}
        for worker in self.workers.values():
            alive = self.is_alive(worker, now_s)
            if worker.was_alive and not alive:
                dead[worker.worker_id] = set(worker.assigned)
                worker.assigned.clear()
                worker.assigned_tokens.clear()
                worker.blocks_reserved = 0
                worker.heartbeat = None
            worker.was_alive = alive
        return dead

    def mark_dead(self, worker_id: str, now_s: float, reason: str = "", stopping: bool = False) -> set[str]:
        """A worker that said it is exiting (and why; `stopping`: a stop asked for): dead now;
        returns the requests it held."""
        worker = self.get(worker_id)
        worker.exit_reason, worker.exited_s, worker.exited_incarnation = reason, now_s, worker.incarnation
        worker.was_alive = False  # gone by its own word: not a worker whose heartbeats stopped
        worker.stopping = worker.stopping or stopping
        lost = set(worker.assigned)
        worker.assigned.clear()
        worker.assigned_tokens.clear()
        worker.blocks_reserved = 0
        worker.heartbeat = None
        worker.last_seen_s = -math.inf
        return lost

    def forget_departed(self, now_s: float, after_s: float) -> list[str]:
        """Workers that joined by themselves and have been silent for `after_s`: removed, so the
        table follows the live set. The cluster's own workers stay listed (they come back)."""
        gone = [w.worker_id for w in self.workers.values() if w.worker_id not in self.local_ids and not w.assigned
                and now_s - max(w.last_seen_s, w.exited_s) > after_s]
        for worker_id in gone:
            del self.workers[worker_id]
        return gone

    def live(self, now_s: float) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if self.is_alive(w, now_s)]

    def all_stopping(self) -> bool:
        """Every worker's latest heartbeat said it was stopping: once gone, none comes back."""
        return all(w.stopping for w in self.workers.values())

    def largest_pool_tokens(self, now_s: float) -> int:
        """The most prompt + output tokens one request can hold on any live worker (its whole KV
        pool); 0 before any has reported."""
        return max((w.pool_tokens() for w in self.live(now_s)), default=0)

    def pick(self, now_s: float, num_tokens: int) -> WorkerHandle | None:
        """The dispatchable worker with the most room for a request of num_tokens prompt tokens."""
        candidates = [w for w in self.live(now_s)
                      if w.can_take() and w.free_slots() > 0 and w.free_blocks() >= w.blocks_for(num_tokens)]
        if not candidates:
            return None
        return max(candidates, key=lambda w: (w.free_slots(), w.free_blocks(), -len(w.assigned)))
