"""The autoscaler's control loop: all of its I/O (Kubernetes API, worker HTTP, Prometheus).

Every ``period`` seconds, for each InferenceService with ``spec.autoscaling.enabled``:

1. list its worker pods (label selector of ``goodput.operator.resources``): *ready* ones (Ready
   condition True, a pod IP, not terminating) and *starting* ones (created, not ready, not
   terminating) with their age; terminating pods (draining) count as neither;
2. scrape every ready pod's ``/metrics`` concurrently, each bounded by ``scrape_timeout`` (or ask
   Prometheus, ``--prometheus-url``); a pod whose scrape fails is *unreachable*;
3. turn the scrapes into ``policy.PodObservation`` deltas (``observe``) and call ``policy.decide``
   with the ``PolicyState`` stored in ``status.autoscaler.policyState`` (a restarted autoscaler
   resumes its windows instead of starting over, so it does not flap);
4. write replicas through the InferenceService's **scale subresource** (the operator copies them
   to the Deployment), ``PUT /admin/limits`` on each ready pod whose limits differ from the
   decision (idempotent; bearer token from the ``<name>-admin`` Secret);
5. write ``status.autoscaler`` (decisions with reasons, conditions MetricsAvailable /
   ScalingActive / AbleToScale, desired replicas, policy state) and ``status.admission`` by a
   JSON merge patch of only what changed — the operator writes other status keys and never
   these — and post an Event when the replicas or limits change or a condition flips;
6. export its own metrics (``metric_names``) for dashboards and for KEDA/HPA users.

Pure helpers (pod classification, condition bookkeeping, the merge-patch diff) are module
functions with unit tests; the I/O sits in :class:`Kube`, :class:`DirectScraper`,
:class:`PrometheusSource` and :class:`Autoscaler`.
"""
from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import pydantic

from goodput.autoscaler import observe, policy
from goodput.autoscaler.metrics import AutoscalerMetrics
from goodput.operator import api, resources

log = logging.getLogger("goodput.autoscaler")

COMPONENT = "goodput-autoscaler"
CONDITION_TYPES = ("MetricsAvailable", "ScalingActive", "AbleToScale")


# --------------------------------------------------------------------------------------- pure helpers
def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> float | None:
    if not s:
        return None
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class ReadyPod:
    name: str
    uid: str
    ip: str
    age_s: float  # since its Ready condition turned True
    metrics_port: int = api.WORKER_PORT  # from the pod's prometheus.io/port annotation
    metrics_path: str = "/metrics"       # from prometheus.io/path


def _metrics_endpoint(meta: Mapping[str, Any]) -> tuple[int, str]:
    ann = meta.get("annotations") or {}
    try:
        port = int(ann.get("prometheus.io/port", api.WORKER_PORT))
    except ValueError:
        port = api.WORKER_PORT
    path = ann.get("prometheus.io/path") or "/metrics"
    return port, path if path.startswith("/") else "/" + path


def classify_pods(pods: Sequence[Mapping[str, Any]], now: float) -> tuple[list[ReadyPod], list[policy.StartingPod]]:
    """Split worker pods (camelCase dicts as the API returns them) into ready and starting.

    Ready: Ready condition True and a pod IP; its metrics endpoint from the ``prometheus.io/port``
    and ``prometheus.io/path`` annotations the operator sets (default 8000, /metrics). Starting: everything else that is alive (Pending, or
    Running but not ready — the model is loading); age from creationTimestamp. Terminating pods
    (deletionTimestamp set: draining) and finished ones (Succeeded/Failed) are neither: they are
    capacity that is going away. Ages in seconds, never negative. Sorted by name.
    """
    ready: list[ReadyPod] = []
    starting: list[policy.StartingPod] = []
    for p in pods:
        meta, st = p.get("metadata") or {}, p.get("status") or {}
        if meta.get("deletionTimestamp") or st.get("phase") in ("Succeeded", "Failed"):
            continue
        cond = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), None)
        if cond and cond.get("status") == "True" and st.get("podIP"):
            since = parse_time(cond.get("lastTransitionTime")) or now
            ready.append(ReadyPod(meta["name"], meta.get("uid", ""), st["podIP"], max(0.0, now - since),
                                  *_metrics_endpoint(meta)))
        else:
            created = parse_time(meta.get("creationTimestamp")) or now
            starting.append(policy.StartingPod(name=meta["name"], age_s=max(0.0, now - created)))
    return sorted(ready, key=lambda r: r.name), sorted(starting, key=lambda s: s.name)


