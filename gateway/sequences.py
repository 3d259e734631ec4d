"""The sequences of one OpenAI request (its prompts times `n`), read as one stream of events.

Each sequence is its own queued request (its own RequestState, worker and request-log line);
a reader task per sequence feeds one queue, so the answer interleaves choices as their tokens
come. `close` ends whatever is still running (the client went away, or one sequence failed and
so the whole answer did) and logs every sequence once, under the status its client saw.
"""
from __future__ import annotations

import asyncio

import grpc

from gateway.admission import Admission
from gateway.relay import DeadlinePassed, event_batches
from gateway.request_log import finish_request
from gateway.streams import RequestState, StreamEvent


class SequenceFailed(Exception):
    """A sequence ended with an error: the request's answer is that error."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Sequences:
    def __init__(self, admission: Admission, states: list[RequestState]):
        self.admission = admission
        self.states = states
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_open = len(states)
        self._closed = False
        # What the client saw of sequences that did not end on their own, unless close() is told:
        # a stream sets OK once it has sent its end.
        self.outcome = grpc.StatusCode.CANCELLED
        self._tasks = [asyncio.ensure_future(self._read(i, s)) for i, s in enumerate(states)]

    async def _read(self, index: int, state: RequestState) -> None:
        try:
            async for events in event_batches(state, self.admission.dispatcher):
                self._queue.put_nowait((index, events))
        except DeadlinePassed as e:
            self._queue.put_nowait((index, e))

    @property
    def is_done(self) -> bool:
        return self._num_open == 0

    async def next(self) -> tuple[int, list[StreamEvent]]:
        """The next batch of events of some sequence; raises SequenceFailed when one failed."""
        index, item = await self._queue.get()
        if isinstance(item, DeadlinePassed):
            raise SequenceFailed(grpc.StatusCode.DEADLINE_EXCEEDED, str(item))
        last = item[-1]
        if last.status is not None:
            raise SequenceFailed(last.status, last.error)
        if last.finish_reason == "error":
            self.states[index].status_code = grpc.StatusCode.INTERNAL
            raise SequenceFailed(grpc.StatusCode.INTERNAL, f"the worker failed the request: {last.error}")
        if last.finish_reason is not None:
            self._num_open -= 1
        return index, item

    def close(self, code: grpc.StatusCode | None = None) -> bool:
        """Stop every sequence still running and log each under what the client saw: its own error
        status if it had one, else `code` (CANCELLED when the client went away, or the error the
        whole answer became, else `outcome`). True the first time only."""
        if self._closed:
            return False
        self._closed = True
        code = code or self.outcome
        for task in self._tasks:
            task.cancel()
        self.admission.cancel(self.states, code)
        for state in self.states:
            finish_request(state, (state.status_code or code).name, self.admission.metrics)
        return True
