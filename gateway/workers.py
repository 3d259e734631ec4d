"""What the gateway knows of each worker: its last heartbeat, liveness and the work it holds.

Liveness is judged only on this process's clock: the time a heartbeat arrived here, and
the durations the worker reports. A new incarnation id means the worker process restarted,
so everything the old one held is lost.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from protos import worker_pb2


@dataclass
class WorkerHandle:
    worker_id: str
    incarnation: str = ""
    heartbeat: worker_pb2.Heartbeat | None = None
    last_seen_s: float = -math.inf  # monotonic, on the gateway's clock
    assigned: set[str] = field(default_factory=set)  # request ids sent and not finished
    blocks_reserved: int = 0  # prompt blocks of requests sent since the last heartbeat
    num_incarnations: int = 0
    was_alive: bool = False

    def heartbeat_age_s(self, now_s: float | None = None) -> float:
        return (time.monotonic() if now_s is None else now_s) - self.last_seen_s

    def is_alive(self, timeout_s: float, now_s: float | None = None) -> bool:
        return self.heartbeat is not None and self.heartbeat_age_s(now_s) <= timeout_s

    def is_ready(self, timeout_s: float, now_s: float | None = None) -> bool:
        return self.is_alive(timeout_s, now_s) and self.heartbeat.ready

    def can_take(self) -> bool:
        """Dispatchable: ready and below the HIGH memory level."""
        return self.heartbeat is not None and self.heartbeat.ready and self.heartbeat.memory_level == "OK"

    def free_slots(self) -> int:
        hb = self.heartbeat
        return 0 if hb is None else max(0, hb.max_num_seqs + hb.max_queued - len(self.assigned))

    def free_blocks(self) -> int:
        hb = self.heartbeat
        return 0 if hb is None else max(0, hb.kv_blocks_free - self.blocks_reserved)

    def blocks_for(self, num_tokens: int) -> int:
        size = self.heartbeat.block_size if self.heartbeat and self.heartbeat.block_size else 16
        return -(-num_tokens // size)


class WorkerRegistry:
    def __init__(self, worker_ids: list[str], heartbeat_timeout_s: float):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers: dict[str, WorkerHandle] = {w: WorkerHandle(w) for w in worker_ids}

    def get(self, worker_id: str) -> WorkerHandle:
        if worker_id not in self.workers:  # a worker the config did not name: accept it
            self.workers[worker_id] = WorkerHandle(worker_id)
        return self.workers[worker_id]

    def on_message(self, envelope: worker_pb2.Envelope, now_s: float) -> set[str]:
        """Record that the worker is alive; returns the requests lost if it restarted."""
        worker = self.get(envelope.worker_id)
        lost: set[str] = set()
        if envelope.incarnation != worker.incarnation:
            if worker.incarnation:
                lost = set(worker.assigned)
                worker.assigned.clear()
            worker.incarnation = envelope.incarnation
            worker.num_incarnations += 1
            worker.heartbeat = None
            worker.blocks_reserved = 0
        worker.last_seen_s = now_s
        if envelope.WhichOneof("body") == "heartbeat":
            worker.heartbeat = envelope.heartbeat
            worker.blocks_reserved = 0
        return lost

    def reap_dead(self, now_s: float) -> dict[str, set[str]]:
        """Workers whose heartbeats stopped: worker id -> the requests they held (now lost)."""
        dead = {}
        for worker in self.workers.values():
            alive = worker.is_alive(self.heartbeat_timeout_s, now_s)
            if worker.was_alive and not alive:
                dead[worker.worker_id] = set(worker.assigned)
                worker.assigned.clear()
                worker.blocks_reserved = 0
                worker.heartbeat = None
            worker.was_alive = alive
        return dead

    def mark_dead(self, worker_id: str) -> set[str]:
        """A worker that said it is exiting: dead now; returns the requests it held."""
        worker = self.get(worker_id)
        lost = set(worker.assigned)
        worker.assigned.clear()
        worker.blocks_reserved = 0
        worker.heartbeat = None
        worker.last_seen_s = -math.inf
        return lost

    def live(self, now_s: float) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.is_alive(self.heartbeat_timeout_s, now_s)]

    def pick(self, now_s: float, num_tokens: int) -> WorkerHandle | None:
        """The dispatchable worker with the most room for a request of num_tokens prompt tokens."""
        candidates = [w for w in self.live(now_s)
                      if w.can_take() and w.free_slots() > 0 and w.free_blocks() >= w.blocks_for(num_tokens)]
        if not candidates:
            return None
        return max(candidates, key=lambda w: (w.free_slots(), w.free_blocks(), -len(w.assigned)))
