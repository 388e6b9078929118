"""The autoscaler's control loop: all of its I/O (Kubernetes API, worker HTTP, Prometheus).

Every ``period`` seconds, while this instance holds the leader Lease (``lease``), for each
InferenceService with ``spec.autoscaling.enabled``, :meth:`Autoscaler.reconcile` runs four steps:

1. **observe** (I/O): list its worker pods (label selector of ``goodput.operator.resources``):
   *ready* ones (Ready condition True, a pod IP, not terminating, not draining) and *starting* ones
   (created, not ready, not terminating) with their age; scrape every ready pod's ``/metrics``
   concurrently, each bounded by ``scrape_timeout`` (or ask Prometheus, ``--prometheus-url``); a pod
   whose scrape fails is *unreachable*; turn the scrapes into ``policy.PodObservation`` deltas
   (``observe``); read the ``PolicyState`` stored in ``status.autoscaler.policyState`` (a restarted
   autoscaler, or a standby that took the Lease over, resumes its windows instead of starting over);
2. **decide** (pure): ``policy.decide``;
3. **plan** (pure, :func:`make_plan`): the scale target, the pods to drain first on a scale-in
   (:func:`pick_drain`), the ``PUT /admin/limits`` pushes (the decided limits bounded by the spec's
   ``engine.maxNumSeqs`` / ``engine.maxWaiting``: :func:`engine_bounds`), the JSON merge patch of
   ``status.autoscaler`` and ``status.admission`` (only what changed; the operator never writes these
   keys), and the Events (:func:`plan_events`);
4. **apply** (I/O, skipped by ``--dry-run``): drain (annotate the pod, ``POST /admin/drain``, wait
   until the API reports it unready: the ReplicaSet removes unready pods first), write
   replicas through the InferenceService's **scale subresource** (the operator copies them to the
   Deployment), push limits (bearer token from the ``<name>-admin`` Secret), patch status, post
   Events. A refused scale write is planned again with the error (AbleToScale False,
   FailedUpdateScale) and the drains are undone.

Its own metrics (``metric_names``) are exported for dashboards and for KEDA/HPA users.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import pydantic

from goodput import kube
from goodput.api import admin as admin_api, crd
from goodput.api.pods import pod_state
from goodput.api.policy import PolicySpec
from goodput.autoscaler import observe, policy
from goodput.autoscaler.metrics import AutoscalerMetrics

log = logging.getLogger("goodput.autoscaler")

COMPONENT = "goodput-autoscaler"
CONDITION_TYPES = ("MetricsAvailable", "ScalingActive", "AbleToScale")
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
DRAIN_DELETION_COST = "-1000"
# status.autoscaler MetricsAvailable reason while no pod has a rate yet but none failed its scrape
AWAITING_RATES = "AwaitingRates"
rfc3339 = kube.rfc3339
parse_time = kube.parse_time


# --------------------------------------------------------------------------------------- pure helpers
@dataclass(frozen=True)
class ReadyPod:
    name: str
    uid: str
    ip: str
    age_s: float  # since its Ready condition turned True
    metrics_port: int = crd.WORKER_PORT  # from the pod's prometheus.io/port annotation
    metrics_path: str = "/metrics"       # from prometheus.io/path
    load_s: float | None = None          # creationTimestamp -> Ready (its model load; None: unknown)


@dataclass(frozen=True)
class Pool:
    """One fleet of an InferenceService that the autoscaler sizes on its own measurements.

    ``name``: :data:`WORKERS` (a colocated service's workers, or a disaggregated service's decode
    pool: replicas through the scale subresource, record in ``status.autoscaler``) or
    :data:`PREFILL` (``spec.disaggregation``'s prefill pool: replicas written to
    ``spec.disaggregation.prefill.replicas``, record in ``status.autoscaler.prefill``);
    ``selector``: its pods' label selector; ``replicas``: what its spec asks for now."""

    name: str
    selector: str
    replicas: int


WORKERS, PREFILL = "workers", "prefill"


def pools(name: str, spec: crd.InferenceServiceSpec) -> list[Pool]:
    """The fleets of InferenceService ``name``: its workers, and the prefill pool when
    ``spec.disaggregation`` is on (docs/disaggregation.md)."""
    out = [Pool(WORKERS, crd.selector_string(name), spec.replicas)]
    d = spec.disaggregation
    if d.enabled:
        selector = ",".join(f"{k}={v}" for k, v in sorted(crd.prefill_selector_labels(name).items()))
        out.append(Pool(PREFILL, selector, d.prefill.replicas))
    return out


def pool_policy(pspec: PolicySpec, spec: crd.InferenceServiceSpec, pool: Pool) -> PolicySpec:
    """The policy a pool is held to: the service's SLO and tuning, with the prefill pool's own
    replica bounds (``spec.disaggregation.prefill.minReplicas/maxReplicas``) for it. The prefill
    pool's requests are remote prefills (the prompt and its first token), so its own TTFT, queue
    and KV use move it; the decode pool's TPOT, KV and its local prefills move the workers. A
    prefill pod reports no TPOT, so its pool is sized by prompt tokens (``prefill_pool``, policy
    rule 18)."""
    if pool.name != PREFILL:
        return pspec
    p = spec.disaggregation.prefill
    return dataclasses.replace(pspec, min_replicas=p.min_replicas, max_replicas=p.max_replicas,
                               prefill_pool=True)


def pool_record(status: Mapping[str, Any], pool: Pool) -> dict[str, Any]:
    """The pool's record in ``status.autoscaler`` as stored now (the workers' without the
    prefill pool's, which is kept under its own key)."""
    autoscaler = status.get("autoscaler") or {}
    if pool.name == PREFILL:
        return dict(autoscaler.get("prefill") or {})
    return {k: v for k, v in autoscaler.items() if k != "prefill"}


def _metrics_endpoint(meta: Mapping[str, Any]) -> tuple[int, str]:
    ann = meta.get("annotations") or {}
    try:
        port = int(ann.get("prometheus.io/port", crd.WORKER_PORT))
    except ValueError:
        port = crd.WORKER_PORT
    path = ann.get("prometheus.io/path") or "/metrics"
    return port, path if path.startswith("/") else "/" + path


