"""Server-sent events framing for OpenAI-style streams (``data: <json>\\n\\n`` ... ``data: [DONE]``).

Reference: the WHATWG HTML "Server-sent events" section (event stream format) and the OpenAI API
streaming format, whose last event is the literal ``[DONE]``.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# No proxy buffering, no caching: tokens must reach the client as they are produced.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: BaseModel | dict[str, Any]) -> bytes:
    """One ``data:`` event holding ``payload`` as compact JSON (never contains a raw newline)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + body.encode("utf-8") + b"\n\n"
