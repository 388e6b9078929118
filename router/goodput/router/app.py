"""The router's FastAPI application: one OpenAI endpoint in front of every InferenceService.

Routes: ``POST /v1/completions``, ``/v1/chat/completions`` (picked pod, fleet admission, SSE
passed through event by event), ``GET /v1/models`` (every served model), ``/v1/models/{id}``,
``POST /tokenize``, ``/detokenize`` (any routable pod of the model's service), ``GET /health``
(the process), ``/ready`` (discovery has synced once), ``/metrics`` (``goodput_router_*``).

One request (generate routes): the body is read (413 beyond ``max_body_bytes``) and parsed (400:
not JSON, not an object, no string ``model``); ``model`` names the service (404 naming it when
unknown); :class:`~goodput.router.admission.Admission` holds, picks, queues or refuses; the body
is sent as is to the pod over the router's one HTTP client (goodput.router.upstream: one pooled
``aiohttp.ClientSession`` for the data path and the router's own calls, scrape, probes, model
cards, tokenize; its timeouts declared once there). The request itself (retries before the first byte,
the buffered and SSE relays) is :func:`goodput.router.forward.forward`; pods that keep failing are
set aside by outlier ejection (goodput.router.outlier); a pod whose engine id changes
(goodput.api.identity: answer header or scrape) loses its prefix-cache knowledge at once
(docs/router-faults.md). A client that goes away (while held, queued, waiting for the answer or
mid-stream) closes the upstream connection, which aborts the request in the worker; one whose
body stops arriving gets 408 after ``--body-timeout`` (its head: ``--header-timeout``,
goodput.router.serve).
Every answer carries ``x-goodput-pod`` (the pod that served it, when one did).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from goodput.api import router_metrics as mn
from goodput.api.errors import error_body
from goodput.api.policy import rank_of
from goodput.api.settings import setting, validate
from prometheus_client import CONTENT_TYPE_LATEST

from goodput.router.admission import Admission
from goodput.router.discovery_static import StaticDiscovery
from goodput.router.errors import APIError, install_error_handlers
from goodput.router.fleet import Discovery, Fleet, Pod, Service
from goodput.router.forward import DRAINING, Attempt, Exchange, forward, verdict
from goodput.router.metrics import RouterMetrics
from goodput.router.outlier import FAILURE, OutlierConfig, Outliers
from goodput.router.kv_follow import KvFollower
from goodput.router.kv_index import ExactIndex
from goodput.router.picker import PickConfig, PrefixIndex
from goodput.router.routing import request_key
from goodput.router.scrape import scrape_forever, scrape_pod
from goodput.router.upstream import ERRORS, Timeouts, Upstream
from goodput.api.identity import INSTANCE_HEADER

log = logging.getLogger("goodput.router")

POD_HEADER = "x-goodput-pod"
TENANT_HEADER = "x-goodput-tenant"              # the request's fairness id (else the body's "user")
QUEUE_TIMEOUT_HEADER = "x-goodput-queue-timeout"  # the request's own longest queue wait, seconds
SLO_CLASS_HEADER = "x-goodput-slo-class"          # the request's SLO class (per-class metrics)
_CLASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_TENANT_B, _QUEUE_TIMEOUT_B, _SLO_CLASS_B = (h.encode() for h in (TENANT_HEADER, QUEUE_TIMEOUT_HEADER,
                                                                    SLO_CLASS_HEADER))
# Request headers passed to the pod; response headers passed back (the rest are hop-by-hop or
# recomputed: content-length, transfer-encoding, connection, date, server).
_FORWARD_REQ = ("content-type", "authorization", "x-request-id", "traceparent", "tracestate", "accept",
                SLO_CLASS_HEADER)   # the worker judges the request by its class
_FORWARD_RESP = ("content-type", "retry-after", "x-request-id", "cache-control")
# The router's own refusals by error code -> goodput_router_requests_total outcome.
_OUTCOMES = {"queue_full": "refused", "queue_timeout": "timeout", "no_ready_pod": "timeout"}


@dataclass
class RouterSettings:
    """The router's settings, each declared once here (``goodput.api.settings.setting``):
    ``python -m goodput.router`` builds one flag per field (``--scrape-period`` for
    ``scrape_period_s``), with its bounds, checked again at construction. Units: seconds (``_s``),
    bytes (``_bytes``)."""

    scrape_period_s: float = setting(2.0, "seconds between scrapes of each pod's /metrics (and, static mode, "
                                     "its /ready)", flag="--scrape-period", gt=0)
    hold_timeout_s: float = setting(600.0, "longest hold of a request while its service has no Ready pod, for "
                                    "services without a startup timeout (static mode: all)",
                                    flag="--hold-timeout", ge=0)
    queue_timeout_s: float = setting(60.0, "longest wait in the fleet queue (every pod at its limits) before 429",
                                     flag="--queue-timeout", ge=0)
    retry_after_s: float = setting(1.0, "Retry-After (seconds) of the router's 429 and 503", flag="--retry-after",
                                   ge=0)
    max_body_bytes: int = setting(8 << 20, "largest request body in bytes (413 beyond)", flag="--max-body-bytes",
                                  ge=1)
    connect_timeout_s: float = setting(5.0, "upstream connect timeout (retried on another pod)",
                                       flag="--connect-timeout", gt=0)
    probe_timeout_s: float = setting(5.0, "longest wait for the whole answer to one of the router's own calls to "
                                     "a pod (scrape of /metrics, static mode's /ready probe, /v1/models card)",
                                     flag="--probe-timeout", gt=0)
    max_connections: int = setting(2000, "upstream connection pool size (keep-alive)", flag="--max-connections",
                                   ge=1)
    header_timeout_s: float = setting(30.0, "longest wait for a client's request head (a connection that sends "
                                      "part of its headers, or nothing, is closed)", flag="--header-timeout", gt=0)
    body_timeout_s: float = setting(60.0, "longest read of a request body (408 beyond)", flag="--body-timeout",
                                    gt=0)
    outlier_consecutive_failures: int = setting(3, "failures in a row (5xx, no answer) that eject a pod "
                                                "(docs/router-faults.md)", flag="--outlier-consecutive-failures",
                                                ge=1)
    outlier_base_ejection_s: float = setting(30.0, "first ejection's length in seconds; the k-th in a row lasts k "
                                             "times it", flag="--outlier-base-ejection", gt=0)
    outlier_max_ejection_s: float = setting(300.0, "longest ejection in seconds", flag="--outlier-max-ejection",
                                            gt=0)
    outlier_interval_s: float = setting(10.0, "window of the success-rate and failure-percentage outlier rules, "
                                        "seconds", flag="--outlier-interval", gt=0)
    band_queue_timeout: list[str] = setting([], "a priority band's longest fleet-queue wait, PRIORITY=SECONDS "
                                            "(repeatable); the shortest of it, --queue-timeout and the request's "
                                            "x-goodput-queue-timeout applies", flag="--band-queue-timeout")
    kv_events: str = setting("on", "follow each pod's KV events (GET /kv/events) into an exact index of its prefix "
                             "cache; off: the request-history index alone (docs/routing.md)", choices=("on", "off"),
                             flag="--kv-events")
    max_slo_classes: int = setting(16, "distinct SLO class names (x-goodput-slo-class) counted under their own "
                                   "slo_class label; later ones count as 'other'", flag="--max-slo-classes", ge=0)
    pd_remote_prefill_min_tokens: int | None = setting(
        None, "disaggregated prefill for services that do not set spec.disaggregation (static mode): a "
              "prefill pod computes the prompt when the decode pod would prefill more than this many of its "
              "tokens (estimated from prefix chunks); none: never (docs/disaggregation.md)",
        flag="--pd-remote-prefill-min-tokens", ge=0)
    pd_prefill_timeout_s: float = setting(60.0, "longest remote prefill call; past it, or on any error, the decode "
                                          "pod prefills locally", flag="--pd-prefill-timeout", gt=0)

    def __post_init__(self) -> None:
        validate(self)
        self.outlier_config()
        self.band_timeouts()

    def band_timeouts(self) -> dict[int, float]:
        """``band_queue_timeout`` as {priority: seconds}; ValueError on an entry that is not
        ``INT=SECONDS`` with seconds a finite number >= 0, or a band given twice."""
        out: dict[int, float] = {}
        for item in self.band_queue_timeout:
            band, sep, secs = item.partition("=")
            try:
                b, t = int(band), float(secs)
            except ValueError:
                b, t = 0, -1.0
            if not sep or not (0 <= t < float("inf")) or b in out:
                raise ValueError(f"band_queue_timeout: want PRIORITY=SECONDS (an integer band, once each; "
                                 f"seconds >= 0), got {item!r}")
            out[b] = t
        return out

    def timeouts(self) -> Timeouts:
        """The upstream client's timeouts (goodput.router.upstream)."""
        return Timeouts(connect_s=self.connect_timeout_s, probe_s=self.probe_timeout_s)

    def outlier_config(self) -> OutlierConfig:
        """The outlier-ejection knobs (goodput.router.outlier); ValueError on bad values."""
        return OutlierConfig(consecutive_failures=self.outlier_consecutive_failures,
                             base_ejection_s=self.outlier_base_ejection_s,
                             max_ejection_s=self.outlier_max_ejection_s, interval_s=self.outlier_interval_s)


