"""ProbeWorker's round trip: a probe sent to one worker over the dispatcher's socket, and the
worker's reply (read by the dispatcher's receive loop) matched back to its caller by id."""
from __future__ import annotations

import asyncio
import itertools
from typing import Awaitable, Callable

from protos import worker_pb2


class WorkerProbes:
    def __init__(self, send: Callable[[str, worker_pb2.Envelope], Awaitable[bool]]):
        self._send = send  # (worker id, envelope) -> whether the worker is connected
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}

    async def ask(self, worker_id: str, deep: bool, memory_report: bool, timeout_s: float) -> worker_pb2.ProbeReply:
        """Ask one worker for a probe reply; TimeoutError if it does not answer in time,
        ConnectionError if it is not connected."""
        probe_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[probe_id] = future
        try:
            sent = await self._send(worker_id, worker_pb2.Envelope(probe=worker_pb2.Probe(
                probe_id=probe_id, deep=deep, memory_report=memory_report)))
            if not sent:
                raise ConnectionError(f"{worker_id} is not connected")
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._waiting.pop(probe_id, None)

    def on_reply(self, reply: worker_pb2.ProbeReply) -> None:
        """A worker's reply; one whose caller gave up (timed out) is dropped."""
        future = self._waiting.pop(reply.probe_id, None)
        if future is not None and not future.done():
            future.set_result(reply)
