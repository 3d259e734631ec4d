"""The worker's side of the wire: commands in, step outputs and heartbeats out.

The heartbeat runs on its own thread with its own socket, so a long step never makes a
live worker look dead; it reports the snapshot the loop last published (and how old it is).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from protos import worker_pb2
from shared.ipc import WorkerSocket


@dataclass
class LoadSnapshot:
    """What the loop publishes after every step; the heartbeat thread only reads it."""
    ready: bool = False
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    memory_used_bytes: int = 0
    memory_limit_bytes: int = 0
    memory_level: str = "OK"
    progress_s: float = field(default_factory=time.monotonic)  # when the loop last stepped or idled


@dataclass(frozen=True)
class StaticInfo:
    max_num_seqs: int
    max_queued: int
    block_size: int
    max_model_len: int
    vocab_size: int
    device: str


class HeartbeatThread(threading.Thread):
    def __init__(self, endpoint: str, worker_id: str, incarnation: str, interval_s: float, info: StaticInfo):
        super().__init__(name=f"heartbeat-{worker_id}", daemon=True)
        self._args = (endpoint, worker_id, incarnation)
        self._interval_s = interval_s
        self._info = info
        self._stop = threading.Event()
        self.snapshot = LoadSnapshot()  # replaced whole by the loop: an atomic reference swap

    def run(self) -> None:
        socket = WorkerSocket(*self._args, routed=False)
        try:
            while not self._stop.is_set():
                socket.send(self._heartbeat())
                self._stop.wait(self._interval_s)
        finally:
            socket.close()

    def _heartbeat(self) -> worker_pb2.Envelope:
        s, info = self.snapshot, self._info
        return worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat(
            ready=s.ready, num_running=s.num_running, num_waiting=s.num_waiting,
            max_num_seqs=info.max_num_seqs, max_queued=info.max_queued,
            kv_blocks_total=s.kv_blocks_total, kv_blocks_free=s.kv_blocks_free, kv_blocks_cached=s.kv_blocks_cached,
            block_size=info.block_size, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            memory_used_bytes=s.memory_used_bytes, memory_limit_bytes=s.memory_limit_bytes,
            memory_level=s.memory_level, last_step_age_s=time.monotonic() - s.progress_s, device=info.device))

    def stop(self) -> None:
        self._stop.set()