def classify_pods(pods: Sequence[Mapping[str, Any]], now: float) -> tuple[list[ReadyPod], list[policy.StartingPod]]:
    """Split worker pods (camelCase dicts as the API returns them) into ready and starting.

    Ready: serving (``goodput.api.pods.pod_state``: Ready condition True and a pod IP); its metrics
    endpoint from the ``prometheus.io/port`` and ``prometheus.io/path`` annotations the operator sets (default 8000, /metrics). Starting: everything else that is alive (Pending, or
    Running but not ready — the model is loading); age from creationTimestamp. Terminating pods
    (deletionTimestamp set), draining ones (annotation ``serving.goodput.dev/draining: "true"``) and
    finished ones (Succeeded/Failed) are neither: they are capacity that is going away. Ages in seconds, never negative. Sorted by name.
    A ready pod's ``load_s`` is creationTimestamp -> the Ready condition's lastTransitionTime (its
    model load, or more if its readiness flapped since).
    """
    ready: list[ReadyPod] = []
    starting: list[policy.StartingPod] = []
    for p in pods:
        meta, s = p.get("metadata") or {}, pod_state(p)
        if s.going:
            continue
        if s.serving:
            since = parse_time(s.ready_since) or now
            created = parse_time(s.created)
            ready.append(ReadyPod(s.name, meta.get("uid", ""), s.ip, max(0.0, now - since),
                                  *_metrics_endpoint(meta),
                                  load_s=max(0.0, since - created) if created is not None else None))
        else:
            created = parse_time(s.created) or now
            starting.append(policy.StartingPod(name=s.name, age_s=max(0.0, now - created)))
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

    A decision record is appended (newest last, at most crd.MAX_DECISIONS kept) when replicas, the
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
        decisions = (decisions + [record])[-crd.MAX_DECISIONS:]
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


TOKEN_TOLERANCE = 0.1   # a token limit within this fraction of the wanted one is not written again


def same_token_limit(have: int, want: int) -> bool:
    """Whether token limit ``have`` stands for ``want``: within :data:`TOKEN_TOLERANCE` of it (the
    limit follows the smoothed capacity estimate, so it moves a little every call; a push or a
    status write per call is not worth a few percent), 0 (no bound) only where 0 is wanted."""
    if have == 0 or want == 0:
        return have == want
    return abs(have - want) <= TOKEN_TOLERANCE * want


def limits_in_force(sample: observe.PodSample, want: policy.Limits) -> bool:
    """Whether a pod's scrape already shows ``want``: the same max_num_seqs and max_waiting, and
    the same token limit (:func:`same_token_limit`). A worker that exports no token limit counts
    as 0."""
    if (int(sample.max_num_seqs), int(sample.max_waiting)) != (want.max_num_seqs, want.max_waiting):
        return False
    return same_token_limit(int(getattr(sample, "max_waiting_tokens", 0) or 0), want.max_waiting_tokens)


def decision_message(message: str, limits: Mapping[str, policy.Limits]) -> str:
    """The message of a decision as applied: the policy's ``message`` (the numbers behind the
    replicas) and the admission limits in force, ``limits`` after the spec's bounds (a range over
    the pods when they differ; the token limit only when one is set). E.g. ``"...; limits
    max_num_seqs 8 max_waiting 4..6 max_waiting_tokens 9000 (3 pods)"``."""
    if not limits:
        return f"{message}; no ready pod to limit"
    def span(xs: list[int]) -> str:
        return str(xs[0]) if min(xs) == max(xs) else f"{min(xs)}..{max(xs)}"
    seqs = span([v.max_num_seqs for v in limits.values()])
    waiting = span([v.max_waiting for v in limits.values()])
    toks = [v.max_waiting_tokens for v in limits.values()]
    tokens = f" max_waiting_tokens {span(toks)}" if any(toks) else ""
    n = len(limits)
    return f"{message}; limits max_num_seqs {seqs} max_waiting {waiting}{tokens} ({n} pod{'s' if n != 1 else ''})"


def engine_bounds(spec: crd.InferenceServiceSpec, pool: str = WORKERS) -> policy.Limits | None:
    """The upper bounds of the limits the autoscaler may set: ``spec.engine.maxNumSeqs``,
    ``spec.engine.maxWaiting`` and ``spec.engine.maxWaitingTokens`` (what the user wrote is the
    most a replica admits; the autoscaler tunes below it); for a disaggregated service's pools,
    their own settings over those (``crd.pool_spec``). None when none is set; an unset count is
    unbounded (a very large int), an unset or 0 token limit is 0 (no token bound)."""
    if spec.disaggregation.enabled:
        spec = crd.pool_spec(spec, "prefill" if pool == PREFILL else "decode")
    seqs, waiting, tokens = spec.engine.max_num_seqs, spec.engine.max_waiting, spec.engine.max_waiting_tokens
    if seqs is None and waiting is None and not tokens:
        return None
    unbounded = 2**31 - 1
    return policy.Limits(max_num_seqs=seqs if seqs is not None else unbounded,
                         max_waiting=waiting if waiting is not None else unbounded,
                         max_waiting_tokens=tokens or 0)


def bound_limits(limits: Mapping[str, policy.Limits], bound: policy.Limits | None) -> dict[str, policy.Limits]:
    """Each pod's limits capped by ``bound`` (field by field; None = unchanged). A token limit of
    0 is no bound: the smaller of two token limits, 0 only when both are 0."""
    if bound is None:
        return dict(limits)

    def tokens(a: int, b: int) -> int:
        return min(a, b) if a and b else a or b
    return {pod: policy.Limits(min(v.max_num_seqs, bound.max_num_seqs), min(v.max_waiting, bound.max_waiting),
                               tokens(v.max_waiting_tokens, bound.max_waiting_tokens))
            for pod, v in limits.items()}


@dataclass(frozen=True)
class DrainCandidate:
    """A ready pod as the scale-in sees it: ``in_flight`` = running + waiting now (None when its
    scrape failed: assumed busy), ``prefix_hits`` = prefix-cache hit tokens over the last interval."""

    name: str
    in_flight: int | None
    prefix_hits: float = 0.0