def merge_diff(old: Any, new: Any) -> Any:
    """The RFC 7386 JSON merge patch that turns ``old`` into ``new`` (keys only in ``old`` -> null).

    Returns ``{}`` for no change at the top level (both dicts). Lists and scalars are replaced whole.
    """
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for k, v in new.items():
        if k not in old:
            patch[k] = v
        elif old[k] != v:
            patch[k] = merge_diff(old[k], v) if isinstance(v, dict) and isinstance(old[k], dict) else v
    for k in old:
        if k not in new:
            patch[k] = None
    return patch


def drop_nulls(value: Any) -> Any:
    """``value`` without None entries in dicts, recursively (lists keep their items)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def conditions_list(decided: Mapping[str, tuple[bool, str, str]], previous: Sequence[Mapping[str, Any]],
                    now: str) -> list[dict[str, Any]]:
    """``Decision.conditions`` -> metav1.Condition dicts; lastTransitionTime kept while status holds.

    Empty messages are omitted (the 1.20 API server reads "" in custom objects back as null).
    """
    prev = {c.get("type"): c for c in previous or ()}
    out = []
    for ctype in CONDITION_TYPES:
        if ctype not in decided:
            continue
        ok, reason, message = decided[ctype]
        status = "True" if ok else "False"
        p = prev.get(ctype) or {}
        c = {"type": ctype, "status": status, "reason": reason,
             "lastTransitionTime": p["lastTransitionTime"] if p.get("status") == status
             and p.get("lastTransitionTime") else now}
        if message:
            c["message"] = message
        out.append(c)
    return out


def summarize_limits(limits: Mapping[str, policy.Limits]) -> tuple[int | None, int | None]:
    """One (max_num_seqs, max_waiting) for status: the limits when every pod has the same, else
    the smallest of each (what every replica admits at least). (None, None) without pods."""
    if not limits:
        return None, None
    return min(v.max_num_seqs for v in limits.values()), min(v.max_waiting for v in limits.values())


def autoscaler_status(previous: Mapping[str, Any] | None, decision: policy.Decision, current_replicas: int,
                      now: float) -> dict[str, Any]:
    """The new ``status.autoscaler`` (camelCase) after ``decision``.

    A decision record is appended (newest last, at most api.MAX_DECISIONS kept) when replicas, the
    summarized limits or the reason differ from the last record; ``lastScaleTime`` moves when the
    replicas changed. ``previous`` is the current ``status.autoscaler`` (or None).
    """
    prev = dict(previous or {})
    ts = rfc3339(now)
    seqs, waiting = summarize_limits(decision.limits)
    decisions = list(prev.get("decisions") or [])
    record = {"time": ts, "replicas": decision.replicas, "reason": decision.reason}
    if seqs is not None:
        record.update(maxNumSeqs=seqs, maxWaiting=waiting)
    if decision.message:
        record["message"] = decision.message[:512]
    last = decisions[-1] if decisions else {}
    key = lambda d: (d.get("replicas"), d.get("maxNumSeqs"), d.get("maxWaiting"), d.get("reason"))  # noqa: E731
    if key(last) != key(record):
        decisions = (decisions + [record])[-api.MAX_DECISIONS:]
    out: dict[str, Any] = {
        "desiredReplicas": decision.replicas,
        "lastDecisionTime": ts,
        "decisions": decisions,
        "conditions": conditions_list(decision.conditions, prev.get("conditions") or [], ts),
        # nulls dropped: a JSON merge patch cannot store null (it deletes the key); from_dict
        # reads a missing key as its default
        "policyState": drop_nulls(decision.state.to_dict()),
    }
    last_scale = ts if decision.replicas != current_replicas else prev.get("lastScaleTime")
    if last_scale:
        out["lastScaleTime"] = last_scale
    return out


def changed(previous: Mapping[str, Any] | None, decision: policy.Decision, current_replicas: int) -> bool:
    """Whether this decision is news worth an Event: the replicas change, the (summarized) limits
    differ from the last recorded decision, or a condition flips status. A new reason alone (e.g.
    Steady <-> HoldStabilizing) is recorded in status.autoscaler.decisions only: no Event spam."""
    if decision.replicas != current_replicas:
        return True
    prev = previous or {}
    last = (prev.get("decisions") or [{}])[-1]
    if (last.get("maxNumSeqs"), last.get("maxWaiting")) != summarize_limits(decision.limits):
        return True
    before = {c.get("type"): c.get("status") for c in prev.get("conditions") or []}
    return any(before.get(t) != ("True" if ok else "False") for t, (ok, _, _) in decision.conditions.items())


# ----------------------------------------------------------------------------------------- metrics I/O
class MetricsSource(Protocol):
    async def samples(self, namespace: str, pods: Sequence[ReadyPod]) -> dict[str, observe.PodSample | Exception]:
        """pod name -> its cumulative sample now, or the exception that made it unavailable."""


class DirectScraper:
    """GET http://<podIP>:<prometheus.io/port><prometheus.io/path> on every ready pod at once, each
    bounded by ``timeout_s``."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float, clock=time.monotonic):
        self.client, self.timeout_s, self.clock = client, timeout_s, clock

    async def _one(self, pod: ReadyPod) -> observe.PodSample:
        r = await self.client.get(f"http://{pod.ip}:{pod.metrics_port}{pod.metrics_path}", timeout=self.timeout_s)
        if r.status_code != 200:
            raise observe.MetricsParseError(f"GET /metrics answered {r.status_code}")
        return observe.parse_sample(r.text, self.clock())

    async def samples(self, namespace: str, pods: Sequence[ReadyPod]) -> dict[str, observe.PodSample | Exception]:
        async def guarded(p: ReadyPod):
            try:
                return await asyncio.wait_for(self._one(p), self.timeout_s + 0.5)
            except (httpx.HTTPError, observe.MetricsParseError, asyncio.TimeoutError, OSError) as e:
                return e
        results = await asyncio.gather(*(guarded(p) for p in pods))
        return {p.name: r for p, r in zip(pods, results)}


