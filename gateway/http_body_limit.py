"""The caps on HTTP request bodies, before they are parsed: `gateway.max_body_bytes`, and
`gateway.max_body_values`, the JSON values a body may hold. FastAPI parses and validates a body on
the event loop that serves every stream, at a cost per value (each token id, each logit_bias
entry), so a body of millions of values would stall everyone for seconds; counting them costs a
small fraction of that, and is done off the loop when it is not trivial. An ASGI middleware inside
the API key check: a caller without a valid key hears 401 whatever it sends; a body too large is
refused 413 (code `body_too_large`) before it is parsed."""
from __future__ import annotations

import asyncio
import json

from gateway.openai_responses import error_body

_COUNT_CHUNK_BYTES = 1 << 20  # the off-loop count holds the GIL for one chunk at a time


class BodyLimit:
    """ASGI middleware: reads the whole body (refusing 413 as soon as it passes `max_bytes`, or
    before it is read by its Content-Length), refuses 413 one of more than `max_values` JSON values,
    and hands the app the body as read."""

    def __init__(self, app, max_bytes: int, max_values: int = 1 << 20,
                 on_refused=lambda request_id, message, scope: None):
        self.app = app
        self.max_bytes = max_bytes
        self.max_values = max_values
        self.on_refused = on_refused  # (x-request-id, message, scope): the request log's line

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"-").decode("latin-1")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send, request_id, scope, self._too_many_bytes(int(length)))
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app hears it so
                first = message
                break
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                await self._discard_rest(receive, message)
                return await self._refuse(send, request_id, scope, self._too_many_bytes(seen))
            if not message.get("more_body"):
                body = b"".join(chunks)
                values = await self._count_values(body)
                if values > self.max_values:
                    return await self._refuse(send, request_id, scope, (
                        f"the request body holds {values} JSON values or more (token ids, logit_bias entries, ...); "
                        f"the gateway parses at most {self.max_values} (gateway.max_body_values)"))
                first = {"type": "http.request", "body": body, "more_body": False}
                break
        pending = [first]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _count_values(self, body: bytes) -> int:
        """At least the JSON values of `body` beyond `max_values`, or a number within it: every comma
        is counted first (a bound: commas in strings too), and only a body over the bound by that
        count is counted again, outside its strings, on a thread."""
        if body.count(b",") + 1 <= self.max_values:  # in UTF-16 or -32 too: each comma has a 0x2c byte
            return 0
        return await asyncio.get_running_loop().run_in_executor(None, _count_values_of, body)

    async def _discard_rest(self, receive, message) -> None:
        """Read (and drop) up to as much again of the body, so a client that sends all of it before
        reading the answer gets its 413 instead of a reset connection; beyond that, it is cut off."""
        discarded = 0
        while message.get("more_body") and discarded <= self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            discarded += len(message.get("body", b""))

    def _too_many_bytes(self, num_bytes: int) -> str:
        return (f"the request body is {num_bytes}+ bytes; the gateway takes at most {self.max_bytes} "
                f"(gateway.max_body_bytes)")

    async def _refuse(self, send, request_id: str, scope, message: str) -> None:
        self.on_refused(request_id, message, scope)
        body = json.dumps(error_body(message, "invalid_request_error", None, "body_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _count_values_of(body: bytes) -> int:
    """values_outside_strings of a body in whichever encoding JSON allows and the parser will detect
    (UTF-8, -16 or -32), counted as UTF-8, where quotes, backslashes and commas are single bytes."""
    encoding = json.detect_encoding(body)
    if encoding != "utf-8":
        body = body.decode(encoding, errors="replace").encode()
    return values_outside_strings(body)


def values_outside_strings(body: bytes, chunk_bytes: int = _COUNT_CHUNK_BYTES) -> int:
    """1 + the commas of a JSON text in UTF-8 outside its strings: the values of its arrays and
    objects, about. A megabyte at a time, so a thread running it lets the event loop in between."""
    body = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # no quote left inside a string is escaped
    count, in_string = 1, False
    for start in range(0, len(body), chunk_bytes):
        parts = body[start:start + chunk_bytes].split(b'"')
        count += b"".join(parts[1::2] if in_string else parts[::2]).count(b",")
        in_string ^= len(parts) % 2 == 0  # an odd number of quotes in the chunk
    return count