def pick_drain(candidates: Sequence[DrainCandidate], k: int) -> list[str]:
    """The ``k`` pods to remove on a scale-in (docs/router-autoscaler-contract.md, "Scale-in"): the
    least in-flight work first, ties broken by the least prefix-cache hits (the pod whose cache is
    worth least), then by name; unscraped pods last. Returns names, at most ``len(candidates)``."""
    order = sorted(candidates, key=lambda c: (c.in_flight is None, c.in_flight or 0, c.prefix_hits, c.name))
    return [c.name for c in order[:max(0, k)]]


@dataclass(frozen=True)
class EventSpec:
    """One Event to post: ``series_key`` None = a new Event; else occurrences with the same
    (type, reason, series_key) are one Event whose count grows (``kube.EventRecorder``)."""

    type: str
    reason: str
    message: str
    series_key: str | None = None


def plan_events(prev_as: Mapping[str, Any], decision: policy.Decision, current_replicas: int,
                limits: Mapping[str, policy.Limits], unreachable: Sequence[str],
                scale_error: str | None = None) -> list[EventSpec]:
    """The Events of one decision: few, and only news.

    - replicas change: one Normal Event (reason = the decision's), or a Warning
      ``FailedUpdateScale`` when the scale write was refused;
    - a condition flips status (against the stored conditions): one Event per condition,
      aggregated by (condition, status) into a series. Warning only for ``MetricsAvailable`` False
      because ready pods could not be scraped (also on the first decision, where nothing else
      posts); never for a first scrape (no rates yet: a new pod, a restart, a new leader), which
      posts nothing;
    - the (summarized) limits change: a Normal ``AdmissionLimits`` Event in one series per object,
      so ``maxWaiting`` moving with the load is one Event with a count, not one per change;
    - requests were infeasible over the interval (``decision.infeasible`` > 0: a prompt no idle
      replica prefills within the TTFT SLO, policy rule 16): a Warning ``InfeasibleRequests`` in
      one series per object (its count grows while they keep coming).
    """
    out: list[EventSpec] = []
    msg = decision.message
    if scale_error is not None:
        out.append(EventSpec("Warning", "FailedUpdateScale",
                             f"replicas {current_replicas} -> {decision.replicas}: {scale_error}", "FailedUpdateScale"))
    elif decision.replicas != current_replicas:
        out.append(EventSpec("Normal", decision.reason, msg))
    before = {c.get("type"): c for c in prev_as.get("conditions") or []}
    for ctype, (ok, reason, cmsg) in decision.conditions.items():
        status = "True" if ok else "False"
        warn = ctype == "MetricsAvailable" and not ok and bool(unreachable)
        was = before.get(ctype) or {}
        if was.get("status", "True" if warn else status) == status:
            continue  # unchanged; or the first decision, where only a pod that cannot be scraped is news
        if ctype == "AbleToScale" and scale_error is not None:
            continue  # the FailedUpdateScale Warning above says it
        if ctype == "MetricsAvailable" and AWAITING_RATES in (reason, was.get("reason")):
            continue  # no rates yet (first scrape: a new pod, a restart, a new leader), or their arrival
        etype = "Warning" if warn else "Normal"
        out.append(EventSpec(etype, reason, f"{ctype} {status}: {cmsg}", f"{ctype}={status}"))
    last = (prev_as.get("decisions") or [{}])[-1]
    seqs, waiting = summarize_limits(limits)
    if seqs is not None and last and (last.get("maxNumSeqs"), last.get("maxWaiting")) != (seqs, waiting):
        out.append(EventSpec("Normal", "AdmissionLimits", f"limits maxNumSeqs={seqs} maxWaiting={waiting}",
                             "AdmissionLimits"))
    n_inf = round(decision.infeasible)
    if n_inf > 0:
        out.append(EventSpec("Warning", "InfeasibleRequests",
                             f"{n_inf} request(s) over the last interval had prompts longer than one idle "
                             f"replica prefills within the TTFT SLO ({decision.capacity_tokens:.0f} tokens/s per "
                             "replica); counted as infeasible and left out of the sizing", "InfeasibleRequests"))
    return out


@dataclass(frozen=True)
class LimitPush:
    """``PUT /admin/limits`` on one pod."""

    pod: ReadyPod
    limits: policy.Limits


@dataclass(frozen=True)
class Observed:
    """What :meth:`Autoscaler.observe` found for one InferenceService (input of :func:`make_plan`).

    ready, starting: the pods (``classify_pods``); draining: (name, pod IP or None) of the pods that
    carry the draining annotation and are not terminating;
    samples: ready pod name -> its sample now (or the exception of its scrape); observation: what
    ``policy.decide`` reads; prefix_hits: ready pod name -> prefix-cache hit tokens over the last
    interval (for :func:`pick_drain`).
    """

    ready: tuple[ReadyPod, ...]
    starting: tuple[policy.StartingPod, ...]
    draining: tuple[tuple[str, str | None], ...]
    samples: Mapping[str, Any]
    observation: policy.Observation
    prefix_hits: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """Everything :meth:`Autoscaler.apply` writes for one decision, in that order.

    drain: ready pods to annotate and drain before the replicas go down; undrain: draining pods
    that no scale-in will remove (replicas went back up): annotation removed, ``DELETE
    /admin/drain``; scale_to: the new ``spec.replicas`` (None = unchanged); pushes: limits to PUT;
    status_patch: the JSON merge patch of ``status`` ({} = no write); events; limits: the limits in
    force after apply (the decision's, bounded by the spec), by pod; message: the decision's message
    with those limits (:func:`decision_message`).
    """

    scale_to: int | None
    drain: tuple[ReadyPod, ...]
    undrain: tuple[tuple[str, str | None], ...]
    pushes: tuple[LimitPush, ...]
    status_patch: dict[str, Any]
    events: tuple[EventSpec, ...]
    limits: dict[str, policy.Limits]
    message: str = ""


