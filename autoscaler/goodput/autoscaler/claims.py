"""One autoscaler per InferenceService when two releases overlap: the operators' namespace rule.

Two releases of the chart can overlap: one for all namespaces and one for a single namespace. The
operators already partition by a Lease per namespace (``goodput.api.claims``: a namespaced
operator claims its namespace with the Lease ``goodput-operator`` there; the all-namespaces one
skips every namespace whose Lease has a live holder). The autoscalers follow the same rule, so a
service gets decisions from exactly one of them:

- a namespaced autoscaler (``--namespace NS``) decides for the services of NS (its release's
  operator claims NS);
- an all-namespaces autoscaler skips every namespace whose operator Lease has a live holder (a
  namespaced release owns it), and takes the namespace back when that Lease lapses (the
  namespaced release is uninstalled or stops).

A Lease it cannot read (a 403 from RBAC that predates this rule) counts as unclaimed: the
namespace is decided here, as before, with one warning. Reads are cached ``cache_s`` seconds per
namespace.
"""
from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from goodput.api import claims

log = logging.getLogger("goodput.autoscaler")

CACHE_S = 5.0


def owned(namespace: str, lease: dict[str, Any] | None, now: datetime.datetime) -> bool:
    """Whether an all-namespaces autoscaler decides for ``namespace`` whose operator Lease is
    ``lease`` (a dict, camelCase spec; None: none) at ``now`` (aware UTC). Pure."""
    return claims.owns(namespace, namespaced=False, claimed=frozenset(),
                       other_holder=claims.live_holder(lease, now))


class NamespaceClaims:
    """The all-namespaces autoscaler's view of the namespaced releases' claims.

    ``read_lease(namespace)``: the operator Lease of ``namespace`` as a dict (None when absent);
    may raise (an API error: the namespace counts as unclaimed). ``clock``: monotonic seconds for
    the cache; ``now``: the wall clock, aware UTC, for the Lease's times.
    """

    def __init__(self, read_lease: Callable[[str], dict[str, Any] | None], cache_s: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.timezone.utc)):
        self.read_lease, self.cache_s, self.clock, self.now = read_lease, cache_s, clock, now
        self._seen: dict[str, tuple[float, bool, str | None]] = {}  # ns -> (read at, owned, holder)
        self._warned: set[str] = set()

    def owns(self, namespace: str) -> bool:
        """Whether this (all-namespaces) autoscaler decides for ``namespace`` now (I/O: reads
        the Lease at most every ``cache_s``)."""
        t = self.clock()
        seen = self._seen.get(namespace)
        if seen is not None and t - seen[0] < self.cache_s:
            return seen[1]
        try:
            lease = self.read_lease(namespace)
        except Exception as e:  # noqa: BLE001 - e.g. 403: no partition, decide as before
            if namespace not in self._warned:
                self._warned.add(namespace)
                log.warning("cannot read Lease %s/%s (%r): deciding for the namespace", namespace,
                            claims.LEASE_NAME, e)
            lease = None
        now = self.now()
        mine = owned(namespace, lease, now)
        holder = None if mine else claims.live_holder(lease, now)
        if seen is None or (seen[1], seen[2]) != (mine, holder):
            if not mine:
                log.warning("namespace %s is claimed by a namespaced goodput release (operator %s, Lease %s/%s): "
                            "its autoscaler decides there, not this one", namespace, holder, namespace,
                            claims.LEASE_NAME)
            elif seen is not None:
                log.warning("namespace %s is no longer claimed (Lease %s/%s lapsed): deciding for it again",
                            namespace, namespace, claims.LEASE_NAME)
        self._seen[namespace] = (t, mine, holder)
        return mine
