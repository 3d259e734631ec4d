"""The gateway process's front doors: a thin grpc.aio servicer, health and reflection, and the
OpenAI-compatible HTTP API (gateway/http_api.py) on the same loop.

Generate admits the request (gateway/admission.py: checks, tokenizing, queueing) and relays its
stream events; a client that cancels or disconnects at any point costs no further compute (the
handler's cleanup aborts it wherever it is). Every RPC is counted and logged once, under the
status its client saw. SIGTERM drains: new requests get UNAVAILABLE (503 over HTTP), in-flight
streams of both APIs finish within the grace period, then the process exits 0.
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

from gateway.admission import Admission, Refusal
from gateway.auth import KeyStore, check_exposure, is_loopback
from gateway.dispatcher import Dispatcher
from gateway.http_api import OpenAiApi
from gateway.http_server import HttpServer
from gateway.listen import add_grpc_port, grpc_server_options, max_request_bytes
from gateway.metrics import Metrics
from gateway.relay import DeadlinePassed, event_batches
from gateway.request_log import finish_request
from gateway.streams import RequestState, StreamEvent
from gateway.tls import grpc_server_credentials, tls_files
from gateway.tokenizer import Tokenizer
from protos import inference_pb2, inference_pb2_grpc
from shared.config import ClusterConfig
from shared.startup_objects import freeze_startup_objects

log = logging.getLogger(__name__)
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
# A cancellation this close to the deadline is the deadline: gRPC cancels the handler when it passes,
# and a client's own deadline fires first by the time its request took to arrive, which on a loaded
# host reaches tens of milliseconds.
_DEADLINE_SLACK_S = 0.1
# Prompt log-probabilities per message at most: with 20 alternatives an entry is about 220 bytes, and gRPC's
# default limit on a message a client takes is 4 MiB.
PROMPT_LOGPROBS_PER_MESSAGE = 4096
_FINISH = {"stop": inference_pb2.FINISH_REASON_STOP, "length": inference_pb2.FINISH_REASON_LENGTH,
           "abort": inference_pb2.FINISH_REASON_ABORT, "error": inference_pb2.FINISH_REASON_ERROR}


def _response(state: RequestState, events: list[StreamEvent]) -> inference_pb2.GenerateResponse:
    """The text and token ids of `events` as one message (a failed event carries none)."""
    text = "".join(e.text for e in events if e.status is None)
    token_ids = [t for e in events if e.status is None for t in e.token_ids]
    response = inference_pb2.GenerateResponse(request_id=state.request_id, text=text, token_ids=token_ids,
                                              worker_id=state.worker_id or "")
    for e in events:
        if e.status is None:
            for field, entries in ((response.logprobs, e.logprobs), (response.prompt_logprobs, e.prompt_logprobs)):
                for entry in entries or ():
                    field.add(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                              top=[inference_pb2.TopLogprob(token_id=t, logprob=p) for t, p in entry.top])
    return response


def _prompt_pieces(response: inference_pb2.GenerateResponse) -> list[inference_pb2.GenerateResponse]:
    """Messages carrying all but the last PROMPT_LOGPROBS_PER_MESSAGE of `response`'s prompt log-probabilities,
    in order (it keeps those last ones): a long prompt's would pass gRPC's default message limit in one."""
    entries = response.prompt_logprobs
    if len(entries) <= PROMPT_LOGPROBS_PER_MESSAGE:
        return []
    pieces = [list(entries[i:i + PROMPT_LOGPROBS_PER_MESSAGE])
              for i in range(0, len(entries), PROMPT_LOGPROBS_PER_MESSAGE)]
    del entries[:]
    entries.extend(pieces.pop())
    return [inference_pb2.GenerateResponse(request_id=response.request_id, worker_id=response.worker_id,
                                           prompt_logprobs=piece) for piece in pieces]


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


async def _abort(context: grpc.aio.ServicerContext, refusal: Refusal) -> None:
    if refusal.retry_after_ms is not None:
        context.set_trailing_metadata((("retry-after-ms", str(refusal.retry_after_ms)),))
    await context.abort(refusal.code, refusal.message)


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return None


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
    def __init__(self, config: ClusterConfig, admission: Admission):
        self.config = config
        self.admission = admission
        self.dispatcher = admission.dispatcher
        self.metrics = admission.metrics

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival_s, remaining_s = time.monotonic(), context.time_remaining()
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        try:
            principal = self.admission.authenticate(request_id, _authorization(context))
            with self.admission.stream(request_id, principal):
                try:
                    state = await self.admission.admit(request, request_id, arrival_s, remaining_s,
                                                       lambda: _cancelled_status(None, context), principal)
                except Refusal as e:
                    await _abort(context, e)
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
                    self.admission.cancel([state], code)
                    finish_request(state, code.name, self.metrics)
        except Refusal as e:  # not authenticated, or no stream slot
            await _abort(context, e)

    async def _relay(self, state: RequestState, context: grpc.aio.ServicerContext):
        await context.send_initial_metadata((("request-id", state.request_id),))
        try:
            async for events in event_batches(state, self.dispatcher):
                last, response = events[-1], _response(state, events)
                for piece in _prompt_pieces(response) if response.prompt_logprobs else ():
                    yield piece
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
        except DeadlinePassed as e:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= _DEADLINE_SLACK_S:
                # The RPC's own deadline: gRPC ends the call with DEADLINE_EXCEEDED itself, and an abort
                # racing it fails in gRPC's core, which logs that as an ERROR with tracebacks.
                raise asyncio.CancelledError() from None
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))

    async def _caller(self, context: grpc.aio.ServicerContext, request_id: str = "-", admin: bool = False):
        """The caller's principal; aborts UNAUTHENTICATED without a valid key, PERMISSION_DENIED
        when `admin` is needed and the key is not one."""
        try:
            principal = self.admission.authenticate(request_id, _authorization(context), generation=False)
        except Refusal as e:
            await _abort(context, e)
        if admin and not principal.is_admin:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"API key {principal.name!r} may not do this: it needs the admin role")
        return principal

    async def Abort(self, request: inference_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        principal = await self._caller(context, request.request_id)
        # Another key's request is as unknown as a request that does not exist: no oracle of ids.
        if not self.dispatcher.cancel_by_client_id(request.request_id, principal.name):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no queued or running request has id {request.request_id!r}")
        return inference_pb2.AbortResponse()

    async def GetClusterStatus(self, request, context):
        await self._caller(context)
        now = time.monotonic()
        registry = self.dispatcher.registry
        status = inference_pb2.ClusterStatus(num_queued=len(self.dispatcher.queue), draining=self.admission.draining)
        for worker in registry.workers.values():
            hb = worker.heartbeat
            entry = status.workers.add(worker_id=worker.worker_id, alive=registry.is_alive(worker, now),
                                       ready=registry.is_ready(worker, now),
                                       last_heartbeat_age_s=min(worker.heartbeat_age_s(now), 1e9),
                                       num_restarts=max(0, worker.num_incarnations - 1),
                                       exit_reason=worker.exit_reason)
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
        await self._caller(context, admin=True)  # memory reports name other clients' requests
        if request.worker_id not in self.dispatcher.registry.workers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker has id {request.worker_id!r}; known: "
                                                           f"{sorted(self.dispatcher.registry.workers)}")
        try:
            reply = await self.dispatcher.probes.ask(request.worker_id, request.deep, request.memory_report,
                                                     self.config.gateway.probe_timeout_s)
        except (asyncio.TimeoutError, ConnectionError) as e:
            # str() of a TimeoutError is empty: say what happened.
            why = (f"no answer within gateway.probe_timeout_s = {self.config.gateway.probe_timeout_s:g} s"
                   if isinstance(e, asyncio.TimeoutError) or not str(e) else str(e))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{request.worker_id} did not answer the probe: {why}")
        return inference_pb2.ProbeWorkerResponse(worker_id=request.worker_id, ok=reply.ok, error=reply.error,
                                                 latency_ms=reply.latency_ms, memory_report=reply.memory_report)


class Gateway:
    """The gateway process: gRPC server, dispatcher and health, with a draining shutdown."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.tokenizer = Tokenizer(config.model_dir)
        for warning in self.tokenizer.warnings:
            log.warning("tokenizer: %s", warning)
        self.health = health_aio.HealthServicer()
        self.metrics = Metrics()
        g = config.gateway
        self.keys = KeyStore.from_config(g)
        check_exposure(g, self.keys)
        if not self.keys.enabled and not is_loopback(g.host):
            log.warning("serving %s without API keys (gateway.allow_unauthenticated): anyone who can reach it may "
                        "call it", g.host)
        self.dispatcher = Dispatcher(config, on_workers_changed=self._schedule_health_update, metrics=self.metrics)
        self.admission = Admission(config, self.tokenizer, self.dispatcher, keys=self.keys)
        self.servicer = InferenceServicer(config, self.admission)
        tls = tls_files(g)
        credentials = grpc_server_credentials(tls) if tls is not None else None
        # The HTTP port is bound first: a gRPC server that bound its port and is then dropped, unstopped,
        # because the HTTP port is taken, writes garbage to stderr as the interpreter exits.
        self.http: HttpServer | None = None
        if g.http_port:
            api = OpenAiApi(self.admission, self.is_serving)
            self.http = HttpServer(api.app, g.host, g.http_port, tls=tls, reuse_port=g.reuse_port,
                                   max_header_bytes=g.max_header_bytes, read_timeout_s=g.read_timeout_s,
                                   max_connections=g.max_connections,
                                   on_connection_refused=self.metrics.http_connections_refused.inc)
        self.server = grpc.aio.server(options=grpc_server_options(g.reuse_port, max_request_bytes(g), g.read_timeout_s,
                                                                     g.max_connections))
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.port = add_grpc_port(self.server, g.host, g.port, credentials, g.reuse_port)
        self._stopped = asyncio.Event()
        self._health_names: set[str] = set()

    def _schedule_health_update(self) -> None:
        asyncio.ensure_future(self._update_health())

    def is_serving(self) -> bool:
        """Some worker is ready and the gateway is not draining."""
        registry, now = self.dispatcher.registry, time.monotonic()
        return not self.admission.draining and any(registry.is_ready(w, now) for w in registry.workers.values())

    async def _update_health(self) -> None:
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        registry = self.dispatcher.registry
        now = time.monotonic()
        any_ready = False
        for worker in registry.workers.values():
            ready = registry.is_ready(worker, now)
            any_ready |= ready
            await self.health.set(worker.worker_id, serving if ready else not_serving)
        for worker_id in self._health_names - registry.workers.keys():  # workers that left
            await self.health.set(worker_id, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        self._health_names = set(registry.workers)
        overall = serving if any_ready and not self.admission.draining else not_serving
        await self.health.set("", overall)
        await self.health.set(SERVICE_NAME, overall)

    async def serve(self) -> int:
        if self.config.gateway.metrics_port:
            self.metrics.serve(self.config.gateway.metrics_port, self.config.gateway.metrics_host,
                               self.config.gateway.read_timeout_s)
        await self.dispatcher.start()
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        await self._update_health()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain()))
        frozen = freeze_startup_objects()
        g = self.config.gateway
        log.info("gateway listening on %s:%d (gRPC%s)%s%s, workers at %s; %s; %d startup objects frozen out of "
                 "garbage collection", g.host, self.port,
                 ", TLS" if g.tls_cert_file else "", f" and {self.http.port} (HTTP, OpenAI API)" if self.http else "",
                 " shared with other gateways (reuse_port)" if g.reuse_port else "", self.config.worker_endpoint,
                 "API keys required" if self.keys.enabled else "no API keys", frozen)
        await self._stopped.wait()
        return 0

    async def drain(self) -> None:
        if self.admission.draining:
            return
        grace = self.config.gateway.drain_grace_s
        log.info("draining: refusing new requests; %d streams in flight, grace %.0f s", self.admission.num_streams,
                 grace)
        self.admission.draining = True
        self.dispatcher.begin_drain()
        await self._update_health()
        try:
            await asyncio.wait_for(self.admission.streams_idle.wait(), grace)
        except asyncio.TimeoutError:
            log.warning("grace period over with %d streams still open; closing them", self.admission.num_streams)
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace=1.0)
        await self.dispatcher.stop()
        self.admission.offload.shutdown()
        self._stopped.set()
