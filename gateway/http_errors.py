"""The OpenAI API's errors: OpenAI's body `{"error": {"message", "type", "param", "code"}}` under the
status the client libraries map, from an admission refusal (a gRPC status), a body that failed
its schema (400 naming the field, never FastAPI's 422), a body nested too deeply to parse (400
naming the field) or anything else (500)."""
from __future__ import annotations

import asyncio
import math
import re

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.json_nesting import deep_path, too_deep
from gateway.openai_requests import ERROR_TYPE, HTTP_STATUS
from gateway.openai_responses import error_body
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, _Request


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, logged: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}
        self.logged = logged  # already in the request log (admission logs its own refusals)

    @classmethod
    def from_code(cls, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                  logged: bool = False) -> "ApiError":
        headers = {"retry-after": str(max(1, math.ceil(retry_after_ms / 1e3)))} if retry_after_ms is not None else {}
        status = HTTP_STATUS.get(code, 500)
        if status == 409 or (status == 429 and retry_after_ms is None):
            # Trying the same again cannot succeed (an id in flight, more tokens than a key's minute):
            # the openai client's retries would only repeat the refusal.
            headers["x-should-retry"] = "false"
        return cls(status, message, param_of(message) if status == 400 else None, code.name.lower(), headers, logged)

    def response(self) -> JSONResponse:
        body = error_body(self.message, ERROR_TYPE.get(self.status, "server_error"), self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# The fields a refusal's message may begin with (validation names the field first).
_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | {
    "prompt_token_ids", "request_id", "messages", "logit_bias"}
_LEADING_NAME = re.compile(r"^(?:the )?([a-z_]+)((?:\[\d+\]|\.[a-z_]+)*)")


def param_of(message: str) -> str | None:
    """The body field an admission message names first, as `param` (e.g. "temperature must be ...",
    "response_format.json_schema.schema: ...": its whole path)."""
    match = _LEADING_NAME.match(message)
    if match and match.group(1) in _FIELDS:
        return match.group(1) + (match.group(2) or "")
    return None


_UNION_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _client_path(loc) -> str:
    """A pydantic error location as the client wrote it: no `body` root, no union branch names
    (a branch that is a body model shows as its class's name)."""
    parts = [str(p) for p in loc if p != "body"]
    models = _body_models()
    return ".".join(p for p in parts if p not in _UNION_BRANCHES and p not in models and "[" not in p
                    and not p.startswith("function-"))


def _body_models() -> set[str]:
    names, todo = set(), [_Request]
    while todo:
        model = todo.pop()
        names.add(model.__name__)
        todo.extend(model.__subclasses__())
    return names


def validation_error(e: RequestValidationError) -> ApiError:
    errors = e.errors() or [{"loc": (), "msg": "invalid body", "type": "invalid"}]
    # Of a union's branches, the one the body got furthest into says most about what is wrong.
    first = max(errors, key=lambda err: len(err.get("loc", ())))
    param = _client_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        param = ""  # pydantic's location is the parse position, not a field
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
    elif first.get("type") == "extra_forbidden":
        message = f"unrecognized request argument: {param}"
    elif first.get("type") == "missing" and not param:
        message = "the request has no body: send a JSON object"
    elif first.get("type") == "missing":
        message = f"missing required argument: {param}"
    elif first.get("type") in ("dict_type", "model_attributes_type") and isinstance(first.get("input"), bytes):
        message = f"the body must be a JSON object (with content-type: application/json): {first['msg']}"
    else:
        message = f"{param or 'body'}: {first['msg']}"
    return ApiError(400, message, param or None, first.get("type"))


# Where a body holds JSON of the client's own design (a schema), named whole; elsewhere a body that
# nests too deeply is named by its top-level field.
_FREE_FORM = re.compile(r"^(?:response_format\.json_schema\.schema|structured_outputs\.json|"
                        r"tools\[\d+\]\.function\.parameters)(?=[.\[]|$)")


async def too_deep_body(http: Request) -> ApiError:
    """The 400 for a body nested deeper than the gateway parses (the JSON parser, or a walk over
    the parsed body, raised RecursionError), naming the field that does. Called only once the
    body has been read; the search runs off the loop (a body may hold a million values)."""
    path = await asyncio.to_thread(deep_path, await http.body())
    written = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    match = _FREE_FORM.match(written)
    field = match[0] if match else path[0] if path and isinstance(path[0], str) else None
    return ApiError(400, too_deep(field or "the body"), field)


def http_error(e: StarletteHTTPException) -> ApiError:
    return ApiError(e.status_code, str(e.detail), headers=dict(e.headers or {}))


async def internal_error(_: Request, e: Exception) -> JSONResponse:
    return ApiError(500, f"internal error: {type(e).__name__}: {e}").response()
