"""HTTP errors in the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.

The same shape and ``type`` per status as the worker: both take them from ``goodput.api.errors``. Statuses: 400
bad input (not JSON, not an object, no ``model``), 404 unknown model or route, 413 body over
``--max-body-bytes``, 429 fleet queue full (``Retry-After``), 502 upstream failed before its
answer, 503 no Ready pod after the hold (``Retry-After``) or no pod at all.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from goodput.api.errors import error_body, error_type
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

class APIError(Exception):
    """Raise from a handler to answer ``status`` with the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = error_type(status)

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
