"""What a pod's state means to goodput, read in one place (pure; pods as the API returns them).

Every deployable that looks at worker or router pods asks :func:`pod_state`: the autoscaler (which
pods are ready, starting, going away; the drain wait), the router's Kubernetes discovery (which pods
may take a request) and the operator's status (a pod being deleted is never failing). The rules:

- ``ready``: the pod's ``Ready`` condition is ``"True"`` (its readiness probe passes);
- ``terminating``: ``metadata.deletionTimestamp`` is set (it is being deleted);
- ``draining``: annotation ``serving.goodput.dev/draining: "true"`` (set by the autoscaler before a
  scale-in; docs/router-autoscaler-contract.md, "Scale-in");
- ``finished``: phase ``Succeeded`` or ``Failed`` (its containers will not run again);
- ``serving`` (a property): ready, with a pod IP, and none of the three above: the only pods that
  receive new requests, and the only ones whose metrics describe capacity that stays.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from goodput.api.crd import DRAINING_ANNOTATION


@dataclass(frozen=True)
class PodState:
    """One pod's state. ``ip``: ``status.podIP`` (None before it has one). ``ready_since``: the
    Ready condition's ``lastTransitionTime`` (RFC 3339; None when unknown). ``created``:
    ``metadata.creationTimestamp`` (RFC 3339; None when unknown)."""

    name: str
    ip: str | None
    ready: bool
    terminating: bool
    draining: bool
    finished: bool
    ready_since: str | None = None
    created: str | None = None

    @property
    def going(self) -> bool:
        """Capacity that is going away: terminating, draining or finished."""
        return self.terminating or self.draining or self.finished

    @property
    def serving(self) -> bool:
        """Ready, with a pod IP, and not going away: it may take new requests."""
        return self.ready and bool(self.ip) and not self.going


def pod_state(pod: Mapping[str, Any]) -> PodState:
    """A pod (a camelCase dict as the API returns it) -> its :class:`PodState`. Missing fields read
    as absent (not ready, no IP, not terminating)."""
    meta, st = pod.get("metadata") or {}, pod.get("status") or {}
    cond = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), None) or {}
    return PodState(
        name=meta.get("name") or "", ip=st.get("podIP") or None, ready=cond.get("status") == "True",
        terminating=bool(meta.get("deletionTimestamp")),
        draining=(meta.get("annotations") or {}).get(DRAINING_ANNOTATION) == "true",
        finished=st.get("phase") in ("Succeeded", "Failed"),
        ready_since=cond.get("lastTransitionTime"), created=meta.get("creationTimestamp"))


__all__ = ["PodState", "pod_state"]
