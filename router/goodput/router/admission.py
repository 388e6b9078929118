"""Fleet-level admission: pick a pod, or hold, or queue, or refuse.

For one request to a service (docs/router-autoscaler-contract.md):

1. **hold** — the service has no routable pod (scale from zero, a rollout): wait until one turns
   Ready, at most the service's startup timeout (``ServiceInfo.startup_timeout_s``, else
   ``hold_timeout_s``); then 503 with ``Retry-After``. Counted in ``goodput_router_held_requests``.
   When one turns Ready, ``learn_limits(service)`` (the router: scrape the pods whose limits are
   unknown) runs before the held requests are picked, so a fresh pod is not sent more than its
   limits.
2. **pick** — ``picker.pick`` over the routable pods; a pod at its limits
   (``in_flight >= max_num_seqs + max_waiting``) is never chosen while another has room.
3. **queue** — every pod at its limits (pick ``"full"``): wait in the service's fleet queue
   (goodput.router.fairqueue): by the request's ``priority`` band (lower first, as the worker),
   tenants of a band in turn, each tenant's requests by arrival; bounded by
   ``Service.queue_bound()`` (``routerMaxQueued``): a newcomer to a full queue replaces the
   newest request of a heavier tenant of its band, else it is refused; a
   request refused, replaced, or still waiting after its queue timeout (the shortest of
   ``queue_timeout_s``, its band's in ``band_timeouts_s`` and its own) gets 429 with
   ``Retry-After``. A request leaves the queue when a pod has room again (a response ended,
   a scrape raised a limit, a pod turned Ready). ``goodput_router_queued_requests``.

Outlier ejection (goodput.router.outlier): a pod set aside is not picked while another routable
pod is not (a retry never goes to one); when every routable pod is set aside they are all
picked from (never a service without a pod). Picking a pod due for its probe claims the probe.

A chosen pod's ``in_flight`` is incremented at the choice (so the next pick sees it), its
``work`` grows by the pick's cost and the prefix index holds the request's chunks for it (a
prefill pending there counts as cached for the next request); :meth:`Admission.release` undoes
all three when the response ends. All of it runs on the event loop.
"""
from __future__ import annotations

import asyncio
import math
import time
from contextlib import suppress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from goodput.router.errors import APIError
from goodput.router.fairqueue import ANONYMOUS, Entry, FairQueue
from goodput.router.fleet import Fleet, Pod, Service, ServiceKey
from goodput.router.metrics import RouterMetrics
from goodput.router.outlier import Outliers
from goodput.router.picker import Pick, PickConfig, PrefixIndex, RouteKey, pick
from goodput.router.routing import endpoints


@dataclass(eq=False)
class _Waiter:
    key: RouteKey
    fut: asyncio.Future
    entry: Entry | None = None


@dataclass
class _Gate:
    queue: FairQueue = field(default_factory=FairQueue)   # of _Waiter
    held: list[asyncio.Future] = field(default_factory=list)


