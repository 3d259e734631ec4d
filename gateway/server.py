"""The gRPC front door: a thin grpc.aio servicer over the dispatcher, plus health and reflection.

Generate checks sizes, then validates and tokenizes (large inputs on a pool thread,
gateway/offload.py), queues the request and relays its stream events; a client that cancels
or disconnects at any point costs no further compute (the handler's cleanup aborts it
wherever it is). Every RPC is counted and logged once, under the status its client saw.
SIGTERM drains: new requests get UNAVAILABLE, in-flight streams finish within the grace
period, then the process exits 0.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from gateway.dispatcher import Dispatcher
from gateway.metrics import Metrics
from gateway.offload import RELEASE_MIN_CHARS, Offload, OffloadBusyError, should_offload
from gateway.queues import QueueFullError
from gateway.request_log import finish_request, refuse_request
from gateway.request_table import DuplicateRequestError
from gateway.streams import RequestState, StreamEvent
from gateway.tokenizer import Tokenizer
from gateway.validation import InvalidRequest, check_request_id, check_sizes, validate
from protos import inference_pb2, inference_pb2_grpc
from shared.config import ClusterConfig

log = logging.getLogger(__name__)
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
_DEADLINE = object()  # queued by a stream's deadline timer: end the RPC with DEADLINE_EXCEEDED
# A cancellation this close to the deadline is the deadline: gRPC cancels the handler when it passes.
_DEADLINE_SLACK_S = 0.01
_FINISH = {"stop": inference_pb2.FINISH_REASON_STOP, "length": inference_pb2.FINISH_REASON_LENGTH,
           "abort": inference_pb2.FINISH_REASON_ABORT, "error": inference_pb2.FINISH_REASON_ERROR}


def _response(state: RequestState, events: list[StreamEvent]) -> inference_pb2.GenerateResponse:
    """The text and token ids of `events` as one message (a failed event carries none)."""
    text = "".join(e.text for e in events if e.status is None)
    token_ids = [t for e in events if e.status is None for t in e.token_ids]
    return inference_pb2.GenerateResponse(request_id=state.request_id, text=text, token_ids=token_ids,
                                          worker_id=state.worker_id or "")


def _with_ending(response: inference_pb2.GenerateResponse, state: RequestState,
                 last: StreamEvent) -> inference_pb2.GenerateResponse:
    """The stream's last message: finish reason, usage and timing added."""
    response.finish_reason = _FINISH[last.finish_reason]
    response.error = last.error
    response.usage.prompt_tokens = len(state.prompt_ids)
    response.usage.completion_tokens = len(state.output_ids)
    response.usage.cached_prompt_tokens = state.num_cached_tokens
    response.timing.queue_ms = state.queue_ms
    response.timing.time_to_first_token_ms = state.ttft_ms
    response.timing.total_ms = ((state.finished_s or time.monotonic()) - state.arrival_s) * 1e3
    return response


