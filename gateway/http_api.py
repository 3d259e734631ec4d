"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health and
/metrics, a FastAPI app on the gateway's own event loop (gateway/http_server.py serves it).

Every generation goes through gateway/admission.py, as a gRPC one does: the same bounds, queues,
priorities, deadlines, workers, metrics and request log. Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}` with the status the client libraries map
(400 naming the field, never 422; 404, 413, 429 with Retry-After, 503, 504). A streamed answer
starts once its first tokens are ready, so anything that ends a request before then (a full
queue, a deadline, no live worker) is still a plain HTTP status; later failures end the stream
with an error event. A client that goes away, streamed or not, cancels its sequences wherever
they are.
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gateway.admission import Admission, Refusal, choice_params
from gateway.auth import ANONYMOUS, Principal
from gateway.http_auth import GENERATE_PATHS, ApiKeyCheck, principal_of
from gateway.http_body_limit import BodyLimit
from gateway.http_errors import ApiError, http_error, internal_error, too_deep_body, validation_error
from gateway.http_tokenize import TokenizeRoutes
from gateway.openai_requests import ERROR_TYPE, HTTP_STATUS, BadRequest, Presentation, chat_request, completion_requests
from gateway.openai_responses import Choice, ResponseBuilder, error_body
from gateway.openai_schema import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                   CompletionResponse, ErrorResponse, ModelCard, ModelList)
from gateway.request_log import refuse_request
from gateway.responses_output import ResponsesBuilder
from gateway.responses_requests import ResponsesRequest, chat_of, in_responses_words
from gateway.sequences import SequenceFailed, Sequences
from gateway.token_texts import TokenTexts
from gateway.tool_schema import named_as_in_body, refused_tool
from protos import inference_pb2

TIMEOUT_HEADER = "x-request-timeout"  # seconds, like the body's `timeout`
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 413, 429, 503, 504)}
# Refusals made by the HTTP layer itself, in the request log under the gRPC status of the same meaning.
_LOG_STATUS = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED"}
# The response headers a browser page may read (CORS): ours, and the 429's retry hint.
EXPOSED_HEADERS = ["x-request-id", "x-worker-id", "x-queue-ms", "x-ttft-ms", "x-total-ms", "retry-after",
                   "x-should-retry"]


def served_model_name(config) -> str:
    return config.gateway.served_model_name or Path(config.model_dir).resolve().name


class OpenAiApi:
    def __init__(self, admission: Admission, is_serving: Callable[[], bool]):
        self.admission = admission
        self.config = admission.config
        self.metrics = admission.metrics
        self.is_serving = is_serving
        self.model = served_model_name(self.config)
        self.created = int(time.time())
        self.texts = TokenTexts(admission.tokenizer)
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="inference-cluster: OpenAI-compatible API", version="1",
                      docs_url=None, redoc_url=None)
        app.add_exception_handler(ApiError, self._answer_error)
        app.add_exception_handler(RequestValidationError, lambda r, e: self._answer_error(r, validation_error(e)))
        app.add_exception_handler(StarletteHTTPException, self._answer_http_exception)
        app.add_exception_handler(Exception, internal_error)
        app.get("/v1/models", response_model=ModelList)(self.models)
        app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)(self.model_card)
        app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)(self.completions)
        app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)(self.chat)
        app.post("/v1/responses", responses=_ERRORS)(self.responses)
        TokenizeRoutes(self.admission, self._check_model, _ERRORS).register(app)
        app.get("/health", responses={503: {"description": "draining, or no worker ready"}})(self.health)
        app.get("/metrics", response_class=PlainTextResponse)(self.prometheus)
        app.openapi = lambda: _without_422(app)
        # Added first, so inside the key check: a caller without a valid key hears 401, not 413.
        app.add_middleware(BodyLimit, max_bytes=self.config.gateway.max_body_bytes,
                           max_values=self.config.gateway.max_body_values,
                           on_refused=lambda request_id, message, scope: self.refused(
                               request_id, 413, message, principal_of(scope)))
        app.add_middleware(ApiKeyCheck, admission=self.admission)
        if self.config.gateway.cors_allow_origins:
            # Added last, so outermost: a browser's preflight (which carries no key) is answered
            # before the key check.
            app.add_middleware(CORSMiddleware, allow_origins=list(self.config.gateway.cors_allow_origins),
                               allow_methods=["GET", "POST"], allow_headers=["*"], expose_headers=EXPOSED_HEADERS)
        return app

    def _answer_error(self, http: Request, e: ApiError) -> JSONResponse:
        """An error response; a refusal of a generation that admission did not already log is logged
        and counted here, once."""
        if not e.logged and http.url.path in GENERATE_PATHS and e.status in _LOG_STATUS:
            self.refused(http.headers.get("x-request-id", "-"), e.status, e.message, principal_of(http.scope))
        return e.response()

    async def _answer_http_exception(self, http: Request, e: StarletteHTTPException) -> Response:
        # FastAPI reports a client that went away while sending its body as a 400 body-parse error:
        # that client cancelled, and its request counts as such, not as a bad request.
        if isinstance(e.__cause__, ClientDisconnect) and http.url.path in GENERATE_PATHS:
            refuse_request(http.headers.get("x-request-id", "-"), grpc.StatusCode.CANCELLED.name,
                           "the client went away while sending its body", self.metrics, principal_of(http.scope).name)
            return Response(status_code=499)
        if isinstance(e.__cause__, RecursionError):  # the same generic 400, for a body nested too deeply
            return self._answer_error(http, await too_deep_body(http))
        return self._answer_error(http, http_error(e))

    def refused(self, request_id: str, status: int, message: str, principal: Principal = ANONYMOUS) -> None:
        refuse_request(request_id, _LOG_STATUS.get(status, "UNKNOWN"), message, self.metrics, principal.name)

    # ---- routes -------------------------------------------------------------------------------------
    async def models(self) -> dict:
        return {"object": "list", "data": [self._card()]}

    async def model_card(self, model: str) -> dict:
        self._check_model(model)
        return self._card()

    async def health(self) -> Response:
        if self.is_serving():
            return JSONResponse({"status": "serving"})
        status = "draining" if self.admission.draining else "no worker ready"
        return JSONResponse({"status": status}, status_code=503)

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, body: CompletionRequest, request: Request):
        return await self._answer(body, request, lambda: completion_requests(body, self.config.gateway), chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        return await self._answer(body, request, lambda: self._chat(body), chat=True)

    async def responses(self, body: ResponsesRequest, request: Request):
        try:
            return await self._answer(body, request, lambda: self._chat(chat_of(body)), chat=True, responses=body)
        except ApiError as e:
            e.message, e.param = in_responses_words(e.message), in_responses_words(e.param)
            raise

    def _chat(self, body: ChatCompletionRequest) -> tuple[list[inference_pb2.GenerateRequest], Presentation]:
        request, presentation = chat_request(body, self.config.gateway, self.admission.tool_parser,
                                             self.admission.reasoning)
        return [request], presentation

    async def _answer(self, body, request: Request, convert, chat: bool, responses: ResponsesRequest | None = None):
        self._check_model(body.model)
        try:
            requests, presentation = convert()
        except BadRequest as e:
            raise ApiError(e.status, e.message, e.param, e.code) from None
        except UnicodeEncodeError as e:  # JSON may carry a lone surrogate, which no UTF-8 string holds
            raise ApiError(400, f"the body's text must be valid Unicode: {e.object[e.start:e.end]!r} is a lone "
                                f"surrogate") from None
        except RecursionError:  # a schema or tool parsed, but nested too deeply to write back as JSON
            raise await too_deep_body(request) from None
        # OpenAI's forms: "resp_…" (as the Responses API's items, responses_output.py), "chatcmpl-…", "cmpl-…".
        kind = "resp_" if responses is not None else "chatcmpl-" if chat else "cmpl-"
        request_id = request.headers.get("x-request-id") or f"{kind}{uuid.uuid4().hex}"
        return await self._generate(request, request_id, requests, presentation, body.timeout, chat, responses)

    # ---- generation ---------------------------------------------------------------------------------
    async def _generate(self, http: Request, request_id: str, requests: list[inference_pb2.GenerateRequest],
                        presentation: Presentation, body_timeout: float | None, chat: bool,
                        responses: ResponsesRequest | None = None):
        arrival_s = time.monotonic()
        timeout_s = _timeout(http, body_timeout)
        principal = principal_of(http.scope)
        try:
            self.admission.acquire_stream(request_id, principal)
        except Refusal as e:
            raise ApiError.from_code(e.code, e.message, e.retry_after_ms, logged=True) from None
        streaming = False
        try:
            sequences = await self._admit(http, request_id, requests, presentation, arrival_s, timeout_s, chat)
            builder = (ResponseBuilder(request_id, self.model, chat, presentation, self.texts) if responses is None
                       else ResponsesBuilder(request_id, responses, self.model, presentation, self.texts))
            n = presentation.n
            # The echoed prompt, once per prompt (its n choices share it).
            echoes = ([self._echo(r, sequences.states[p * n]) for p, r in enumerate(requests)] if presentation.echo
                      else [""] * len(requests))
            choices = [Choice(i, s, prefix=echoes[i // n]) for i, s in enumerate(sequences.states)]
            if not presentation.stream:
                await _until_disconnect(http, self._collect(sequences, choices), sequences.close)
                return JSONResponse(builder.response(choices), headers=_headers(request_id, choices, timing=True))
            first = await _until_disconnect(http, sequences.next(), sequences.close)
            streaming = True  # the stream now holds the slot until it ends

            def close() -> None:
                if sequences.close():
                    self.admission.release_stream(principal)

            return SequenceStream(self._stream(sequences, choices, builder, first), close,
                                  headers={**_headers(request_id, choices), "cache-control": "no-cache"})
        except SequenceFailed as e:
            sequences.close(e.code)
            raise ApiError.from_code(e.code, e.message, logged=True) from None
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not streaming:
                self.admission.release_stream(principal)

    async def _admit(self, http: Request, request_id: str, requests: list[inference_pb2.GenerateRequest],
                     presentation: Presentation, arrival_s: float, timeout_s: float | None, chat: bool) -> Sequences:
        """Every sequence queued, or none. Every prompt is checked and tokenized first (watching
        for the client going away), then every sequence queued at once, so a bad or abandoned
        prompt costs no other prompt a dispatch; a queue refusal cancels those already queued."""
        n = presentation.n
        total = len(requests) * n
        limit = self.config.queues.max_queued_requests
        if total > limit:  # could never be queued at once: not worth a retry
            raise ApiError(400, f"{len(requests)} prompts x n={n} = {total} sequences; the gateway queues at most "
                                f"{limit} (queues.max_queued_requests)", "n")

        principal = principal_of(http.scope)

        prepared = []

        async def prepare_all():
            for r in requests:
                prepared.append(await self.admission.prepare(r, request_id, lambda: grpc.StatusCode.CANCELLED,
                                                             principal, copies=n))

        try:
            await _until_disconnect(http, prepare_all(), lambda: None)
        except Refusal as e:
            self.admission.release_unqueued(prepared)
            message = named_as_in_body(e.message, presentation.constraint_field)
            if presentation.tool_parameters and message.startswith("tools ") and "tools[" not in message:
                message = await self.admission.offload.run(refused_tool, message, presentation.tool_parameters,
                                                           self.admission.constraints, large=False)
            error = ApiError.from_code(e.code, message, e.retry_after_ms, logged=True)
            if chat and error.param == "prompt":  # a chat's prompt is its rendered messages
                error.param = "messages"
            raise error from None
        except BaseException:  # the client went away, or the handler was cancelled
            self.admission.release_unqueued(prepared)
            raise
        states = []
        try:
            for p, checked in enumerate(prepared):
                for j in range(n):
                    sequence_id = request_id if total == 1 else f"{request_id}-{p * n + j}"
                    # The n choices of a prompt are one session: they go to one worker, which then
                    # prefills their shared prompt once.
                    states.append(self.admission.enqueue(checked, sequence_id, arrival_s, timeout_s,
                                                         choice_params(checked.params, j),
                                                         session_id=f"{request_id}-p{p}" if n > 1 else "",
                                                         principal=principal,
                                                         group_id=request_id if total > 1 else ""))
        except Refusal as e:
            Sequences(self.admission, states).close(e.code)
            self.admission.release_unqueued(prepared)
            raise ApiError.from_code(e.code, e.message, e.retry_after_ms, logged=True) from None
        return Sequences(self.admission, states)

    async def _collect(self, sequences: Sequences, choices: list[Choice]) -> None:
        while not sequences.is_done:
            index, events = await sequences.next()
            choices[index].add(events)
        sequences.close(grpc.StatusCode.OK)

    async def _stream(self, sequences: Sequences, choices: list[Choice], builder: ResponseBuilder,
                      first: tuple[int, list]) -> AsyncIterator[str]:
        try:
            for chunk in builder.opening(choices):
                yield chunk
            index, events = first
            while True:
                choice = choices[index]
                added = choice.add(events)
                # Tokens with no text yet (a character's first bytes) are worth a chunk only to a
                # client that reads token ids or log-probabilities.
                if added[0] or choice.finish_reason or (added[1] and builder.carries_tokens):
                    chunk = builder.delta(choice, *added)
                    if chunk is not None:
                        yield chunk
                if sequences.is_done:
                    break
                index, events = await sequences.next()
            for chunk in builder.closing(choices):
                yield chunk
            sequences.outcome = grpc.StatusCode.OK
        except SequenceFailed as e:
            sequences.outcome = e.code
            status = HTTP_STATUS.get(e.code, 500)
            yield builder.failure(error_body(e.message, ERROR_TYPE.get(status, "server_error"), None,
                                             e.code.name.lower()))

    # ---- helpers ------------------------------------------------------------------------------------
    def _card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "inference-cluster",
                "max_model_len": self.admission.max_model_len}

    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise ApiError(404, f"The model `{model[:200]}` does not exist; this server serves `{self.model}`",
                           "model", "model_not_found")

    def _echo(self, request: inference_pb2.GenerateRequest, state) -> str:
        if request.prompt and not request.truncate_prompt_tokens:
            return request.prompt
        return self.admission.tokenizer.decode(state.prompt_ids)


def _without_422(app: FastAPI) -> dict:
    """FastAPI documents its own 422 for every body; this server answers validation errors 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


class ClientGone(Exception):
    pass


class SequenceStream(StreamingResponse):
    """A server-sent-event stream that runs `on_close` however it ends, even when the client went
    away before the first chunk (a generator that never started would run no cleanup of its own)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _until_disconnect(http: Request, work, on_gone: Callable[[], None]):
    """Await `work` unless the client goes away first (raises ClientGone) or the handler itself
    is cancelled (the server stopping): either way `work` is cancelled and `on_gone` runs."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        on_gone()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        on_gone()
        raise ClientGone()
    return task.result()


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _timeout(http: Request, body_timeout: float | None) -> float | None:
    header = http.headers.get(TIMEOUT_HEADER)
    values = []
    if header is not None:
        try:
            values.append(float(header))
        except ValueError:
            raise ApiError(400, f"the {TIMEOUT_HEADER} header must be a number of seconds, got {header[:40]!r}",
                           TIMEOUT_HEADER) from None
    if body_timeout is not None:
        values.append(body_timeout)
    if any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ApiError(400, "timeout must be a positive number of seconds", "timeout")
    return min(values) if values else None


def _headers(request_id: str, choices: list[Choice], timing: bool = False) -> dict[str, str]:
    """The request's id, the workers its sequences run on, and (whole answers) choice 0's timing."""
    workers = sorted({c.state.worker_id for c in choices if c.state.worker_id})
    headers = {"x-request-id": request_id, "x-worker-id": ",".join(workers)}
    if timing:
        state = choices[0].state
        headers.update({"x-queue-ms": f"{state.queue_ms:.3f}", "x-ttft-ms": f"{state.ttft_ms:.3f}",
                        "x-total-ms": f"{((state.finished_s or time.monotonic()) - state.arrival_s) * 1e3:.3f}"})
    return headers
