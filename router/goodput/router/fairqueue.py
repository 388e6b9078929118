"""The router's fleet queue: strict priority bands, fair turns between tenants within a band, and
a bound that drops from the longest tenant queue first (pure, stdlib only; no clock, no I/O).

- **Bands.** ``priority`` is the request's (lower first, as the worker); a band is served only
  when every better band is empty.
- **Tenants.** Within a band each tenant (a fairness id: the router's ``x-goodput-tenant``
  header, else the OpenAI body's ``user``, else ``""``, one shared anonymous tenant) has its own
  FIFO. The next entry is the head of the backlogged tenant served longest ago in that band (a
  tenant that has not been served since it last had nothing queued counts as never served;
  ties: the earlier head). Backlogged tenants thus take turns one entry each, as round-robin
  (deficit round-robin with equal quanta): a tenant flooding the queue gets one turn per
  round however much it queues, and a light tenant's entry waits at most one round.
- **Bound.** The caller bounds the queue; when it is full, :meth:`FairQueue.victim` names the
  entry a newcomer may replace: in the newcomer's band, the newest entry of the tenant with the
  most entries when that tenant holds at least two more than the newcomer's (it still holds as
  many after the swap): the flooder, not the newcomer, is refused. Other bands are never
  touched (a full queue refuses a newcomer of any band whose own band has no heavier tenant).

Entries are removed by identity (:meth:`FairQueue.remove`: a timeout, a client gone).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["Entry", "FairQueue", "ANONYMOUS"]

ANONYMOUS = ""


@dataclass(eq=False)
class Entry:
    """One queued request: the caller's ``item``, its ``priority`` band, ``tenant`` and arrival
    order ``seq`` (unique, increasing)."""

    item: Any
    priority: int
    tenant: str
    seq: int


class FairQueue:
    """Bands of per-tenant FIFOs (module doc). ``len()`` is the number of entries."""

    def __init__(self) -> None:
        self._bands: dict[int, dict[str, deque[Entry]]] = {}
        self._served: dict[tuple[int, str], int] = {}  # (band, tenant) -> the turn it was last served
        self._turns = itertools.count(1)
        self._seq = itertools.count()
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Entry]:
        """Every entry, in no particular order."""
        for tenants in self._bands.values():
            for q in tenants.values():
                yield from q

    def push(self, item: Any, priority: int = 0, tenant: str = ANONYMOUS) -> Entry:
        """Queue ``item`` at the tail of ``tenant``'s FIFO in band ``priority``; returns its entry."""
        e = Entry(item, priority, tenant, next(self._seq))
        self._bands.setdefault(priority, {}).setdefault(tenant, deque()).append(e)
        self._n += 1
        return e

    def count(self, tenant: str, priority: int) -> int:
        """Entries of ``tenant`` in band ``priority``."""
        q = self._bands.get(priority, {}).get(tenant)
        return len(q) if q else 0

    def peek(self) -> Entry | None:
        """The entry :meth:`pop` would return; None when empty."""
        if not self._n:
            return None
        band = min(self._bands)
        served = self._served
        tenant = min(self._bands[band].items(), key=lambda tq: (served.get((band, tq[0]), 0), tq[1][0].seq))[0]
        return self._bands[band][tenant][0]

    def pop(self) -> Entry:
        """Remove and return the next entry (module doc: best band, then the tenant served longest
        ago, then its oldest entry); the tenant's turn in that band is now. IndexError when empty."""
        e = self.peek()
        if e is None:
            raise IndexError("pop from an empty FairQueue")
        self._served[(e.priority, e.tenant)] = next(self._turns)
        self._unlink(e)
        return e

    def remove(self, e: Entry) -> bool:
        """Remove ``e`` if it is still queued (True), else False."""
        q = self._bands.get(e.priority, {}).get(e.tenant)
        if not q or not any(x is e for x in q):
            return False
        self._unlink(e)
        return True

    def victim(self, tenant: str, priority: int) -> Entry | None:
        """When the queue is full: the entry a newcomer of ``tenant`` in band ``priority`` replaces
        (module doc, "Bound"), or None (the newcomer is refused)."""
        band = self._bands.get(priority)
        if not band:
            return None
        heavy = max(band.values(), key=lambda q: (len(q), q[-1].seq))
        if len(heavy) > self.count(tenant, priority) + 1:
            return heavy[-1]
        return None

    def _unlink(self, e: Entry) -> None:
        tenants = self._bands[e.priority]
        q = tenants[e.tenant]
        if q[0] is e:
            q.popleft()
        else:
            q.remove(e)
        self._n -= 1
        if not q:
            del tenants[e.tenant]
            self._served.pop((e.priority, e.tenant), None)
            if not tenants:
                del self._bands[e.priority]
