"""uvicorn serving an ASGI app inside the gateway's own asyncio loop, beside grpc.aio.

uvicorn rather than a server of our own: it is the ASGI server FastAPI is built and tested
against, and its httptools parser keeps HTTP's cost per request small (with the bounds on reading
a request that uvicorn lacks: gateway/http_protocol.py). It runs as a task of the
running loop, so a request handler calls the dispatcher directly (no threads, no locks); the
gateway keeps its own signal handling (uvicorn's would replace it) and binds the socket itself
(gateway/listen.py), so a port that is taken fails the gateway's start with a ListenError naming it
instead of exiting the process, and several gateways may share the port (gateway.reuse_port).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

import uvicorn

from gateway.http_protocol import guarded_http_protocol
from gateway.listen import listen_socket

log = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 1  # after the gateway's own drain: connections still open are closed


class _InLoopServer(uvicorn.Server):
    handshake_timeout_s: float | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the gateway handles SIGTERM/SIGINT itself, by draining

    async def startup(self, sockets=None) -> None:
        # A TLS connection reaches the protocol (its bounds, the connection cap) only once its handshake
        # is done; uvicorn leaves that to asyncio's 60 s default, so one that never completes it would hold
        # its socket three times as long as an idle plaintext one. Its server is made with ours instead.
        loop = asyncio.get_running_loop()
        if self.config.ssl is not None and self.handshake_timeout_s is not None:
            loop.create_server = functools.partial(loop.create_server, ssl_handshake_timeout=self.handshake_timeout_s)
        try:
            await super().startup(sockets)
        finally:
            loop.__dict__.pop("create_server", None)


class HttpServer:
    def __init__(self, app, host: str, port: int, tls=None, reuse_port: bool = False,
                 max_header_bytes: int = 64 << 10, read_timeout_s: float = 20.0, max_connections: int = 4096,
                 on_connection_refused=lambda: None):
        """`tls`: a gateway.tls.TlsFiles to serve HTTPS (with client certificates when it names a CA);
        `reuse_port`: share host:port with other gateways (SO_REUSEPORT). A taken port is a ListenError.
        `max_header_bytes`, `read_timeout_s`, `max_connections`: bounds on reading requests and on the
        connections open at once (gateway/http_protocol.py), which calls `on_connection_refused` for each
        connection the cap refuses."""
        self.sock = listen_socket(host, port, reuse_port)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                timeout_keep_alive=30,
                                http=guarded_http_protocol(max_header_bytes, read_timeout_s, max_connections,
                                                           on_connection_refused),
                                **(tls.uvicorn_args() if tls else {}))
        self.server = _InLoopServer(config)
        self.server.handshake_timeout_s = read_timeout_s
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