def _cancelled_status(ended_with: grpc.StatusCode | None, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a client saw when its handler was cancelled: the one the gateway had already ended
    the RPC with, else DEADLINE_EXCEEDED if its deadline passed (gRPC cancels the handler then),
    else CANCELLED (the client cancelled or went away)."""
    if ended_with is not None:
        return ended_with
    remaining = context.time_remaining()
    if remaining is not None and remaining <= _DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, config: ClusterConfig, tokenizer: Tokenizer, dispatcher: Dispatcher,
                 offload: Offload | None = None):
        self.config = config
        self.metrics = dispatcher.metrics
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.offload = offload or Offload(config.gateway.tokenizer_threads)
        self.max_model_len = config.worker.max_model_len or int(
            tokenizer.model_config.get("max_position_embeddings", 2048))
        self.draining = False
        self.num_streams = 0  # admitting or streaming
        self.streams_idle = asyncio.Event()
        self.streams_idle.set()

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival_s, remaining_s = time.monotonic(), context.time_remaining()
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        if self.draining:
            await self._refuse(context, request_id, grpc.StatusCode.UNAVAILABLE,
                               "the gateway is draining for shutdown; retry elsewhere")
        if self.num_streams >= self.config.gateway.max_concurrent_streams:
            await self._exhausted(context, request_id, f"the gateway already serves its maximum of "
                                                       f"{self.config.gateway.max_concurrent_streams} streams")
        self._stream_started()
        try:
            state = await self._admit(request, request_id, context, arrival_s, remaining_s)
            code = grpc.StatusCode.OK
            try:
                async for response in self._relay(state, context):
                    yield response
            except (asyncio.CancelledError, GeneratorExit):
                # The RPC ended under the handler: grpc.aio cancels it, or closes it at its `yield`.
                code = _cancelled_status(state.status_code, context)
                raise
            except BaseException:
                code = state.status_code or grpc.StatusCode.UNKNOWN
                raise
            finally:
                # Cancelled, disconnected, deadline or done: make sure no worker keeps computing it.
                if not state.is_finished:
                    self.dispatcher.cancel(state.internal_id)
                finish_request(state, code.name, self.metrics)
        finally:
            self._stream_ended()

    async def _admit(self, request: inference_pb2.GenerateRequest, request_id: str,
                     context: grpc.aio.ServicerContext, arrival_s: float, remaining_s: float | None) -> RequestState:
        """Check, tokenize and queue, or end the RPC with the status that names the problem."""
        gateway = self.config.gateway
        try:
            check_request_id(request_id)
            num_chars = check_sizes(request, gateway)  # lengths only: before any work on the contents
        except InvalidRequest as e:
            await self._refuse(context, request_id, e.code, e.message)
        if self.dispatcher.requests.is_live(request_id):  # cheap to tell now; checked again at submit
            await self._refuse_duplicate(context, request_id)
        try:
            checked = await self._validate(request, num_chars)
        except InvalidRequest as e:
            await self._refuse(context, request_id, e.code, e.message)
        except OffloadBusyError as e:
            await self._exhausted(context, request_id, str(e))
        except asyncio.CancelledError:
            refuse_request(request_id, _cancelled_status(None, context).name,
                           "the RPC ended while its prompt was being tokenized", self.metrics)
            raise
        if not self.dispatcher.has_live_worker():
            await self._refuse(context, request_id, grpc.StatusCode.UNAVAILABLE, "no worker is alive to serve requests")
        limits = [t for t in (remaining_s, gateway.request_timeout_s or None) if t is not None]
        state = RequestState(request_id=request_id, internal_id=self.dispatcher.requests.new_id(),
                             prompt_ids=checked.prompt_ids, params=checked.params, priority=checked.priority,
                             tokenizer=self.tokenizer, arrival_s=arrival_s,
                             deadline_s=arrival_s + min(limits) if limits else None,
                             stream_interval=gateway.stream_interval, hold_s=gateway.stream_hold_ms / 1e3)
        try:
            self.dispatcher.submit(state)
        except QueueFullError as e:
            await self._exhausted(context, request_id, str(e))
        except DuplicateRequestError:  # another one with this id was admitted while we tokenized
            await self._refuse_duplicate(context, request_id)
        return state

    async def _refuse_duplicate(self, context: grpc.aio.ServicerContext, request_id: str) -> None:
        await self._refuse(context, request_id, grpc.StatusCode.ALREADY_EXISTS,
                           f"request_id {request_id!r} is already in flight")

    async def _validate(self, request: inference_pb2.GenerateRequest, num_chars: int):
        """Tokenize and validate: on a pool thread when the input is large enough to stall the loop."""
        args = (request, self.tokenizer, self.max_model_len, self.config.gateway.default_max_tokens)
        if should_offload(num_chars, len(request.messages)):
            return await self.offload.run(validate, *args, release_memory=num_chars >= RELEASE_MIN_CHARS)
        return validate(*args)

    async def _refuse(self, context: grpc.aio.ServicerContext, request_id: str, code: grpc.StatusCode,
                      message: str) -> None:
        refuse_request(request_id, code.name, message, self.metrics)
        await context.abort(code, message)

    async def _exhausted(self, context: grpc.aio.ServicerContext, request_id: str, message: str) -> None:
        context.set_trailing_metadata((("retry-after-ms", str(self.config.queues.retry_after_ms)),))
        await self._refuse(context, request_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{message}; retry after {self.config.queues.retry_after_ms} ms")

    async def _relay(self, state: RequestState, context: grpc.aio.ServicerContext):
        await context.send_initial_metadata((("request-id", state.request_id),))
        # One timer per stream, not one per token: at the deadline a marker event wakes the relay.
        timer = (asyncio.get_running_loop().call_at(state.deadline_s, state.events.put_nowait, _DEADLINE)
                 if state.deadline_s is not None else None)
        try:
            while True:
                events = [await state.events.get()]
                # Everything already queued for this stream leaves as one message: gRPC's cost is per
                # message, so a stream that fell behind catches up instead of paying it per token.
                while not state.events.empty() and events[-1] is not _DEADLINE and events[-1].finish_reason is None:
                    events.append(state.events.get_nowait())
                deadline_passed = events[-1] is _DEADLINE
                if deadline_passed:
                    events.pop()
                if events:
                    last, response = events[-1], _response(state, events)
                    has_tokens = bool(response.text or response.token_ids)
                    if last.status is not None:
                        if has_tokens:
                            yield response
                        context.set_code(last.status)
                        await context.abort(last.status, last.error)
                    if last.finish_reason is not None:
                        yield _with_ending(response, state, last)
                        return
                    if has_tokens:
                        yield response
                if deadline_passed:
                    self.dispatcher.cancel(state.internal_id, reason="error")
                    state.status_code = grpc.StatusCode.DEADLINE_EXCEEDED
                    context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"request {state.request_id} passed its deadline while running")
        finally:
            if timer is not None:
                timer.cancel()

    async def Abort(self, request: inference_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        if not self.dispatcher.cancel_by_client_id(request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no queued or running request has id {request.request_id!r}")
        return inference_pb2.AbortResponse()

    async def GetClusterStatus(self, request, context):
        now = time.monotonic()
        registry = self.dispatcher.registry
        status = inference_pb2.ClusterStatus(num_queued=len(self.dispatcher.queue), draining=self.draining)
        for worker in registry.workers.values():
            hb = worker.heartbeat
            entry = status.workers.add(worker_id=worker.worker_id, alive=registry.is_alive(worker, now),
                                       ready=registry.is_ready(worker, now),
                                       last_heartbeat_age_s=min(worker.heartbeat_age_s(now), 1e9),
                                       num_restarts=max(0, worker.num_incarnations - 1))
            if hb is not None:
                entry.num_running, entry.num_waiting = hb.num_running, hb.num_waiting
                entry.kv_blocks_total, entry.kv_blocks_free = hb.kv_blocks_total, hb.kv_blocks_free
                entry.kv_blocks_cached = hb.kv_blocks_cached
                entry.memory_used_bytes, entry.memory_limit_bytes = hb.memory_used_bytes, hb.memory_limit_bytes
                entry.memory_level, entry.device = hb.memory_level, hb.device
                entry.utilization_percent, entry.hung = hb.utilization_percent, hb.is_hung
                entry.memory_reserved_bytes, entry.memory_peak_bytes = hb.memory_reserved_bytes, hb.memory_peak_bytes
        return status

    async def ProbeWorker(self, request: inference_pb2.ProbeWorkerRequest, context: grpc.aio.ServicerContext):
        if request.worker_id not in self.dispatcher.registry.workers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker has id {request.worker_id!r}; known: "
                                                           f"{sorted(self.dispatcher.registry.workers)}")
        try:
            reply = await self.dispatcher.probe(request.worker_id, request.deep, request.memory_report,
                                                self.config.gateway.probe_timeout_s)
        except (asyncio.TimeoutError, ConnectionError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{request.worker_id} did not answer the probe: "
                                                             f"{e or 'timed out'}")
        return inference_pb2.ProbeWorkerResponse(worker_id=request.worker_id, ok=reply.ok, error=reply.error,
                                                 latency_ms=reply.latency_ms, memory_report=reply.memory_report)

    def _stream_started(self) -> None:
        self.num_streams += 1
        self.streams_idle.clear()

    def _stream_ended(self) -> None:
        self.num_streams -= 1
        if self.num_streams == 0:
            self.streams_idle.set()


class Gateway:
    """The gateway process: gRPC server, dispatcher and health, with a draining shutdown."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.tokenizer = Tokenizer(config.model_dir)
        for warning in self.tokenizer.warnings:
            log.warning("tokenizer: %s", warning)
        self.health = health_aio.HealthServicer()
        self.metrics = Metrics()
        self.dispatcher = Dispatcher(config, on_workers_changed=self._schedule_health_update, metrics=self.metrics)
        self.servicer = InferenceServicer(config, self.tokenizer, self.dispatcher)
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.port = self.server.add_insecure_port(f"{config.gateway.host}:{config.gateway.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {config.gateway.host}:{config.gateway.port}")
        self._stopped = asyncio.Event()

    def _schedule_health_update(self) -> None:
        asyncio.ensure_future(self._update_health())

    async def _update_health(self) -> None:
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        registry = self.dispatcher.registry
        now = time.monotonic()
        any_ready = False
        for worker in registry.workers.values():
            ready = registry.is_ready(worker, now)
            any_ready |= ready
            await self.health.set(worker.worker_id, serving if ready else not_serving)
        overall = serving if any_ready and not self.servicer.draining else not_serving
        await self.health.set("", overall)
        await self.health.set(SERVICE_NAME, overall)

    async def serve(self) -> int:
        if self.config.gateway.metrics_port:
            self.metrics.serve(self.config.gateway.metrics_port, self.config.gateway.metrics_host)
        await self.dispatcher.start()
        await self.server.start()
        await self._update_health()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain()))
        log.info("gateway listening on %s:%d, workers at %s", self.config.gateway.host, self.port,
                 self.config.worker_endpoint)
        await self._stopped.wait()
        return 0

    async def drain(self) -> None:
        if self.servicer.draining:
            return
        grace = self.config.gateway.drain_grace_s
        log.info("draining: refusing new requests; %d streams in flight, grace %.0f s", self.servicer.num_streams,
                 grace)
        self.servicer.draining = True
        await self._update_health()
        try:
            await asyncio.wait_for(self.servicer.streams_idle.wait(), grace)
        except asyncio.TimeoutError:
            log.warning("grace period over with %d streams still open; closing them", self.servicer.num_streams)
        await self.server.stop(grace=1.0)
        await self.dispatcher.stop()
        self.servicer.offload.shutdown()
        self._stopped.set()