class _Disconnected(Exception):
    pass


async def _read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body_unbounded(request, limit)
    except TimeoutError:
        raise _body_timeout(timeout_s) from None


async def _read_body_unbounded(request: Request, limit: int) -> bytes:
    too_big = APIError(413, f"the request body is larger than the router's limit of {limit} bytes "
                            "(--max-body-bytes)")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise APIError(400, "the request body must be a JSON object (Content-Type: application/json); "
                            "got an empty body")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        kind = {list: "array", str: "string"}.get(type(body), type(body).__name__)
        raise APIError(400, f"the request body must be a JSON object; got a JSON {kind}")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise APIError(400, "'model' is a required parameter", param="model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' must be a non-empty string", param="model")
    return model


def _unknown_model(model: str, fleet: Fleet) -> APIError:
    known = ", ".join(repr(s.info.model) for s in fleet.models()) or "none"
    return APIError(404, f"The model '{model}' does not exist (served here: {known})", param="model",
                    code="model_not_found")


def _header(scope, name: bytes) -> str | None:
    """The first ``name`` header of an ASGI scope (lowercase bytes), decoded; None without one."""
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


def _tenant(scope, body: dict[str, Any], max_len: int = 256) -> str:
    """The fairness id: the ``x-goodput-tenant`` header, else the OpenAI body's ``user`` (a
    string), else ``""`` (one shared anonymous tenant); at most ``max_len`` characters."""
    tenant = _header(scope, _TENANT_B)
    if tenant is not None:
        return tenant[:max_len]
    user = body.get("user")
    return user[:max_len] if isinstance(user, str) else ""


