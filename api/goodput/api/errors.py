"""The OpenAI error body every goodput HTTP answer uses: ``{"error": {"message", "type", "param",
"code"}}``, with one ``type`` per HTTP status. The worker (``goodput.worker.server.errors``) and the
router (``goodput.router.errors``) both answer with it, so a client sees one shape whoever refused.

``code`` names the cause a client can act on (``queue_full``, ``never_fits``, ``no_ready_pod``, ...);
``param`` the request field at fault, when there is one.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# HTTP status -> the body's ``type`` (OpenAI's names); any other status: invalid_request_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error", 502: "internal_error",
               503: "service_unavailable", 504: "service_unavailable"}


def error_type(status: int) -> str:
    """The ``type`` of an error answered with HTTP ``status``."""
    return ERROR_TYPES.get(status, "invalid_request_error")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI error body: ``{"error": {"message", "type", "param", "code"}}`` (the OpenAPI schema
    the worker documents its errors with)."""

    error: ErrorInfo


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The body as a plain dict (what :class:`ErrorResponse` dumps to)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


__all__ = ["ERROR_TYPES", "ErrorInfo", "ErrorResponse", "error_body", "error_type"]