# ------------------------------------------------------------------------------------------ Kubernetes
class Kube:
    """The few Kubernetes calls the autoscaler makes (synchronous; run in threads by the loop).

    RBAC it needs (e2e/autoscaler-rbac.yaml): inferenceservices get/list/watch, inferenceservices/
    status patch, inferenceservices/scale get/patch, pods list, secrets get, events create.
    """

    def __init__(self) -> None:
        import kubernetes
        from kubernetes.dynamic import DynamicClient

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        self.dyn = DynamicClient(kubernetes.client.ApiClient())
        self.isvc = self.dyn.resources.get(api_version=api.API_VERSION, kind=api.KIND)
        self.pods = self.dyn.resources.get(api_version="v1", kind="Pod")
        self.secrets = self.dyn.resources.get(api_version="v1", kind="Secret")
        self.events = self.dyn.resources.get(api_version="v1", kind="Event")

    def list_isvcs(self, namespace: str | None) -> list[dict[str, Any]]:
        return self.isvc.get(namespace=namespace).to_dict().get("items") or []

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.pods.get(namespace=namespace, label_selector=selector).to_dict().get("items") or []

    def admin_token(self, namespace: str, name: str) -> str | None:
        from kubernetes.client.exceptions import ApiException
        try:
            s = self.secrets.get(name=resources.admin_secret_name(name), namespace=namespace).to_dict()
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raw = (s.get("data") or {}).get(resources.ADMIN_TOKEN_KEY)
        return base64.b64decode(raw).decode() if raw else None

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self.isvc.scale.patch(body={"spec": {"replicas": replicas}}, name=name, namespace=namespace,
                              content_type="application/merge-patch+json")

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.isvc.status.patch(body={"status": patch}, name=name, namespace=namespace,
                               content_type="application/merge-patch+json")

    def event(self, obj: Mapping[str, Any], etype: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        ts = rfc3339(time.time())
        self.events.create(namespace=meta["namespace"], body={
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "type": etype, "reason": reason, "message": message[:1024],
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "reportingInstance": os.uname().nodename,
            "firstTimestamp": ts, "lastTimestamp": ts, "count": 1})


# ------------------------------------------------------------------------------------------- the loop
class Autoscaler:
    """One reconcile pass per ``tick()``; ``run()`` ticks every ``period_s`` until stopped.

    ``kube``: a :class:`Kube` (or anything with its methods); ``source``: where samples come from.
    Per pod (by uid) it keeps the previous sample, so deltas span the time between two good scrapes.
    """

    def __init__(self, kube: Any, source: MetricsSource, http: httpx.AsyncClient, *,
                 namespace: str | None = None, period_s: float = 5.0, metrics: AutoscalerMetrics | None = None,
                 wall_clock=time.time, dry_run: bool = False):
        self.kube, self.source, self.http = kube, source, http
        self.dry_run = dry_run  # decide and report (log, own metrics), write nothing anywhere
        self.namespace, self.period_s = namespace, period_s
        self.metrics = metrics
        self.wall_clock = wall_clock
        self._prev: dict[tuple[str, str], dict[str, observe.PodSample]] = {}  # (ns, name) -> uid -> sample
        self._tokens: dict[tuple[str, str], str] = {}

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - an API outage must not end the loop
                log.exception("reconcile pass failed")
            if self.metrics:
                self.metrics.loop_duration.observe(time.monotonic() - t0)
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, self.period_s - (time.monotonic() - t0)))
            except asyncio.TimeoutError:
                pass

    async def tick(self) -> dict[tuple[str, str], policy.Decision]:
        """One pass over every autoscaled InferenceService; returns the decisions by (namespace, name)."""
        objs = await asyncio.to_thread(self.kube.list_isvcs, self.namespace)
        todo = [o for o in objs if ((o.get("spec") or {}).get("autoscaling") or {}).get("enabled")
                and not o["metadata"].get("deletionTimestamp")]
        results = await asyncio.gather(*(self.reconcile(o) for o in todo), return_exceptions=True)
        out = {}
        for o, r in zip(todo, results):
            key = (o["metadata"]["namespace"], o["metadata"]["name"])
            if isinstance(r, BaseException):
                log.error("autoscaling %s/%s failed: %r", *key, r)
            elif r is not None:
                out[key] = r
        return out

    async def reconcile(self, obj: Mapping[str, Any]) -> policy.Decision | None:
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        try:
            spec = api.InferenceServiceSpec.model_validate(obj.get("spec") or {})
        except pydantic.ValidationError as e:
            log.warning("%s/%s: spec does not validate, not autoscaling it: %s", ns, name, e.errors()[:1])
            return None
        now = self.wall_clock()
        pods = await asyncio.to_thread(self.kube.list_pods, ns, resources.selector_string(name))
        ready, starting = classify_pods(pods, now)
        samples = await self.source.samples(ns, ready) if ready else {}

        observations, unreachable = [], []
        prev = self._prev.get((ns, name), {})
        kept: dict[str, observe.PodSample] = {}  # pods no longer ready are forgotten: fresh start
        for p in ready:
            s = samples.get(p.name)
            if isinstance(s, observe.PodSample):
                observations.append(observe.observation(p.name, prev.get(p.uid), s, p.age_s))
                kept[p.uid] = s
            else:
                unreachable.append(p.name)
                if p.uid in prev:
                    kept[p.uid] = prev[p.uid]  # the next good scrape's delta spans the gap
                log.info("%s/%s: pod %s unreachable: %r", ns, name, p.name, s)
                if self.metrics:
                    self.metrics.scrape_errors.labels(ns, name).inc()
        self._prev[(ns, name)] = kept

        status = obj.get("status") or {}
        prev_as = status.get("autoscaler") or {}
        state = None
        if prev_as.get("policyState"):
            try:
                state = policy.PolicyState.from_dict(prev_as["policyState"])
            except (TypeError, ValueError, KeyError) as e:
                log.warning("%s/%s: stored policy state unreadable (%r); starting fresh", ns, name, e)
        try:
            pspec = policy.PolicySpec.from_crd(spec.model_dump(by_alias=True))
        except ValueError as e:  # e.g. minReplicas > maxReplicas: the operator reports it as Degraded
            log.warning("%s/%s: autoscaling settings refused, not autoscaling it: %s", ns, name, e)
            return None
        observation = policy.Observation(ready=tuple(observations), starting=tuple(starting),
                                         unreachable=tuple(unreachable), current_replicas=spec.replicas)
        decision = policy.decide(now, observation, pspec, state)

        if self.dry_run:
            log.info("%s/%s (dry run): would set replicas %d -> %d, limits %s (%s: %s)", ns, name, spec.replicas,
                     decision.replicas, {p: (v.max_num_seqs, v.max_waiting) for p, v in decision.limits.items()},
                     decision.reason, decision.message)
            if self.metrics:
                self.metrics.record(ns, name, decision, decision.replicas, len(ready), len(starting))
            return decision
        scale_error = None
        if decision.replicas != spec.replicas:
            try:
                await asyncio.to_thread(self.kube.scale, ns, name, decision.replicas)
                log.info("%s/%s: replicas %d -> %d (%s: %s)", ns, name, spec.replicas, decision.replicas,
                         decision.reason, decision.message)
            except Exception as e:  # noqa: BLE001 - reported as AbleToScale=False
                scale_error = e
                log.warning("%s/%s: scaling to %d failed: %r", ns, name, decision.replicas, e)
        await self._push_limits(ns, name, ready, samples, decision)

        conditions = dict(decision.conditions)
        if scale_error is not None:
            conditions["AbleToScale"] = (False, "FailedUpdateScale",
                                         f"the scale subresource refused replicas={decision.replicas}: {scale_error}")
            decision = _with_conditions(decision, conditions)
        applied = spec.replicas if scale_error is not None else decision.replicas
        new_as = autoscaler_status(prev_as, decision, spec.replicas, now)
        if scale_error is not None:
            new_as["desiredReplicas"] = decision.replicas
        seqs, waiting = summarize_limits(decision.limits)
        patch = {}
        as_patch = merge_diff(prev_as, new_as)
        if as_patch:
            patch["autoscaler"] = as_patch
        if seqs is not None:
            adm = {"maxNumSeqs": seqs, "maxWaiting": waiting}
            old_adm = status.get("admission") or {}
            if (old_adm.get("maxNumSeqs"), old_adm.get("maxWaiting")) != (seqs, waiting):
                patch["admission"] = {**adm, "updatedAt": rfc3339(now)}
        # lastDecisionTime alone changing is not worth a write every period
        if patch and set(patch) == {"autoscaler"} and set(as_patch) <= {"lastDecisionTime"}:
            patch = {}
        if patch:
            await asyncio.to_thread(self.kube.patch_status, ns, name, patch)
        if changed(prev_as, decision, spec.replicas) or scale_error is not None:
            failing = [t for t, (ok, _, _) in conditions.items() if not ok]
            etype = "Warning" if scale_error is not None or "MetricsAvailable" in failing else "Normal"
            reason = "FailedUpdateScale" if scale_error is not None else decision.reason
            msg = f"replicas {spec.replicas} -> {decision.replicas}"
            if seqs is not None:
                msg += f", limits maxNumSeqs={seqs} maxWaiting={waiting}"
            try:
                await asyncio.to_thread(self.kube.event, obj, etype, reason, f"{msg}: {decision.message}")
            except Exception as e:  # noqa: BLE001 - an Event is best effort; status already says it
                log.warning("%s/%s: could not post an Event: %r", ns, name, e)
        if self.metrics:
            self.metrics.record(ns, name, decision, applied, len(ready), len(starting))
        return decision

    async def _token(self, ns: str, name: str, refresh: bool = False) -> str | None:
        key = (ns, name)
        if refresh or key not in self._tokens:
            tok = await asyncio.to_thread(self.kube.admin_token, ns, name)
            if tok is None:
                return None
            self._tokens[key] = tok
        return self._tokens[key]

    async def _push_limits(self, ns: str, name: str, ready: Sequence[ReadyPod],
                           samples: Mapping[str, Any], decision: policy.Decision) -> None:
        """PUT /admin/limits on each ready pod whose scraped limits differ from the decision."""
        todo = []
        for p in ready:
            want = decision.limits.get(p.name)
            s = samples.get(p.name)
            if want is None:
                continue
            if isinstance(s, observe.PodSample) and (int(s.max_num_seqs), int(s.max_waiting)) == (
                    want.max_num_seqs, want.max_waiting):
                continue
            todo.append((p, want))
        if not todo:
            return
        token = await self._token(ns, name)
        if token is None:
            log.warning("%s/%s: no admin Secret %s: cannot set admission limits", ns, name,
                        resources.admin_secret_name(name))
            return

        async def put(p: ReadyPod, lim: policy.Limits) -> None:
            body = {"max_num_seqs": lim.max_num_seqs, "max_waiting": lim.max_waiting}
            url = f"http://{p.ip}:{api.WORKER_PORT}/admin/limits"
            try:
                r = await self.http.put(url, json=body, headers={"Authorization": f"Bearer {token}"})
                if r.status_code == 401:  # the Secret was recreated: read it again once
                    fresh = await self._token(ns, name, refresh=True)
                    r = await self.http.put(url, json=body, headers={"Authorization": f"Bearer {fresh}"})
                if r.status_code != 200:
                    log.warning("%s/%s: PUT /admin/limits on %s answered %d: %s", ns, name, p.name,
                                r.status_code, r.text[:200])
            except httpx.HTTPError as e:
                log.warning("%s/%s: PUT /admin/limits on %s failed: %r", ns, name, p.name, e)

        await asyncio.gather(*(put(p, lim) for p, lim in todo))


def _with_conditions(decision: policy.Decision, conditions: dict) -> policy.Decision:
    import dataclasses
    return dataclasses.replace(decision, conditions=conditions)