def _queue_timeout(scope) -> float | None:
    """The ``x-goodput-queue-timeout`` header in seconds (a finite number >= 0); None when absent.
    400 when it is not such a number."""
    v = _header(scope, _QUEUE_TIMEOUT_B)
    if v is None:
        return None
    try:
        t = float(v)
    except ValueError:
        t = -1.0
    if not (0 <= t < float("inf")):
        raise APIError(400, f"{QUEUE_TIMEOUT_HEADER} must be a number of seconds >= 0; got {v!r}",
                       param=QUEUE_TIMEOUT_HEADER)
    return t


def request_priority(body: dict[str, Any], slo_class: str | None, ranks: tuple[tuple[str, int], ...]) -> int:
    """The request's band in the fleet queue (lower first): the body's integer ``priority`` when it
    has one (vLLM's field), else the band of the SLO class its ``x-goodput-slo-class`` names among
    the service's ``ranks`` (:attr:`ServiceInfo.slo_ranks`; an unknown or missing name: the unnamed
    class's band), else 0. E.g. ranks ``(("batch", 1), ("default", 0))``: class ``batch`` → 1,
    ``batch`` with ``"priority": 0`` → 0."""
    p = body.get("priority")
    if isinstance(p, int) and not isinstance(p, bool):
        return p
    return rank_of(slo_class, dict(ranks)) if ranks else 0


