"""The router's view of the fleet: model → InferenceService → pods. The discovery interface.

Discovery (static flags: ``goodput.router.discovery_static``; Kubernetes watch:
``goodput.router.discovery_k8s``) feeds a :class:`Fleet` through its update methods, with plain
frozen records (:class:`ServiceInfo`, :class:`PodInfo`); the router reads it on every request and
adds its own runtime view of each pod (in-flight count, the last scrape of the pod's ``/metrics``),
which discovery updates never overwrite.

Threading: a ``Fleet`` belongs to the router's asyncio event loop; call its update methods on that
loop (from a watch thread: ``loop.call_soon_threadsafe(fleet.set_pod, ...)``). Every update calls
the listeners (``add_listener``) with the service's key, so requests held for a service with no
Ready pod wake up the moment one turns Ready.

A discovery source is anything with ``async def run(self, fleet: Fleet) -> None`` (:class:`Discovery`):
the router starts it as a task at startup and cancels it at shutdown; it may return once the
fleet is filled (static) or run forever (watch).

Routability (docs/router-autoscaler-contract.md, "Scale-in"): a pod receives new requests only
while Ready, without a deletionTimestamp (``terminating``) and not annotated
``serving.goodput.dev/draining: "true"`` (``draining``); requests already in flight finish.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

ServiceKey = tuple[str, str]  # (namespace, InferenceService name)


@dataclass(frozen=True)
class ServiceInfo:
    """One InferenceService as discovery sees it.

    ``model``: the served model name clients put in ``model`` (one per service; unique in the
    router's scope). ``revision``: the model revision (part of the prefix-cache identity; ``""``
    when unset). ``router_max_queued``: ``status.admission.routerMaxQueued`` (None = unset: the
    sum of the Ready pods' ``max_waiting``). ``startup_timeout_s``: how long a request may be held
    while the service has no Ready pod (``spec.probes.startupTimeoutSeconds``; None = the
    router's ``--hold-timeout``). ``created``: ``metadata.creationTimestamp`` (RFC 3339; ``""``
    unknown): when several services claim one model name, the earliest created owns it
    (:meth:`claim_order`). ``remote_prefill_min_tokens``: ``spec.disaggregation.remotePrefillMinTokens``
    when ``spec.disaggregation.enabled`` (None: not disaggregated; the router's
    ``--pd-remote-prefill-min-tokens`` applies). ``slo_ranks``: each SLO class's priority band,
    ``(name, band)`` pairs (``goodput.api.policy.slo_ranks`` of ``spec.slo``: the tighter the TTFT,
    the smaller the band, as the worker queues them; empty without named classes).
    ``prefill_coming``: prefill pods ordered and not Ready yet (``status.pools.prefill``
    ``desiredReplicas - readyReplicas``, at least 0; the autoscaler sets the desired count): while
    it is positive, a prompt no Ready prefill pod has room for is refused rather than prefilled on
    its decode pod (``goodput.router.disagg.defer_when_full``). Static mode: namespace ``""`` and
    name = the model.
    """

    namespace: str
    name: str
    model: str
    revision: str = ""
    router_max_queued: int | None = None
    startup_timeout_s: float | None = None
    created: str = ""
    remote_prefill_min_tokens: int | None = None
    slo_ranks: tuple[tuple[str, int], ...] = ()
    prefill_coming: int = 0

    @property
    def key(self) -> ServiceKey:
        return (self.namespace, self.name)

    @property
    def claim_order(self) -> tuple[str, str, str]:
        """Several services claiming one model name: the smallest order owns it (created first,
        unknown last, then namespace and name): the operator's rule, goodput.operator.model_names.order."""
        return (self.created or "\uffff", self.namespace, self.name)


@dataclass(frozen=True)
class PodInfo:
    """One worker pod as discovery sees it. ``url``: ``http://<podIP>:<port>``, no trailing slash.
    ``role``: its part in disaggregated serving (``both``, ``prefill``, ``decode``; label
    ``serving.goodput.dev/role``, static mode's ``URL#role``)."""

    name: str
    url: str
    ready: bool = True
    terminating: bool = False  # metadata.deletionTimestamp is set
    draining: bool = False     # annotation serving.goodput.dev/draining == "true"
    role: str = "both"


@dataclass
class Pod:
    """A pod in the fleet: its discovery record plus the router's runtime view of it.

    ``in_flight``: requests this router has open to the pod (incremented before the upstream
    request is sent, decremented when its response, stream included, ends). ``work``: the sum of
    the picker's ``Pick.cost`` (chunks of prefill plus a per-request share) over those requests.
    The rest come from
    the last scrape of the pod's ``/metrics`` (None = not scraped yet): ``running``, ``waiting``
    (goodput_requests_running / _waiting), ``kv_usage`` (goodput_kv_cache_usage_ratio, 0..1),
    ``max_num_seqs``, ``max_waiting`` (goodput_admission_max_num_seqs / _max_waiting),
    ``max_waiting_tokens`` (goodput_admission_max_waiting_tokens; 0 = no token bound; the picker
    does not read it: a pod whose prompt-token queue is full answers 429 and the router retries).
    ``instance``: the engine id the pod last reported (answer header or scrape; None = not yet;
    goodput.api.identity): a change is a restart in place.
    """

    info: PodInfo
    in_flight: int = 0
    work: int = 0
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    max_num_seqs: int | None = None
    max_waiting: int | None = None
    max_waiting_tokens: int | None = None
    instance: str | None = None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def url(self) -> str:
        return self.info.url

    @property
    def routable(self) -> bool:
        """Ready, not terminating, not draining: may receive new requests."""
        return self.info.ready and not self.info.terminating and not self.info.draining

    @property
    def capacity(self) -> int | None:
        """``max_num_seqs + max_waiting`` (None while either is unknown: never "at its limits")."""
        if self.max_num_seqs is None or self.max_waiting is None:
            return None
        return self.max_num_seqs + self.max_waiting

    @property
    def at_limits(self) -> bool:
        """The contract's rule: ``in_flight >= max_num_seqs + max_waiting`` (unknown limits: never)."""
        cap = self.capacity
        return cap is not None and self.in_flight >= cap


@dataclass
class Service:
    """An InferenceService in the fleet: its record and its pods by name."""

    info: ServiceInfo
    pods: dict[str, Pod] = field(default_factory=dict)

    @property
    def key(self) -> ServiceKey:
        return self.info.key

    def routable_pods(self) -> list[Pod]:
        """The pods that may receive new requests, in name order."""
        return [p for _, p in sorted(self.pods.items()) if p.routable]

    def queue_bound(self) -> int:
        """The fleet queue's bound: ``routerMaxQueued``, or unset: the sum of the routable pods'
        ``max_waiting`` (those not scraped yet count 0; a prefill pool's pods do not count: they
        take queued requests only when no other pod is left)."""
        if self.info.router_max_queued is not None:
            return self.info.router_max_queued
        pods = self.routable_pods()
        return sum(p.max_waiting or 0 for p in ([p for p in pods if p.info.role != "prefill"] or pods))


class Discovery(Protocol):
    """A discovery source: fills ``fleet`` and keeps it current (static: returns once filled)."""

    async def run(self, fleet: Fleet) -> None: ...


class Fleet:
    """Services by key and by served model name; the update methods are discovery's interface."""

    def __init__(self) -> None:
        self._services: dict[ServiceKey, Service] = {}
        self._listeners: list[Callable[[ServiceKey], None]] = []
        self.synced = False  # discovery filled the fleet once (the router's /ready)
        self._by_model: dict[str, ServiceKey] = {}

    # ------------------------------------------------------------------ reads (the router)

    def services(self) -> list[Service]:
        """Every service, in key order."""
        return [s for _, s in sorted(self._services.items())]

    def service(self, key: ServiceKey) -> Service | None:
        return self._services.get(key)

    def for_model(self, model: str) -> Service | None:
        """The service serving ``model`` (None = unknown model). Several services claiming one
        name: the earliest created (``ServiceInfo.claim_order``); the operator refuses the others
        (Degraded, reason ModelNameTaken)."""
        key = self._by_model.get(model)
        return self._services.get(key) if key is not None else None

    def models(self) -> list[Service]:
        """The service owning each served model name, in model-name order (one per name)."""
        return [self._services[k] for _, k in sorted(self._by_model.items())]

    def shadowed(self, model: str) -> list[Service]:
        """The services claiming ``model`` that do not own it (refused), in key order."""
        owner = self._by_model.get(model)
        return [s for k, s in sorted(self._services.items()) if s.info.model == model and k != owner]

    def add_listener(self, fn: Callable[[ServiceKey], None]) -> None:
        """``fn(key)`` after every change to the service ``key`` or its pods (on the loop)."""
        self._listeners.append(fn)

    # ------------------------------------------------------------------ updates (discovery)

    def mark_synced(self) -> None:
        """Discovery has listed everything once (a watch: after its initial list); the router
        answers ``/ready`` 200 from then on. A source whose ``run`` returns is synced then."""
        self.synced = True

    def set_service(self, info: ServiceInfo) -> None:
        """Add the service or replace its record (its pods stay)."""
        svc = self._services.get(info.key)
        if svc is None:
            self._services[info.key] = Service(info)
        else:
            svc.info = info
        self._reindex()
        self._changed(info.key)

    def remove_service(self, namespace: str, name: str) -> None:
        """Forget the service and its pods (no-op if unknown)."""
        if self._services.pop((namespace, name), None) is not None:
            self._reindex()
            self._changed((namespace, name))

    def set_pod(self, namespace: str, service: str, info: PodInfo) -> None:
        """Add the pod to the service or replace its discovery record; the router's runtime view
        (in-flight count, scrape) stays unless the URL changed (then it is a new pod: requests
        in flight to the old URL count against the old record only). Raises KeyError for an
        unknown service (call ``set_service`` first)."""
        svc = self._services[(namespace, service)]
        self._put(svc, info)
        self._changed(svc.key)

    def remove_pod(self, namespace: str, service: str, name: str) -> None:
        """Forget the pod (deleted); no-op if unknown. In-flight requests to it finish."""
        svc = self._services.get((namespace, service))
        if svc is not None and svc.pods.pop(name, None) is not None:
            self._changed(svc.key)

    def replace_pods(self, namespace: str, service: str, infos: Iterable[PodInfo]) -> None:
        """Make the service's pods exactly ``infos`` (a relist): the others are removed, the
        ones kept keep their runtime view."""
        svc = self._services[(namespace, service)]
        infos = list(infos)
        names = {i.name for i in infos}
        for name in [n for n in svc.pods if n not in names]:
            del svc.pods[name]
        for info in infos:
            self._put(svc, info)
        self._changed(svc.key)

    @staticmethod
    def _put(svc: Service, info: PodInfo) -> None:
        pod = svc.pods.get(info.name)
        if pod is None or pod.url != info.url:
            svc.pods[info.name] = Pod(info)
        else:
            pod.info = info

    def _reindex(self) -> None:
        by_model: dict[str, ServiceKey] = {}
        for svc in sorted(self._services.values(), key=lambda s: s.info.claim_order):
            by_model.setdefault(svc.info.model, svc.key)
        self._by_model = by_model

    def _changed(self, key: ServiceKey) -> None:
        for fn in list(self._listeners):
            fn(key)
