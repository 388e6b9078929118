"""Kubernetes discovery: watch InferenceServices and their worker pods, keep the router's
:class:`~goodput.router.fleet.Fleet` equal to what the API server says.

``python -m goodput.router --kubernetes [--namespace NS ...| --all-namespaces]`` (the default is
all namespaces). RBAC: ``list`` and ``watch`` on ``inferenceservices`` (serving.goodput.dev) and
on ``pods``; nothing else.

What the fleet gets (pure functions, table-tested):

- :func:`service_info`: one InferenceService → :class:`ServiceInfo`: ``model`` = the served model
  name the worker answers to (``spec.model.servedModelName``, else ``spec.model.name``'s file name
  without ``.gguf``: the worker's own rule, ``goodput.api.crd.served_model_name``), ``revision`` =
  ``spec.model.revision`` (``""`` unset), ``router_max_queued`` = ``status.admission.routerMaxQueued``
  (None unset), ``prefill_coming`` = ``status.pools.prefill.desiredReplicas - readyReplicas`` (at
  least 0; 0 when absent), ``startup_timeout_s`` = ``spec.probes.startupTimeoutSeconds`` (the CRD's default
  when absent) — the longest hold of a request while the service has no Ready pod.
- :func:`pod_record`: one pod → (namespace, InferenceService, pod name, :class:`PodInfo` or None).
  Worker pods are those labelled ``app.kubernetes.io/component=worker`` (or ``prefill-worker``: a
  disaggregated service's prefill pool, role ``prefill``) and
  ``serving.goodput.dev/inferenceservice=<name>`` (the operator's selector labels); ``role`` from
  ``serving.goodput.dev/role`` (absent: ``both``). URL =
  ``http://<podIP>:<container port "http">`` (8000 when the port is not named). ``ready``,
  ``terminating`` and ``draining`` as :func:`goodput.api.pods.pod_state` reads them (the Ready
  condition; ``metadata.deletionTimestamp``; annotation ``serving.goodput.dev/draining: "true"``,
  set by the autoscaler before a scale-in). A pod without an IP yet, or finished (Succeeded/Failed), has no record (None): it
  cannot take a request. The router sends new requests only to Ready, not terminating, not
  draining pods (``fleet.Pod.routable``); requests in flight finish.

The watch (I/O, :class:`KubernetesDiscovery`): per kind and per watched namespace, one thread runs
the client-go reflector's loop (k8s.io/client-go/tools/cache/reflector.go): *list* (the
collection's ``resourceVersion``) → *watch* from that version (``allowWatchBookmarks``; each event
and bookmark advances it; the server ends a watch after ``--watch-timeout`` seconds and the loop
watches again from the last version) → on ``410 Gone`` (the version expired: "Efficient detection
of changes", Kubernetes API concepts) list again; on any other error wait (1 s doubling to 30 s)
and watch again from the last version (a list when none). Each list replaces that scope's objects
(deleted meanwhile → removed); each event is applied on the router's event loop
(``loop.call_soon_threadsafe``). The fleet is marked synced once every initial list is applied.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from goodput.api import crd
from goodput.api.pods import pod_state
from goodput.api.policy import PolicySpec, slo_ranks
from goodput.api.settings import setting

from goodput.api.states import WorkerRole
from goodput.router.fleet import Fleet, PodInfo, ServiceInfo, ServiceKey

log = logging.getLogger("goodput.router.discovery")

# the decode (or only) pool and, of a disaggregated service, its prefill pool (role prefill: the router
# sends it prompts to prefill, and plain requests only when no other pod is left)
WORKER_SELECTOR = f"{crd.LABEL_COMPONENT} in ({crd.WORKER_COMPONENT},{crd.PREFILL_COMPONENT}),{crd.LABEL_ISVC}"
DEFAULT_STARTUP_TIMEOUT_S = crd.ProbeSpec.model_fields["startup_timeout_seconds"].default
GONE = 410
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 30.0


# ------------------------------------------------------------------------------------- pure parts
def service_info(obj: Mapping[str, Any]) -> ServiceInfo:
    """An InferenceService (a dict as the API returns it, camelCase) → its :class:`ServiceInfo`.
    Missing fields take the CRD's defaults; a non-integer ``routerMaxQueued`` counts as unset."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    model = spec.get("model") or {}
    rmq = ((obj.get("status") or {}).get("admission") or {}).get("routerMaxQueued")
    startup = (spec.get("probes") or {}).get("startupTimeoutSeconds")
    return ServiceInfo(
        namespace=meta.get("namespace") or "", name=meta["name"], model=crd.served_model_name(model),
        revision=model.get("revision") or "",
        router_max_queued=rmq if isinstance(rmq, int) and not isinstance(rmq, bool) and rmq >= 0 else None,
        startup_timeout_s=float(startup if isinstance(startup, (int, float)) else DEFAULT_STARTUP_TIMEOUT_S),
        created=meta.get("creationTimestamp") or "",
        remote_prefill_min_tokens=_remote_prefill_min_tokens(spec.get("disaggregation")),
        slo_ranks=_slo_ranks(spec), prefill_coming=_prefill_coming(obj.get("status")))


