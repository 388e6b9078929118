"""Leader election with a ``coordination.k8s.io/v1`` Lease: of several autoscaler replicas only
the holder decides and writes; a standby takes over within a lease duration of the holder's last
renewal and resumes from the state in each InferenceService's status.

The rules are client-go's ``leaderelection`` package (k8s.io/client-go/tools/leaderelection), the
one kube-controller-manager and the scheduler use:

- a candidate reads the Lease every ``retry_period_s``. No Lease: it creates one naming itself.
  Its own: it renews (``renewTime`` = now). Someone else's: it waits, and takes over (new holder,
  ``acquireTime`` = now, ``leaseTransitions`` + 1) only when the record has not changed for
  ``leaseDurationSeconds`` **by the candidate's own clock** since it first saw that record (a
  holder's clock skew cannot steal or keep a lease), or when ``holderIdentity`` is empty (released);
- every write carries the ``resourceVersion`` read (optimistic concurrency: of two candidates
  writing the same record one gets 409 Conflict and stays a candidate);
- the holder leads while its last successful write is younger than ``renew_deadline_s`` (<
  the lease duration, so it stops before anyone can take over) and steps down otherwise;
- on a clean stop (SIGTERM) the holder releases the Lease (empty holder), so a standby takes over
  at its next retry instead of after a lease duration.

:func:`lease_step` is the rule as a pure function of (Lease record, what this candidate saw, now);
:class:`LeaderElector` is its I/O (the dynamic client in a thread). Times are Unix seconds (the
Lease's ``MicroTime`` fields on the wire).
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from goodput import kube

log = logging.getLogger("goodput.autoscaler.lease")

LEASE_DURATION_S = 15.0   # client-go's defaults (kube-controller-manager's too)
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 2.0


@dataclass(frozen=True)
class LeaseRecord:
    """A Lease's spec: ``holder`` (None = released), ``duration_s``, ``acquire_time``,
    ``renew_time`` (Unix seconds or None), ``transitions`` (times the holder changed)."""

    holder: str | None
    duration_s: float
    acquire_time: float | None
    renew_time: float | None
    transitions: int = 0


@dataclass(frozen=True)
class Seen:
    """The record a candidate last read and when, by its own clock, it first saw it."""

    record: LeaseRecord | None
    at: float


def lease_step(current: LeaseRecord | None, seen: Seen | None, me: str, now: float,
               duration_s: float) -> tuple[str, LeaseRecord | None, Seen]:
    """One election step: ``(action, record to write or None, what to remember)``.

    action: ``create`` (no Lease), ``renew`` (ours), ``takeover`` (expired or released), ``wait``
    (someone else holds it). ``now``: this candidate's clock (seconds); ``duration_s``: the lease
    duration this candidate writes.
    """
    if current is None:
        return "create", LeaseRecord(me, duration_s, now, now, 0), Seen(None, now)
    if seen is None or seen.record != current:
        seen = Seen(current, now)   # the record moved: its holder is alive (as of now)
    if current.holder == me:
        return "renew", replace(current, renew_time=now, duration_s=duration_s), seen
    if not current.holder or now >= seen.at + current.duration_s:
        return "takeover", LeaseRecord(me, duration_s, now, now, current.transitions + 1), seen
    return "wait", None, seen


def _micro(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def to_spec(r: LeaseRecord) -> dict[str, Any]:
    """A Lease ``spec`` (camelCase, MicroTime strings)."""
    return {"holderIdentity": r.holder, "leaseDurationSeconds": int(round(r.duration_s)),
            "acquireTime": _micro(r.acquire_time), "renewTime": _micro(r.renew_time),
            "leaseTransitions": r.transitions}


def from_spec(spec: Mapping[str, Any] | None) -> LeaseRecord:
    spec = spec or {}
    return LeaseRecord(holder=spec.get("holderIdentity") or None,
                       duration_s=float(spec.get("leaseDurationSeconds") or LEASE_DURATION_S),
                       acquire_time=kube.parse_time(spec.get("acquireTime")),
                       renew_time=kube.parse_time(spec.get("renewTime")),
                       transitions=int(spec.get("leaseTransitions") or 0))


def identity() -> str:
    """This process's holder identity: ``<pod or host name>_<8 hex digits>`` (unique per process,
    so two instances on one host are two candidates)."""
    return f"{kube.instance_name()}_{uuid.uuid4().hex[:8]}"


class LeaseAPI:
    """Lease get/create/patch through the dynamic client (synchronous; RBAC: leases get, create,
    patch in the Lease's namespace)."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes.dynamic import DynamicClient

        self.leases = DynamicClient(api_client).resources.get(api_version="coordination.k8s.io/v1", kind="Lease")

    def get(self, namespace: str, name: str) -> tuple[LeaseRecord, str] | None:
        """(record, resourceVersion), or None when there is no such Lease."""
        from kubernetes.client.exceptions import ApiException
        try:
            obj = self.leases.get(name=name, namespace=namespace).to_dict()
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return from_spec(obj.get("spec")), obj["metadata"]["resourceVersion"]

    def create(self, namespace: str, name: str, record: LeaseRecord) -> None:
        self.leases.create(namespace=namespace, body={
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace}, "spec": to_spec(record)})

    def write(self, namespace: str, name: str, record: LeaseRecord, resource_version: str) -> None:
        """Merge-patch the spec, refused with 409 unless the Lease is still at ``resource_version``."""
        self.leases.patch(name=name, namespace=namespace, content_type="application/merge-patch+json",
                          body={"metadata": {"resourceVersion": resource_version}, "spec": to_spec(record)})


