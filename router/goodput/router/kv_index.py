"""The exact per-pod index of the chunk keys each pod's prefix cache holds, from its KV events
(pure, stdlib only; ``goodput.api.kv_events`` is the wire format).

One :class:`PodKv` per pod that is in sync: the engine's instance id, the sequence number of the
last event applied and the keys held. :meth:`ExactIndex.reset` installs a snapshot;
:meth:`ExactIndex.apply` merges one event and says when the pod must be resynced instead (a
gap in the sequence, or another instance id: the engine restarted). A pod not in sync is absent:
the router's request-history index answers for it (``picker.PrefixIndex``). Memory: a set entry
per key and pod plus a reverse map entry per key (~100-150 bytes per key held).

Merge rules (event ``e`` for pod ``p`` in sync at (instance ``i``, sequence ``s``)):

==========================================  ==============================================
``e.instance != i``                          resync (``instance``); ``p`` dropped
``e.kind == heartbeat``, ``e.seq == s``      nothing (the stream is alive)
``e.kind == heartbeat``, ``e.seq != s``      resync (``gap``); ``p`` dropped
``e.seq <= s`` (not a heartbeat)             nothing (already applied: a replay)
``e.seq > s + 1``                            resync (``gap``); ``p`` dropped
``stored``                                   keys added, ``s = e.seq``
``evicted``                                  keys removed, ``s = e.seq``
``cleared``                                  every key removed, ``s = e.seq``
==========================================  ==============================================
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from goodput.api.kv_events import CLEARED, EVICTED, HEARTBEAT, STORED, KvEvent

__all__ = ["PodKv", "ExactIndex", "OK", "GAP", "INSTANCE"]

OK, GAP, INSTANCE = "ok", "gap", "instance"


@dataclass
class PodKv:
    """A pod in sync: ``instance`` (its engine's id), ``seq`` (last event applied), ``keys``."""

    instance: str
    seq: int
    keys: set[int] = field(default_factory=set)


class ExactIndex:
    """Pod name -> :class:`PodKv`, and key -> pods holding it (the picker's lookup)."""

    def __init__(self) -> None:
        self._pods: dict[str, PodKv] = {}
        self._by_key: dict[int, set[str]] = {}
        # read-only views for the picker's hot loop (PrefixIndex.match): pods in sync, key -> pods
        self.synced_pods = self._pods.keys()
        self.by_key = self._by_key

    # ---- reads ---------------------------------------------------------------------------------
    def synced(self, pod: str) -> bool:
        """Whether ``pod``'s keys are known (a snapshot installed and no gap since)."""
        return pod in self._pods

    def state(self, pod: str) -> PodKv | None:
        return self._pods.get(pod)

    def pods(self, key: int) -> frozenset[str] | set[str]:
        """Pods in sync holding ``key`` (do not mutate)."""
        return self._by_key.get(key, frozenset())

    def size(self, pod: str) -> int:
        """Keys ``pod`` holds (0 when not in sync)."""
        st = self._pods.get(pod)
        return len(st.keys) if st else 0

    def __len__(self) -> int:
        """Distinct keys held by any pod in sync."""
        return len(self._by_key)

    # ---- writes --------------------------------------------------------------------------------
    def _add(self, pod: str, st: PodKv, keys: Iterable[int]) -> None:
        for k in keys:
            if k not in st.keys:
                st.keys.add(k)
                self._by_key.setdefault(k, set()).add(pod)

    def _remove(self, pod: str, st: PodKv, keys: Iterable[int]) -> None:
        for k in keys:
            if k in st.keys:
                st.keys.discard(k)
                holders = self._by_key.get(k)
                if holders is not None:
                    holders.discard(pod)
                    if not holders:
                        del self._by_key[k]

    def drop(self, pod: str) -> None:
        """Forget ``pod`` (it left, or its stream broke): the history index answers for it."""
        st = self._pods.pop(pod, None)
        if st is not None:
            self._remove(pod, st, list(st.keys))

    def reset(self, pod: str, instance: str, seq: int, keys: Iterable[int]) -> None:
        """Install a snapshot: ``pod`` holds exactly ``keys`` after event ``seq`` of ``instance``."""
        self.drop(pod)
        st = self._pods[pod] = PodKv(instance, seq)
        self._add(pod, st, keys)

    def apply(self, pod: str, ev: KvEvent) -> str:
        """Merge ``ev`` (the module's table): :data:`OK`, or :data:`GAP` / :data:`INSTANCE` when
        ``pod`` was dropped and must be resynced from a snapshot. A pod not in sync: :data:`GAP`."""
        st = self._pods.get(pod)
        if st is None:
            return GAP
        if ev.instance != st.instance:
            self.drop(pod)
            return INSTANCE
        if ev.kind == HEARTBEAT:
            if ev.seq != st.seq:
                self.drop(pod)
                return GAP
            return OK
        if ev.seq <= st.seq:
            return OK
        if ev.seq != st.seq + 1:
            self.drop(pod)
            return GAP
        if ev.kind == STORED:
            self._add(pod, st, ev.keys)
        elif ev.kind == EVICTED:
            self._remove(pod, st, ev.keys)
        elif ev.kind == CLEARED:
            self._remove(pod, st, list(st.keys))
        st.seq = ev.seq
        return OK