def _prefill_coming(status: Any) -> int:
    """``status.pools.prefill``: ``desiredReplicas - readyReplicas`` (the prefill pods ordered and
    not Ready yet), at least 0; 0 when absent or not integers."""
    pool = ((status or {}).get("pools") or {}).get("prefill") if isinstance(status, Mapping) else None
    if not isinstance(pool, Mapping):
        return 0
    desired, ready = pool.get("desiredReplicas"), pool.get("readyReplicas", 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (desired, ready)):
        return 0
    return max(0, desired - ready)


def _slo_ranks(spec: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    """``spec.slo``'s classes → each class's priority band (``goodput.api.policy.slo_ranks`` of the
    SLO as the autoscaler reads it, ``PolicySpec.from_crd``; the unnamed class included), as sorted
    ``(name, band)`` pairs; ``()`` without named classes or when the spec does not validate (the
    operator reports that as Degraded; requests keep their bodies' priority)."""
    try:
        p = PolicySpec.from_crd(spec)
    except ValueError:
        return ()
    return tuple(sorted(slo_ranks(p.slo_ttft_s, p.slo_classes).items())) if p.slo_classes else ()


def _remote_prefill_min_tokens(d: Any) -> int | None:
    """``spec.disaggregation.remotePrefillMinTokens`` when enabled (the CRD's default when unset),
    else None."""
    if not isinstance(d, Mapping) or d.get("enabled") is not True:
        return None
    v = d.get("remotePrefillMinTokens")
    default = crd.DisaggregationSpec.model_fields["remote_prefill_min_tokens"].default
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


def _http_port(spec: Mapping[str, Any]) -> int:
    for c in spec.get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http" and isinstance(p.get("containerPort"), int):
                return p["containerPort"]
    return crd.WORKER_PORT


ROLES = tuple(r.value for r in WorkerRole)


def pod_record(pod: Mapping[str, Any]) -> tuple[str, str, str, PodInfo | None] | None:
    """A pod (camelCase dict) → ``(namespace, InferenceService name, pod name, PodInfo | None)``;
    None when it is not a worker pod of an InferenceService. The PodInfo is None for a pod that
    cannot take a request yet or any more: no pod IP, or phase Succeeded/Failed."""
    meta, spec, s = pod.get("metadata") or {}, pod.get("spec") or {}, pod_state(pod)
    labels = meta.get("labels") or {}
    isvc = labels.get(crd.LABEL_ISVC)
    component = labels.get(crd.LABEL_COMPONENT)
    if not isvc or component not in (crd.WORKER_COMPONENT, crd.PREFILL_COMPONENT):
        return None
    ns, name = meta.get("namespace") or "", meta["name"]
    if not s.ip or s.finished:
        return ns, isvc, name, None
    host = f"[{s.ip}]" if ":" in s.ip else s.ip
    role = "prefill" if component == crd.PREFILL_COMPONENT else labels.get(crd.LABEL_ROLE, "both")
    return ns, isvc, name, PodInfo(name=name, url=f"http://{host}:{_http_port(spec)}", ready=s.ready,
                                   terminating=s.terminating, draining=s.draining,
                                   role=role if role in ROLES else "both")


class FleetMirror:
    """What the watches have seen, applied to a :class:`Fleet` (on its event loop; no I/O).

    Pods may arrive before their InferenceService (two watches): they are kept and join the fleet
    when it appears. Every method writes to the fleet only what changed, so listeners (requests
    held for a service) wake only on real changes. ``scope``: a namespace, or None (all)."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.services: dict[ServiceKey, ServiceInfo] = {}
        self.pods: dict[ServiceKey, dict[str, PodInfo]] = {}

    @staticmethod
    def _in(scope: str | None, key: ServiceKey) -> bool:
        return scope is None or key[0] == scope

    def relist_services(self, scope: str | None, objs: Iterable[Mapping[str, Any]]) -> None:
        """A list of InferenceServices in ``scope``: the ones not in it are gone."""
        seen = {}
        for obj in objs:
            info = service_info(obj)
            seen[info.key] = info
        for key in [k for k in self.services if self._in(scope, k) and k not in seen]:
            del self.services[key]
            self._sync(key)
        for key, info in seen.items():
            self.services[key] = info
            self._sync(key)

    def service_event(self, etype: str, obj: Mapping[str, Any]) -> None:
        """A watch event (ADDED, MODIFIED, DELETED) of one InferenceService."""
        info = service_info(obj)
        if etype == "DELETED":
            self.services.pop(info.key, None)
        else:
            self.services[info.key] = info
        self._sync(info.key)

    def relist_pods(self, scope: str | None, objs: Iterable[Mapping[str, Any]]) -> None:
        """A list of worker pods in ``scope``: the ones not in it are gone."""
        fresh: dict[ServiceKey, dict[str, PodInfo]] = {}
        for obj in objs:
            rec = pod_record(obj)
            if rec is not None and rec[3] is not None:
                fresh.setdefault((rec[0], rec[1]), {})[rec[2]] = rec[3]
        for key in [k for k in self.pods if self._in(scope, k)]:
            if key not in fresh:
                del self.pods[key]
                self._sync(key)
        for key, pods in fresh.items():
            self.pods[key] = pods
            self._sync(key)

    def pod_event(self, etype: str, obj: Mapping[str, Any]) -> None:
        """A watch event (ADDED, MODIFIED, DELETED) of one pod."""
        rec = pod_record(obj)
        if rec is None:
            return
        ns, isvc, name, info = rec
        key = (ns, isvc)
        pods = self.pods.setdefault(key, {})
        if etype == "DELETED" or info is None:
            pods.pop(name, None)
        else:
            pods[name] = info
        if not pods:
            del self.pods[key]
        self._sync(key)

    def _sync(self, key: ServiceKey) -> None:
        info = self.services.get(key)
        svc = self.fleet.service(key)
        if info is None:
            if svc is not None:
                self.fleet.remove_service(*key)
            return
        if svc is None or svc.info != info:
            other = self.fleet.for_model(info.model)
            if other is not None and other.key != key:
                log.warning("InferenceServices %s/%s and %s/%s both serve model %r: requests go to %s/%s",
                            *key, *other.key, info.model, *min(key, other.key))
            self.fleet.set_service(info)
            svc = self.fleet.service(key)
        want = self.pods.get(key, {})
        if {n: p.info for n, p in svc.pods.items()} != want:
            self.fleet.replace_pods(key[0], key[1], [want[n] for n in sorted(want)])


# ------------------------------------------------------------------------------------------ watch
@dataclass
class Reflector:
    """list → watch → (410: list again; error: back off, watch again) for one collection, on the
    calling thread until ``stop`` is set. ``list_fn() -> (items, resourceVersion)``;
    ``watch_fn(resource_version) -> iterator of {"type", "object"}`` (plain dicts; ends when the
    server closes the watch); ``on_list(items)``, ``on_event(type, object)`` are called in order.
    Raising ``ApiException`` with status 410 from ``watch_fn`` (or an ERROR event with code 410)
    means the version expired."""

    what: str
    list_fn: Callable[[], tuple[list[dict[str, Any]], str]]
    watch_fn: Callable[[str], Iterator[dict[str, Any]]]
    on_list: Callable[[list[dict[str, Any]]], None]
    on_event: Callable[[str, dict[str, Any]], None]
    stop: threading.Event = field(default_factory=threading.Event)
    sleep: Callable[[float], Any] | None = None  # default: stop.wait (so a stop ends a back-off)
    lists: int = 0     # how many lists ran (1 + relists after 410 or errors without a version)
    errors: int = 0

    def run(self) -> None:
        rv: str | None = None
        delay = RETRY_FIRST_S
        sleep = self.sleep or self.stop.wait
        while not self.stop.is_set():
            try:
                if rv is None:
                    items, rv = self.list_fn()
                    self.lists += 1
                    self.on_list(items)
                for ev in self.watch_fn(rv):
                    if self.stop.is_set():
                        return
                    etype, obj = ev.get("type"), ev.get("object") or {}
                    if etype == "ERROR":
                        if obj.get("code") == GONE:
                            raise _Gone(obj.get("message", ""))
                        raise RuntimeError(f"watch error event: {obj}")
                    new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                    if etype != "BOOKMARK":
                        self.on_event(etype, obj)
                    rv = new_rv or rv
                delay = RETRY_FIRST_S  # the server ended the watch (timeout): watch again from rv
            except Exception as e:  # noqa: BLE001 - a watch must outlive API-server hiccups
                if isinstance(e, _Gone) or getattr(e, "status", None) == GONE:
                    log.info("%s: resourceVersion %s expired (410 Gone): listing again", self.what, rv)
                    rv = None
                    continue
                self.errors += 1
                log.warning("%s: %s; retrying in %.0f s", self.what, _short(e), delay)
                sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)


class _Gone(Exception):
    pass


def _short(e: Exception) -> str:
    status = getattr(e, "status", None)
    return f"{type(e).__name__} {status} {getattr(e, 'reason', '')}".strip() if status else repr(e)[:300]


@dataclass
class KubernetesDiscovery:
    """The watch source (:class:`~goodput.router.fleet.Discovery`). ``namespaces``: the watched
    namespaces (None: all). ``watch_timeout_s``: the server-side length of one watch request."""

    namespaces: list[str] | None = None
    watch_timeout_s: int = 300
    api_client: Any = None  # a kubernetes.client.ApiClient; None: goodput.kube.load_config()
    reflectors: list[Reflector] = field(default_factory=list)

    def _clients(self):
        import kubernetes

        if self.api_client is None:
            from goodput import kube
            self.api_client = kube.load_config(pool_maxsize=4 * len(self.namespaces or [None]))
        return kubernetes.client.CoreV1Api(self.api_client), kubernetes.client.CustomObjectsApi(self.api_client)

    def _reflectors(self, mirror: FleetMirror, post: Callable[..., None], synced: Callable[[], None]):
        core, custom = self._clients()
        timeout = self.watch_timeout_s
        out = []
        for ns in self.namespaces or [None]:
            if ns is None:
                def isvcs(**kw):
                    return custom.list_cluster_custom_object(crd.GROUP, crd.VERSION, crd.PLURAL, **kw)

                def pods(**kw):
                    return core.list_pod_for_all_namespaces(label_selector=WORKER_SELECTOR, **kw)
            else:
                def isvcs(ns=ns, **kw):
                    return custom.list_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, **kw)

                def pods(ns=ns, **kw):
                    return core.list_namespaced_pod(ns, label_selector=WORKER_SELECTOR, **kw)
            for kind, fn, on_list, on_event in (
                    ("inferenceservices", isvcs, mirror.relist_services, mirror.service_event),
                    ("pods", pods, mirror.relist_pods, mirror.pod_event)):
                first = [True]

                def listed(items, on_list=on_list, ns=ns, first=first):
                    post(on_list, ns, items)
                    if first[0]:
                        first[0] = False
                        post(synced)

                out.append(Reflector(
                    what=f"{kind} in {ns or 'all namespaces'}", list_fn=_lister(fn),
                    watch_fn=_watcher(fn, timeout), on_list=listed,
                    on_event=lambda t, o, on_event=on_event: post(on_event, t, o)))
        return out

    async def run(self, fleet: Fleet) -> None:
        """List and watch until cancelled; ``fleet.mark_synced()`` once every initial list is in."""
        loop = asyncio.get_running_loop()
        mirror = FleetMirror(fleet)
        pending = [0]

        def post(fn, *args):
            loop.call_soon_threadsafe(fn, *args)

        def synced():
            pending[0] -= 1
            if pending[0] == 0:
                fleet.mark_synced()
                log.info("discovery synced: %d InferenceService(s), %d pod(s)", len(mirror.services),
                         sum(len(p) for p in mirror.pods.values()))

        self.reflectors = await asyncio.to_thread(self._reflectors, mirror, post, synced)
        pending[0] = len(self.reflectors)
        threads = [threading.Thread(target=r.run, name=f"watch {r.what}", daemon=True) for r in self.reflectors]
        for t in threads:
            t.start()
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            for r in self.reflectors:
                r.stop.set()  # each thread ends after its current watch request returns


def _lister(fn: Callable[..., Any]) -> Callable[[], tuple[list[dict[str, Any]], str]]:
    def list_all() -> tuple[list[dict[str, Any]], str]:
        resp = fn(_preload_content=False)
        body = json.loads(resp.data)
        return body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion") or "0"
    return list_all


def _watcher(fn: Callable[..., Any], timeout_s: int) -> Callable[[str], Iterator[dict[str, Any]]]:
    def watch(resource_version: str) -> Iterator[dict[str, Any]]:
        import kubernetes

        w = kubernetes.watch.Watch()
        # ``fn`` declares no return type, so events stay plain dicts (camelCase, as listed); with
        # timeout_seconds the client does not retry a 410 itself: it raises ApiException(410).
        # The client-side read timeout is a little past the server's: a dropped connection ends too.
        for ev in w.stream(fn, resource_version=resource_version, timeout_seconds=timeout_s,
                           allow_watch_bookmarks=True, _request_timeout=timeout_s + 30):
            yield {"type": ev.get("type"), "object": ev.get("raw_object") or {}}
    return watch


# -------------------------------------------------------------------------------------------- CLI
@dataclass(frozen=True)
class DiscoverySettings:
    """The flags of ``--kubernetes`` mode (``python -m goodput.router`` adds them)."""

    namespace: list[str] = setting([], "watch InferenceServices and pods in NS (repeatable); default: all "
                                   "namespaces", metavar="NS")
    all_namespaces: bool = setting(False, "watch every namespace (the default)")
    watch_timeout: int = setting(300, "seconds one watch request lasts before the server ends it and it resumes",
                                 ge=1, metavar="S")


def from_args(args: argparse.Namespace) -> KubernetesDiscovery:
    """The discovery the :class:`DiscoverySettings` flags describe. Raises SystemExit (2) for ``--namespace``
    with ``--all-namespaces``."""
    if args.namespace and args.all_namespaces:
        raise SystemExit("goodput-router: give --namespace NS (repeatable) or --all-namespaces, not both")
    if args.watch_timeout < 1:
        raise SystemExit("goodput-router: --watch-timeout must be at least 1 second")
    return KubernetesDiscovery(namespaces=list(dict.fromkeys(args.namespace)) or None,
                               watch_timeout_s=args.watch_timeout)


__all__ = ["DiscoverySettings", "FleetMirror", "KubernetesDiscovery", "Reflector",
           "from_args", "pod_record", "service_info"]