def make_plan(status: Mapping[str, Any], spec: crd.InferenceServiceSpec, seen: Observed,
              decision: policy.Decision, now: float, scale_error: str | None = None,
              pool: Pool | None = None) -> Plan:
    """The writes that carry out ``decision`` (pure). ``status``: the object's status now;
    ``scale_error``: the scale write was refused (re-plan after apply's failed attempt): replicas
    stay, AbleToScale False (FailedUpdateScale), no drain. ``pool``: the fleet decided (default:
    the workers); the prefill pool's record goes to ``status.autoscaler.prefill``, its Events say
    "prefill pool", and it writes no ``status.admission`` (the router's bound is the service's)."""
    pool = pool or Pool(WORKERS, "", spec.replicas)
    current = pool.replicas
    limits = bound_limits(decision.limits, engine_bounds(spec, pool.name))
    pushes = []
    for p in seen.ready:
        want, s = limits.get(p.name), seen.samples.get(p.name)
        if want is None:
            continue
        if isinstance(s, observe.PodSample) and limits_in_force(s, want):
            continue
        pushes.append(LimitPush(p, want))
    conditions = dict(decision.conditions)
    ok, _, msg = conditions.get("MetricsAvailable", (True, "", ""))
    if not ok and not seen.observation.unreachable:  # nothing failed: rates need a second scrape
        conditions["MetricsAvailable"] = (False, AWAITING_RATES, msg)
    if scale_error is not None:
        conditions["AbleToScale"] = (False, "FailedUpdateScale",
                                     f"the scale subresource refused replicas={decision.replicas}: {scale_error}")
    shown = dataclasses.replace(decision, conditions=conditions, limits=limits,
                                message=decision_message(decision.message, limits))
    scale_to = decision.replicas if decision.replicas != current and scale_error is None else None
    drain: tuple[ReadyPod, ...] = ()
    undrain: tuple[tuple[str, str | None], ...] = ()
    if scale_to is not None and scale_to < current:
        by_name = {p.name: p for p in seen.ready}
        cands = [DrainCandidate(p.name, (int(s.running + s.waiting) if isinstance(s := seen.samples.get(p.name),
                                                                                   observe.PodSample) else None),
                                seen.prefix_hits.get(p.name, 0.0)) for p in seen.ready]
        drain = tuple(by_name[n] for n in pick_drain(cands, len(seen.ready) - scale_to))
    elif seen.draining and len(seen.ready) + len(seen.starting) + len(seen.draining) <= (scale_to or current):
        undrain = tuple(seen.draining)   # the replicas went back up: these pods stay, serve again

    prev_as = pool_record(status, pool)
    # a refused scale is no scale: lastScaleTime stays (current_replicas = the decided ones)
    new_as = autoscaler_status(prev_as, shown, current if scale_error is None else decision.replicas, now)
    patch: dict[str, Any] = {}
    as_patch = merge_diff(prev_as, new_as)
    if as_patch and set(as_patch) - {"lastDecisionTime"}:  # the time alone is not worth a write
        patch["autoscaler"] = {"prefill": as_patch} if pool.name == PREFILL else as_patch
    events = plan_events(prev_as, shown, current, limits, seen.observation.unreachable, scale_error)
    if pool.name == PREFILL:  # its own Event series; status.admission (the router's bound) is the workers'
        events = [dataclasses.replace(e, message=f"prefill pool: {e.message}", series_key=e.series_key and
                                      f"prefill/{e.series_key}") for e in events]
    else:
        adm = admission_patch(status.get("admission") or {}, limits, decision.router_max_queued)
        if adm:
            patch["admission"] = {**adm, "updatedAt": rfc3339(now)}
    return Plan(scale_to=scale_to, drain=drain, undrain=undrain, pushes=tuple(pushes), status_patch=patch,
                events=tuple(events), limits=limits, message=shown.message)


def admission_patch(old: Mapping[str, Any], limits: Mapping[str, policy.Limits],
                    router_max_queued: int | None) -> dict[str, Any]:
    """The ``status.admission`` fields that change: the summarized limits in force, the smallest
    token limit (``maxWaitingTokens``, 0 or absent = none; rewritten only when it is no longer
    :func:`same_token_limit`) and the router's queue bound ({} = nothing new)."""
    seqs, waiting = summarize_limits(limits)
    adm: dict[str, Any] = {}
    if seqs is not None and (old.get("maxNumSeqs"), old.get("maxWaiting")) != (seqs, waiting):
        adm.update(maxNumSeqs=seqs, maxWaiting=waiting)
    if limits:
        tokens = min(v.max_waiting_tokens for v in limits.values())
        was = old.get("maxWaitingTokens") or 0     # absent: none (a status from before the field)
        if not same_token_limit(was, tokens):
            adm["maxWaitingTokens"] = tokens
    if router_max_queued is not None and old.get("routerMaxQueued") != router_max_queued:
        adm["routerMaxQueued"] = router_max_queued
    return adm

# ----------------------------------------------------------------------------------------- metrics I/O
RETRIED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


async def get_once_more(client: httpx.AsyncClient, url: str, **kw: Any) -> httpx.Response:
    """``GET url``, sent again once when the connection broke before any response: the server
    closed a pooled keep-alive connection just as it was reused (``RemoteProtocolError: Server
    disconnected without sending a response``, or a reset). A GET is idempotent, and the retry
    opens a fresh connection, which no keep-alive timeout can close under it. Other errors
    (connect refused, timeouts, HTTP statuses) are not retried: they say something about the pod."""
    try:
        return await client.get(url, **kw)
    except RETRIED as e:
        log.debug("GET %s: %r on a pooled connection; once more on a new one", url, e)
        return await client.get(url, **kw)


class MetricsSource(Protocol):
    async def samples(self, namespace: str, pods: Sequence[ReadyPod]) -> dict[str, observe.PodSample | Exception]:
        """pod name -> its cumulative sample now, or the exception that made it unavailable."""


