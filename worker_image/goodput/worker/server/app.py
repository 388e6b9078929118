"""The worker's FastAPI application: the model loads in the lifespan, in the background.

While the model loads, ``GET /health`` answers 200 ``{"status": "loading"}`` (the process is
alive and making progress) and ``GET /ready`` answers 503; inference routes answer 503. Once
loaded, ``/health`` is the engine loop's heartbeat (503 when the loop died) and ``/ready`` is 200.
A failed load makes both 503 (the error is in the body and the log); ``goodput-worker serve``
then exits with status 1.

Drain (scale-down, rollout, node drain): on SIGTERM ``goodput-worker serve`` calls
:meth:`ServerState.start_drain`. From then on ``/ready`` answers 503 ``{"status": "draining"}`` (the
pod leaves the Service's endpoints), new generate requests get 503 with an OpenAI error body
(code ``draining``) telling the client to retry elsewhere, and the requests already in flight —
streams included — run to their end. The process exits 0 once none is left; the pod's
``terminationGracePeriodSeconds`` bounds the wait (the kubelet's SIGKILL).

``POST /admin/drain`` (the autoscaler's scale-in, before it lowers replicas) starts the same
drain without ending the process: ``/ready`` 503 ``draining``, new generate requests 503, in-flight
ones finish; ``DELETE /admin/drain`` undoes it (not a SIGTERM drain). See server/admin.py.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/v1/models/{model}``,
``/tokenize``, ``/detokenize`` (server/openai_routes.py); ``/admin/limits``, ``/admin/state``,
``/admin/drain`` (server/admin.py); ``/health``, ``/ready``, ``/metrics`` (here).

A request body larger than ``EngineArgs.max_request_body_bytes`` is answered 413 (HTTP's
"Content Too Large", with the OpenAI error body naming the limit and the flag) before it is
parsed. ``/openapi.json`` declares each route's real response models, the error statuses it
can answer (OpenAI error body) and the ``text/event-stream`` / Prometheus text content types;
FastAPI's default 422 is removed (validation errors are 400s here).

Every answer, once the engine is loaded, carries the engine's instance id (header
``x-goodput-instance``, goodput.api.identity), new at every start: a router forgets the
pod's prefix-cache knowledge when it changes.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from goodput.api.admin import ADMIN_TOKEN_ENV
from goodput.worker.async_engine import AsyncLLMEngine
from goodput.worker.engine_args import EngineArgs, build_engine
from goodput.api.identity import INSTANCE_HEADER
from goodput.worker.llm_engine import LLMEngine
from goodput.worker.server.errors import APIError, install_error_handlers
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

log = logging.getLogger("goodput.worker.server")



class HealthStatus(BaseModel):
    """``/health`` and ``/ready`` bodies: status is loading | ok | ready | dead | error."""

    status: str
    heartbeat_age_s: float | None = None
    model: str | None = None
    error: str | None = None


_PROBE_503 = {503: {"model": HealthStatus, "description": "loading (/ready), load failed or engine dead"}}


class BodySizeLimit:
    """ASGI middleware: answer 413 to a request body over ``limit`` bytes without parsing it
    (the Content-Length is checked first; a chunked body is counted as it arrives)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _refuse(self, scope, receive, send, what: str) -> None:
        err = APIError(413, f"the request body is {what}; the limit is {self.limit} bytes "
                            "(--max-request-body-bytes)", code="body_too_large")
        await err.response()(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send, f"{int(length)} bytes")
        if length is not None:
            return await self.app(scope, receive, send)
        # No Content-Length (chunked): read it here, within the limit, then replay it.
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left
            size += len(msg.get("body", b""))
            if size > self.limit:
                return await self._refuse(scope, receive, send, f"more than {self.limit} bytes")
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def _truthful_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its default 422 (validation errors are 400s with the OpenAI
    error body here) and with every route that takes a body declaring 413 (the body-size limit)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        from goodput.api.errors import ErrorResponse
        from goodput.worker.server.protocol import ChatCompletionChunk
        for path_item in schema.get("paths", {}).values():
            for method, op in path_item.items():
                responses = op.get("responses", {})
                responses.pop("422", None)
                if method in ("post", "put", "patch") and "413" not in responses:
                    responses["413"] = {"description": "Request body larger than --max-request-body-bytes",
                                        "content": {"application/json": {
                                            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        # Models only named in hand-written response docs (error bodies, stream chunks).
        for model in (ErrorResponse, ChatCompletionChunk):
            sub = model.model_json_schema(mode="serialization", ref_template="#/components/schemas/{model}")
            for name, d in sub.pop("$defs", {}).items():
                comps.setdefault(name, d)
            comps.setdefault(model.__name__, sub)
        app.openapi_schema = schema
    return app.openapi_schema


class ServerState:
    """Everything the routes need; ``app.state.server``."""

    def __init__(self, args: EngineArgs, admin_token: str | None):
        self.args = args
        self.model_name = args.model_name
        self.admin_token = admin_token or None
        self.created = int(time.time())
        self.llm: LLMEngine | None = None
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None
        self.loader: threading.Thread | None = None
        self.draining = False  # SIGTERM drain: the process exits once drained (cli.py)
        self.admin_draining = False  # POST /admin/drain: same admission effect, the process stays
        self.inflight = 0  # generate requests whose response (stream included) is not finished
        self.kv_events = None  # the engine's KvEventLog (server/kv_events.py), once loaded

    def start_drain(self) -> None:
        """SIGTERM: stop admitting (/ready 503, new generate requests 503); in-flight ones finish,
        then the process exits (:attr:`drained`)."""
        if not self.draining:
            self.draining = True
            log.info("draining: admitting nothing new; %d request(s) in flight", self.inflight)

    def set_admin_drain(self, on: bool) -> None:
        """``POST``/``DELETE /admin/drain``: the admission effect of :meth:`start_drain` without
        the exit; idempotent. Undoing it does not undo a SIGTERM drain (:attr:`admitting` stays
        False while :attr:`draining`)."""
        if on != self.admin_draining:
            self.admin_draining = on
            log.info("admin drain %s; %d request(s) in flight", "started" if on else "undone", self.inflight)

    @property
    def admitting(self) -> bool:
        """False while any drain (SIGTERM or admin) is on."""
        return not (self.draining or self.admin_draining)

    @property
    def drained(self) -> bool:
        """SIGTERM-draining, no generate request left in flight and no remote prefill's KV lease
        open (a decode worker may still pull it; a lease ends within --kv-lease-seconds): the
        process may exit."""
        leases = getattr(getattr(self.llm, "scheduler", None), "leases", None)
        return self.draining and self.inflight == 0 and not leases

    def require_admitting(self) -> None:
        """Raise 503 (OpenAI error body, code ``draining``) once a drain (SIGTERM or admin) started."""
        if not self.admitting:
            why = "shutting down (draining)" if self.draining else "draining (scale-in)"
            raise APIError(503, f"this replica is {why} and admits no new requests; "
                                "retry the request: the Service routes it to another replica",
                           code="draining", headers={"Retry-After": "1"})

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.is_healthy() and self.admitting

    def require_engine(self) -> AsyncLLMEngine:
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error!r}")
            raise APIError(503, "the model is still loading; retry when GET /ready returns 200",
                           headers={"Retry-After": "5"})
        if not self.engine.is_healthy():
            raise APIError(503, f"the engine loop is not running ({self.engine.error!r})")
        return self.engine

    @property
    def max_model_len(self) -> int | None:
        return self.llm.config.max_model_len if self.llm is not None else None


GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class _InflightCounter:
    """Pure ASGI middleware: counts generate requests until their response (a whole SSE stream
    included) is sent, so a drain knows when the last stream ended."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATE_PATHS:
            return await self.app(scope, receive, send)
        self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1


class _InstanceHeader:
    """Pure ASGI middleware: every answer carries the engine's instance id (header
    ``goodput.api.identity.INSTANCE_HEADER``) once the engine is loaded, so a router learns of
    a restart in place from the first answer after it."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        llm = self.state.llm
        if scope["type"] != "http" or llm is None or llm.metrics is None:
            return await self.app(scope, receive, send)
        header = (INSTANCE_HEADER.encode(), llm.metrics.instance_id.encode())

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(args: EngineArgs, engine_factory: Callable[[EngineArgs], LLMEngine] | None = None,
               admin_token: str | None = None,
               on_load_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """Build the app. ``engine_factory`` (default :func:`~goodput.worker.engine_args.build_engine`) loads the model;
    ``admin_token`` defaults to the ``GOODPUT_ADMIN_TOKEN`` environment variable;
    ``on_load_failure`` is called (from the loader thread) after a failed load — the CLI uses it
    to stop the server and exit 1."""
    factory = engine_factory or build_engine
    token = admin_token if admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV)
    state = ServerState(args, token)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()

        def load() -> None:
            t0 = time.monotonic()
            try:
                llm = factory(args)
            except BaseException as exc:
                log.exception("model load failed")
                state.load_error = exc
                if on_load_failure is not None:
                    on_load_failure(exc)
                return
            from goodput.worker.server.kv_events import attach as attach_kv_events
            state.kv_events = attach_kv_events(llm)  # before any request: the log sees every block
            eng = AsyncLLMEngine(llm)
            eng.start(loop)
            state.llm, state.engine = llm, eng
            log.info("model %s loaded in %.1f s; ready", args.model_name, time.monotonic() - t0)

        state.loader = threading.Thread(target=load, name="goodput-model-load", daemon=True)
        state.loader.start()
        try:
            yield
        finally:
            if state.engine is not None:
                state.engine.shutdown()

    app = FastAPI(title="goodput worker", lifespan=lifespan)
    app.state.server = state
    app.openapi = lambda: _truthful_openapi(app)
    app.add_middleware(BodySizeLimit, limit=args.max_request_body_bytes)

    def count_invalid(request: Request) -> None:
        if request.url.path in ("/v1/completions", "/v1/chat/completions") and state.llm is not None:
            state.llm.count_invalid()

    install_error_handlers(app, count_invalid)
    app.add_middleware(_InflightCounter, state=state)
    app.add_middleware(_InstanceHeader, state=state)

    from goodput.worker.server.admin import router as admin_router
    from goodput.worker.server.disagg import router as kv_router
    from goodput.worker.server.kv_events import router as kv_events_router
    from goodput.worker.server.openai_routes import router as openai_router
    app.include_router(openai_router)
    app.include_router(admin_router)
    app.include_router(kv_events_router)
    app.include_router(kv_router)

    @app.get("/health", response_model=HealthStatus, responses=_PROBE_503)
    async def health() -> JSONResponse:
        if state.load_error is not None:
            return JSONResponse({"status": "error", "error": repr(state.load_error)}, status_code=503)
        if state.engine is None:
            return JSONResponse({"status": "loading"})
        if not state.engine.is_healthy():
            return JSONResponse({"status": "dead", "error": repr(state.engine.error)}, status_code=503)
        return JSONResponse({"status": "ok",
                             "heartbeat_age_s": round(time.monotonic() - state.engine.heartbeat, 3)})

    @app.get("/ready", response_model=HealthStatus, responses=_PROBE_503)
    async def ready() -> JSONResponse:
        if state.ready:
            return JSONResponse({"status": "ready", "model": state.model_name})
        if not state.admitting:
            return JSONResponse({"status": "draining", "inflight": state.inflight}, status_code=503)
        body: dict[str, Any] = {"status": "loading" if state.load_error is None else "error"}
        if state.load_error is not None:
            body["error"] = repr(state.load_error)
        return JSONResponse(body, status_code=503)

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text exposition format",
              "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
        503: {"description": "model not loaded yet", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        if state.llm is None or state.llm.metrics is None:
            return Response("# model not loaded yet\n", status_code=503, media_type="text/plain")
        return Response(state.llm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
