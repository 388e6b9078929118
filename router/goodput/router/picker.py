"""Which pod serves a request: prefix affinity, rendezvous hashing and bounded loads (pure, stdlib only).

The router calls :func:`pick` once per request with the request's :class:`RouteKey`, the Ready,
not-draining pods of its InferenceService as :class:`Endpoint` values and its own
:class:`PrefixIndex`; after sending the request it calls ``index.record(key, pod)``. The
simulator (``--routing``) calls the same functions. Nothing here does I/O or reads a clock.

How a pod is picked with ``PickConfig.cost`` (the default, :func:`pick_by_cost`): by cost, in chunks
of work. Pods at their admission limits are filtered (step 1 below); each other pod ``p`` is
scored ``work(p) + added(p) + request_cost + recompute_weight * (added(p) - min added)``, where
``added(p)`` is the request's prompt chunks ``p`` does not hold (by the prefix index, which
counts the chunks of requests still open on ``p`` as held: a prefill pending there is as good
as cached for the next request sharing it) and ``work(p)`` the work the router's open requests
hold there (``Endpoint.work``: their ``Pick.cost``, the prefill part released at the first
token). The least score wins, then the higher rendezvous weight (step 3). So a request
stays with the pod holding its prefix until the work queued there exceeds what moving would
cost: its own prefill elsewhere plus, once more (``recompute_weight``), the fleet work that
prefill takes from the requests after it. A burst of requests sharing a new prefix stays on
one pod until the queued work there passes one recompute of the prefix, then fills a second,
and reaches a third only when both hold that much more than a fresh prefill would cost.

With ``cost = False`` (``--no-picker-cost``, :func:`pick_by_count`) the pipeline is by in-flight counts (filter ->
score -> pick, the shape of llm-d's endpoint picker, with the scores compared in a fixed order
instead of summed with weights):

1. **Filter: admission limits** (:func:`at_limits`). A pod whose router-side in-flight count has
   reached ``max_num_seqs + max_waiting`` (its scraped admission limits; unknown limits never
   filter) would answer 429; it is never picked. No pod left: ``Pick(None, "full", 0)`` and the
   router queues or refuses the request (fleet-level admission).
2. **Score: prefix affinity** (:func:`prefix_scores`). The request's text is cut in fixed-size
   chunks hashed as a chain (:func:`chunk_hashes`), so chunk ``i``'s hash stands for the whole
   prefix up to it. The :class:`PrefixIndex` remembers which pods were sent each chunk hash;
   a pod's score is the number of leading chunks of this request it was sent before (the
   longest matching chain). That pod most likely still holds the prefix's KV blocks in its
   prefix cache, so it skips their prefill.
3. **Score: rendezvous** (:func:`rendezvous_weight`, highest random weight hashing, Thaler and
   Ravishankar 1998). Every pod gets a pseudo-random weight from the hash of (the request's
   rendezvous key, pod name); higher wins among equal prefix scores. The key
   (:func:`rendezvous_key`) is the conversation's *anchor* when the request has one (chat: its
   messages up to the first user message, the same in every turn), else its first
   ``rendezvous_chunks`` chunks. With no match (a new conversation, or a router replica that
   never saw it) every router replica computes the same order without sharing state, a shared
   system prompt matched on every pod leaves new conversations spread by their anchors, and
   adding or removing one pod of n moves only the keys that pod wins or won: ~1/n of them.
4. **Pick, under a load bound** (:func:`load_bound`; consistent hashing with bounded loads,
   Mirrokni, Thorup and Zadimoghaddam, SODA 2018). The preferred pod is the first in the order
   (prefix score, rendezvous weight), taken over every endpoint. It gets the request unless it
   was filtered in step 1 or its in-flight count plus this request would exceed
   ``ceil((1 + e) * (total in-flight + 1) / n)``: then the request goes to the best pod that is
   within both, ordered by prefix score, then fewest waiting (scraped queue), then lowest KV
   usage (scraped), then rendezvous weight (reason ``load_bound_fallback``). The slack ``e`` is
   ``eps`` when the preferred pod holds more of the request's prefix than any other pod that
   fits (moving the request would recompute that difference), or when the request continues a
   chat conversation (``RouteKey.continuation``: messages past its anchor) and so was most
   likely sent to that same rendezvous home before, by this or another router replica that
   this one does not hear from; and ``eps_no_affinity`` (default 0: at most the mean, rounded
   up) otherwise (a new conversation, or a prefix every pod has, like a shared system prompt):
   such a request loses nothing by moving, so it balances the load, and a new pod fills with
   new conversations first. **A pending prefill counts as held**: when no pod within the
   bound holds as much of the prompt as some pod whose extra is held only for requests still
   open there (a new prefix being prefilled now; ``PrefixIndex.match(key, pending=False)`` does
   not count it), that pod keeps the request up to the wider bound of ``eps_pending`` (1: twice
   the mean), so a burst sharing a new prefix fills its rendezvous pod, then a second one, not
   every pod (all 16 of a burst on 3 pods: 8/8/0 instead of 6/5/5). The bound always
   leaves one pod below it, so a fallback exists unless every pod is at its limits (then the
   least-loaded pod that is not). ``eps = None`` disables the bound (and ``respect_limits =
   False`` the filter: the simulator's ``affinity`` routing).

Reasons (``Pick.reason``, the router's ``goodput_router_decisions_total{reason}``): ``affinity``
(the preferred pod, with a prefix match), ``rendezvous`` (the preferred pod, no match anywhere),
``load_bound_fallback`` (load moved it; cost picking: any pod other than one holding the
longest match or, with no match, the rendezvous pod), ``full``.

Router replicas: each keeps its own index; a chat conversation whose turns reach different
router replicas still lands on one pod (the anchor is the same in every turn) unless the load
bound moved it. Without an anchor (completions), turns agree when their first
``rendezvous_chunks`` chunks are the same (a shorter request keys on its last chunk, which the
next turn extends, so a short first turn may be placed elsewhere once by another replica).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from goodput.api.prefix import _h64, _seed, chunk_hashes, render_messages
from goodput.api.settings import setting, validate

__all__ = [
    "Endpoint", "RouteKey", "Pick", "PickConfig", "PrefixIndex", "chunk_hashes", "route_key",
    "render_messages", "at_limits", "load_bound", "prefix_scores", "rendezvous_key",
    "rendezvous_weight", "pick", "pick_by_cost", "pick_by_count", "added_work",
    "REASON_AFFINITY", "REASON_RENDEZVOUS", "REASON_FALLBACK", "REASON_FULL",
]

REASON_AFFINITY = "affinity"
REASON_RENDEZVOUS = "rendezvous"
REASON_FALLBACK = "load_bound_fallback"
REASON_FULL = "full"


@dataclass(frozen=True)
class Endpoint:
    """One Ready, not-terminating, not-draining pod of one InferenceService.

    name: pod name (unique in the service; the rendezvous hash and the index key on it).
    url: ``http://<podIP>:<port>``.
    in_flight: requests the router has open to this pod (its own count; >= 0).
    max_num_seqs, max_waiting: the pod's admission limits from its ``/metrics``
        (``goodput_admission_max_num_seqs`` / ``goodput_admission_max_waiting``); None = not
        scraped yet.
    running, waiting: ``goodput_requests_running`` / ``goodput_requests_waiting`` (scrape).
    kv_usage: ``goodput_kv_cache_usage_ratio`` in [0, 1] (scrape).
    work: work held on the pod, in chunks: over the requests the router has open to it, their
        ``Pick.cost`` (prompt chunks to prefill plus ``request_cost``), less ``Pick.prefill`` for
        those whose first token came back; >= 0.
    """

    name: str
    url: str
    in_flight: int
    max_num_seqs: int | None = None
    max_waiting: int | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    work: int = 0


@dataclass(frozen=True)
class RouteKey:
    """What the picker knows of a request: its model, revision, tenant salt and chunk chain.

    chunks: 64-bit chained hashes of the fixed-size chunks of the canonical request (from
    :func:`chunk_hashes`, which seeds the chain with model, revision and cache_salt, so two
    tenants' chains never meet in the index).
    anchor: optional 64-bit identity of the conversation, the same in each of its turns (chat:
    the last chunk hash of its messages up to the first user message, set by :func:`route_key`);
    the rendezvous hash keys on it when set.
    continuation: the request continues a chat conversation (it has messages past its anchor: an
    earlier turn's reply); the load bound gives its rendezvous home the ``eps`` slack even where
    this router replica holds no prefix of it (set by :func:`route_key`).
    """

    model: str
    revision: str
    cache_salt: str | None
    chunks: tuple[int, ...]
    anchor: int | None = None
    continuation: bool = False


@dataclass(frozen=True)
class Pick:
    """The decision: ``pod`` (an ``Endpoint.name``; None when every endpoint is at its limits),
    ``reason`` (one of the module's ``REASON_*``), ``matched_chunks`` (the picked pod's prefix
    score: leading chunks of the request it holds or was sent; 0 when ``pod`` is None),
    ``cost`` (cost picking: the work, in chunks, the request adds on the picked pod: its
    ``Endpoint.work`` grows by it; 0 for count picking and for None) and ``prefill`` (the part of
    ``cost`` that is prompt to prefill: it leaves the pod's work at the request's first token,
    the rest, ``request_cost``, when the request ends)."""

    pod: str | None
    reason: str
    matched_chunks: int
    cost: int = 0
    prefill: int = 0


@dataclass(frozen=True)
class PickConfig:
    """Knobs of the picker (one declaration each, ``goodput.api.settings.setting``: the router's
    ``--picker-*`` flags and the checks at construction derive from it).

    chunk_size: characters of canonical text, or token ids, per chunk. 256 characters is ~64 tokens
        of English: 4 KV blocks of 16.
    eps: the load bound's slack for a request whose preferred pod holds more of its prefix than
        any other: that pod may carry up to ``(1 + eps)`` x the mean in-flight count (rounded up,
        this request included). Smaller spreads load more evenly, larger keeps more
        conversations on their pod. None: no bound at all (``affinity`` routing in the simulator).
    eps_no_affinity: the slack for any other request (no prefix advantage, not a continuation;
        ignored when ``eps`` is None).
    eps_pending: count picking: the slack for a pod whose advantage over every pod within the
        bound is a prefill still pending there (chunks it holds only for open requests: a cold
        prefix on its way into that pod's cache). Moving such a request prefills the prefix once
        more on another pod, so it stays with a pending holder up to ``(1 + eps_pending)`` x the
        mean. None: the plain bound (a burst sharing a new prefix then spreads over every pod).
    rendezvous_chunks: how many leading chunks the rendezvous hash keys on.
    index_capacity: most chunk hashes the :class:`PrefixIndex` keeps (LRU beyond).
    respect_limits: skip pods at their admission limits (False: the simulator's ``affinity``).
    cost: pick by cost (:func:`pick_by_cost`: the work the request adds on a pod plus the work
        held there); False: by counts (the prefix-first order under the in-flight load bound).
    request_cost: cost picking: chunks of work a request counts for beyond its prefill (its
        decode and its slot; a request with its whole prompt cached still counts this much).
    recompute_weight: cost picking: how much prefill that some other pod would not need (it
        holds more of the prompt) counts again on top of the request's own wait: the fleet's
        work that the request would take from the requests after it.
    """

    chunk_size: int = setting(256, "characters of canonical text, or token ids, per chunk", gt=0)
    eps: float | None = setting(0.25, "load-bound slack for a request with a prefix advantage (none: no bound)",
                                ge=0)
    eps_no_affinity: float = setting(0.0, "load-bound slack for any other request", ge=0)
    eps_pending: float | None = setting(1.0, "count picking: load-bound slack for a pod whose prefix advantage is "
                                        "a prefill still pending there (none: the plain bound)", ge=0)
    rendezvous_chunks: int = setting(8, "leading chunks the rendezvous hash keys on", ge=1)
    index_capacity: int = setting(1 << 18, "most chunk hashes the prefix index keeps (LRU beyond)", ge=1)
    respect_limits: bool = setting(True, "skip pods at their admission limits")
    cost: bool = setting(True, "pick by work (prefill chunks to do + work held); off: by in-flight counts under a load bound")
    request_cost: int = setting(0, "cost picking: chunks of work a request counts for beyond its prefill", ge=0)
    recompute_weight: float = setting(1.0, "cost picking: weight of prefill another pod would not need, "
                                      "on top of the request's own wait", ge=0)

    def __post_init__(self) -> None:
        validate(self)


# ------------------------------------------------------------------------------------ hashing
# The chunk chain (chunk_hashes, render_messages) lives in the contract package goodput.api.prefix:
# the worker computes the same keys for its KV events.


def route_key(model: str, revision: str, cache_salt: str | None, cfg: PickConfig | None = None,
              **content: Any) -> RouteKey:
    """``RouteKey(model, revision, cache_salt, chunk_hashes(..., **content), anchor)`` with
    ``cfg``'s chunk size (``content``: the keyword arguments of :func:`chunk_hashes`). For chat
    (``messages``) the anchor is the last chunk hash of the messages up to and including the first
    ``user`` one (all of them when there is none), and ``continuation`` says whether messages
    follow that head; otherwise None and False."""
    size = (cfg or PickConfig()).chunk_size
    chunks = chunk_hashes(model, revision, cache_salt, chunk_size=size, **content)
    anchor, continuation = None, False
    messages = content.get("messages")
    if messages is not None:
        head = list(messages)
        for i, m in enumerate(head):
            if m.get("role") == "user":
                head = head[:i + 1]
                break
        head_chunks = chunk_hashes(model, revision, cache_salt, chunk_size=size, messages=head,
                                   tools=content.get("tools"))
        anchor = head_chunks[-1] if head_chunks else None
        continuation = len(head) < len(messages)
    return RouteKey(model, revision, cache_salt, chunks, anchor, continuation)


# -------------------------------------------------------------------------------- prefix index
class PrefixIndex:
    """Approximate map chunk hash -> pods it was sent to, bounded by LRU.

    Approximate: a pod may have evicted the blocks since (the index never hears of it), 64-bit
    hashes may collide (probability ~n^2 / 2^65), and each router replica sees only its own
    requests. Memory: one entry per distinct chunk hash, ``capacity`` at most; an entry is an
    ``OrderedDict`` slot holding an int key and a tuple of pod names (the names are shared with
    the endpoints): ~200 bytes with one pod, +8 bytes per further pod, so the default 262,144
    entries take ~50 MiB (measured with tracemalloc: 191 bytes per single-pod entry) and cover
    64 MiB of prompt text in 256-character chunks (16k conversations of 4k characters).

    ``record`` touches a request's chunks last to first, so a prefix is more recently used than
    its suffix and outlives it (the engine's prefix cache evicts in the same order).

    ``exact``: the router's exact index of what each pod's prefix cache holds, from the pods' KV
    events (``goodput.router.kv_index.ExactIndex``; None: events off). For a pod in sync there
    (``exact.synced(pod)``) a chunk is held when the pod's cache holds its key
    (``exact.pods(chunk)``), whatever it was sent; for any other pod, when it was sent the chunk
    (this index's history). Pending holds count either way.
    """

    def __init__(self, capacity: int = PickConfig.index_capacity) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._map: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self._pending: dict[int, dict[str, int]] = {}  # chunk -> {pod: requests open with it}
        self.exact = None  # an ExactIndex (kv_index.py) when the router follows the pods' KV events

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, chunk: int) -> bool:
        return chunk in self._map

    def pods(self, chunk: int) -> tuple[str, ...]:
        """Pods ``chunk`` was sent to (most recent last); () when unknown. Does not touch LRU.
        Pending holds (:meth:`hold`) are not included."""
        return self._map.get(chunk, ())

    def hold(self, key: RouteKey, pod: str) -> None:
        """A request with ``key`` was just given to ``pod`` and is open there: until
        :meth:`unhold`, :meth:`match` counts its chunks as held by ``pod`` (its prefill is
        pending there: the next request sharing the prefix finds it cached once it runs).
        Counted per request; not bounded by ``capacity`` (at most the open requests' chunks)."""
        pend = self._pending
        for h in key.chunks:
            d = pend.get(h)
            if d is None:
                pend[h] = {pod: 1}
            else:
                d[pod] = d.get(pod, 0) + 1

    def unhold(self, key: RouteKey, pod: str) -> None:
        """The request of a :meth:`hold` ended (answered, failed or moved); a hold that
        :meth:`forget` dropped already is ignored."""
        pend = self._pending
        for h in key.chunks:
            d = pend.get(h)
            if d is None or pod not in d:
                continue
            if d[pod] <= 1:
                del d[pod]
                if not d:
                    del pend[h]
            else:
                d[pod] -= 1

    def held(self) -> int:
        """Distinct chunk hashes held by open requests (:meth:`hold`)."""
        return len(self._pending)

    def record(self, key: RouteKey, pod: str) -> None:
        """Remember that ``pod`` was sent ``key``'s chunks; evicts least recently used entries
        beyond ``capacity``."""
        m = self._map
        for h in reversed(key.chunks):
            pods = m.get(h)
            if pods is None:
                m[h] = (pod,)
            else:
                if pods[-1] != pod:
                    m[h] = tuple(p for p in pods if p != pod) + (pod,)
                m.move_to_end(h)
        while len(m) > self.capacity:
            m.popitem(last=False)

    def match(self, key: RouteKey, pending: bool = True) -> dict[str, int]:
        """Prefix score per pod: the number of leading chunks of ``key`` the pod holds (in sync
        with its KV events: its cache holds them; else: it was sent them) or holds for an open
        request (:meth:`hold`; only when ``pending``); pods with none are absent. Walks the
        chain until no pod is left; O(longest match)."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        pend = self._pending if pending else {}
        sent_map = self._map
        ex = self.exact
        synced = ex.synced_pods if ex is not None else None
        held_map = ex.by_key if ex is not None else None
        for i, h in enumerate(key.chunks):
            pods: Any = sent_map.get(h, ())
            if synced is not None:  # pods in sync: what their caches hold; the others: what was sent
                cached = held_map.get(h)
                if pods and synced:
                    pods = [p for p in pods if p not in synced]
                if cached:
                    pods = cached if not pods else [*pods, *cached]
            held = pend.get(h)
            if held:
                pods = (*pods, *held)
            if not pods:
                break
            alive = set(pods) if alive is None else alive.intersection(pods)
            if not alive:
                break
            for p in alive:
                out[p] = i + 1
        return out

    def forget(self, pod: str) -> None:
        """Drop ``pod`` from every entry, pending holds and the exact index included (it left
        the fleet, or its engine restarted); O(entries)."""
        if self.exact is not None:
            self.exact.drop(pod)
        for h in list(self._pending):
            d = self._pending[h]
            if d.pop(pod, None) is not None and not d:
                del self._pending[h]
        m = self._map
        for h in list(m):
            pods = m[h]
            if pod in pods:
                rest = tuple(p for p in pods if p != pod)
                if rest:
                    m[h] = rest
                else:
                    del m[h]


# ------------------------------------------------------------------------------------ scorers
def at_limits(e: Endpoint) -> bool:
    """True when ``e.in_flight >= e.max_num_seqs + e.max_waiting`` (both known; else False)."""
    if e.max_num_seqs is None or e.max_waiting is None:
        return False
    return e.in_flight >= e.max_num_seqs + e.max_waiting


def load_bound(endpoints: Sequence[Endpoint], eps: float) -> int:
    """Most in-flight requests a pod may hold after taking this one:
    ``ceil((1 + eps) * (sum of in_flight + 1) / n)`` (Mirrokni et al. 2018, with the new request
    counted). ``n`` > 0."""
    total = sum(e.in_flight for e in endpoints) + 1
    return math.ceil((1.0 + eps) * total / len(endpoints) - 1e-12)


def prefix_scores(key: RouteKey, index: PrefixIndex) -> dict[str, int]:
    """Prefix affinity score per pod: ``index.match(key)`` (longest matching chain, in chunks)."""
    return index.match(key)


def rendezvous_key(key: RouteKey, n_chunks: int) -> int:
    """The hash the rendezvous order keys on: ``key.anchor`` when set, else chunk
    ``min(len, n_chunks)`` of the chain (it stands for all chunks before it); with neither, the
    seed of (model, revision, salt)."""
    if key.anchor is not None:
        return key.anchor
    if not key.chunks:
        return _seed(key.model, key.revision, key.cache_salt, "")
    return key.chunks[min(len(key.chunks), n_chunks) - 1]


def rendezvous_weight(rkey: int, pod: str) -> int:
    """Highest-random-weight score of ``pod`` for ``rkey`` (0 <= rkey < 2**64):
    ``blake2b64(rkey as 8 big-endian bytes + UTF-8 pod name)``; the highest weight wins."""
    return _h64(rkey.to_bytes(8, "big") + pod.encode("utf-8"))


def pick(key: RouteKey, endpoints: Sequence[Endpoint], index: PrefixIndex, cfg: PickConfig) -> Pick:
    """Pick the pod for ``key`` among ``endpoints`` (the module doc gives the pipeline):
    :func:`pick_by_cost` when ``cfg.cost`` (the default), else :func:`pick_by_count`.

    Pure: reads ``index`` without changing it (the router calls ``index.hold(key, pick.pod)``
    when it gives the request to the pod, ``index.unhold`` when the request ends, and
    ``index.record(key, pick.pod)`` once the pod answered). No endpoints: ``Pick(None, "full",
    0)``.
    """
    if cfg.cost:
        return pick_by_cost(key, endpoints, index, cfg)
    return pick_by_count(key, endpoints, index, cfg)


def added_work(n_chunks: int, held: int, cfg: PickConfig) -> int:
    """Work (chunks) a request of ``n_chunks`` chunks adds on a pod holding ``held`` leading
    chunks of it: ``max(0, n_chunks - held) + cfg.request_cost``."""
    return max(0, n_chunks - held) + cfg.request_cost


def pick_by_cost(key: RouteKey, endpoints: Sequence[Endpoint], index: PrefixIndex, cfg: PickConfig) -> Pick:
    """Pick by cost: the pod where the request's wait plus the fleet work it wastes is least.

    Units are chunks of work (one chunk of prompt to prefill = 1). For each pod ``p`` that is
    not at its admission limits (when ``cfg.respect_limits``), with ``n`` the request's chunks
    and ``held(p)`` the leading chunks of it ``p`` holds (``index.match``: sent before, or held
    by an open request there, a prefill still pending counts as held):

    - ``added(p) = max(0, n - held(p))``: the prompt chunks ``p`` would prefill;
    - ``cost(p) = added(p) + request_cost`` (:func:`added_work`): what ``p``'s work grows by;
    - ``score(p) = work(p) + cost(p) + recompute_weight * (added(p) - min_q added(q))``:
      the work ahead of the request there plus its own, plus the prefill it does that the pod
      holding most of it would not (that fleet work is taken from the requests after it).

    The least score wins; ties go to the higher rendezvous weight (:func:`rendezvous_weight`
    of :func:`rendezvous_key`), so idle pods split new prefixes by rendezvous. A continuation
    (``key.continuation``) whose rendezvous home (over all endpoints) holds at least as much as
    any pod this index knows of is taken to hold all of it but the last chunk there (another
    router replica most likely sent the earlier turns home). Reason: ``affinity`` when the
    picked pod holds a prefix and no fitting pod holds more, ``rendezvous`` when no fitting pod
    holds any and the picked one has the top weight, ``load_bound_fallback`` otherwise (load
    moved it), all by the index's own scores (a continuation's assumed hold is not one).
    ``Pick.cost`` is ``cost(picked)``; no pod outside its limits: ``Pick(None,
    "full", 0)``.
    """
    fits = [e for e in endpoints if not (cfg.respect_limits and at_limits(e))]
    if not fits:
        return Pick(None, REASON_FULL, 0)
    rk = rendezvous_key(key, cfg.rendezvous_chunks)
    scores = prefix_scores(key, index)
    weight = {e.name: rendezvous_weight(rk, e.name) for e in fits}
    n = len(key.chunks)
    held = {e.name: min(n, scores.get(e.name, 0)) for e in fits}
    if key.continuation and n:
        home = max(endpoints, key=lambda e: rendezvous_weight(rk, e.name)).name
        if home in held and held[home] >= max(held.values()):
            held[home] = max(held[home], n - 1)
    top = max(held.values())
    least = n - top

    def score(e: Endpoint) -> tuple[float, int]:
        added = n - held[e.name]
        return e.work + added + cfg.request_cost + cfg.recompute_weight * (added - least), -weight[e.name]

    best = min(fits, key=score)
    known = scores.get(best.name, 0)
    known_top = max(scores.get(e.name, 0) for e in fits)
    if known > 0 and known == known_top:
        reason = REASON_AFFINITY
    elif known_top == 0 and weight[best.name] == max(weight.values()):
        reason = REASON_RENDEZVOUS
    else:
        reason = REASON_FALLBACK
    cost = added_work(n, held[best.name], cfg)
    return Pick(best.name, reason, known, cost, cost - cfg.request_cost)


def pick_by_count(key: RouteKey, endpoints: Sequence[Endpoint], index: PrefixIndex, cfg: PickConfig) -> Pick:
    """Pick by in-flight counts: the preferred pod by (prefix score, rendezvous weight) under
    the bounded-load rule (the module doc, steps 1-4). Ties between equal weights cannot occur
    for distinct pod names except by a 64-bit collision; they then fall to the endpoint order.
    ``Pick.cost`` is 0."""
    if not endpoints:
        return Pick(None, REASON_FULL, 0)
    rk = rendezvous_key(key, cfg.rendezvous_chunks)
    scores = prefix_scores(key, index)
    weight = {e.name: rendezvous_weight(rk, e.name) for e in endpoints}
    preferred = max(endpoints, key=lambda e: (scores.get(e.name, 0), weight[e.name]))
    fits = [e for e in endpoints if not (cfg.respect_limits and at_limits(e))]
    if not fits:
        return Pick(None, REASON_FULL, 0)
    m_pref = scores.get(preferred.name, 0)
    gain = m_pref > max((scores.get(e.name, 0) for e in fits if e is not preferred), default=0)
    if cfg.eps is None:
        bound = math.inf
    else:
        bound = load_bound(endpoints, cfg.eps if gain or key.continuation else cfg.eps_no_affinity)
    ok = [e for e in fits if e.in_flight + 1 <= bound]
    if any(e is preferred for e in ok):
        return Pick(preferred.name, REASON_AFFINITY if m_pref > 0 else REASON_RENDEZVOUS, m_pref)
    if cfg.eps is not None and cfg.eps_pending is not None and m_pref > 0:
        # A pending prefill counts as held: a pod holding more than any pod within the bound,
        # that extra only for open requests (a cold prefix being prefilled there), keeps the
        # request up to the wider bound; else another pod would prefill the prefix again.
        top_ok = max((scores.get(e.name, 0) for e in ok), default=0)
        sent = index.match(key, pending=False)
        wide = load_bound(endpoints, cfg.eps_pending)
        holders = [e for e in fits if scores.get(e.name, 0) > top_ok and sent.get(e.name, 0) <= top_ok
                   and e.in_flight + 1 <= wide]
        if holders:
            best = max(holders, key=lambda e: (scores.get(e.name, 0), -e.in_flight, weight[e.name]))
            return Pick(best.name, REASON_AFFINITY, scores.get(best.name, 0))
    if ok:
        best = max(ok, key=lambda e: (scores.get(e.name, 0), -(e.waiting or 0), -(e.kv_usage or 0.0),
                                      weight[e.name]))
    else:  # every pod under its limits is over the bound (the bound alone always leaves one)
        best = max(fits, key=lambda e: (-e.in_flight, scores.get(e.name, 0), weight[e.name]))
    return Pick(best.name, REASON_FALLBACK, scores.get(best.name, 0))
