"""HTTP errors in the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.

Status codes: 400 bad or unsupported input (including requests that can never fit: prompt +
max_tokens > max_model_len, or more KV blocks than the pool, a batch of more prompts than
max_waiting), 401/403 admin auth, 404 unknown model or route, 429 "not now": the waiting queue
has no room at the moment (with ``Retry-After``), 503 model loading or engine dead.
Validation errors use 400 (not FastAPI's default 422 shape) with a message naming the field.
"""
from __future__ import annotations

import math
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from goodput.worker.engine.scheduler import AdmissionError
from goodput.api.states import RejectReason
from goodput.api.errors import error_body, error_type
from goodput.worker.server.protocol import UnsupportedParameter
from starlette.exceptions import HTTPException as StarletteHTTPException

class APIError(Exception):
    """Raise from a handler to answer ``status`` with the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type_ or error_type(status)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)

    @classmethod
    def from_admission(cls, e: AdmissionError) -> APIError:
        if e.reason is RejectReason.QUEUE_FULL:
            retry = max(1, math.ceil(e.retry_after or 1))
            return cls(429, f"Server is at capacity: {e.message}. Retry after {retry} s.",
                       code=e.reason.value, headers={"Retry-After": str(retry)})
        return cls(400, e.message, param=e.param, code=e.reason.value)

    @classmethod
    def unsupported(cls, e: UnsupportedParameter) -> APIError:
        return cls(400, str(e), param=e.param, code="unsupported_parameter")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}


def _loc_name(loc: tuple[Any, ...]) -> str:
    # Drop the request part and pydantic's union-member tags ("list[int]", "function-after[...]").
    parts = [str(p) for p in loc if p not in ("body", "query", "path")
             and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    return ".".join(parts)


def _describe(value: Any) -> str:
    if isinstance(value, (bytes, str)):
        return f"{len(value)} bytes of non-JSON data" if value else "an empty body"
    return f"a JSON {type(value).__name__}".replace("list", "array").replace("dict", "object")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message naming the field(s), and the first field as ``param``."""
    msgs, first = [], None
    errors = list(exc.errors())
    # For a union (prompt: str | list[int] | ...), one member's specific complaint (a value error)
    # says more than "Input should be a valid list" from the others.
    specific = {_loc_name(tuple(e.get("loc", ()))) for e in errors if e.get("type") == "value_error"}
    errors = [e for e in errors if e.get("type") == "value_error"
              or _loc_name(tuple(e.get("loc", ()))) not in specific]
    for err in errors:
        loc = tuple(err.get("loc", ()))
        typ = err.get("type", "")
        name = _loc_name(loc)
        if typ == "json_invalid":
            msgs.append(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}".strip())
            continue
        if not name and typ == "value_error":  # a whole-body check (e.g. "give prompt or messages")
            msgs.append(err.get("msg", "invalid request").removeprefix("Value error, "))
            continue
        if not name:  # the body itself: empty, a JSON array, form-encoded ...
            msgs.append("the request body must be a JSON object (Content-Type: application/json)"
                        + ("" if typ == "missing" else f"; got {_describe(err.get('input'))}"))
            continue
        if typ == "extra_forbidden":
            msgs.append(f"Unsupported parameter: '{name}' is not recognized by this server")
        elif typ == "missing":
            msgs.append(f"'{name}' is a required parameter")
        else:
            msgs.append(f"'{name}': {err.get('msg', 'invalid value').removeprefix('Value error, ')}")
        if first is None:
            first = name
    return "; ".join(dict.fromkeys(msgs)) or "invalid request", first


def install_error_handlers(app, on_invalid=None) -> None:
    """Make every error an OpenAI error body. ``on_invalid(request)`` is called for 400s that
    come from request validation (so ``rejected{reason="invalid"}`` counts them)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        if on_invalid is not None:
            on_invalid(request)
        message, param = validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path} not found"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None) or {}).response()
