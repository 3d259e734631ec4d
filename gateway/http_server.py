"""uvicorn serving an ASGI app inside the gateway's own asyncio loop, beside grpc.aio, and the cap
on request bodies.

uvicorn rather than a server of our own: it is the ASGI server FastAPI is built and tested
against, and its httptools parser keeps HTTP's cost per request small. It runs as a task of the
running loop, so a request handler calls the dispatcher directly (no threads, no locks); the
gateway keeps its own signal handling (uvicorn's would replace it) and binds the socket itself
(gateway/listen.py), so a port that is taken fails the gateway's start with a ListenError naming it
instead of exiting the process, and several gateways may share the port (gateway.reuse_port).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import uvicorn
from fastapi import HTTPException

from gateway.listen import listen_socket

log = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 1  # after the gateway's own drain: connections still open are closed


class BodyLimit:
    """ASGI middleware: a body beyond `max_bytes` is refused 413 before it is read (by its
    Content-Length) or as soon as it passes the bound (a chunked body), never parsed."""

    def __init__(self, app, max_bytes: int, on_refused=lambda request_id, message: None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused  # (x-request-id, message): the request log's line

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            self.on_refused(headers.get(b"x-request-id", b"-").decode("latin-1"), self._message(int(length)))
            return await self._refuse(send, int(length))
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    await self._discard_rest(receive, message)
                    # Raised inside the body read, which FastAPI re-raises as this response.
                    raise HTTPException(413, self._message(seen))
            return message

        await self.app(scope, limited_receive, send)

    async def _discard_rest(self, receive, message) -> None:
        """Read (and drop) up to as much again of the body, so a client that sends all of it before
        reading the answer gets its 413 instead of a reset connection; beyond that, it is cut off."""
        discarded = 0
        while message.get("more_body") and discarded <= self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            discarded += len(message.get("body", b""))

    def _message(self, num_bytes: int) -> str:
        return (f"the request body is {num_bytes}+ bytes; the gateway takes at most {self.max_bytes} "
                f"(gateway.max_body_bytes)")

    async def _refuse(self, send, num_bytes: int) -> None:
        body = json.dumps({"error": {"message": self._message(num_bytes), "type": "invalid_request_error",
                                     "param": None, "code": "body_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _InLoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the gateway handles SIGTERM/SIGINT itself, by draining


class HttpServer:
    def __init__(self, app, host: str, port: int, max_body_bytes: int, on_refused=lambda request_id, message: None,
                 tls=None, reuse_port: bool = False):
        """`tls`: a gateway.tls.TlsFiles to serve HTTPS (with client certificates when it names a CA);
        `reuse_port`: share host:port with other gateways (SO_REUSEPORT). A taken port is a ListenError."""
        self.sock = listen_socket(host, port, reuse_port)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(BodyLimit(app, max_body_bytes, on_refused), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                timeout_keep_alive=30, http="auto", **(tls.uvicorn_args() if tls else {}))
        self.server = _InLoopServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await self._task
        except Exception:
            log.exception("the HTTP server failed while stopping")
