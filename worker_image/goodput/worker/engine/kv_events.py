"""The prefix cache's events, as the router's chunk keys (torch-free, no I/O).

The server ties each request's router chunk keys (``goodput.api.prefix``) to the hash of the KV
block that completes the chunk (:meth:`KvEventLog.annotate`); the :class:`BlockManager` tells
the log when a block hash enters its prefix cache (:meth:`KvEventLog.block_stored`) and when it
leaves (:meth:`KvEventLog.block_evicted`). The log keeps, per chunk key, how many cached blocks
tie it, and records an event when a key's count goes 0 -> 1 (``stored``) or 1 -> 0
(``evicted``), numbered 1, 2, ... in a bounded ring that the server streams
(``goodput.api.kv_events``). The step pays one dict lookup per newly cached or evicted block
(a block nobody annotated: nothing else); annotated blocks take a lock shared with the server
thread for O(keys). No I/O, no allocation beyond the ring and the annotations, both bounded.

Threads: the engine thread calls ``block_*``, the server's threads call ``annotate``, ``since``
and ``snapshot``. The block manager updates its cache map before it calls the log, and
``annotate`` asks the map (``is_cached``) under the log's lock, so a block cached while it was
being annotated is counted exactly once.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Callable, Iterable, Sequence

from goodput.api.kv_events import CLEARED, EVICTED, STORED

__all__ = ["KvEventLog", "block_ties", "token_ends_from_offsets"]


class _Ann:
    """An annotated block: the chunk keys it completes, and whether it is in the cache (live)."""

    __slots__ = ("keys", "live")

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.live = False


class KvEventLog:
    """Bounded log of chunk-key events of one engine.

    capacity: events the ring keeps (older ones are gone: a reader behind them resyncs from
        :meth:`snapshot`); >= 1.
    max_annotations: annotated block hashes kept (least recently annotated dropped beyond, a
        live one with an ``evicted`` for the keys only it held); >= 1.
    is_cached: block hash -> whether it is in the prefix cache now (set by
        ``BlockManager.attach_kv_events``; until then nothing is cached).
    """

    def __init__(self, capacity: int = 65536, max_annotations: int = 262144,
                 is_cached: Callable[[bytes], bool] | None = None) -> None:
        if capacity < 1 or max_annotations < 1:
            raise ValueError(f"capacity and max_annotations must be >= 1, got {capacity}, {max_annotations}")
        self.capacity, self.max_annotations = capacity, max_annotations
        self.is_cached: Callable[[bytes], bool] = is_cached or (lambda h: False)
        self._lock = threading.Lock()
        self._ring: deque[tuple[int, str, tuple[int, ...]]] = deque(maxlen=capacity)
        self._ann: OrderedDict[bytes, _Ann] = OrderedDict()
        self._held: dict[int, int] = {}  # chunk key -> live blocks tying it (> 0)
        self.seq = 0
        self.events_total = {STORED: 0, EVICTED: 0, CLEARED: 0}  # events recorded, by kind
        self.keys_total = {STORED: 0, EVICTED: 0}  # keys in them

    # ---- under the lock --------------------------------------------------------------------
    def _emit(self, kind: str, keys: tuple[int, ...]) -> None:
        self.seq += 1
        self._ring.append((self.seq, kind, keys))
        self.events_total[kind] += 1
        if kind in self.keys_total:
            self.keys_total[kind] += len(keys)

    def _up(self, keys: Iterable[int]) -> list[int]:
        new = []
        for k in keys:
            n = self._held.get(k, 0)
            self._held[k] = n + 1
            if n == 0:
                new.append(k)
        return new

    def _down(self, keys: Iterable[int]) -> list[int]:
        gone = []
        for k in keys:
            n = self._held.get(k, 0)
            if n <= 1:
                if n == 1:
                    del self._held[k]
                    gone.append(k)
            else:
                self._held[k] = n - 1
        return gone

    # ---- the server ------------------------------------------------------------------------
    def annotate(self, ties: Iterable[tuple[bytes, int]]) -> None:
        """Tie chunk keys to block hashes: ``(block hash, chunk key)`` pairs (a request's, in
        chain order). A key tied to a block already in the cache is stored at once."""
        with self._lock:
            stored: list[int] = []
            for h, key in ties:
                a = self._ann.get(h)
                if a is None:
                    a = self._ann[h] = _Ann()
                else:
                    self._ann.move_to_end(h)
                if key in a.keys:
                    continue
                a.keys.add(key)
                if a.live:
                    stored += self._up((key,))
                elif self.is_cached(h):
                    a.live = True
                    stored += self._up(a.keys)
            evicted: list[int] = []
            while len(self._ann) > self.max_annotations:
                _, old = self._ann.popitem(last=False)
                if old.live:
                    evicted += self._down(old.keys)
            if evicted:
                self._emit(EVICTED, tuple(evicted))
            if stored:
                self._emit(STORED, tuple(stored))

    def since(self, seq: int) -> list[tuple[int, str, tuple[int, ...]]] | None:
        """Events after ``seq`` as (seq, kind, keys), oldest first; None when event ``seq + 1`` is
        no longer kept or ``seq`` is ahead of the log (the reader must resync)."""
        with self._lock:
            if seq > self.seq:
                return None
            first = self._ring[0][0] if self._ring else self.seq + 1
            if seq + 1 < first:
                return None
            return list(self._ring)[seq + 1 - first:] if seq + 1 <= self.seq else []

    def snapshot(self) -> tuple[int, frozenset[int]]:
        """(seq, every chunk key held after event seq)."""
        with self._lock:
            return self.seq, frozenset(self._held)

    def held(self) -> int:
        """Chunk keys held now."""
        return len(self._held)

    # ---- the engine ------------------------------------------------------------------------
    def block_stored(self, h: bytes) -> None:
        """Block hash ``h`` entered the prefix cache (call after the cache map has it)."""
        if h not in self._ann:  # lock-free: an annotation racing this one sees is_cached(h)
            return
        with self._lock:
            a = self._ann.get(h)
            if a is None or a.live:
                return
            a.live = True
            new = self._up(a.keys)
            if new:
                self._emit(STORED, tuple(new))

    def block_evicted(self, h: bytes) -> None:
        """Block hash ``h`` left the prefix cache (call after the cache map dropped it)."""
        if h not in self._ann:
            return
        with self._lock:
            a = self._ann.get(h)
            if a is None or not a.live:
                return
            a.live = False
            gone = self._down(a.keys)
            if gone:
                self._emit(EVICTED, tuple(gone))

    def clear(self) -> None:
        """The whole cache is gone (an engine reset): every key dropped, one ``cleared`` event."""
        with self._lock:
            for a in self._ann.values():
                a.live = False
            self._held.clear()
            self._emit(CLEARED, ())


# ------------------------------------------------------------------------------ ties
def token_ends_from_offsets(char_ends: Sequence[int], token_char_ends: Sequence[int], shift: int) -> list[int]:
    """Token ends (exclusive, in the prompt) of chunks ending at ``char_ends``: the token whose
    character span reaches the chunk's last character, plus one; ``token_char_ends[t]`` is where
    token ``t`` of the text ends, ``shift`` the tokens before the text (a BOS). A chunk past the
    last token ends with the last token."""
    out, t, n = [], 0, len(token_char_ends)
    for c in char_ends:
        while t < n and token_char_ends[t] < c:
            t += 1
        out.append(shift + min(t + 1, n))
    return out


def block_ties(keys: Sequence[int], token_ends: Sequence[int], hashes: Sequence[bytes],
               block_size: int) -> list[tuple[bytes, int]]:
    """(block hash, key) for each chunk: the last full block inside ``[0, token_end)``; chunks
    shorter than one block are not tied."""
    out = []
    for key, end in zip(keys, token_ends):
        b = min(end // block_size, len(hashes)) - 1
        if b >= 0:
            out.append((hashes[b], key))
    return out
