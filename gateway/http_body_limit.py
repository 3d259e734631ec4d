"""The cap on HTTP request bodies (`gateway.max_body_bytes`): an ASGI middleware inside the API
key check, so a caller without a valid key hears 401 whatever it sends, and a body too large is
refused 413 (code `body_too_large`) before it is parsed."""
from __future__ import annotations

import json

from fastapi import HTTPException

from gateway.openai_responses import error_body


class BodyLimit:
    """ASGI middleware: a body beyond `max_bytes` is refused 413 before it is read (by its
    Content-Length) or as soon as it passes the bound (a chunked body), never parsed."""

    def __init__(self, app, max_bytes: int, on_refused=lambda request_id, message, scope: None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused  # (x-request-id, message, scope): the request log's line

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            self.on_refused(headers.get(b"x-request-id", b"-").decode("latin-1"), self._message(int(length)), scope)
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
        body = json.dumps(error_body(self._message(num_bytes), "invalid_request_error", None, "body_too_large")
                          ).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
