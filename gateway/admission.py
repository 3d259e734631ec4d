"""Admission, shared by every front door (gRPC, the OpenAI HTTP API): from a GenerateRequest to a
queued RequestState, or a Refusal naming the problem and the status to answer with.

One path for both APIs, so the bounds, the tokenizing off the loop, the duplicate-id check, the
live-worker check, the deadline and the queue bounds hold the same whichever protocol a client
speaks. Each refusal is logged and counted here, once; the front door only translates it (a gRPC
status, or an HTTP status with OpenAI's error body). `prepare` does the work done once per request
(checks and tokenizing); `enqueue` queues one sequence of it, so `n` choices of one prompt are
tokenized once.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Callable, Iterator

import grpc

from gateway.constraints import ConstraintCompiler
from gateway.dispatcher import Dispatcher
from gateway.offload import RELEASE_MIN_CHARS, Offload, OffloadBusyError, should_offload
from gateway.queues import QueueFullError
from gateway.request_log import refuse_request
from gateway.request_table import DuplicateRequestError
from gateway.streams import RequestState
from gateway.tokenizer import Tokenizer
from gateway.validation import InvalidRequest, ValidatedRequest, check_request_id, check_sizes, validate
from protos import inference_pb2
from shared.config import ClusterConfig
from shared.sampling_params import SamplingParams


class Refusal(Exception):
    """A request the gateway will not serve; `retry_after_ms` is set when trying later may succeed."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


class Admission:
    def __init__(self, config: ClusterConfig, tokenizer: Tokenizer, dispatcher: Dispatcher,
                 offload: Offload | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.metrics = dispatcher.metrics
        self.offload = offload or Offload(config.gateway.tokenizer_threads)
        self.constraints = ConstraintCompiler(config.model_dir, tokenizer.vocab_size, tokenizer.special.eos_ids)
        self.max_model_len = config.worker.max_model_len or int(
            tokenizer.model_config.get("max_position_embeddings", 2048))
        self.draining = False
        self.num_streams = 0  # admitting or streaming, on every front door
        self.streams_idle = asyncio.Event()
        self.streams_idle.set()

    # ---- streams -----------------------------------------------------------------------------------
    def acquire_stream(self, request_id: str) -> None:
        """Take one of the gateway's stream slots for a request's whole life, or refuse it; every
        acquire is paired with one `release_stream`."""
        if self.draining:
            self.refuse(request_id, grpc.StatusCode.UNAVAILABLE, "the gateway is draining for shutdown; retry elsewhere")
        limit = self.config.gateway.max_concurrent_streams
        if self.num_streams >= limit:
            self.exhausted(request_id, f"the gateway already serves its maximum of {limit} streams")
        self.num_streams += 1
        self.streams_idle.clear()

    def release_stream(self) -> None:
        self.num_streams -= 1
        if self.num_streams == 0:
            self.streams_idle.set()

    @contextlib.contextmanager
    def stream(self, request_id: str) -> Iterator[None]:
        self.acquire_stream(request_id)
        try:
            yield
        finally:
            self.release_stream()

    # ---- admission ---------------------------------------------------------------------------------
    async def prepare(self, request: inference_pb2.GenerateRequest, request_id: str,
                      cancelled_status: Callable[[], grpc.StatusCode]) -> ValidatedRequest:
        """Check, then tokenize and validate; large inputs on a pool thread. `cancelled_status` names
        the status a client that went away while its prompt was tokenized saw, for the log."""
        try:
            check_request_id(request_id)
            num_chars = check_sizes(request, self.config.gateway)  # lengths only: before any work on contents
        except InvalidRequest as e:
            self.refuse(request_id, e.code, e.message)
        if self.dispatcher.requests.is_live(request_id):  # cheap to tell now; checked again at submit
            self.refuse_duplicate(request_id)
        args = (request, self.tokenizer, self.max_model_len, self.config.gateway.default_max_tokens, self.constraints)
        try:
            # A constraint is checked against the vocabulary (a lexer build): never on the loop.
            if should_offload(num_chars, len(request.messages)) or request.sampling.HasField("structured_output"):
                checked = await self.offload.run(validate, *args, release_memory=num_chars >= RELEASE_MIN_CHARS)
            else:
                checked = validate(*args)
        except InvalidRequest as e:
            self.refuse(request_id, e.code, e.message)
        except OffloadBusyError as e:
            self.exhausted(request_id, str(e))
        except asyncio.CancelledError:
            refuse_request(request_id, cancelled_status().name, "the request ended while its prompt was being tokenized",
                           self.metrics)
            raise
        if not self.dispatcher.has_live_worker():
            self.refuse(request_id, grpc.StatusCode.UNAVAILABLE, "no worker is alive to serve requests")
        return checked

    def enqueue(self, checked: ValidatedRequest, request_id: str, arrival_s: float, timeout_s: float | None,
                params: SamplingParams | None = None, session_id: str = "") -> RequestState:
        """Queue one sequence of a prepared request (with `params` in place of its own, for the
        n-th choice of several, and `session_id` when the request names none), within the client's
        timeout and the gateway's own."""
        gateway = self.config.gateway
        limits = [t for t in (timeout_s, gateway.request_timeout_s or None) if t is not None]
        session_id = (checked.session_id or session_id) if self.config.dispatch.sticky_sessions else ""
        state = RequestState(request_id=request_id, internal_id=self.dispatcher.requests.new_id(),
                             prompt_ids=checked.prompt_ids, params=params or checked.params,
                             priority=checked.priority, tokenizer=self.tokenizer, arrival_s=arrival_s,
                             session_id=session_id,
                             deadline_s=arrival_s + min(limits) if limits else None,
                             stream_interval=gateway.stream_interval, hold_s=gateway.stream_hold_ms / 1e3)
        try:
            self.dispatcher.submit(state)
        except QueueFullError as e:
            self.exhausted(request_id, str(e))
        except DuplicateRequestError:  # another one with this id was admitted while we tokenized
            self.refuse_duplicate(request_id)
        return state

    async def admit(self, request: inference_pb2.GenerateRequest, request_id: str, arrival_s: float,
                    timeout_s: float | None, cancelled_status: Callable[[], grpc.StatusCode]) -> RequestState:
        checked = await self.prepare(request, request_id, cancelled_status)
        return self.enqueue(checked, request_id, arrival_s, timeout_s)

    def cancel(self, states: list[RequestState]) -> None:
        """Stop whichever of `states` are still running (the client went away or one of them failed)."""
        for state in states:
            if not state.is_finished:
                self.dispatcher.cancel(state.internal_id)

    # ---- refusals ----------------------------------------------------------------------------------
    def refuse(self, request_id: str, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None):
        refuse_request(request_id, code.name, message, self.metrics)
        raise Refusal(code, message, retry_after_ms)

    def refuse_duplicate(self, request_id: str):
        self.refuse(request_id, grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")

    def exhausted(self, request_id: str, message: str):
        retry_ms = self.config.queues.retry_after_ms
        self.refuse(request_id, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message}; retry after {retry_ms} ms", retry_ms)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling of choice `index` of several from one request: distinct seeds derived from the
    request's (so the choices differ, and each is reproducible), the request's own for choice 0."""
    if index == 0 or params.seed is None:
        return params
    mixed = (params.seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03) & (2**64 - 1)
    return dataclasses.replace(params, seed=(mixed ^ (mixed >> 29)) % 2**63)
