"""The HTTP API's key check: an ASGI middleware that answers 401 (OpenAI's error body, with
`WWW-Authenticate: Bearer`) before a request's body is read, and hands the caller's principal to
the routes in `scope["principal"]`. /health stays open, as the gRPC health service does. A
generation the caller's or the gateway's limits would refuse now (streams, request rate, a drain)
is answered then too, as the route would answer it, so that its body is never read or parsed."""
from __future__ import annotations

import json

from gateway.admission import Admission, Refusal
from gateway.auth import ANONYMOUS, Principal
from gateway.http_errors import ApiError

OPEN_PATHS = frozenset({"/health"})
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")  # the routes whose calls are requests


def principal_of(scope) -> Principal:
    return scope.get("principal", ANONYMOUS)


class ApiKeyCheck:
    def __init__(self, app, admission: Admission):
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"-").decode("latin-1")
        generation = scope.get("path") in GENERATE_PATHS
        if self.admission.keys.enabled:
            authorization = headers.get(b"authorization")
            try:
                scope["principal"] = self.admission.authenticate(
                    request_id, None if authorization is None else authorization.decode("latin-1"),
                    generation=generation)
            except Refusal as e:
                return await _refuse(send, e.message)
        if generation and scope.get("method") == "POST":
            try:
                self.admission.check_room(request_id, principal_of(scope))
            except Refusal as e:
                refusal = ApiError.from_code(e.code, e.message, e.retry_after_ms, logged=True)
                return await refusal.response()(scope, receive, send)
        await self.app(scope, receive, send)


async def _refuse(send, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
