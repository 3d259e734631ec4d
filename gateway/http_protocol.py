"""uvicorn's httptools protocol with the bounds a public HTTP port needs and uvicorn lacks.

A request's head (request line and headers) may hold at most `gateway.max_header_bytes` (431
beyond, as the bytes arrive: httptools would otherwise buffer a header of any size), and must
arrive within `gateway.read_timeout_s` of the connection opening or the request's first byte
(408); a body may pause at most as long between its chunks (the connection is closed, the handler
sees the client gone). So an idle or stalled client, and a head sent a byte at a time, hold a
socket and its buffers for a bounded time, whether or not it has a key; a body that keeps moving
is bounded by its size (`gateway.max_body_bytes`), not its duration. Keep-alive connections between
requests close after uvicorn's own keep-alive timeout, or when bytes that begin no request (a bare
CRLF) pass the head's timeout. A connection beyond `gateway.max_connections` open at once is
answered 503 and closed as it opens, before anything of it is read.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
REFUSAL_LOG_INTERVAL_S = 10.0  # a flood of refused connections logs one line per interval


def guarded_http_protocol(max_header_bytes: int, read_timeout_s: float, max_connections: int = 4096,
                          on_connection_refused: Callable[[], None] = lambda: None) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these bounds; `on_connection_refused`
    is called for each connection refused for the cap."""
    return type("GuardedHttpProtocol", (_GuardedHttpProtocol,),
                {"max_header_bytes": max_header_bytes, "read_timeout_s": read_timeout_s,
                 "max_connections": max_connections, "on_connection_refused": staticmethod(on_connection_refused),
                 "_refusals": _RefusalLog()})


class _RefusalLog:
    """Connections refused for the cap, logged at most once per interval with their count."""

    def __init__(self) -> None:
        self.unlogged = 0
        self.logged_at = float("-inf")

    def note(self, max_connections: int) -> None:
        self.unlogged += 1
        now = time.monotonic()
        if now - self.logged_at >= REFUSAL_LOG_INTERVAL_S:
            log.warning("refused %d HTTP connection(s): %d are open (gateway.max_connections)", self.unlogged,
                        max_connections)
            self.unlogged, self.logged_at = 0, now


class _GuardedHttpProtocol(HttpToolsProtocol):
    max_header_bytes = 64 << 10
    read_timeout_s = 20.0
    max_connections = 4096
    on_connection_refused: Callable[[], None]
    _refusals: _RefusalLog

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # now one of self.connections
        self._head_bytes = 0  # of a head still incomplete: the bytes received (_head_size: as parsed)
        self._in_head = True  # waiting for a request's head: the first one, now
        self._in_body = False
        self._refused = False  # answered 431 or 408 and closing: nothing more is read
        self._read_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            self.on_connection_refused()
            self._refusals.note(self.max_connections)
            return self._refuse(503, f"the gateway holds {self.max_connections} HTTP connections, its most "
                                     f"(gateway.max_connections); retry later")
        self._arm(self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_body:
            self._arm(self._body_timed_out)  # the body moved: its pause starts again
        elif not self._in_head and self._read_timer is None:
            # Bytes between requests (a bare CRLF, which starts no message, or a head's first bytes)
            # stop uvicorn's keep-alive timer: the head's clock runs from them.
            self._arm(self._head_timed_out)
        head_was_open = self._in_head
        super().data_received(data)
        if head_was_open and self._in_head and not self.transport.is_closing():
            # A head still incomplete: httptools buffers it, so its bytes so far are bounded here:
            # whole chunks, not the one in which it began (that may end an earlier request's body),
            # so what is buffered stays within a read's size of the bound.
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse_head_size()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0  # its request line and headers as parsed
        if not self._in_head:  # a request after another on this connection
            self._in_head, self._head_bytes = True, 0
            self._arm(self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._head_size > self.max_header_bytes:  # a whole head too long, parsed from one chunk
            return self._refuse_head_size()
        self._in_head, self._in_body = False, True
        super().on_headers_complete()
        self._arm_body_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts a pipelined request's cycle and reads again
        if self._in_body and not self._refused:
            self._arm_body_timer()

    def _arm_body_timer(self) -> None:
        # A request pipelined behind a response still running is not read (uvicorn paused reading)
        # until that response ends: its pauses are the server's, not the client's.
        if self.flow.read_paused:
            self._disarm()
        else:
            self._arm(self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        if not self._refused:
            super().on_message_complete()

    def _refuse_head_size(self) -> None:
        self._refuse(431, f"the request's head passed {self.max_header_bytes} bytes (gateway.max_header_bytes)")

    def _head_timed_out(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm(self._head_timed_out)  # an answer is still going out: the 408 would read as its
            return
        self._refuse(408, f"the request's head did not arrive within {self.read_timeout_s:g} s "
                          f"(gateway.read_timeout_s)")

    def _body_timed_out(self) -> None:
        self.logger.info("closing %s: its request body paused for %g s (gateway.read_timeout_s)",
                         self.client, self.read_timeout_s)
        self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        self._in_head, self._in_body, self._refused = False, False, True
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is under way: a status of our own would read as its
            return
        body = message.encode()
        retry = b"retry-after: 1\r\n" if status == 503 else b""
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                             b"%sconnection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), retry, body))
        self.transport.close()

    def _arm(self, on_timeout) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout_s, on_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