def _req_headers(request: Request) -> dict[str, str]:
    h = {k: v for k in _FORWARD_REQ if (v := request.headers.get(k)) is not None}
    h.setdefault("content-type", "application/json")
    return h


def _resp_headers(resp: Any, pod: Pod | None) -> dict[str, str]:
    h = {k: v for k in _FORWARD_RESP if (v := resp.headers.get(k)) is not None}
    if pod is not None:
        h[POD_HEADER] = pod.name
    return h


def _body_timeout(timeout_s: float) -> APIError:
    return APIError(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout)",
                    code="body_timeout", headers={"Connection": "close"})


async def _asgi_body(scope, receive, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body from ASGI ``receive``; 413 beyond ``limit`` bytes (declared or read);
    408 when it is not all there after ``timeout_s`` seconds (None: no bound)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _asgi_body_unbounded(scope, receive, limit)
    except TimeoutError:
        raise _body_timeout(timeout_s) from None


async def _asgi_body_unbounded(scope, receive, limit: int) -> bytes:
    too_big = APIError(413, f"the request body is larger than the router's limit of {limit} bytes "
                            "(--max-body-bytes)")
    for k, v in scope["headers"]:
        if k == b"content-length" and v.isdigit() and int(v) > limit:
            raise too_big
    chunks, n, more = [], 0, True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _Disconnected()
        chunk = msg.get("body", b"")
        n += len(chunk)
        if n > limit:
            raise too_big
        chunks.append(chunk)
        more = msg.get("more_body", False)
    return b"".join(chunks)


async def _until_disconnect(receive) -> None:
    """Return when the client goes away (ASGI ``http.disconnect``, after the body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data, "more_body": False})


_FORWARD_REQ_B = tuple(h.encode() for h in _FORWARD_REQ)


def _asgi_req_headers(scope) -> dict[str, str]:
    h = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _FORWARD_REQ_B}
    h.setdefault("content-type", "application/json")
    return h


def _asgi_resp_headers(resp: aiohttp.ClientResponse, pod: Pod) -> list[tuple[bytes, bytes]]:
    out = [(k.encode(), v.encode("latin-1")) for k in _FORWARD_RESP if (v := resp.headers.get(k)) is not None]
    out.append((POD_HEADER.encode(), pod.name.encode()))
    return out


class Router:
    """The router's state: the fleet, admission, the upstream client (``upstream``), metrics."""

    def __init__(self, discovery: Discovery, settings: RouterSettings, fleet: Fleet | None = None,
                 pick_cfg: PickConfig | None = None):
        self.discovery, self.settings = discovery, settings
        self.fleet = fleet or Fleet()
        self.metrics = RouterMetrics()
        self.pick_cfg = pick_cfg or PickConfig()
        self.index = PrefixIndex(self.pick_cfg.index_capacity)
        self.index.exact = ExactIndex() if settings.kv_events == "on" else None
        self.outliers = Outliers(settings.outlier_config())
        self.admission = Admission(self.fleet, self.metrics, self.index, self.pick_cfg,
                                   hold_timeout_s=settings.hold_timeout_s,
                                   queue_timeout_s=settings.queue_timeout_s,
                                   band_timeouts_s=settings.band_timeouts(),
                                   retry_after_s=settings.retry_after_s,
                                   learn_limits=self.learn_limits, outliers=self.outliers)
        self.metrics.watch_fleet(self.fleet, self.outliers)
        self.metrics.watch_kv(self.fleet, self.index.exact)
        self._scrapes: dict[str, asyncio.Future] = {}  # pod URL -> the scrape in progress
        self.upstream = Upstream(settings.timeouts(), settings.max_connections)
        self.cards: dict[tuple[str, str], dict[str, Any]] = {}  # (pod URL, model) -> the pod's card
        self._tasks: list[asyncio.Task] = []
        self._classes: set[str] = set()  # SLO class names with a label of their own

    # ------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        s = self.settings
        self.upstream.open()
        if isinstance(self.discovery, StaticDiscovery) and self.discovery.http is None:
            self.discovery.http = self.upstream  # its /ready probes: the same client and timeouts
        self._tasks = [asyncio.create_task(self._run_discovery(), name="discovery"),
                       asyncio.create_task(scrape_forever(self.fleet, self.upstream, s.scrape_period_s,
                                                          self.admission.dispatch, self.note_instance),
                                           name="scrape")]
        if self.index.exact is not None:
            follower = KvFollower(self.fleet, self.upstream, self.index.exact, self.metrics, self.pick_cfg.chunk_size,
                                  s.scrape_period_s)
            self._tasks.append(asyncio.create_task(follower.run(), name="kv-events"))

    async def _run_discovery(self) -> None:
        try:
            await self.discovery.run(self.fleet)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery failed")
            raise
        self.fleet.mark_synced()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with suppress(asyncio.CancelledError, Exception):
                await t
        await self.upstream.close()

    # ------------------------------------------------------------------------- helpers

    async def scrape_now(self, pods: list[Pod]) -> None:
        """Scrape ``pods`` now (concurrent callers share one scrape per pod); at most
        ``connect_timeout_s`` of waiting."""
        futs = []
        for p in pods:
            fut = self._scrapes.get(p.url)
            if fut is None:
                fut = self._scrapes[p.url] = asyncio.ensure_future(scrape_pod(self.upstream, p, self.note_instance))
                fut.add_done_callback(lambda _, url=p.url: self._scrapes.pop(url, None))
            futs.append(fut)
        if futs:
            await asyncio.wait(futs, timeout=self.settings.connect_timeout_s)

    async def learn_limits(self, svc: Service) -> None:
        """Scrape the routable pods of ``svc`` whose admission limits are unknown."""
        await self.scrape_now([p for p in svc.routable_pods() if p.capacity is None])

    def _count(self, svc: Service, pod: Pod | None, outcome: str, slo_class: str = mn.NO_CLASS) -> None:
        self.metrics.requests.labels(svc.key[0], svc.key[1], svc.info.model, pod.name if pod else "",
                                     outcome).inc()
        self.metrics.class_requests.labels(*svc.key, slo_class, outcome).inc()

    def slo_class(self, name: str | None) -> str:
        """The SLO class label of a request whose ``x-goodput-slo-class`` header is ``name``: the
        name when it is one (a letter or digit, then up to 62 of letters, digits, ``_ . -``) among
        the first ``max_slo_classes`` distinct names this router saw, ``"other"`` beyond them,
        ``""`` without one (or not a name)."""
        if name is None or not _CLASS_NAME.fullmatch(name):
            return mn.NO_CLASS
        if name in self._classes:
            return name
        if len(self._classes) < self.settings.max_slo_classes and name != mn.OTHER_CLASS:
            self._classes.add(name)
            return name
        return mn.OTHER_CLASS

    def _mark_draining(self, svc: Service, pod: Pod) -> None:
        current = self.fleet.service(svc.key)
        if current is not None and current.pods.get(pod.name) is pod and not pod.info.draining:
            self.fleet.set_pod(svc.key[0], svc.key[1], replace(pod.info, draining=True))

    # ------------------------------------------------------------------------- generate (raw ASGI)

    async def generate(self, scope, receive, send) -> None:
        """``POST /v1/completions`` and ``/v1/chat/completions`` as a plain ASGI handler (no
        Starlette request/response objects, middleware or task groups on the hot path); the
        request itself goes through :func:`goodput.router.forward.forward`."""
        t0 = time.perf_counter()
        ex: Exchange | None = None
        outcome: str | None = None
        try:
            raw = await _asgi_body(scope, receive, self.settings.max_body_bytes, self.settings.body_timeout_s)
            body = _parse(raw)
            model = _model(body)
            svc = self.fleet.for_model(model)
            if svc is None:
                raise _unknown_model(model, self.fleet)
            slo_class = _header(scope, _SLO_CLASS_B)
            ex = Exchange(svc, request_key(svc, scope["path"], body, self.pick_cfg),
                          request_priority(body, slo_class, svc.info.slo_ranks), scope["path"],
                          raw, _asgi_req_headers(scope), t0, tenant=_tenant(scope, body),
                          queue_timeout_s=_queue_timeout(scope), slo_class=self.slo_class(slo_class))
            work = asyncio.ensure_future(forward(self, ex, send))
            watch = asyncio.ensure_future(_until_disconnect(receive))
            watch.add_done_callback(lambda w: (not w.cancelled()) and work.cancel())
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                if not watch.done() or watch.cancelled():  # this handler was cancelled (shutdown)
                    work.cancel()
                    raise
                with suppress(asyncio.CancelledError, Exception):
                    await work
                outcome = ex.outcome or "client_abort"
            finally:
                watch.cancel()
        except _Disconnected:
            outcome = "client_abort"
        except APIError as e:
            outcome = (ex.outcome if ex else None) or _OUTCOMES.get(e.code or "", "error")
            if e.code in _OUTCOMES and ex is not None:  # the router's own refusal: no pod was chosen
                ex.pod = None
            if not (ex and ex.started):
                await _send_json(send, e.status, e.body(), e.headers)
        except Exception as e:  # a bug: answer 500 in the error body, count it, keep serving
            log.exception("request failed")
            outcome = (ex.outcome if ex else None) or "error"
            if not (ex and ex.started):
                await _send_json(send, 500, error_body(f"router error: {type(e).__name__}", "internal_error"))
        finally:
            if ex is not None:
                self._count(ex.svc, ex.pod, outcome or ex.outcome or "client_abort", ex.slo_class)

    # ------------------------------------------------------------------------- forward's hooks

    def observe(self, ex: Exchange, resp: aiohttp.ClientResponse | None, a: Attempt) -> None:
        """An attempt's answer: the pod's engine identity, its draining answer, its outlier
        verdict (ejections logged and counted)."""
        pod = ex.pod
        assert pod is not None
        if resp is not None:
            self.note_instance(pod, resp.headers.get(INSTANCE_HEADER))
        if a.kind == DRAINING:
            self._mark_draining(ex.svc, pod)
        self._verdict(ex.svc, pod, verdict(a), a.detail)

    def mid_stream_failure(self, ex: Exchange) -> None:
        """The pod failed after its first byte: a failure for outlier ejection."""
        assert ex.pod is not None
        self._verdict(ex.svc, ex.pod, FAILURE, "failed mid-answer")

    def _verdict(self, svc: Service, pod: Pod, v: bool | None, detail: str) -> None:
        key = (*svc.key, pod.name)
        was_out = self.outliers.set_aside(key)
        current = self.fleet.service(svc.key) or svc
        now = time.monotonic()
        peers = [name for name, p in current.pods.items() if p.routable]
        for e in self.outliers.record(key, v, now, peers):
            why = f"{detail}; " if e.pod == key and detail else ""
            log.warning("%s (%s%s)", e.describe(), why, "returns through one probe request after that")
            self.metrics.ejections.labels(*e.pod, e.reason).inc()
        if was_out and not self.outliers.set_aside(key):
            log.warning("pod %s of %s/%s returned: its probe request succeeded", pod.name, *svc.key)

    def note_instance(self, pod: Pod, instance: str | None) -> None:
        """The engine id ``pod`` reports (answer header or scrape; None: it says none). A change
        is a restart in place: its prefix-cache knowledge, outlier past and card are dropped."""
        if instance is None or instance == pod.instance:
            return
        before, pod.instance = pod.instance, instance
        if before is None:
            return
        self.index.forget(pod.name)
        for k in [k for k in self.cards if k[0] == pod.url]:
            del self.cards[k]
        for svc in self.fleet.services():
            if svc.pods.get(pod.name) is pod:
                self.outliers.forget((*svc.key, pod.name))
                self.metrics.restarts.labels(*svc.key, pod.name).inc()
        log.warning("pod %s restarted in place (engine %s -> %s): forgot its prefix-cache knowledge",
                    pod.name, before, instance)

    def response_headers(self, resp: aiohttp.ClientResponse, pod: Pod) -> list[tuple[bytes, bytes]]:
        return _asgi_resp_headers(resp, pod)

    # ------------------------------------------------------------------------- others

    async def by_model(self, request: Request, path: str) -> Response:
        """``/tokenize``, ``/detokenize``: any routable pod of the model's service (the least
        loaded, pods set aside by outlier ejection last; one other on a connection error); 503
        when none is Ready."""
        raw = await _read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)
        model = _model(_parse(raw))
        svc = self.fleet.for_model(model)
        if svc is None:
            raise _unknown_model(model, self.fleet)
        routable = svc.routable_pods()
        now = time.monotonic()  # pods set aside by outlier ejection last, not never
        pods = sorted(routable, key=lambda p: (not self.outliers.admits((*svc.key, p.name), now), p.in_flight))
        if not pods:
            raise APIError(503, f"no Ready pod serves {model!r}; retry later", code="no_ready_pod",
                           headers={"Retry-After": str(max(1, round(self.settings.retry_after_s)))})
        for pod in pods[:2]:
            try:
                r = await self.upstream.post(pod.url + path, raw, _req_headers(request))
            except ERRORS:  # no answer, or one cut short: the next pod
                continue
            return Response(r.body, status_code=r.status, headers=_resp_headers(r, pod))
        raise APIError(502, f"no pod of {model!r} answered")

    async def card(self, svc: Service) -> dict[str, Any]:
        """The model card: a routable pod's own (cached per pod), else one built from the fleet."""
        fallback = {"id": svc.info.model, "object": "model", "created": 0, "owned_by": "goodput"}
        for pod in svc.routable_pods():
            if (pod.url, svc.info.model) in self.cards:
                return self.cards[(pod.url, svc.info.model)]
            try:
                r = await self.upstream.get(pod.url + "/v1/models")
                for card in json.loads(r.body).get("data", []):
                    if card.get("id") == svc.info.model:
                        self.cards[(pod.url, svc.info.model)] = card
                        return card
            except (*ERRORS, ValueError, AttributeError):
                continue
        return fallback


