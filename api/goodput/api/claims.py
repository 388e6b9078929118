"""Pure: which operator reconciles a namespace when releases overlap (one Lease per namespace).

The rule (docs/kubernetes.md, "Namespaced mode and two releases"): **a namespaced operator owns the namespaces it lists.**

- An operator started with exact ``--namespace`` names claims each of them with a
  ``coordination.k8s.io/v1`` Lease named :data:`LEASE_NAME` in that namespace, renewed every
  :data:`RENEW_SECONDS` for :data:`LEASE_SECONDS`. It reconciles a namespace only while it holds
  that Lease; a second namespaced operator for the same namespace stands by until the holder's
  Lease expires (an operator that stops releases its Leases, so the next takes over at once).
- An all-namespaces operator takes no Lease and skips every namespace whose Lease is held by a live
  holder: the namespaced release wins there, and the all-namespaces one takes the namespace back
  when that Lease lapses (the namespaced release is uninstalled or stops).

- **Two namespaced releases for the same namespace** (the chart installed twice, both listing it):
  the operators settle it by the Lease (one holds it, the other stands by); the autoscalers follow
  their release's operator. Each operator writes its release (``<release namespace>/<release
  name>``, from :data:`RELEASE_ENV`, which the chart sets) on the Lease it holds, annotation
  :data:`RELEASE_ANNOTATION`; a namespaced autoscaler decides for a namespace unless a live holder
  of *another* release holds its Lease (:func:`release_decides`). The one that stands down says so
  in its log and in an Event on the Lease, and takes the namespace back if that Lease lapses.

A Lease is live while ``renewTime + leaseDurationSeconds`` is in the future, as in Kubernetes'
leader election (client-go ``tools/leaderelection``; Lease fields: core API
``coordination.k8s.io/v1`` LeaseSpec). Times are ``datetime`` in UTC; the API's MicroTime is
RFC 3339 with microseconds (``2026-12-01T15:04:05.123456Z``).
"""

from __future__ import annotations

import datetime
from typing import Any

LEASE_NAME = "goodput-operator"
# The release (``<release namespace>/<release name>``) of the operator holding the Lease.
RELEASE_ANNOTATION = "serving.goodput.dev/release"
# Where the operator and the autoscaler read their release from (the chart sets it on both).
RELEASE_ENV = "GOODPUT_RELEASE"
LEASE_SECONDS = 15
RENEW_SECONDS = 5
_FMT = "%Y-%m-%dT%H:%M:%S.%fZ"


def micro_time(t: datetime.datetime) -> str:
    """``t`` (UTC) as a Kubernetes MicroTime string."""
    return t.astimezone(datetime.timezone.utc).strftime(_FMT)


def parse_time(text: str | None) -> datetime.datetime | None:
    """A MicroTime or Time string (with or without fractional seconds) as an aware UTC datetime."""
    if not text:
        return None
    for fmt in (_FMT, "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.datetime.strptime(text, fmt).replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            continue
    return None


def live_holder(lease: dict[str, Any] | None, now: datetime.datetime) -> str | None:
    """The identity holding ``lease`` (a Lease as a dict, camelCase spec) at ``now``, or None when it
    is absent, released (no holder) or expired (``renewTime + leaseDurationSeconds <= now``)."""
    spec = (lease or {}).get("spec") or {}
    holder = spec.get("holderIdentity")
    renewed = parse_time(spec.get("renewTime"))
    if not holder or renewed is None:
        return None
    if renewed + datetime.timedelta(seconds=int(spec.get("leaseDurationSeconds") or 0)) <= now:
        return None
    return holder


def claim(lease: dict[str, Any] | None, identity: str, now: datetime.datetime) -> dict[str, Any] | None:
    """The Lease spec that claims (or renews) the namespace for ``identity``, or None when another live
    holder has it. ``acquireTime`` moves and ``leaseTransitions`` counts up only when the holder changes."""
    holder = live_holder(lease, now)
    if holder is not None and holder != identity:
        return None
    spec = (lease or {}).get("spec") or {}
    same = spec.get("holderIdentity") == identity
    transitions = int(spec.get("leaseTransitions") or 0)
    return {"holderIdentity": identity, "leaseDurationSeconds": LEASE_SECONDS,
            "acquireTime": spec.get("acquireTime") if same and spec.get("acquireTime") else micro_time(now),
            "renewTime": micro_time(now),
            "leaseTransitions": transitions if same or lease is None else transitions + 1}


def release(lease: dict[str, Any] | None, identity: str) -> dict[str, Any] | None:
    """The Lease spec that gives the namespace up (no holder), or None when ``identity`` does not hold it."""
    spec = (lease or {}).get("spec") or {}
    if spec.get("holderIdentity") != identity:
        return None
    return {**spec, "holderIdentity": None}


def owns(namespace: str, *, namespaced: bool, claimed: set[str] | frozenset[str],
         other_holder: str | None) -> bool:
    """Whether this operator reconciles objects in ``namespace``.

    ``namespaced``: it was started with exact namespace names (and then reconciles only the ones whose
    Lease it holds: ``claimed``); otherwise it watches all namespaces and yields each one whose Lease
    has a live holder (``other_holder``).
    """
    if namespaced:
        return namespace in claimed
    return other_holder is None


def release_of(lease: dict[str, Any] | None) -> str | None:
    """The release written on ``lease`` (annotation :data:`RELEASE_ANNOTATION`), None when absent or empty."""
    annotations = ((lease or {}).get("metadata") or {}).get("annotations") or {}
    return annotations.get(RELEASE_ANNOTATION) or None


def lease_body(namespace: str, spec: dict[str, Any], release: str | None,
               resource_version: str | None = None) -> dict[str, Any]:
    """The whole Lease object an operator writes to claim, renew or release ``namespace``: ``spec`` (from
    :func:`claim` or :func:`release`), its release as annotation :data:`RELEASE_ANNOTATION` (none when
    ``release`` is None or empty) and, to replace an existing Lease, its ``resource_version``."""
    meta: dict[str, Any] = {"name": LEASE_NAME, "namespace": namespace}
    if release:
        meta["annotations"] = {RELEASE_ANNOTATION: release}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


def release_decides(lease: dict[str, Any] | None, release: str | None, now: datetime.datetime) -> bool:
    """Whether a namespaced autoscaler of ``release`` decides for the namespace whose operator Lease is
    ``lease`` at ``now``: False only when a live holder's release is known and is another one. True when
    nobody holds the Lease (absent, released, expired), when it is held by ``release``'s own operator, or
    when either release is unknown (an operator or autoscaler started without :data:`RELEASE_ENV`:
    nothing to compare, so as before the rule)."""
    if live_holder(lease, now) is None:
        return True
    theirs = release_of(lease)
    return not release or not theirs or theirs == release
