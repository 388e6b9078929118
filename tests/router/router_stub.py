"""Helpers for the router tests: an upstream worker stub whose behaviour the test steers, and a
thread that serves any ASGI app with uvicorn on a free 127.0.0.1 port (real HTTP).

The stub answers like the worker (OpenAI bodies, ``/ready``, ``/metrics`` with the admission
limits, 503 ``draining``) and records what reached it. Its generate routes stream
``chunks`` SSE events; the test steers them through ``StubState`` (thread-safe):

- ``gate``: a ``threading.Semaphore`` each event after the first waits on (None: no wait), so a
  test can read event 1 through the router before event 2 exists;
- ``die_after``: raise after that many events (the connection drops mid-stream);
- ``hold``: a ``threading.Event`` every request waits on before answering (keeps it in flight);
- ``draining``: /ready 503 ``{"status": "draining"}`` and generate 503 code ``draining``;
- ``refuse``: generate answers 429 (its queue is full);
- ``fail_status``: generate answers that status at once (e.g. 500), OpenAI error body;
- ``metrics_when_ready``: /metrics 503 while ``draining`` (limits unknown until Ready);
- ``max_num_seqs`` / ``max_waiting``: exported on /metrics when set.

- ``kv_events``: ``/kv/snapshot`` and ``/kv/events`` answer as a worker whose prefix cache stays
  empty (else 404, as a worker without KV events: the router then uses its request history).
"""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from conftest import free_port  # noqa: F401 (the router tests import it from here)
from server_utils import ServerThread  # noqa: F401 (likewise)


@dataclass
class StubState:
    model: str
    name: str
    chunks: int = 3
    gate: threading.Semaphore | None = None
    die_after: int | None = None
    hold: threading.Event | None = None
    draining: bool = False
    refuse: bool = False  # generate answers 429 queue_full
    fail_status: int | None = None  # generate answers this status at once (a pod failing fast)
    instance: str | None = None  # sent as x-goodput-instance and on /metrics (goodput.api.identity)
    metrics_when_ready: bool = False  # /metrics answers 503 while draining (a pod still loading)
    max_num_seqs: int | None = None
    max_waiting: int | None = None
    kv_events: bool = False  # serve /kv/snapshot and /kv/events (an empty cache); else 404 (an older worker)
    bodies: list = field(default_factory=list)
    paths: list = field(default_factory=list)
    headers: list = field(default_factory=list)   # each generate request's headers (lowercase names)
    started: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    aborted: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self) -> int:
        with self.lock:
            return len(self.bodies)


async def _wait(ev_or_sem) -> None:
    """Wait on a threading primitive without blocking the loop (polls; no timing asserted)."""
    acquire = ev_or_sem.acquire if isinstance(ev_or_sem, threading.Semaphore) else ev_or_sem.wait
    while not acquire(timeout=0):
        await asyncio.sleep(0.005)


class _InstanceHeader:
    """Pure ASGI middleware: ``x-goodput-instance: st.instance`` on every answer (when set)."""

    def __init__(self, app, st: StubState):
        self.app, self.st = app, st

    async def __call__(self, scope, receive, send):
        async def send_with_id(message):
            if message["type"] == "http.response.start" and self.st.instance is not None:
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-goodput-instance", self.st.instance.encode())]}
            await send(message)
        await self.app(scope, receive, send_with_id)


def make_stub(st: StubState) -> FastAPI:
    app = FastAPI()
    app.add_middleware(_InstanceHeader, st=st)

    @app.get("/ready")
    async def ready():
        if st.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ready", "model": st.model}

    @app.get("/metrics")
    async def metrics():
        if st.metrics_when_ready and st.draining:
            return PlainTextResponse("loading\n", status_code=503)
        lines = [f'goodput_requests_running{{model_name="{st.model}"}} 0']
        if st.instance is not None:
            lines.append(f'goodput_engine_instance_info{{model_name="{st.model}",instance_id="{st.instance}"}} 1')
        if st.max_num_seqs is not None:
            lines.append(f'goodput_admission_max_num_seqs{{model_name="{st.model}"}} {st.max_num_seqs}')
        if st.max_waiting is not None:
            lines.append(f'goodput_admission_max_waiting{{model_name="{st.model}"}} {st.max_waiting}')
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.get("/kv/snapshot")  # goodput.api.kv_events: an empty cache (404 unless kv_events)
    async def kv_snapshot():
        if not st.kv_events:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"instance": st.instance or "stub0", "seq": 0, "chunk_size": 256, "keys": []}

    @app.get("/kv/events")
    async def kv_events(since: int = 0):
        if not st.kv_events:
            return JSONResponse({"detail": "Not Found"}, status_code=404)

        async def beats():
            for _ in range(100):  # heartbeats for 5 s, then the stream ends (the router resumes it)
                yield json.dumps({"instance": st.instance or "stub0", "seq": since, "kind": "heartbeat",
                                  "keys": []}) + "\n"
                await asyncio.sleep(0.05)
        return StreamingResponse(beats(), media_type="application/x-ndjson")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": st.model, "object": "model", "created": 1,
                                            "owned_by": "goodput", "max_model_len": 512}]}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        body = await req.json()
        text = body.get("prompt", "")
        return {"tokens": [ord(c) for c in text], "count": len(text), "max_model_len": 512, "pod": st.name}

    async def generate(req: Request, chat: bool):
        body = await req.json()
        with st.lock:
            st.bodies.append(body)
            st.paths.append(req.url.path)
            st.headers.append(dict(req.headers))
        st.started.release()
        if st.draining:
            return JSONResponse({"error": {"message": "draining", "type": "service_unavailable",
                                           "param": None, "code": "draining"}},
                                status_code=503, headers={"Retry-After": "1"})
        if st.fail_status is not None:
            return JSONResponse({"error": {"message": "engine failure", "type": "internal_error", "param": None,
                                           "code": None}}, status_code=st.fail_status)
        if st.refuse:
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit_error", "param": None,
                                           "code": "queue_full"}}, status_code=429, headers={"Retry-After": "1"})
        if st.hold is not None:
            await _wait(st.hold)
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            text = "".join(f"{st.name}-{i} " for i in range(st.chunks))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                      if chat else {"index": 0, "text": text, "finish_reason": "stop"})
            return {"id": "x", "object": obj, "created": 1, "model": st.model, "choices": [choice],
                    "usage": {"prompt_tokens": 1, "completion_tokens": st.chunks, "total_tokens": 1 + st.chunks}}

        async def events():
            try:
                for i in range(st.chunks):
                    if i and st.gate is not None:
                        await _wait(st.gate)
                    if st.die_after is not None and i == st.die_after:
                        raise RuntimeError("stub dies mid-stream")
                    piece = f"{st.name}-{i} "
                    choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat
                              else {"index": 0, "text": piece, "finish_reason": None})
                    yield "data: " + json.dumps({"id": "x", "object": obj + ("" if not chat else ".chunk"),
                                                 "created": 1, "model": st.model, "choices": [choice]}) + "\n\n"
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                st.aborted.set()
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await generate(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await generate(req, chat=True)

    return app


