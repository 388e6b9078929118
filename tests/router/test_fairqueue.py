"""The router's fleet queue on its own (goodput.router.fairqueue): bands, tenant turns, the bound's
victim, and a flood: a tenant sending 10x the capacity leaves a 1 req/s tenant of the same band
its goodput. Every expected value is worked out by hand in the comments; time is simulated
(integer milliseconds), no clock is read."""
from __future__ import annotations

import heapq

from goodput.router.fairqueue import FairQueue


def drain(q: FairQueue) -> list:
    out = []
    while len(q):
        out.append(q.pop().item)
    return out


def test_bands_first_then_tenants_in_turn():
    q = FairQueue()
    for i in range(4):
        q.push(f"f{i}", 0, "flood")     # the flooder queues 4 first
    q.push("l0", 0, "light")
    q.push("l1", 0, "light")
    q.push("b0", 1, "light")            # a worse band: after every band-0 entry
    q.push("u0", -1, "other")           # a better band: first
    # band -1: u0. band 0: flood and light never served: the earlier head first (f0), then light
    # (served longest ago: never, since it has been backlogged), then they alternate until light
    # is empty; then the rest of the flood. band 1: b0.
    assert drain(q) == ["u0", "f0", "l0", "f1", "l1", "f2", "f3", "b0"]


def test_a_tenant_back_after_emptying_gets_the_next_turn():
    q = FairQueue()
    q.push("f0", 0, "flood"), q.push("f1", 0, "flood"), q.push("l0", 0, "light")
    assert q.pop().item == "f0" and q.pop().item == "l0"   # light's queue is now empty
    q.push("f2", 0, "flood")
    q.push("l1", 0, "light")            # back: not served since it last had nothing queued
    assert drain(q) == ["l1", "f1", "f2"]


def test_remove_and_victim():
    q = FairQueue()
    es = [q.push(f"f{i}", 0, "flood") for i in range(3)]
    light = q.push("l0", 0, "light")
    # full (the caller's bound): a newcomer of light (1 queued) vs flood (3): 3 > 1 + 1 -> flood's newest
    assert q.victim("light", 0) is es[2]
    # a newcomer of a third tenant (0 queued): 3 > 0 + 1 -> flood's newest too
    assert q.victim("new", 0) is es[2]
    # the flooder itself: never (it is the heaviest)
    assert q.victim("flood", 0) is None
    assert q.remove(es[2]) and not q.remove(es[2])
    # flood 2, light 1: 2 > 1 + 1 is false -> light's next newcomer is refused
    assert q.victim("light", 0) is None
    # other bands are never touched: band 5's newcomers find no heavier tenant in their band
    # (light 1 there), band 0's a victim in band 0 only (flood 2 > 0 + 1: its newest, f1)
    worse = q.push("w0", 5, "light")
    assert q.victim("flood", 5) is None and q.victim("x", 5) is None and q.victim("x", 0) is es[1]
    assert q.remove(light) and q.remove(worse) and len(q) == 2
    assert q.count("flood", 0) == 2 and q.count("light", 0) == 0


def flood(fair: bool, seconds: int = 60, slots: int = 4, service_ms: int = 1000, bound: int = 8,
          timeout_ms: int = 2000) -> dict[str, dict[str, int]]:
    """A fleet of ``slots`` request slots, each request taking ``service_ms``: capacity 4 req/s.
    The flooder sends 40 req/s (every 25 ms, 10x the capacity), the light tenant 1 req/s (at
    500 ms past each second), both in band 0, for ``seconds``. A request is served at once when a
    slot is free and nobody queues, else queued (the bound, the victim rule, ``timeout_ms``:
    the router's admission). ``fair=False`` gives both one tenant id (a plain FIFO). Returns per
    tenant: sent, served (goodput: started within its timeout), refused (full, or replaced),
    timed_out."""
    events: list[tuple[int, int, str, str]] = []    # (ms, order: completions first, kind, tenant)
    for t in range(0, seconds * 1000, 25):
        heapq.heappush(events, (t, 2, "arrive", "flood"))
    for s in range(seconds):
        heapq.heappush(events, (s * 1000 + 500, 3, "arrive", "light"))
    stats = {t: {"sent": 0, "served": 0, "refused": 0, "timed_out": 0} for t in ("flood", "light")}
    q, free = FairQueue(), slots

    def expire(now: int) -> None:
        for e in [e for e in q if now - e.item[1] >= timeout_ms]:
            q.remove(e)
            stats[e.item[0]]["timed_out"] += 1

    def start(tenant: str, now: int) -> None:
        nonlocal free
        free -= 1
        stats[tenant]["served"] += 1
        heapq.heappush(events, (now + service_ms, 1, "done", tenant))

    while events:
        now, _, kind, tenant = heapq.heappop(events)
        expire(now)
        if kind == "done":
            free += 1
            if len(q):
                start(q.pop().item[0], now)
            continue
        stats[tenant]["sent"] += 1
        if free and not len(q):
            start(tenant, now)
            continue
        tid = tenant if fair else ""
        if len(q) >= bound:
            victim = q.victim(tid, 0)
            if victim is None:
                stats[tenant]["refused"] += 1
                continue
            q.remove(victim)
            stats[victim.item[0]]["refused"] += 1
        q.push((tenant, now), 0, tid)
    expire(1 << 62)   # what is still queued after the last event times out
    return stats


def test_a_flooding_tenant_leaves_a_light_one_its_goodput():
    fair = flood(fair=True)
    # the light tenant's request finds at most 1 of its own queued (1 req/s, served within a round
    # of 2 turns: <= 0.5 s) and the flooder with 8 -> it replaces the flooder's newest: all 60 served
    assert fair["light"] == {"sent": 60, "served": 60, "refused": 0, "timed_out": 0}
    assert fair["light"]["served"] >= 0.95 * fair["light"]["sent"]
    # the flooder: each of its requests is served, refused or timed out (429s); at most 248 start
    # (4 slots, one start per slot per second from t = 0 to 61.075 s, the last queued ones
    # included), so at least 2,400 - 248 of its requests get a 429
    f = fair["flood"]
    assert f["sent"] == 2400 == f["served"] + f["refused"] + f["timed_out"]
    assert f["served"] + fair["light"]["served"] <= 248 and f["refused"] + f["timed_out"] >= 2400 - 248
    # one tenant id for both (a plain FIFO): the light tenant's requests find the queue full of
    # the flooder's and are refused: far below 95 %
    fifo = flood(fair=False)
    assert fifo["light"]["served"] < 0.5 * fifo["light"]["sent"]