class Admission:
    """``acquire`` a pod for a request (hold / pick / queue / refuse); ``release`` it after.

    ``hold_timeout_s``: the hold bound for services without a startup timeout (seconds).
    ``queue_timeout_s``: the longest wait in the fleet queue (seconds).
    ``band_timeouts_s``: {priority: seconds}, a band's own longest wait (the shorter one applies).
    ``retry_after_s``: the ``Retry-After`` of a 429 (queue full) and of the hold-timeout 503.
    """

    def __init__(self, fleet: Fleet, metrics: RouterMetrics, index: PrefixIndex, cfg: PickConfig,
                 hold_timeout_s: float = 600.0, queue_timeout_s: float = 60.0, retry_after_s: float = 1.0,
                 learn_limits: Callable[[Service], Awaitable[None]] | None = None,
                 band_timeouts_s: dict[int, float] | None = None,
                 outliers: Outliers | None = None, clock: Callable[[], float] = time.monotonic):
        self.fleet, self.metrics, self.index, self.cfg = fleet, metrics, index, cfg
        self.outliers, self.clock = outliers, clock
        self.learn_limits = learn_limits
        self.hold_timeout_s, self.queue_timeout_s, self.retry_after_s = hold_timeout_s, queue_timeout_s, retry_after_s
        self.band_timeouts_s = dict(band_timeouts_s or {})
        self._gates: dict[ServiceKey, _Gate] = {}
        self._pods: dict[ServiceKey, set[str]] = {}  # pod names last seen, to forget removed ones
        fleet.add_listener(self.on_change)

    def _gate(self, key: ServiceKey) -> _Gate:
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = _Gate()
        return gate

    def retry_after_headers(self) -> dict[str, str]:
        """The ``Retry-After`` header of the router's own 429 and 503 answers."""
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    # ---------------------------------------------------------------------------- picking

    def try_pick(self, svc: Service, key: RouteKey, exclude: frozenset[str] = frozenset()
                 ) -> tuple[Pod, Pick] | None:
        """Pick a routable pod not in ``exclude`` and reserve it (``in_flight += 1``); None when
        there is none or every one is at its limits. Pods whose role is ``prefill`` are picked only
        when no other pod is left (they compute prompts for the others)."""
        pods = self._in_service(svc, [p for p in svc.routable_pods() if p.name not in exclude], bool(exclude))
        # a request is decoded where it is sent: pods of role prefill only when no other can take it
        # (disaggregated prefill, docs/disaggregation.md)
        pods = [p for p in pods if p.info.role != "prefill"] or pods
        if not pods:
            return None
        choice = pick(key, endpoints(pods), self.index, self.cfg)
        pod = svc.pods.get(choice.pod) if choice.pod is not None else None
        if pod is None or pod.at_limits:
            return None
        if self.outliers is not None:
            self.outliers.claim((*svc.key, pod.name), self.clock())
        pod.in_flight += 1
        pod.work += choice.cost
        self.index.hold(key, pod.name)
        self.metrics.decisions.labels(choice.reason).inc()
        return pod, choice

    def _in_service(self, svc: Service, pods: list[Pod], retry: bool) -> list[Pod]:
        """``pods`` less those outlier ejection set aside (a retry: also those due for their
        probe, so a retry never lands on a doubtful pod); all of them when that leaves none and
        this is not a retry."""
        if self.outliers is None:
            return pods
        now = self.clock()
        if retry:
            return [p for p in pods if not self.outliers.set_aside((*svc.key, p.name))]
        ok = [p for p in pods if self.outliers.admits((*svc.key, p.name), now)]
        return ok or pods

    def release(self, svc: Service, pod: Pod, key: RouteKey | None = None, work: int = 0) -> None:
        """The response from ``pod`` ended: ``in_flight -= 1``, the request's remaining ``work``
        (chunks: its ``Pick.cost``, less what :meth:`prefilled` took off) and prefix hold
        (``key``) leave the pod, and a queued request gets in (a probe claimed and never judged
        is given back)."""
        pod.in_flight -= 1
        pod.work = max(0, pod.work - work)
        if key is not None:
            self.index.unhold(key, pod.name)
        if self.outliers is not None:
            self.outliers.unclaim((*svc.key, pod.name))
        current = self.fleet.service(svc.key)
        if current is not None:
            self.dispatch(current)

    @staticmethod
    def prefilled(pod: Pod, choice: Pick) -> int:
        """The request of ``choice`` on ``pod`` got its first token: its prompt's prefill
        (``choice.prefill``) leaves the pod's work. Returns the work it still holds there."""
        pod.work = max(0, pod.work - choice.prefill)
        return choice.cost - choice.prefill

    # ---------------------------------------------------------------------------- acquire

    async def acquire(self, svc: Service, key: RouteKey, priority: int = 0, tenant: str = ANONYMOUS,
                      queue_timeout_s: float | None = None) -> tuple[Pod, Pick, float]:
        """A reserved pod, the picker's decision and the seconds spent held or queued.

        ``priority``: the request's band (lower first); ``tenant``: its fairness id (turns within
        a band, goodput.router.fairqueue); ``queue_timeout_s``: its own longest queue wait
        (seconds; None: none). The wait is bounded by the shortest of it, the band's
        (``band_timeouts_s``) and ``self.queue_timeout_s``. Raises
        :class:`APIError` 503 (hold timed out; ``Retry-After``), 429 (queue full, or replaced in
        a full queue by another tenant's request, or queue wait timed out; ``Retry-After``), 404
        (the service went away while waiting)."""
        t0 = time.monotonic()
        labels = svc.key
        gate = self._gate(svc.key)
        if not svc.routable_pods():
            await self._hold(svc, gate)
            svc = self.fleet.service(labels) or svc
            if self.learn_limits is not None and any(p.capacity is None for p in svc.routable_pods()):
                # a pod just turned Ready (scale from zero): learn its limits before the held
                # requests reach it, so those beyond them wait here instead of getting its 429
                await self.learn_limits(svc)
        if not gate.queue:
            got = self.try_pick(svc, key)
            if got is not None:
                return (*got, self._waited(labels, t0))
        bound = svc.queue_bound()
        if len(gate.queue) >= bound:
            victim = gate.queue.victim(tenant, priority)
            if victim is None or bound < 1:
                self.metrics.decisions.labels("refused").inc()
                raise self._queue_full(svc, len(gate.queue), bound)
            gate.queue.remove(victim)   # a heavier tenant's newest request of this band makes room
            self.metrics.decisions.labels("refused").inc()
            if not victim.item.fut.done():
                victim.item.fut.set_exception(self._queue_full(svc, len(gate.queue) + 1, bound))
        self.metrics.decisions.labels("queued").inc()
        waiter = _Waiter(key, asyncio.get_running_loop().create_future())
        waiter.entry = gate.queue.push(waiter, priority, tenant)
        self._set_queued(svc.key, gate)
        self.dispatch(svc)
        timeout = min(self.queue_timeout_s, self.band_timeouts_s.get(priority, self.queue_timeout_s),
                      self.queue_timeout_s if queue_timeout_s is None else queue_timeout_s)
        # asyncio.wait, not wait_for: wait_for (before 3.12) may return a result that arrived with a
        # cancellation and lose the cancellation; _drop gives back a pod handed over meanwhile.
        try:
            done, _ = await asyncio.wait({waiter.fut}, timeout=timeout)
        except BaseException:
            self._drop(svc.key, gate, waiter)
            raise
        if not done:
            self._drop(svc.key, gate, waiter)
            raise APIError(429, f"every pod of {svc.info.model!r} stayed at its admission limits for "
                                f"{timeout:g} s; retry later", code="queue_timeout",
                           headers=self.retry_after_headers())
        self._drop_done(svc.key, gate, waiter)
        pod, choice = waiter.fut.result()  # raises the 404 of a removed service
        return pod, choice, self._waited(labels, t0)

    def _queue_full(self, svc: Service, n: int, bound: int) -> APIError:
        return APIError(429, f"every pod of {svc.info.model!r} is at its admission limits and the router's "
                             f"queue holds {n} of {bound} requests; retry later",
                        code="queue_full", headers=self.retry_after_headers())

    def _waited(self, labels: ServiceKey, t0: float) -> float:
        waited = time.monotonic() - t0
        self.metrics.queue_wait.labels(*labels).observe(waited)
        return waited

    async def _hold(self, svc: Service, gate: _Gate) -> None:
        timeout = svc.info.startup_timeout_s or self.hold_timeout_s
        self.metrics.decisions.labels("held").inc()
        fut = asyncio.get_running_loop().create_future()
        gate.held.append(fut)
        self.metrics.held.labels(*svc.key).inc()
        try:
            done, _ = await asyncio.wait({fut}, timeout=timeout)
            if not done:
                raise APIError(503, f"no Ready pod serves {svc.info.model!r} (InferenceService "
                                    f"{'/'.join(p for p in svc.key if p)}) after waiting {timeout:g} s "
                                    "(scaling from zero or starting); retry later", code="no_ready_pod",
                               headers=self.retry_after_headers())
            fut.result()  # raises the 404 of a removed service
        finally:
            if fut in gate.held:
                gate.held.remove(fut)
            self.metrics.held.labels(*svc.key).dec()

    def _drop(self, key: ServiceKey, gate: _Gate, waiter: _Waiter) -> None:
        """A waiter gave up (timeout, client gone): leave the queue; a pod it was given goes back."""
        fut = waiter.fut
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            pod, choice = fut.result()
            svc = self.fleet.service(key)
            if svc is not None:
                self.release(svc, pod, waiter.key, choice.cost)
            else:
                pod.in_flight -= 1
                pod.work = max(0, pod.work - choice.cost)
                self.index.unhold(waiter.key, pod.name)
        if waiter.entry is not None:
            gate.queue.remove(waiter.entry)
        self._set_queued(key, gate)

    def _drop_done(self, key: ServiceKey, gate: _Gate, waiter: _Waiter) -> None:
        """A waiter got its answer: make sure it left the queue."""
        if waiter.entry is not None:
            gate.queue.remove(waiter.entry)
        self._set_queued(key, gate)

    def _set_queued(self, key: ServiceKey, gate: _Gate) -> None:
        self.metrics.queued.labels(*key).set(sum(1 for e in gate.queue if not e.item.fut.done()))

    # ---------------------------------------------------------------------------- wake-ups

    def dispatch(self, svc: Service) -> None:
        """Give pods with room to queued requests: best priority band first, tenants of a band in
        turn (goodput.router.fairqueue)."""
        gate = self._gates.get(svc.key)
        if gate is None or not gate.queue:
            return
        while gate.queue:
            head = gate.queue.peek()
            if head.item.fut.done():
                gate.queue.remove(head)
                continue
            got = self.try_pick(svc, head.item.key)
            if got is None:
                break
            gate.queue.pop()
            head.item.fut.set_result(got)
        self._set_queued(svc.key, gate)

    def on_change(self, key: ServiceKey) -> None:
        """Fleet listener: wake held requests when a pod is routable; refill from the queue; fail
        the waiters of a removed service with 404; drop removed pods from the prefix index."""
        svc = self.fleet.service(key)
        per_service = (self.metrics.held, self.metrics.queued, self.metrics.queue_wait, self.metrics.upstream_ttft)
        if svc is not None:  # export 0, not nothing, for every known service: rate() then sees the first requests
            for g in per_service:
                g.labels(*key)
        elif key in self._pods:
            for g in per_service:
                with suppress(KeyError):
                    g.remove(*key)
        names = set(svc.pods) if svc is not None else set()
        for gone in self._pods.get(key, set()) - names:
            self.index.forget(gone)
            if self.outliers is not None:
                self.outliers.forget((*key, gone))
        self._pods[key] = names
        gate = self._gates.get(key)
        if gate is None:
            return
        if svc is None:
            err = APIError(404, f"the service {key[0]}/{key[1]} was removed while the request waited",
                           code="model_not_found")
            for fut in gate.held + [e.item.fut for e in gate.queue]:
                if not fut.done():
                    fut.set_exception(err)
            return
        if gate.held and svc.routable_pods():
            for fut in gate.held:
                if not fut.done():
                    fut.set_result(None)
        self.dispatch(svc)
