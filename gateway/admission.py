"""Admission, shared by every front door (gRPC, the OpenAI HTTP API): from a GenerateRequest to a
queued RequestState, or a Refusal naming the problem and the status to answer with.

One path for both APIs, so the bounds, the tokenizing off the loop, the duplicate-id check, the
live-worker check, the deadline, the queue bounds and the caller's API key (gateway/auth.py:
who it is, its rate limits, its streams and its priority floor) hold the same whichever protocol
a client speaks. Each refusal is logged and counted here, once; the front door only translates it (a gRPC
status, or an HTTP status with OpenAI's error body). `prepare` does the work done once per request
(checks and tokenizing); `enqueue` queues one sequence of it, so `n` choices of one prompt are
tokenized once.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Callable, Iterator

import grpc

from gateway.auth import ANONYMOUS, KeyStore, Principal, retry_after_ms
from gateway.constraints import ConstraintCompiler
from gateway.dispatcher import Dispatcher
from gateway.offload import RELEASE_MIN_CHARS, Offload, OffloadBusyError, should_offload
from gateway.queues import QueueFullError
from gateway.rate_limit import TokenCharge
from gateway.reasoning_parser import reads_reasoning
from gateway.request_log import refuse_request
from gateway.request_table import DuplicateRequestError
from gateway.streams import RequestState
from gateway.tokenizer import Tokenizer
from gateway.tool_parsers import parser_for
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
                 offload: Offload | None = None, keys: KeyStore | None = None):
        self.config = config
        self.keys = keys or KeyStore([])
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.metrics = dispatcher.metrics
        self.offload = offload or Offload(config.gateway.tokenizer_threads)
        self.constraints = ConstraintCompiler(config.model_dir, tokenizer.vocab_size, tokenizer.special.eos_ids)
        self.max_model_len = config.worker.max_model_len or int(
            tokenizer.model_config.get("max_position_embeddings", 2048))
        # The model's tool-call format, which a chat's tool_choice "auto" is read in (None: refused).
        self.tool_parser = parser_for(config.gateway.tool_call_parser, tokenizer.chat_template)
        self.reasoning = reads_reasoning(config.gateway.reasoning_parser, tokenizer.chat_template)
        self.draining = False
        self.num_streams = 0  # admitting or streaming, on every front door
        self.streams_idle = asyncio.Event()
        self.streams_idle.set()

    # ---- callers and streams ------------------------------------------------------------------------
    def authenticate(self, request_id: str, authorization: str | None, generation: bool = True) -> Principal:
        """The caller's principal, or an UNAUTHENTICATED refusal before any work is done. Only a
        generation's refusal is a request: it gets a request-log line and counts in the request
        metrics; any other call's (status, abort, probe, a side route) does not."""
        principal = self.keys.authenticate(authorization)
        if principal is None:
            message = ("a valid API key is required: send it as `authorization: Bearer KEY`" if authorization is None
                       else "the API key is not valid")
            if generation:
                self.refuse(request_id, grpc.StatusCode.UNAUTHENTICATED, message)
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, message)
        return principal

    def acquire_stream(self, request_id: str, principal: Principal = ANONYMOUS) -> None:
        """Take one of the gateway's stream slots (and one of the caller's) for a request's whole
        life, or refuse it; every acquire is paired with one `release_stream`. The caller's
        request rate is charged here, before any work."""
        self.check_room(request_id, principal)
        if principal.requests is not None:
            principal.requests.take(1, time.monotonic())  # there is room: check_room just saw it
        self.num_streams += 1
        principal.num_streams += 1
        self.streams_idle.clear()

    def check_room(self, request_id: str, principal: Principal = ANONYMOUS) -> None:
        """acquire_stream's refusals, taking nothing: the HTTP layer asks before it reads a body, so a
        caller that would be refused costs no parsing."""
        if self.draining:
            self.refuse(request_id, grpc.StatusCode.UNAVAILABLE,
                        "the gateway is draining for shutdown; retry elsewhere", principal=principal)
        limit = self.config.gateway.max_concurrent_streams
        if self.num_streams >= limit:
            self.exhausted(request_id, f"the gateway already serves its maximum of {limit} streams", principal)
        spec = principal.spec
        if spec.max_streams and principal.num_streams >= spec.max_streams:
            self.exhausted(request_id, f"API key {spec.name!r} already has its maximum of {spec.max_streams} streams "
                                       f"open", principal)
        if principal.requests is not None and (wait_s := principal.requests.wait_s(1, time.monotonic())):
            self.refuse(request_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"API key {spec.name!r} is over its rate limit of {spec.requests_per_minute:g} requests per "
                        f"minute; retry after {retry_after_ms(wait_s)} ms", retry_after_ms(wait_s), principal)

    def release_stream(self, principal: Principal = ANONYMOUS) -> None:
        self.num_streams -= 1
        principal.num_streams -= 1
        if self.num_streams == 0:
            self.streams_idle.set()

    @contextlib.contextmanager
    def stream(self, request_id: str, principal: Principal = ANONYMOUS) -> Iterator[None]:
        self.acquire_stream(request_id, principal)
        try:
            yield
        finally:
            self.release_stream(principal)

    # ---- admission ---------------------------------------------------------------------------------
    async def prepare(self, request: inference_pb2.GenerateRequest, request_id: str,
                      cancelled_status: Callable[[], grpc.StatusCode], principal: Principal = ANONYMOUS,
                      copies: int = 1) -> ValidatedRequest:
        """Check, then tokenize and validate; large inputs on a pool thread. `cancelled_status` names
        the status a client that went away while its prompt was tokenized saw, for the log. The
        caller's tokens per minute are charged for `copies` sequences of prompt + max_tokens."""
        try:
            check_request_id(request_id)
            num_chars = check_sizes(request, self.config.gateway)  # lengths only: before any work on contents
        except InvalidRequest as e:
            self.refuse(request_id, e.code, e.message, principal=principal)
        if self.dispatcher.requests.is_live(request_id, principal.name):  # cheap now; checked again at submit
            self.refuse_duplicate(request_id, principal)
        # Only a request that sets no max_tokens is fitted into a worker's pool.
        room = (None if request.sampling.HasField("max_tokens")
                else self.dispatcher.registry.largest_pool_tokens(time.monotonic()) or self.max_model_len)
        default_max_tokens = (self.config.gateway.chat_default_max_tokens or room if request.messages and room
                              else self.config.gateway.default_max_tokens)
        args = (request, self.tokenizer, self.max_model_len, default_max_tokens, self.constraints, room)
        try:
            # A constraint is checked against the vocabulary (a lexer build): never on the loop.
            large = should_offload(num_chars, len(request.messages))
            if large or request.sampling.HasField("structured_output"):
                checked = await self.offload.run(validate, *args, release_memory=num_chars >= RELEASE_MIN_CHARS,
                                                 large=large)
            else:
                checked = validate(*args)
        except InvalidRequest as e:
            self.refuse(request_id, e.code, e.message, principal=principal)
        except OffloadBusyError as e:
            self.exhausted(request_id, str(e), principal)
        except asyncio.CancelledError:
            refuse_request(request_id, cancelled_status().name,
                           "the request ended while its prompt was being tokenized", self.metrics, principal.name)
            raise
        if not self.dispatcher.has_live_worker():
            self.refuse(request_id, grpc.StatusCode.UNAVAILABLE, "no worker is alive to serve requests",
                        principal=principal)
        # A sequence holds its prompt and every token it may write in one worker's KV pool: one that
        # no live worker's whole pool can hold would wait in the queue until its deadline.
        per_sequence = len(checked.prompt_ids) + checked.params.max_tokens
        pool = self.dispatcher.registry.largest_pool_tokens(time.monotonic())
        if pool and per_sequence > pool:
            self.refuse(request_id, grpc.StatusCode.INVALID_ARGUMENT,
                        f"prompt ({len(checked.prompt_ids)} tokens) + max_tokens ({checked.params.max_tokens}) = "
                        f"{per_sequence} tokens, more than the largest worker's KV pool holds ({pool} tokens: "
                        f"worker.num_kv_blocks x block_size)", principal=principal)
        if principal.tokens is not None:
            self._charge_tokens(request_id, principal, copies * per_sequence,
                                None if request.sampling.HasField("max_tokens") else checked.params.max_tokens)
            checked = dataclasses.replace(checked, charge=TokenCharge(principal.tokens, per_sequence,
                                                                      checked.params.max_tokens, copies))
        return checked

    def _charge_tokens(self, request_id: str, principal: Principal, num_tokens: int,
                       defaulted_max_tokens: int | None) -> None:
        wait_s = principal.tokens.take(num_tokens, time.monotonic())
        if not wait_s:
            return
        spec = principal.spec
        hint = ("it is more than the key may use in a minute" if retry_after_ms(wait_s) is None
                else f"retry after {retry_after_ms(wait_s)} ms")
        if defaulted_max_tokens is not None:
            hint += f" (max_tokens was not set, so it is {defaulted_max_tokens}: set a smaller one)"
        self.refuse(request_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"API key {spec.name!r} is over its rate limit of {spec.tokens_per_minute:g} tokens per minute: "
                    f"this request needs {num_tokens} (prompt + max_tokens); {hint}", retry_after_ms(wait_s), principal)

    def enqueue(self, checked: ValidatedRequest, request_id: str, arrival_s: float, timeout_s: float | None,
                params: SamplingParams | None = None, session_id: str = "", principal: Principal = ANONYMOUS,
                group_id: str = "") -> RequestState:
        """Queue one sequence of a prepared request (with `params` in place of its own, for the
        n-th choice of several, and `session_id` when the request names none), within the client's
        timeout and the gateway's own."""
        gateway = self.config.gateway
        limits = [t for t in (timeout_s, gateway.request_timeout_s or None) if t is not None]
        session_id = (checked.session_id or session_id) if self.config.dispatch.sticky_sessions else ""
        state = RequestState(request_id=request_id, internal_id=self.dispatcher.requests.new_id(),
                             prompt_ids=checked.prompt_ids, params=params or checked.params,
                             priority=principal.priority(checked.priority), tokenizer=self.tokenizer,
                             arrival_s=arrival_s, session_id=session_id, owner=principal.name, group_id=group_id,
                             deadline_s=arrival_s + min(limits) if limits else None,
                             stream_interval=gateway.stream_interval, hold_s=gateway.stream_hold_ms / 1e3,
                             on_finished=checked.charge.sequence_ended if checked.charge else None)
        try:
            self.dispatcher.submit(state)
        except QueueFullError as e:
            self.exhausted(request_id, str(e), principal)
        except DuplicateRequestError:  # another one with this id was admitted while we tokenized
            if group_id and group_id != request_id:  # the id of one of several sequences, not the client's
                self.refuse(group_id, grpc.StatusCode.ALREADY_EXISTS,
                            f"request_id {group_id!r} cannot be used now: one of its sequences would run as "
                            f"{request_id!r}, the id of a request already in flight", principal=principal)
            self.refuse_duplicate(request_id, principal)
        if checked.charge is not None:
            checked.charge.queued()
        return state

    @staticmethod
    def release_unqueued(prepared: list[ValidatedRequest]) -> None:
        """Give back the rate-limit charge of every sequence of `prepared` not queued: the request
        was refused, or its client went away, part-way."""
        for checked in prepared:
            if checked.charge is not None:
                checked.charge.release_unqueued()

    async def admit(self, request: inference_pb2.GenerateRequest, request_id: str, arrival_s: float,
                    timeout_s: float | None, cancelled_status: Callable[[], grpc.StatusCode],
                    principal: Principal = ANONYMOUS) -> RequestState:
        checked = await self.prepare(request, request_id, cancelled_status, principal)
        try:
            return self.enqueue(checked, request_id, arrival_s, timeout_s, principal=principal)
        except Refusal:
            self.release_unqueued([checked])
            raise

    def cancel(self, states: list[RequestState], code: grpc.StatusCode | None = None) -> None:
        """Stop whichever of `states` are still running (the client went away or one of them failed;
        `code`: the status the request ends with). Their finish reason is "error" for a deadline,
        however it was noticed first (our timer or the RPC's), else "abort"."""
        reason = "error" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "abort"
        for state in states:
            if not state.is_finished:
                self.dispatcher.cancel(state.internal_id, reason)

    # ---- refusals ----------------------------------------------------------------------------------
    def refuse(self, request_id: str, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
               principal: Principal = ANONYMOUS):
        refuse_request(request_id, code.name, message, self.metrics, principal.name)
        raise Refusal(code, message, retry_after_ms)

    def refuse_duplicate(self, request_id: str, principal: Principal = ANONYMOUS):
        self.refuse(request_id, grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight",
                    principal=principal)

    def exhausted(self, request_id: str, message: str, principal: Principal = ANONYMOUS):
        retry_ms = self.config.queues.retry_after_ms
        self.refuse(request_id, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message}; retry after {retry_ms} ms", retry_ms,
                    principal)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling of choice `index` of several from one request: distinct seeds derived from the
    request's (so the choices differ, and each is reproducible), the request's own for choice 0."""
    if index == 0 or params.seed is None:
        return params
    mixed = (params.seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03) & (2**64 - 1)
    return dataclasses.replace(params, seed=(mixed ^ (mixed >> 29)) % 2**63)