class DirectScraper:
    """GET http://<podIP>:<prometheus.io/port><prometheus.io/path> on every ready pod at once, each
    bounded by ``timeout_s`` (:func:`get_once_more`)."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float, clock=time.monotonic):
        self.client, self.timeout_s, self.clock = client, timeout_s, clock

    async def _one(self, pod: ReadyPod) -> observe.PodSample:
        r = await get_once_more(self.client, f"http://{pod.ip}:{pod.metrics_port}{pod.metrics_path}",
                                timeout=self.timeout_s)
        if r.status_code != 200:
            raise observe.MetricsParseError(f"GET /metrics answered {r.status_code}")
        return observe.parse_sample(r.text, self.clock())

    async def samples(self, namespace: str, pods: Sequence[ReadyPod]) -> dict[str, observe.PodSample | Exception]:
        async def guarded(p: ReadyPod):
            try:
                return await asyncio.wait_for(self._one(p), 2 * self.timeout_s + 0.5)
            except (httpx.HTTPError, observe.MetricsParseError, asyncio.TimeoutError, OSError) as e:
                return e
        results = await asyncio.gather(*(guarded(p) for p in pods))
        return {p.name: r for p, r in zip(pods, results)}


ROUTER_SELECTOR = "app.kubernetes.io/component=router"
ROUTER_PORT = 8080  # the router's default --port; a pod's prometheus.io/port annotation overrides it


def router_targets(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ``/metrics`` URLs of the Ready, not terminating router pods (sorted): port and path from
    their ``prometheus.io/port`` / ``prometheus.io/path`` annotations (default 8080, /metrics)."""
    out = []
    for p in pods:
        s = pod_state(p)
        if not s.serving:
            continue
        ann = (p.get("metadata") or {}).get("annotations") or {}
        port = ann.get("prometheus.io/port") or ROUTER_PORT
        path = ann.get("prometheus.io/path") or "/metrics"
        out.append(f"http://{s.ip}:{port}{path if path.startswith('/') else '/' + path}")
    return sorted(out)


class RouterScraper:
    """The routers' view of every service, once per pass (docs/router-autoscaler-contract.md,
    "Router -> autoscaler"): ``GET /metrics`` on each router — the ``urls`` given
    (``--router-metrics-url``) and, with ``kube`` and ``namespace`` (``--router-namespace``), the
    Ready pods labelled ``app.kubernetes.io/component=router`` there — summed per (namespace,
    inferenceservice) by :func:`observe.router_observation`, counters as deltas per router.
    A router that fails its scrape is left out of that pass (logged); its previous sample stays,
    so its next delta spans the gap."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float, urls: Sequence[str] = (), kube: Any = None,
                 namespace: str | None = None, clock=time.monotonic):
        self.client, self.timeout_s, self.urls = client, timeout_s, list(urls)
        self.kube, self.namespace, self.clock = kube, namespace, clock
        self._prev: dict[tuple[str, observe.ServiceKey], observe.PodSample] = {}

    async def targets(self) -> list[str]:
        urls = list(self.urls)
        if self.kube is not None and self.namespace:
            pods = await asyncio.to_thread(self.kube.list_pods, self.namespace, ROUTER_SELECTOR)
            urls += router_targets(pods)
        return urls

    async def _one(self, url: str) -> dict[observe.ServiceKey, observe.PodSample]:
        r = await get_once_more(self.client, url, timeout=self.timeout_s)
        if r.status_code != 200:
            raise observe.MetricsParseError(f"GET {url} answered {r.status_code}")
        return observe.parse_router(r.text, self.clock())

    async def observe(self) -> dict[observe.ServiceKey, policy.RouterObservation] | None:
        """Service -> the routers' observation; None when no router answered (or none exists)."""
        urls = await self.targets()
        results = await asyncio.gather(*(self._one(u) for u in urls), return_exceptions=True)
        pairs: dict[observe.ServiceKey, list[tuple[observe.PodSample | None, observe.PodSample]]] = {}
        answered = 0
        kept = {k: v for k, v in self._prev.items() if k[0] in urls}
        for url, res in zip(urls, results):
            if isinstance(res, BaseException):
                log.info("router %s not scraped: %r", url, res)
                continue
            answered += 1
            for svc, cur in res.items():
                pairs.setdefault(svc, []).append((self._prev.get((url, svc)), cur))
                kept[(url, svc)] = cur
        self._prev = kept
        if not answered:
            return None
        return {svc: observe.router_observation(ps) for svc, ps in pairs.items()}


