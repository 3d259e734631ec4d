"""One request's stream events, batched as they come, with its deadline: shared by every front door.

Everything already queued for a stream leaves as one batch (a message's cost is per message, so a
stream that fell behind catches up instead of paying it per token). One timer per stream, not one
per token: at the deadline a marker event wakes the reader, the request is cancelled on its
worker, and `DeadlinePassed` is raised.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc

from gateway.dispatcher import Dispatcher
from gateway.streams import RequestState, StreamEvent

_DEADLINE = object()


class DeadlinePassed(Exception):
    pass


async def event_batches(state: RequestState, dispatcher: Dispatcher) -> AsyncIterator[list[StreamEvent]]:
    """Batches of a stream's events; the last batch ends with the event that carries the finish reason."""
    timer = (asyncio.get_running_loop().call_at(state.deadline_s, state.events.put_nowait, _DEADLINE)
             if state.deadline_s is not None else None)
    try:
        while True:
            events = [await state.events.get()]
            while not state.events.empty() and events[-1] is not _DEADLINE and events[-1].finish_reason is None:
                events.append(state.events.get_nowait())
            deadline_passed = events[-1] is _DEADLINE
            if deadline_passed:
                events.pop()
            if events:
                yield events
                if events[-1].finish_reason is not None:
                    return
            if deadline_passed:
                dispatcher.cancel(state.internal_id, reason="error")
                state.status_code = grpc.StatusCode.DEADLINE_EXCEEDED
                where = "while running" if state.first_token_s is not None else "before its first token"
                raise DeadlinePassed(f"request {state.request_id} passed its deadline {where}")
    finally:
        if timer is not None:
            timer.cancel()