def _with_service(card: dict[str, Any], svc: Service, fleet: Fleet) -> dict[str, Any]:
    """The model card plus where the name goes: ``inferenceservice`` (``namespace/name``; static
    mode: the model) and, when other services claim the same name, ``refused_inferenceservices``
    (they get no request: docs/router-faults.md, "One model name, one service")."""
    out = {**card, "inferenceservice": "/".join(p for p in svc.key if p)}
    refused = ["/".join(s.key) for s in fleet.shadowed(svc.info.model)]
    if refused:
        out["refused_inferenceservices"] = refused
    return out


GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class RouterApp:
    """The ASGI app: ``POST`` to a generate route goes to :meth:`Router.generate` (raw ASGI);
    everything else (other routes, 405 on the generate paths, lifespan) to the FastAPI app."""

    def __init__(self, api: FastAPI, router: Router):
        self.api, self.router, self.state = api, router, api.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATE_PATHS:
            await self.router.generate(scope, receive, send)
        else:
            await self.api(scope, receive, send)


def create_app(discovery: Discovery, settings: RouterSettings | None = None, fleet: Fleet | None = None,
               pick_cfg: PickConfig | None = None) -> RouterApp:
    """The router app; ``discovery`` fills ``fleet`` (new if None) once the app starts;
    ``pick_cfg``: the picker's knobs (default ``PickConfig()``)."""
    router = Router(discovery, settings or RouterSettings(), fleet, pick_cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="goodput router", lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await router.by_model(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await router.by_model(request, "/detokenize")

    @app.get("/v1/models")
    async def models():
        services = router.fleet.models()  # one per served name: the service that owns it
        cards = await asyncio.gather(*(router.card(s) for s in services))
        return {"object": "list", "data": [_with_service(c, s, router.fleet) for c, s in zip(cards, services)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        svc = router.fleet.for_model(model)
        if svc is None:
            raise _unknown_model(model, router.fleet)
        return await router.card(svc)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not router.fleet.synced:
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ready", "models": [s.info.model for s in router.fleet.models()]}

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return RouterApp(app, router)
