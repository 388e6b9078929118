"""One autoscaler per InferenceService when two releases overlap: the operators' namespace rule.

Releases of the chart can overlap: one for all namespaces and some for a few namespaces each, or
two namespaced ones listing the same namespace. The operators partition by a Lease per namespace
(``goodput.api.claims``: a namespaced operator claims its namespace with the Lease
``goodput-operator`` there, writing its release on it; the all-namespaces one skips every
namespace whose Lease has a live holder). The autoscalers follow the same Lease, so a service gets
decisions from exactly one of them while that Lease is live:

- an all-namespaces autoscaler skips every namespace whose operator Lease has a live holder (a
  namespaced release owns it), and takes the namespace back when that Lease lapses (the
  namespaced release is uninstalled or stops);
- a namespaced autoscaler (``--namespace NS``, its release from ``--release`` /
  ``$GOODPUT_RELEASE``) decides for NS unless the Lease there is held by the operator of *another*
  release (``goodput.api.claims.release_decides``): the second release installed for a namespace
  stands down there, and takes it over with the Lease.

Each change of mind is a log line and an Event on the Lease (``notify``): Warning ``StandingDown``
when a namespaced autoscaler yields to another release, Normal ``NamespaceClaimed`` when an
all-namespaces one yields to a namespaced release (that is the rule working), Normal ``Deciding``
when it takes a namespace back. A Lease it cannot read (a 403 from RBAC that predates this rule)
counts as unclaimed: the namespace is decided here, as before, with one warning. Reads are cached
``cache_s`` seconds per namespace.
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


def stand_down_message(namespace: str, lease: dict[str, Any] | None, now: datetime.datetime, *,
                       namespaced: bool, release: str | None) -> str:
    """The log line and Event message of an autoscaler that does not decide for ``namespace``
    (``lease`` has a live holder). Pure."""
    holder = claims.live_holder(lease, now)
    theirs = claims.release_of(lease) or "unknown"
    where = f"Lease {namespace}/{claims.LEASE_NAME}"
    if namespaced:
        return (f"the goodput autoscaler of release {release} stands down in namespace {namespace}: the operator "
                f"{holder} of release {theirs} holds {where}, so release {theirs}'s autoscaler decides there; "
                "this one takes over if that Lease lapses")
    return (f"namespace {namespace} is claimed by a namespaced goodput release ({theirs}, operator {holder}, "
            f"{where}): its autoscaler decides there, not this all-namespaces one")


class NamespaceClaims:
    """An autoscaler's view of the operators' namespace claims.

    ``read_lease(namespace)``: the operator Lease of ``namespace`` as a dict (None when absent);
    may raise (an API error: the namespace counts as unclaimed). ``namespaced``: this autoscaler
    was given exact namespaces (the rule of :func:`goodput.api.claims.release_decides` with
    ``release``, its own); else it watches all namespaces (:func:`owned`). ``notify(lease, type,
    reason, message)``: an Event about the Lease at each change of mind (None: log only).
    ``clock``: monotonic seconds for the cache; ``now``: the wall clock, aware UTC, for the
    Lease's times.
    """

    def __init__(self, read_lease: Callable[[str], dict[str, Any] | None], cache_s: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.timezone.utc), *,
                 namespaced: bool = False, release: str | None = None,
                 notify: Callable[[dict[str, Any], str, str, str], None] | None = None):
        self.read_lease, self.cache_s, self.clock, self.now = read_lease, cache_s, clock, now
        self.namespaced, self.release, self.notify = namespaced, release, notify
        self._seen: dict[str, tuple[float, bool, str | None]] = {}  # ns -> (read at, owned, holder)
        self._warned: set[str] = set()

    def owns(self, namespace: str) -> bool:
        """Whether this autoscaler decides for ``namespace`` now (I/O: reads the Lease at most
        every ``cache_s``)."""
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
        mine = (claims.release_decides(lease, self.release, now) if self.namespaced
                else owned(namespace, lease, now))
        holder = None if mine else claims.live_holder(lease, now)
        if seen is None or (seen[1], seen[2]) != (mine, holder):
            if not mine:
                message = stand_down_message(namespace, lease, now, namespaced=self.namespaced, release=self.release)
                log.warning("%s", message)
                self._event(lease, "Warning" if self.namespaced else "Normal",
                            "StandingDown" if self.namespaced else "NamespaceClaimed", message)
            elif seen is not None and not seen[1]:
                message = (f"namespace {namespace}: Lease {namespace}/{claims.LEASE_NAME} lapsed or is this "
                           f"release's now: the goodput autoscaler (release {self.release or 'unknown'}) "
                           "decides for it again")
                log.warning("%s", message)
                self._event(lease, "Normal", "Deciding", message)
        self._seen[namespace] = (t, mine, holder)
        return mine

    def _event(self, lease: dict[str, Any] | None, etype: str, reason: str, message: str) -> None:
        if self.notify is None or not ((lease or {}).get("metadata") or {}).get("name"):
            return
        try:
            self.notify(lease, etype, reason, message)
        except Exception as e:  # noqa: BLE001 - an Event is best effort; the log line says it
            log.warning("could not post event %s: %r", reason, e)