# ------------------------------------------------------------------------------------------ Kubernetes
class Kube:
    """The few Kubernetes calls the autoscaler makes (synchronous; run in threads by the loop).

    RBAC it needs (e2e/autoscaler-rbac.yaml): inferenceservices get/list/watch, inferenceservices/
    status patch, inferenceservices/scale get/patch, pods list/patch, secrets get, events
    create/get/patch, leases get/create/update (all namespaces: get, the operators' namespace claims).
    """

    def __init__(self, api_client: Any | None = None) -> None:
        from kubernetes.dynamic import DynamicClient

        self.api_client = api_client or kube.load_config()
        self.dyn = DynamicClient(self.api_client)
        self.isvc = self.dyn.resources.get(api_version=crd.API_VERSION, kind=crd.KIND)
        self.pods = self.dyn.resources.get(api_version="v1", kind="Pod")
        self.secrets = self.dyn.resources.get(api_version="v1", kind="Secret")
        self.recorder = kube.EventRecorder(self.dyn.resources.get(api_version="v1", kind="Event"), COMPONENT)

    def list_isvcs(self, namespace: str | None) -> list[dict[str, Any]]:
        return self.isvc.get(namespace=namespace).to_dict().get("items") or []

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.pods.get(namespace=namespace, label_selector=selector).to_dict().get("items") or []

    def lease_event(self, lease: Mapping[str, Any], etype: str, reason: str, message: str) -> None:
        """An Event about a namespace's operator Lease (best effort)."""
        self.recorder.record({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": lease["metadata"]},
                             etype, reason, message)

    def operator_lease(self, namespace: str) -> dict[str, Any] | None:
        """The operator's namespace Lease (goodput.api.claims.LEASE_NAME), None when absent."""
        from kubernetes.client.exceptions import ApiException

        from goodput.api import claims
        try:
            return self.dyn.resources.get(api_version="coordination.k8s.io/v1", kind="Lease").get(
                name=claims.LEASE_NAME, namespace=namespace).to_dict()
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def admin_token(self, namespace: str, name: str) -> str | None:
        from kubernetes.client.exceptions import ApiException
        try:
            s = self.secrets.get(name=crd.admin_secret_name(name), namespace=namespace).to_dict()
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raw = (s.get("data") or {}).get(admin_api.ADMIN_TOKEN_KEY)
        return base64.b64decode(raw).decode() if raw else None

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self.isvc.scale.patch(body={"spec": {"replicas": replicas}}, name=name, namespace=namespace,
                              content_type="application/merge-patch+json")

    def scale_prefill(self, namespace: str, name: str, replicas: int) -> None:
        """``spec.disaggregation.prefill.replicas`` (a merge patch of that field only: the prefill
        pool has no scale subresource of its own)."""
        self.isvc.patch(body={"spec": {"disaggregation": {"prefill": {"replicas": replicas}}}}, name=name,
                        namespace=namespace, content_type="application/merge-patch+json")

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.isvc.status.patch(body={"status": patch}, name=name, namespace=namespace,
                               content_type="application/merge-patch+json")

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        """Merge ``annotations`` into the pod's (None removes one)."""
        self.pods.patch(body={"metadata": {"annotations": annotations}}, name=name, namespace=namespace,
                        content_type="application/merge-patch+json")

    def event(self, obj: Mapping[str, Any], etype: str, reason: str, message: str,
              series_key: str | None = None) -> None:
        self.recorder.record({"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": obj["metadata"]},
                             etype, reason, message, series_key)


# ------------------------------------------------------------------------------------------- the loop
def _stored_state(obj: Mapping[str, Any], pool: Pool) -> policy.PolicyState | None:
    """The pool's ``PolicyState`` as stored in its status record; None (fresh) when absent or
    unreadable (logged)."""
    stored = pool_record(obj.get("status") or {}, pool).get("policyState")
    if not stored:
        return None
    try:
        return policy.PolicyState.from_dict(stored)
    except (TypeError, ValueError, KeyError) as e:
        log.warning("%s/%s: stored %s policy state unreadable (%r); starting fresh", obj["metadata"]["namespace"],
                    obj["metadata"]["name"], pool.name, e)
        return None


class Autoscaler:
    """One reconcile pass per ``tick()``; ``run()`` ticks every ``period_s`` while it leads.

    ``kube``: a :class:`Kube` (or anything with its methods); ``source``: where samples come from.
    Per pod (by uid) it keeps the previous sample, so deltas span the time between two good scrapes.
    """

    def __init__(self, kube: Any, source: MetricsSource, http: httpx.AsyncClient, *,
                 namespace: str | Sequence[str] | None = None, period_s: float = 5.0,
                 metrics: AutoscalerMetrics | None = None,
                 wall_clock=time.time, dry_run: bool = False, routers: RouterScraper | None = None,
                 drain_unready_wait_s: float = 30.0, claims: Any = None):
        self.kube, self.source, self.http = kube, source, http
        # the namespaces another release owns are skipped (goodput.autoscaler.claims.NamespaceClaims;
        # None: every namespace listed is decided here)
        self.claims = claims
        # a scale-in waits up to this long for its drained pods to be reported unready (see apply)
        self.drain_unready_wait_s = drain_unready_wait_s
        self.routers = routers  # None: no router in front of the services (Observation.router None)
        self._router_view: dict[observe.ServiceKey, policy.RouterObservation] | None = None
        self.dry_run = dry_run  # observe, decide and plan; apply nothing
        # the namespaces it decides for (None: all); a str is one namespace
        self.namespaces: tuple[str, ...] | None = ((namespace,) if isinstance(namespace, str)
                                                   else None if namespace is None else tuple(namespace))
        self.period_s = period_s
        self.metrics = metrics
        self.wall_clock = wall_clock
        self._prev: dict[tuple[str, str, str], dict[str, observe.PodSample]] = {}  # (ns, name, pool) -> uid -> sample
        # (ns, name) -> prefill pods ordered and not ready at the prefill pool's last decision (rule 19)
        self._prefill_coming: dict[tuple[str, str], int] = {}
        self._tokens: dict[tuple[str, str], str] = {}

    async def run(self, stop: asyncio.Event, leading: Any = None) -> None:
        """Tick every ``period_s`` until ``stop`` is set; with ``leading`` (a callable -> bool, e.g.
        ``lease.LeaderElector.is_leader``) only while it returns True. A pass that starts leading
        forgets the previous samples (they may be a whole leadership old)."""
        was_leading = False
        while not stop.is_set():
            t0 = time.monotonic()
            lead = leading is None or leading()
            if lead and not was_leading:
                self._prev.clear()
            was_leading = lead
            if lead:
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
        if self.namespaces is None:
            objs = await asyncio.to_thread(self.kube.list_isvcs, None)
        else:
            objs = [o for n in self.namespaces for o in await asyncio.to_thread(self.kube.list_isvcs, n)]
        self._router_view = await self._observe_routers()
        todo = [o for o in objs if ((o.get("spec") or {}).get("autoscaling") or {}).get("enabled")
                and not o["metadata"].get("deletionTimestamp")]
        if self.claims is not None:
            namespaces = sorted({o["metadata"]["namespace"] for o in todo})
            mine = await asyncio.to_thread(lambda: {ns for ns in namespaces if self.claims.owns(ns)})
            todo = [o for o in todo if o["metadata"]["namespace"] in mine]
        self._forget_gone({(o["metadata"]["namespace"], o["metadata"]["name"]) for o in todo})
        results = await asyncio.gather(*(self.reconcile(o) for o in todo), return_exceptions=True)
        out = {}
        for o, r in zip(todo, results):
            key = (o["metadata"]["namespace"], o["metadata"]["name"])
            if isinstance(r, BaseException):
                log.error("autoscaling %s/%s failed: %r", *key, r)
            elif r is not None:
                out[key] = r
        return out

    def _forget_gone(self, live: set[tuple[str, str]]) -> None:
        """Drop what the loop keeps per service (previous samples, prefill pods coming, admin
        tokens) for every (namespace, name) not in ``live``: deleted, no longer autoscaled or no
        longer ours. Nothing then grows with service churn, and a service created again under the
        same name starts from nothing, not from its predecessor's last pass."""
        self._prev = {k: v for k, v in self._prev.items() if k[:2] in live}
        self._prefill_coming = {k: v for k, v in self._prefill_coming.items() if k in live}
        self._tokens = {k: v for k, v in self._tokens.items() if k in live}

    async def reconcile(self, obj: Mapping[str, Any]) -> policy.Decision | None:
        """observe -> decide -> plan -> apply (apply skipped by ``dry_run``); the decision, or None
        when the spec is not one to autoscale (invalid, or settings the policy refuses)."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        inputs = self._inputs(obj)
        if inputs is None:
            return None
        spec, pspec, state = inputs
        now = self.wall_clock()
        workers, *others = pools(name, spec)
        decision, plan, seen = await self._reconcile_pool(obj, spec, workers, pspec, state, now)
        for pool in others:  # the prefill pool: its own observation, policy state, record and writes
            p_decision, _, p_seen = await self._reconcile_pool(obj, spec, pool, pool_policy(pspec, spec, pool),
                                                               _stored_state(obj, pool), now)
            # what the workers' next decision reads as prefill capacity on its way (policy rule 19)
            self._prefill_coming[(ns, name)] = max(0, p_decision.replicas - len(p_seen.ready))
        if self.metrics:
            applied = plan.scale_to if plan.scale_to is not None else spec.replicas
            self.metrics.record(ns, name, dataclasses.replace(decision, limits=plan.limits),
                                decision.replicas if self.dry_run else applied, len(seen.ready), len(seen.starting))
        return dataclasses.replace(decision, limits=plan.limits, message=plan.message)

    async def _reconcile_pool(self, obj: Mapping[str, Any], spec: crd.InferenceServiceSpec, pool: Pool,
                              pspec: PolicySpec, state: policy.PolicyState | None,
                              now: float) -> tuple[policy.Decision, Plan, Observed]:
        """observe -> decide -> plan -> apply for one pool."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        seen = await self.observe(ns, name, spec, now, pool)
        decision = policy.decide(now, seen.observation, pspec, state)
        plan = make_plan(obj.get("status") or {}, spec, seen, decision, now, pool=pool)
        if self.dry_run:
            log.info("%s/%s %s (dry run): %s", ns, name, pool.name, plan)
        else:
            plan = await self.apply(obj, spec, seen, decision, plan, now, pool)
        return decision, plan, seen

    async def _observe_routers(self) -> dict[observe.ServiceKey, policy.RouterObservation] | None:
        if self.routers is None:
            return None
        try:
            return await self.routers.observe()
        except Exception as e:  # noqa: BLE001 - e.g. listing router pods failed: no router view this pass
            log.warning("routers not observed: %r", e)
            return None

    def _inputs(self, obj: Mapping[str, Any]) -> tuple[crd.InferenceServiceSpec, PolicySpec,
                                                       policy.PolicyState | None] | None:
        """The validated spec, the PolicySpec and the stored PolicyState; None (logged) when the
        object is not one to autoscale."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        try:
            spec = crd.InferenceServiceSpec.model_validate(obj.get("spec") or {})
            pspec = PolicySpec.from_crd(spec.model_dump(by_alias=True))
        except pydantic.ValidationError as e:
            log.warning("%s/%s: spec does not validate, not autoscaling it: %s", ns, name, e.errors()[:1])
            return None
        except ValueError as e:  # e.g. minReplicas > maxReplicas: the operator reports it as Degraded
            log.warning("%s/%s: autoscaling settings refused, not autoscaling it: %s", ns, name, e)
            return None
        return spec, pspec, _stored_state(obj, pools(name, spec)[0])

    async def observe(self, ns: str, name: str, spec: crd.InferenceServiceSpec, now: float,
                      pool: Pool | None = None) -> Observed:
        """List the pool's pods (default: the workers), scrape the ready ones, turn the scrapes into
        deltas (I/O)."""
        pool = pool or pools(name, spec)[0]
        pods = await asyncio.to_thread(self.kube.list_pods, ns, pool.selector)
        ready, starting = classify_pods(pods, now)
        gone = tuple(sorted((s.name, s.ip) for s in map(pod_state, pods) if s.draining and not s.terminating))
        samples = await self.source.samples(ns, ready) if ready else {}
        observations, unreachable, hits = [], [], {}
        prev = self._prev.get((ns, name, pool.name), {})
        kept: dict[str, observe.PodSample] = {}  # pods no longer ready are forgotten: fresh start
        for p in ready:
            s = samples.get(p.name)
            if isinstance(s, observe.PodSample):
                observations.append(observe.observation(p.name, prev.get(p.uid), s, p.age_s, load_s=p.load_s))
                hits[p.name] = observe.delta(prev.get(p.uid), s).counters.get("prefix_cache_hits", 0.0)
                kept[p.uid] = s
            else:
                unreachable.append(p.name)
                if p.uid in prev:
                    kept[p.uid] = prev[p.uid]  # the next good scrape's delta spans the gap
                log.info("%s/%s: pod %s unreachable: %r", ns, name, p.name, s)
                if self.metrics:
                    self.metrics.scrape_errors.labels(ns, name).inc()
        self._prev[(ns, name, pool.name)] = kept
        # the router's held and queued requests wait for the service's workers, not for its prefill pool
        router = None if self._router_view is None or pool.name == PREFILL else self._router_view.get(
            (ns, name), policy.RouterObservation(held=0, queued=0, refused=0.0))
        # the workers of a disaggregated service (policy rule 19): the prompts the routers had them
        # prefill in the prefill pool's place, and the prefill pods coming (the last pass's)
        disagg = pool.name != PREFILL and spec.disaggregation.enabled
        observation = policy.Observation(ready=tuple(observations), starting=tuple(starting),
                                         unreachable=tuple(unreachable), current_replicas=pool.replicas,
                                         router=router,
                                         prefill_fallback=router.pd_fallback if disagg and router else 0.0,
                                         prefill_coming=self._prefill_coming.get((ns, name), 0) if disagg else 0)
        return Observed(tuple(ready), tuple(starting), gone, samples, observation, hits)

    async def apply(self, obj: Mapping[str, Any], spec: crd.InferenceServiceSpec, seen: Observed,
                    decision: policy.Decision, plan: Plan, now: float, pool: Pool | None = None) -> Plan:
        """Carry out ``plan`` for ``pool`` (default: the workers) (I/O): drain, scale, push limits,
        patch status, post Events. Returns the plan that was applied (re-planned with the error when
        the scale write was refused)."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        pool = pool or pools(name, spec)[0]
        await asyncio.gather(*(self._drain(ns, name, p.name, p.ip, True) for p in plan.drain))
        await asyncio.gather(*(self._drain(ns, name, pod, ip, False) for pod, ip in plan.undrain))
        if plan.drain and plan.scale_to is not None:
            still = await self._await_unready(ns, name, {p.name for p in plan.drain}, pool.selector)
            if still:
                log.warning("%s/%s: drained pod(s) %s still Ready after %.0f s; lowering replicas anyway "
                            "(the ReplicaSet may remove another pod)", ns, name, ", ".join(sorted(still)),
                            self.drain_unready_wait_s)
        if plan.scale_to is not None:
            try:
                scale = self.kube.scale_prefill if pool.name == PREFILL else self.kube.scale
                await asyncio.to_thread(scale, ns, name, plan.scale_to)
                log.info("%s/%s: %s: %s", ns, name, decision.reason, plan.message)
            except Exception as e:  # noqa: BLE001 - reported as AbleToScale=False
                log.warning("%s/%s: scaling to %d failed: %r", ns, name, plan.scale_to, e)
                await asyncio.gather(*(self._drain(ns, name, p.name, p.ip, False) for p in plan.drain))
                plan = make_plan(obj.get("status") or {}, spec, seen, decision, now, scale_error=repr(e)[:300],
                                 pool=pool)
        await self._push_limits(ns, name, plan.pushes)
        if plan.status_patch:
            await asyncio.to_thread(self.kube.patch_status, ns, name, plan.status_patch)
        for ev in plan.events:
            try:
                await asyncio.to_thread(self.kube.event, obj, ev.type, ev.reason, ev.message, ev.series_key)
            except Exception as e:  # noqa: BLE001 - an Event is best effort; status already says it
                log.warning("%s/%s: could not post an Event: %r", ns, name, e)
        return plan

    async def _await_unready(self, ns: str, name: str, pods: set[str], selector: str) -> set[str]:
        """Poll the service's pods (every 0.5 s, at most ``drain_unready_wait_s``) until none of
        ``pods`` is Ready in the API; returns the ones still Ready. Why: the ReplicaSet picks the pod
        to delete from the API's view, and before Kubernetes 1.22 (no pod-deletion-cost) it removes
        unready pods first; the drained worker's ``/ready`` answers 503 at once, but the pod turns
        unready only at the kubelet's next readiness probe. Lowering replicas before that removes
        another, possibly busy, pod (k8s.io/kubernetes pkg/controller/replicaset, getPodsToDelete)."""
        deadline = time.monotonic() + self.drain_unready_wait_s
        while True:
            listed = await asyncio.to_thread(self.kube.list_pods, ns, selector)
            still = {s.name for s in map(pod_state, listed) if s.name in pods and s.ready and not s.terminating}
            if not still or time.monotonic() >= deadline:
                return still
            await asyncio.sleep(0.5)

    async def _token(self, ns: str, name: str, refresh: bool = False) -> str | None:
        key = (ns, name)
        if refresh or key not in self._tokens:
            tok = await asyncio.to_thread(self.kube.admin_token, ns, name)
            if tok is None:
                return None
            self._tokens[key] = tok
        return self._tokens[key]

    async def _admin(self, ns: str, name: str, method: str, url: str, body: Any = None) -> httpx.Response | None:
        """An admin call with the service's bearer token (read again once on a 401: the Secret was
        recreated); None when there is no token or the pod did not answer (logged)."""
        token = await self._token(ns, name)
        if token is None:
            log.warning("%s/%s: no admin Secret %s: cannot %s %s", ns, name, crd.admin_secret_name(name),
                        method, url)
            return None
        try:
            r = await self.http.request(method, url, json=body, headers=admin_api.bearer(token))
            if r.status_code == 401:
                fresh = await self._token(ns, name, refresh=True)
                r = await self.http.request(method, url, json=body, headers=admin_api.bearer(fresh or ""))
            if r.status_code != 200:
                log.warning("%s/%s: %s %s answered %d: %s", ns, name, method, url, r.status_code, r.text[:200])
            return r
        except httpx.HTTPError as e:
            log.warning("%s/%s: %s %s failed: %r", ns, name, method, url, e)
            return None

    async def _push_limits(self, ns: str, name: str, pushes: Sequence[LimitPush]) -> None:
        """PUT /admin/limits on each planned pod."""
        await asyncio.gather(*(self._admin(
            ns, name, "PUT", f"http://{u.pod.ip}:{crd.WORKER_PORT}{admin_api.LIMITS_PATH}",
            admin_api.limits_body(u.limits.max_num_seqs, u.limits.max_waiting, u.limits.max_waiting_tokens))
            for u in pushes))

    async def _drain(self, ns: str, name: str, pod: str, ip: str | None, on: bool) -> None:
        """Start (``on``) or undo a pod's drain: the annotations the router and the ReplicaSet read,
        then ``POST`` / ``DELETE /admin/drain`` on the worker (``ip`` None: only the annotations). Best
        effort: failures are logged."""
        ann = {crd.DRAINING_ANNOTATION: "true", DELETION_COST_ANNOTATION: DRAIN_DELETION_COST} if on else \
            {crd.DRAINING_ANNOTATION: None, DELETION_COST_ANNOTATION: None}
        try:
            await asyncio.to_thread(self.kube.annotate_pod, ns, pod, ann)
        except Exception as e:  # noqa: BLE001 - the drain call below still keeps new work off it
            log.warning("%s/%s: annotating pod %s failed: %r", ns, name, pod, e)
        if ip is not None:
            await self._admin(ns, name, "POST" if on else "DELETE",
                              f"http://{ip}:{crd.WORKER_PORT}{admin_api.DRAIN_PATH}")
