"""HTTP errors in the worker's OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.

The same shape and ``type`` per status as the worker (worker_image/goodput/worker/server/errors.py),
written here so the router imports nothing of the worker (it runs without torch). Statuses: 400
bad input (not JSON, not an object, no ``model``), 404 unknown model or route, 413 body over
``--max-body-bytes``, 429 fleet queue full (``Retry-After``), 502 upstream failed before its
answer, 503 no Ready pod after the hold (``Retry-After``) or no pod at all.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_error", 500: "internal_error", 502: "internal_error",
         503: "service_unavailable", 504: "service_unavailable"}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body (as the worker's ``protocol.error_body``)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """Raise from a handler to answer ``status`` with the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def install_error_handlers(app) -> None:
    """Every error answer, FastAPI's own 404/405 included, in the OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path} not found"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None) or {}).response()
