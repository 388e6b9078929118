"""One generate request from the router to a pod: the typed record, the next-action decision
(pure, table-tested), the buffered relay and the SSE relay.

The loop (:func:`forward`): acquire a pod (admission), send, classify the pod's answer
(:func:`classify`, :func:`connection_failure`) into an :class:`Attempt`, tell the router (outlier
ejection, draining, engine identity), then ask :func:`next_action` what to do:

=================  ===========================================================================
``deliver``        the pod's answer goes to the client (a 2xx-4xx answer, or the pod's own
                   503 / 429 / 5xx when no other pod can take the request)
``retry_other``    before the first byte, once: another routable pod with room takes it (a
                   connection error, a 5xx, a ``draining`` 503, a 429)
``retry_same``     a pooled keep-alive connection the pod closed as it was reused, no other
                   pod: the same pod on a new connection, once
``requeue``        a 429 with no other pod (the pod's scraped limits were stale): learn its
                   limits and go through admission again (the router's queue or its 429), once
``fail``           a connection error with nothing left to try: 502 naming the pod
=================  ===========================================================================

Never after the first byte: a stream cut mid-way ends the client's stream with one
``data: {"error": ...}`` event and no ``[DONE]`` (:func:`relay_sse`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from goodput.api.disagg import KV_HANDLE_HEADER, KV_PATH, KV_SOURCE_HEADER, REMOTE_PREFILL_HEADER
from goodput.router.disagg import DEFERRED, decide, defer_when_full, min_chunks
from goodput.router.errors import APIError, error_body
from goodput.router.fleet import Pod, Service
from goodput.router.picker import Pick, RouteKey
from goodput.router.routing import endpoints
from goodput.router.upstream import CONNECTION_ERRORS as RETRYABLE

log = logging.getLogger("goodput.router")

# Attempt kinds.
ANSWER, DRAINING, FULL, SERVER_ERROR, CONN_ERROR = "answer", "draining", "full", "server_error", "conn_error"
# Next actions.
DELIVER, RETRY_OTHER, RETRY_SAME, REQUEUE, FAIL = "deliver", "retry_other", "retry_same", "requeue", "fail"


@dataclass(frozen=True)
class Attempt:
    """What one send to one pod gave, before its first body byte reached the client.

    ``kind``: ``answer`` (a status below 500 other than 429), ``draining`` (503 with code
    ``draining``), ``full`` (429: the pod's queue is full), ``server_error`` (any other 5xx),
    ``conn_error`` (no answer: refused, reset, closed, timed out). ``status``: the HTTP status
    (None for ``conn_error``); ``detail``: what went wrong, for logs and the 502; ``stale``: the
    error is a connection the pod closed as the router reused it (a keep-alive race).
    """

    kind: str
    status: int | None = None
    detail: str = ""
    stale: bool = False


def classify(status: int, body: bytes | None = None) -> Attempt:
    """The :class:`Attempt` of an answer: ``body`` is read only for a 503 (its error code)."""
    if status == 429:
        return Attempt(FULL, status, "429 from the pod")
    if status < 500:
        return Attempt(ANSWER, status)
    if status == 503 and body is not None:
        with suppress(ValueError, AttributeError, KeyError, TypeError):
            if json.loads(body)["error"]["code"] == "draining":
                return Attempt(DRAINING, status, "503 draining")
    return Attempt(SERVER_ERROR, status, f"{status} from the pod")


def connection_failure(exc: BaseException) -> Attempt:
    """The :class:`Attempt` of a send that got no answer."""
    return Attempt(CONN_ERROR, None, f"{type(exc).__name__}: {exc}",
                   stale=isinstance(exc, aiohttp.ServerDisconnectedError))


def verdict(a: Attempt) -> bool | None:
    """The attempt for outlier ejection (goodput.router.outlier): True a success, False a
    failure (a 5xx or no answer), None neither (a 429 or a ``draining`` 503: the pod is healthy
    and says so)."""
    if a.kind == ANSWER:
        return True
    if a.kind in (SERVER_ERROR, CONN_ERROR):
        return False
    return None


def next_action(a: Attempt, *, moved: bool, other: bool, requeued: bool, stale_retried: bool) -> str:
    """What to do after ``a`` (pure; the module doc has the table).

    ``moved``: this request already went to a second pod (retry_other is once per request);
    ``other``: another routable pod with room was found (the caller reserved it: it is used
    exactly when the answer is ``retry_other``); ``requeued``: it already went through admission
    twice; ``stale_retried``: it already retried on a new connection to the same pod."""
    if a.kind == ANSWER:
        return DELIVER
    if other and not moved:
        return RETRY_OTHER
    if a.kind == FULL and not requeued:
        return REQUEUE
    if a.kind == CONN_ERROR:
        return RETRY_SAME if a.stale and not stale_retried else FAIL
    return DELIVER  # the pod's own 503 / 429 / 5xx answer goes to the client


@dataclass
class Exchange:
    """One generate request as the router carries it (the typed request record).

    ``svc``, ``key``, ``priority``, ``path``, ``body``, ``headers`` (to send), ``t0`` (arrival,
    ``time.perf_counter``). ``pod``: the last pod chosen (the ``pod`` label of its count; None
    when the router refused it itself); ``reserved``: ``pod`` holds this request's in-flight
    slot. ``tried``: pod names sent to since the last admission. ``started``: the client got its
    response head (no error answer can follow). ``outcome``: the count's outcome once known.
    ``tenant``: the fairness id (goodput.router.fairqueue); ``queue_timeout_s``: the request's
    own longest wait in the fleet queue (None: the router's). ``slo_class``: the request's SLO
    class (the ``slo_class`` label of the per-class metrics; "" when it names none).
    """

    svc: Service
    key: RouteKey
    priority: int
    path: str
    body: bytes
    headers: dict[str, str]
    t0: float
    pod: Pod | None = None
    choice: Pick | None = None
    work: int = 0
    reserved: bool = False
    tried: set[str] = field(default_factory=set)
    moved: bool = False
    requeued: bool = False
    stale_retried: bool = False
    started: bool = False
    outcome: str | None = None
    tenant: str = ""
    queue_timeout_s: float | None = None
    slo_class: str = ""

    def take(self, pod: Pod, choice: Pick | None = None) -> None:
        """``pod`` (reserved by admission with the picker's ``choice``) now carries the request."""
        self.pod, self.choice, self.reserved = pod, choice, True
        self.work = choice.cost if choice is not None else 0
        self.tried.add(pod.name)


def sse_error(message: str) -> bytes:
    """One SSE event with the OpenAI error body (code ``upstream_error``)."""
    return b"data: " + json.dumps(error_body(message, "internal_error", code="upstream_error")).encode() + b"\n\n"


async def relay_buffered(resp: aiohttp.ClientResponse, send, headers: list[tuple[bytes, bytes]],
                         ex: Exchange) -> None:
    """The whole answer, read then sent with its length (``ex.started`` once its head is sent).
    Raises APIError 502 when the pod fails while answering (nothing was sent to the client)."""
    try:
        content = await resp.read()
    except aiohttp.ClientError as e:
        raise APIError(502, f"the pod {ex.pod.name if ex.pod else '?'} of {ex.svc.info.model!r} failed "
                            f"while answering ({type(e).__name__}: {e})") from None
    ex.started = True
    await send({"type": "http.response.start", "status": resp.status,
                "headers": [*headers, (b"content-length", str(len(content)).encode())]})
    await send({"type": "http.response.body", "body": content, "more_body": False})


async def relay_sse(resp: aiohttp.ClientResponse, send, headers: list[tuple[bytes, bytes]], pod: Pod,
                    on_first=None) -> bool:
    """An event stream, passed on whole event by whole event as the pod sends it (nothing held
    beyond an incomplete event). ``on_first()`` at the first upstream chunk. Returns False when
    the pod failed mid-stream (the client's stream then ends with one error event, no
    ``[DONE]``), True otherwise."""
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    tail = b""
    first = True
    ok = True
    try:
        async for chunk in resp.content.iter_any():
            if first and on_first is not None:
                on_first()
            first = False
            data = tail + chunk if tail else chunk
            cut = data.rfind(b"\n\n") + 2
            if cut >= 2:
                tail = data[cut:]
                await send({"type": "http.response.body", "body": data[:cut], "more_body": True})
            else:
                tail = data
    except aiohttp.ClientError as e:
        ok = False
        log.warning("pod %s died mid-stream: %r", pod.name, e)
        await send({"type": "http.response.body", "more_body": True, "body": sse_error(
            f"the pod {pod.name} serving this stream failed mid-stream ({type(e).__name__}); "
            "the response is incomplete")})
    else:
        if tail.strip():
            await send({"type": "http.response.body", "body": tail + b"\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return ok


async def attempt(session: aiohttp.ClientSession, ex: Exchange) -> tuple[aiohttp.ClientResponse | None, Attempt]:
    """Send ``ex`` to ``ex.pod``: the response (None when none came) and its :class:`Attempt`.
    A non-answer's body is read (small: an error body) so the connection can be reused."""
    assert ex.pod is not None
    try:
        resp = await session.post(ex.pod.url + ex.path, data=ex.body, headers=ex.headers)
    except RETRYABLE as e:
        return None, connection_failure(e)
    if resp.status < 500 and resp.status != 429:
        return resp, classify(resp.status)
    try:
        body = await resp.read()
    except RETRYABLE as e:
        resp.close()
        return None, connection_failure(e)
    return resp, classify(resp.status, body)


async def forward(rt: Any, ex: Exchange, send) -> None:
    """Acquire a pod, send, act on :func:`next_action`, relay the answer (module doc).

    ``rt``: the :class:`~goodput.router.app.Router` (admission, upstream client, metrics, prefix index,
    and its ``observe(ex, resp, attempt)`` / ``scrape_now``). Raises APIError for the router's
    own refusals (429, 503, 404 from admission) and the 502 of ``fail``."""
    adm, svc = rt.admission, ex.svc
    pod, choice, waited = await adm.acquire(svc, ex.key, ex.priority, ex.tenant, ex.queue_timeout_s)
    ex.take(pod, choice)
    rt.metrics.overhead.observe(max(0.0, time.perf_counter() - ex.t0 - waited))
    resp: aiohttp.ClientResponse | None = None
    lease: tuple[str, str] | None = None
    try:
        lease = await remote_prefill(rt, ex)
        while True:
            sent = time.perf_counter()
            resp, a = await attempt(rt.upstream.session, ex)
            rt.observe(ex, resp, a)
            other = None
            if a.kind != ANSWER and not ex.moved:
                other = adm.try_pick(svc, ex.key, exclude=frozenset(ex.tried))
            action = next_action(a, moved=ex.moved, other=other is not None, requeued=ex.requeued,
                                 stale_retried=ex.stale_retried)
            if action == DELIVER:
                break
            if resp is not None:
                resp.release()
                resp = None
            if action == FAIL:
                raise APIError(502, f"the pod {ex.pod.name} of {svc.info.model!r} failed before answering "
                                    f"({a.detail}) and no other pod could take the request")
            if action == RETRY_SAME:
                ex.stale_retried = True
                log.info("retrying on %s: closed keep-alive connection (%s)", ex.pod.name, a.detail)
                continue
            adm.release(svc, ex.pod, ex.key, ex.work)
            ex.reserved = False
            if action == RETRY_OTHER:
                log.info("retrying on %s: %s failed before its first byte (%s)", other[0].name, ex.pod.name,
                         a.detail)
                ex.moved = True
                ex.take(*other)
            else:  # REQUEUE: the pod's limits were stale; learn them, then admission again, once
                ex.requeued, ex.moved, ex.tried = True, False, set()
                stale_pod, ex.pod = ex.pod, None
                await rt.scrape_now([stale_pod])
                pod, choice, _ = await adm.acquire(svc, ex.key, ex.priority, ex.tenant, ex.queue_timeout_s)
                ex.take(pod, choice)
        await _deliver(rt, ex, resp, send, sent)
    finally:
        if resp is not None:
            if ex.outcome == "success":
                resp.release()
            else:
                resp.close()  # client gone or pod failed: closing the connection aborts the request
        if ex.reserved and ex.pod is not None:
            adm.release(svc, ex.pod, ex.key, ex.work)
            ex.reserved = False
        if lease is not None and ex.outcome != "success":
            _delete_lease(rt, *lease)  # a cancelled or failed request: free the prefill pod's blocks now


_background: set[asyncio.Task] = set()


def _delete_lease(rt: Any, url: str, handle: str) -> None:
    """``DELETE {url}/kv/leases/{handle}`` in the background (404 when the decode pod pulled it already)."""
    async def delete() -> None:
        with suppress(*RETRYABLE, asyncio.TimeoutError):
            async with rt.upstream.session.delete(url + KV_PATH.format(handle=handle),
                                                  timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()

    task = asyncio.ensure_future(delete())
    _background.add(task)
    task.add_done_callback(_background.discard)


async def remote_prefill(rt: Any, ex: Exchange) -> tuple[str, str] | None:
    """Disaggregated prefill (goodput.router.disagg, docs/disaggregation.md): when :func:`decide`
    picks a prefill pod for the request ``ex.pod`` will decode, send it the request with
    ``x-goodput-remote-prefill`` and, on its 200, add the transfer headers (handle, the prefill
    pod's URL) to ``ex.headers``. Returns (prefill pod URL, handle), or None: the decode pod
    prefills locally (off, a short uncached prompt, no prefill pod with room, or the prefill call
    failed or took longer than ``--pd-prefill-timeout``: nothing reached the client yet). Raises
    :class:`APIError` 429 (``prefill_deferred``) when no Ready prefill pod has room (none under
    its limits, or the one picked answered 429) while prefill pods are starting
    (``ServiceInfo.prefill_coming``; ``goodput.router.disagg.defer_when_full``)."""
    s, svc = rt.settings, ex.svc
    labels = svc.key
    if ex.pod is None:
        return None
    tokens = svc.info.remote_prefill_min_tokens
    threshold = min_chunks(tokens if tokens is not None else s.pd_remote_prefill_min_tokens, rt.pick_cfg.chunk_size)
    if threshold is None:
        rt.metrics.pd_decisions.labels(*labels, "off").inc()
        return None
    pods = svc.routable_pods()
    held = ex.choice.matched_chunks if ex.choice is not None else 0
    d = decide(ex.key, ex.pod.name, held, endpoints(pods), {p.name: p.info.role for p in pods}, rt.index,
               rt.pick_cfg, threshold, svc.info.prefill_coming)
    if d.reason == DEFERRED:
        _defer(rt, ex)
    if d.prefill is None:
        rt.metrics.pd_decisions.labels(*labels, d.reason).inc()
        return None
    pp = svc.pods[d.prefill]
    pp.in_flight += 1
    try:
        async with rt.upstream.session.post(
                pp.url + ex.path, data=ex.body, headers={**ex.headers, REMOTE_PREFILL_HEADER: "1"},
                timeout=aiohttp.ClientTimeout(total=s.pd_prefill_timeout_s)) as resp:
            if resp.status == 429 and defer_when_full(1, svc.info.prefill_coming):
                _defer(rt, ex)             # full and more are coming: refused, not prefilled locally
            if resp.status != 200:
                raise ValueError(f"{resp.status} from the prefill pod: {(await resp.read())[:200]!r}")
            handle = (await resp.json())["handle"]
            if not isinstance(handle, str):
                raise ValueError(f"handle {handle!r}")
    except (*RETRYABLE, asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
        log.warning("remote prefill on %s failed (%s: %s); %s prefills locally", pp.name, type(e).__name__, e,
                    ex.pod.name)
        rt.metrics.pd_decisions.labels(*labels, "prefill_failed").inc()
        return None
    finally:
        pp.in_flight -= 1
    rt.index.record(ex.key, pp.name)
    rt.metrics.pd_decisions.labels(*labels, "remote").inc()
    ex.headers = {**ex.headers, KV_HANDLE_HEADER: handle, KV_SOURCE_HEADER: pp.url}
    return pp.url, handle


def _defer(rt: Any, ex: Exchange) -> None:
    """The prefill pool is full and growing (``goodput.router.disagg.defer_when_full``): count
    ``prefill_deferred`` and refuse the request (429, ``Retry-After``) before any byte."""
    rt.metrics.pd_decisions.labels(*ex.svc.key, DEFERRED).inc()
    raise APIError(429, f"the prefill pods of {ex.svc.info.model!r} are full and more are starting; retry",
                   headers=rt.admission.retry_after_headers())


async def _deliver(rt: Any, ex: Exchange, resp: aiohttp.ClientResponse, send, sent: float) -> None:
    pod, labels = ex.pod, ex.svc.key
    assert pod is not None
    status = resp.status
    if status < 400:
        rt.index.record(ex.key, pod.name)
    headers = rt.response_headers(resp, pod)
    ttft_all = rt.metrics.upstream_ttft.labels(*labels)
    ttft_class = rt.metrics.class_ttft.labels(*labels, ex.slo_class)

    def observe_ttft(v: float) -> None:  # the service's histogram and its SLO class's
        ttft_all.observe(v)
        ttft_class.observe(v)

    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            await relay_buffered(resp, send, headers, ex)
        except APIError:
            rt.mid_stream_failure(ex)
            raise
        observe_ttft(time.perf_counter() - sent)
        ex.outcome = "success" if status < 400 else "error"
        return
    ex.started = True

    def first() -> None:
        observe_ttft(time.perf_counter() - sent)
        if ex.choice is not None and ex.reserved:  # its prefill is done: only its decode is left there
            ex.work = rt.admission.prefilled(pod, ex.choice)

    ok = await relay_sse(resp, send, headers, pod, on_first=first)
    if not ok:
        rt.mid_stream_failure(ex)
    ex.outcome = "success" if ok and status < 400 else "error"
