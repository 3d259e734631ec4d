"""The HTTP API's key check: an ASGI middleware that answers 401 (OpenAI's error body, with
`WWW-Authenticate: Bearer`) before a request's body is read, and hands the caller's principal to
the routes in `scope["principal"]`. /health stays open, as the gRPC health service does."""
from __future__ import annotations

import json

from gateway.admission import Admission, Refusal
from gateway.auth import ANONYMOUS, Principal

OPEN_PATHS = frozenset({"/health"})
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")  # the routes whose calls are requests


def principal_of(scope) -> Principal:
    return scope.get("principal", ANONYMOUS)


class ApiKeyCheck:
    def __init__(self, app, admission: Admission):
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or not self.admission.keys.enabled:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization")
        request_id = headers.get(b"x-request-id", b"-").decode("latin-1")
        try:
            scope["principal"] = self.admission.authenticate(
                request_id, None if authorization is None else authorization.decode("latin-1"),
                generation=scope.get("path") in GENERATE_PATHS)
        except Refusal as e:
            return await _refuse(send, e.message)
        await self.app(scope, receive, send)


async def _refuse(send, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