class LeaderElector:
    """Runs :func:`lease_step` every ``retry_period_s`` against one Lease; :meth:`is_leader` says
    whether this instance may write now. ``api``: a :class:`LeaseAPI` (or a fake with its methods);
    ``clock``: seconds (wall clock: the Lease's times are written with it)."""

    def __init__(self, api: Any, namespace: str, name: str, me: str | None = None, *,
                 lease_duration_s: float = LEASE_DURATION_S, renew_deadline_s: float = RENEW_DEADLINE_S,
                 retry_period_s: float = RETRY_PERIOD_S, clock: Callable[[], float] = time.time):
        if not 0 < retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError(f"need 0 < retry period ({retry_period_s}) < renew deadline ({renew_deadline_s}) "
                             f"< lease duration ({lease_duration_s})")
        self.api, self.namespace, self.name = api, namespace, name
        self.me = me or identity()
        self.lease_duration_s, self.renew_deadline_s, self.retry_period_s = (
            lease_duration_s, renew_deadline_s, retry_period_s)
        self.clock = clock
        self._seen: Seen | None = None
        self._renewed: float | None = None   # our last successful write
        self.holder: str | None = None        # as last read

    def is_leader(self) -> bool:
        return self._renewed is not None and self.clock() - self._renewed < self.renew_deadline_s

    def try_once(self) -> bool:
        """One read and at most one write (synchronous); returns :meth:`is_leader` after it."""
        from kubernetes.client.exceptions import ApiException

        was = self.is_leader()
        try:
            got = self.api.get(self.namespace, self.name)
            current, rv = got if got is not None else (None, None)
            now = self.clock()
            action, record, self._seen = lease_step(current, self._seen, self.me, now, self.lease_duration_s)
            self.holder = current.holder if current else None
            if action == "create":
                self.api.create(self.namespace, self.name, record)
            elif action in ("renew", "takeover"):
                self.api.write(self.namespace, self.name, record, rv)
            if record is not None:
                self._renewed, self.holder = now, self.me
                self._seen = Seen(record, now)
        except ApiException as e:   # 409: another candidate wrote first; others: the API is down
            log.info("lease %s/%s: %s %s", self.namespace, self.name, e.status, e.reason)
        if self.is_leader() != was:
            log.warning("%s leadership of lease %s/%s as %s", "acquired" if not was else "lost",
                        self.namespace, self.name, self.me)
        return self.is_leader()

    def release(self) -> None:
        """Give the Lease up (empty holder) if we hold it: a standby takes over at its next retry."""
        if not self.is_leader():
            return
        try:
            got = self.api.get(self.namespace, self.name)
            if got is not None and got[0].holder == self.me:
                self.api.write(self.namespace, self.name, replace(got[0], holder=None), got[1])
        except Exception as e:  # noqa: BLE001 - best effort: the lease expires anyway
            log.warning("lease %s/%s: release failed: %r", self.namespace, self.name, e)
        self._renewed = None

    async def run(self, stop: asyncio.Event) -> None:
        """Try every ``retry_period_s`` until ``stop``; then release."""
        while not stop.is_set():
            await asyncio.to_thread(self.try_once)
            try:
                await asyncio.wait_for(stop.wait(), self.retry_period_s)
            except asyncio.TimeoutError:
                pass
        await asyncio.to_thread(self.release)
