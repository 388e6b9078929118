"""Table tests of the pure picker: every expected value is worked out by hand in the comments
(hashes from the documented formulas with hashlib, loads and bounds by arithmetic)."""
from __future__ import annotations

import hashlib
import struct

import pytest

from goodput.router.picker import (
    Endpoint,
    Pick,
    PickConfig,
    PrefixIndex,
    RouteKey,
    chunk_hashes,
    load_bound,
    pick,
    render_messages,
    route_key,
)


def h64(b: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "big")


def field(s: str) -> bytes:
    b = s.encode()
    return len(b).to_bytes(4, "big") + b


def weight(rkey: int, pod: str) -> int:
    """The documented rendezvous weight: blake2b64(rkey 8 bytes big-endian + pod name)."""
    return h64(rkey.to_bytes(8, "big") + pod.encode())


def ep(name: str, in_flight: int = 0, **kw) -> Endpoint:
    return Endpoint(name, f"http://127.0.0.1:{8000 + ord(name[0])}", in_flight, **kw)


def key(*chunks: int, salt: str | None = None) -> RouteKey:
    return RouteKey("m", "r1", salt, tuple(chunks))


CFG = PickConfig(cost=False, chunk_size=4, eps=0.25, rendezvous_chunks=2, index_capacity=1000)


# ------------------------------------------------------------------------------- chunk hashes
def test_chunk_hashes_token_ids_by_hand():
    # seed = h64("goodput-route-v1" | len+"m" | len+"r1" | 0x00 (no salt) | len+"ids"),
    # chunks of 2 ids as 4-byte big-endian: [1, 2], [3]
    seed = h64(b"goodput-route-v1" + field("m") + field("r1") + b"\x00" + field("ids"))
    h1 = h64(seed.to_bytes(8, "big") + struct.pack(">2I", 1, 2))
    h2 = h64(h1.to_bytes(8, "big") + struct.pack(">I", 3))
    assert chunk_hashes("m", "r1", None, token_ids=[1, 2, 3], chunk_size=2) == (h1, h2)


def test_chunk_hashes_text_by_hand_and_salt_in_seed():
    seed = h64(b"goodput-route-v1" + field("m") + field("r1") + b"\x01" + field("t") + field("text"))
    h1 = h64(seed.to_bytes(8, "big") + b"abc")
    h2 = h64(h1.to_bytes(8, "big") + b"d")
    assert chunk_hashes("m", "r1", "t", prompt="abcd", chunk_size=3) == (h1, h2)
    assert chunk_hashes("m", "r1", "t", prompt="", chunk_size=3) == ()


def test_render_messages_by_hand():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    assert render_messages(msgs) == ('{"content":"Be brief.","role":"system"}\n'
                                     '{"content":"hi there","role":"user"}\n')
    # text parts and a plain string are the same prompt
    assert render_messages([msgs[1]]) == render_messages([{"role": "user", "content": "hi there"}])


def test_next_turn_extends_the_chain():
    turn1 = [{"role": "system", "content": "S" * 40}, {"role": "user", "content": "q1" * 10}]
    turn2 = turn1 + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    c1 = chunk_hashes("m", "r1", None, messages=turn1, chunk_size=8)
    c2 = chunk_hashes("m", "r1", None, messages=turn2, chunk_size=8)
    n_full = len(render_messages(turn1)) // 8          # the full chunks of turn 1 are shared
    assert c2[:n_full] == c1[:n_full] and len(c2) > len(c1)


@pytest.mark.parametrize("other", [
    dict(model="m", revision="r1", cache_salt="tenant-b"),   # another tenant
    dict(model="m", revision="r2", cache_salt="tenant-a"),   # another revision
    dict(model="m2", revision="r1", cache_salt="tenant-a"),  # another model
    dict(model="m", revision="r1", cache_salt=None),         # no salt is not the empty salt...
])
def test_tenants_never_share_a_chunk(other):
    a = chunk_hashes("m", "r1", "tenant-a", prompt="same prompt text", chunk_size=4)
    b = chunk_hashes(other["model"], other["revision"], other["cache_salt"], prompt="same prompt text",
                     chunk_size=4)
    assert len(a) == len(b) == 4 and not set(a) & set(b)


def test_empty_salt_differs_from_none():
    assert not (set(chunk_hashes("m", "r", "", prompt="abcdefgh", chunk_size=4))
                & set(chunk_hashes("m", "r", None, prompt="abcdefgh", chunk_size=4)))


def test_chunk_hashes_errors():
    with pytest.raises(ValueError):
        chunk_hashes("m", "r", None, chunk_size=4)
    with pytest.raises(ValueError):
        chunk_hashes("m", "r", None, prompt="a", token_ids=[1], chunk_size=4)
    with pytest.raises(ValueError):
        chunk_hashes("m", "r", None, prompt="a", chunk_size=0)


# ------------------------------------------------------------------------------------ affinity
def test_affinity_hit_longest_chain_wins():
    idx = PrefixIndex()
    idx.record(key(1, 2), "a")          # a was sent a 2-chunk prefix
    idx.record(key(1, 2, 3, 4), "b")    # b a 4-chunk one
    eps = [ep("a"), ep("b"), ep("c")]
    assert pick(key(1, 2, 3, 4, 5), eps, idx, CFG) == Pick("b", "affinity", 4)
    # a request that diverges after chunk 2: a and b both matched 2; the chain stops at chunk 9
    got = pick(key(1, 2, 9), eps, idx, CFG)
    assert got.reason == "affinity" and got.matched_chunks == 2 and got.pod in ("a", "b")
    # between a and b the rendezvous weight of chunk 2 (rendezvous_chunks = 2) decides
    assert got.pod == max(("a", "b"), key=lambda p: weight(2, p))


def test_tenant_isolation_through_the_index():
    idx = PrefixIndex()
    mine = route_key("m", "r1", "tenant-a", CFG, prompt="a long shared prompt")
    idx.record(mine, "b")
    eps = [ep("a"), ep("b"), ep("c")]
    assert pick(mine, eps, idx, CFG) == Pick("b", "affinity", 5)     # 20 chars / 4 = 5 chunks
    for other in (route_key("m", "r1", "tenant-b", CFG, prompt="a long shared prompt"),
                  route_key("m", "r2", "tenant-a", CFG, prompt="a long shared prompt")):
        got = pick(other, eps, idx, CFG)
        assert got.reason == "rendezvous" and got.matched_chunks == 0


# ---------------------------------------------------------------------------------- rendezvous
def test_rendezvous_pod_by_hand():
    # no index entry: the pod with the highest weight for chunk min(3, 2) = 2 (value 20)
    eps = [ep("a"), ep("b"), ep("c")]
    expected = max("abc", key=lambda p: weight(20, p))
    assert pick(key(10, 20, 30), eps, PrefixIndex(), CFG) == Pick(expected, "rendezvous", 0)
    # one chunk only: it keys on that chunk
    assert pick(key(10), eps, PrefixIndex(), CFG).pod == max("abc", key=lambda p: weight(10, p))


def test_rendezvous_adding_a_pod_moves_only_its_keys():
    keys = [key(k) for k in range(1, 41)]
    three = [ep("a"), ep("b"), ep("c")]
    four = three + [ep("d")]
    cfg = PickConfig(cost=False, eps=None)
    before = {k.chunks[0]: pick(k, three, PrefixIndex(), cfg).pod for k in keys}
    after = {k.chunks[0]: pick(k, four, PrefixIndex(), cfg).pod for k in keys}
    # by the HRW rule: key k moves iff d's weight beats a, b and c's; it moves to d
    expected_moved = {k for k in before if weight(k, "d") > max(weight(k, p) for p in "abc")}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == expected_moved
    assert all(after[k] == "d" for k in moved)
    assert all(before[k] == max("abc", key=lambda p: weight(k, p)) for k in before)
    # ~1/4 of 40 keys: binomial(40, 1/4) has mean 10, sd 2.7
    assert 3 <= len(moved) <= 17
    # removing d again restores every key
    assert {k.chunks[0]: pick(k, three, PrefixIndex(), cfg).pod for k in keys} == before


# --------------------------------------------------------------------------------- load bound
@pytest.mark.parametrize("loads,eps,bound", [
    ((5, 1, 0), 0.25, 3),    # ceil(1.25 * 7 / 3) = ceil(2.917)
    ((2, 0, 0), 0.25, 2),    # ceil(1.25 * 3 / 3) = ceil(1.25)
    ((2, 0, 0), 1.0, 2),     # ceil(2 * 3 / 3)
    ((2, 0, 0), 2.0, 3),     # ceil(3 * 3 / 3)
    ((0, 0, 0, 0), 0.0, 1),  # ceil(1 / 4)
])
def test_load_bound_by_hand(loads, eps, bound):
    assert load_bound([ep(chr(97 + i), n) for i, n in enumerate(loads)], eps) == bound


def test_bounded_load_fallback():
    idx = PrefixIndex()
    idx.record(key(1, 2, 3), "b")
    # b is preferred (3 chunks) but holds 5 of 6 in flight: 5 + 1 > 3 -> fall back.
    # a (1 + 1 <= 3) and c (0 + 1 <= 3) both fit, neither matches; fewer waiting wins: a
    eps = [ep("a", 1, waiting=0), ep("b", 5), ep("c", 0, waiting=2)]
    assert pick(key(1, 2, 3), eps, idx, CFG) == Pick("a", "load_bound_fallback", 0)
    # equal waiting: lower KV usage wins
    eps = [ep("a", 1, waiting=0, kv_usage=0.9), ep("b", 5), ep("c", 0, waiting=0, kv_usage=0.3)]
    assert pick(key(1, 2, 3), eps, idx, CFG) == Pick("c", "load_bound_fallback", 0)
    # a pod with part of the prefix beats the queue tie-break
    idx.record(key(1), "a")
    eps = [ep("a", 1, waiting=3), ep("b", 5), ep("c", 0, waiting=0)]
    assert pick(key(1, 2, 3), eps, idx, CFG) == Pick("a", "load_bound_fallback", 1)
    # a looser bound (eps 2: ceil(3 * 7 / 3) = 7 >= 5 + 1) keeps b
    assert pick(key(1, 2, 3), eps, idx, PickConfig(cost=False, eps=2.0, rendezvous_chunks=2)) == Pick("b", "affinity", 3)
    # no bound at all (affinity routing) keeps b too
    assert pick(key(1, 2, 3), eps, idx, PickConfig(cost=False, eps=None, respect_limits=False)).pod == "b"


def test_at_limits_pod_is_skipped():
    idx = PrefixIndex()
    idx.record(key(7, 8), "b")
    # b: 2 + 1 = 3 in flight = its limits -> skipped even though the bound (eps None) allows it
    eps = [ep("a", 0), ep("b", 3, max_num_seqs=2, max_waiting=1), ep("c", 0)]
    cfg = PickConfig(cost=False, eps=None, rendezvous_chunks=2)
    got = pick(key(7, 8), eps, idx, cfg)
    assert got.reason == "load_bound_fallback" and got.pod == max("ac", key=lambda p: weight(8, p))
    # one below its limits: b is picked
    eps[1] = ep("b", 2, max_num_seqs=2, max_waiting=1)
    assert pick(key(7, 8), eps, idx, cfg) == Pick("b", "affinity", 2)
    # unknown limits never filter
    eps[1] = ep("b", 100, max_num_seqs=None, max_waiting=1)
    assert pick(key(7, 8), eps, idx, cfg) == Pick("b", "affinity", 2)
    # affinity routing ignores limits
    eps[1] = ep("b", 3, max_num_seqs=2, max_waiting=1)
    assert pick(key(7, 8), eps, idx, PickConfig(cost=False, eps=None, respect_limits=False)).pod == "b"


def test_all_full_gives_no_pod():
    eps = [ep("a", 4, max_num_seqs=2, max_waiting=2), ep("b", 9, max_num_seqs=4, max_waiting=5)]
    assert pick(key(1), eps, PrefixIndex(), CFG) == Pick(None, "full", 0)
    assert pick(key(1), [], PrefixIndex(), CFG) == Pick(None, "full", 0)


def test_below_bound_pod_at_limits_falls_to_least_loaded():
    # no prefix match: the strict bound (eps_no_affinity 0). Loads 0, 4, 3 (total 7 + 1):
    # bound ceil(8 / 3) = 3; a (0) is under it but at its limits (0 >= 0 + 0), b (4 + 1) and
    # c (3 + 1) are over it -> the least-loaded pod that fits its limits: c
    eps = [ep("a", 0, max_num_seqs=0, max_waiting=0), ep("b", 4), ep("c", 3)]
    assert pick(key(1), eps, PrefixIndex(), CFG) == Pick("c", "load_bound_fallback", 0)
    # loads 0, 5, 5 (total 11): bound ceil(11 / 3) = 4: b and c (6 > 4) are over, a is at its
    # limits -> b or c (5 each), by weight
    eps = [ep("a", 0, max_num_seqs=0, max_waiting=0), ep("b", 5), ep("c", 5)]
    got = pick(key(1), eps, PrefixIndex(), CFG)
    assert got.reason == "load_bound_fallback" and got.pod == max("bc", key=lambda p: weight(1, p))


def test_slack_only_for_a_prefix_no_other_pod_has():
    # loads a 2, b 1, c 1 (total 4 + 1): with eps 0.25 the bound is ceil(1.25 * 5 / 3) = 3, with
    # eps_no_affinity 0 it is ceil(5 / 3) = 2; a + 1 = 3 fits only the first
    eps = [ep("a", 2), ep("b", 1, waiting=1), ep("c", 1, waiting=0)]
    # requests (900, k): the rendezvous key is chunk 2 = k; pick a k whose top weight is a's
    k = next(k for k in range(1, 100) if max("abc", key=lambda p: weight(k, p)) == "a")
    # chunk 900 recorded on every pod (a shared system prompt): a is preferred by its weight but
    # holds nothing the others lack -> strict bound -> fallback to the fewest waiting: c
    shared = PrefixIndex()
    for p in "abc":
        shared.record(key(900), p)
    assert pick(key(900, k), eps, shared, CFG) == Pick("c", "load_bound_fallback", 1)
    # with eps_no_affinity 0.25 it stays on a
    loose = PickConfig(cost=False, chunk_size=4, eps=0.25, eps_no_affinity=0.25, rendezvous_chunks=2)
    assert pick(key(900, k), eps, shared, loose) == Pick("a", "affinity", 1)
    # a also holds the request's second chunk: the eps slack keeps it there
    shared.record(key(900, k), "a")
    assert pick(key(900, k), eps, shared, CFG) == Pick("a", "affinity", 2)


def test_a_continued_conversation_keeps_the_slack_on_a_replica_that_never_saw_it():
    # the loads of the test above: a 2, b 1, c 1 -> bound 3 with eps 0.25, 2 with eps_no_affinity 0
    eps = [ep("a", 2), ep("b", 1, waiting=1), ep("c", 1, waiting=0)]
    k = next(k for k in range(1, 100) if max("abc", key=lambda p: weight(k, p)) == "a")
    # this replica's index is empty (another replica served the earlier turns): a is the
    # rendezvous home; a new conversation gets the strict bound and moves to the fewest waiting
    assert pick(RouteKey("m", "r1", None, (7, 8), k), eps, PrefixIndex(), CFG) == Pick("c", "load_bound_fallback", 0)
    # a later turn of it (continuation) gets eps: a + 1 = 3 <= 3 stays home
    later = RouteKey("m", "r1", None, (7, 8), k, continuation=True)
    assert pick(later, eps, PrefixIndex(), CFG) == Pick("a", "rendezvous", 0)
    # beyond the eps bound it moves all the same: a 3 -> 4 > ceil(1.25 * 6 / 3) = 3
    assert pick(later, [ep("a", 3), *eps[1:]], PrefixIndex(), CFG).reason == "load_bound_fallback"


def test_route_key_continuation_is_a_message_past_the_anchor():
    system = {"role": "system", "content": "be brief"}
    first = [system, {"role": "user", "content": "q1"}]
    assert route_key("m", "r1", None, CFG, messages=first).continuation is False
    later = first + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert route_key("m", "r1", None, CFG, messages=later).continuation is True
    assert route_key("m", "r1", None, CFG, prompt="q1 a1 q2").continuation is False


# ---------------------------------------------------------------------------------------- index
def test_lru_eviction_keeps_prefixes():
    idx = PrefixIndex(capacity=3)
    idx.record(key(1, 2), "a")        # touched 2 then 1: LRU order [2, 1]
    idx.record(key(3, 4), "b")        # [2, 1, 4, 3] -> 2 evicted -> [1, 4, 3]
    assert len(idx) == 3 and 2 not in idx
    assert idx.match(key(1, 2)) == {"a": 1}          # the prefix outlived its suffix
    assert idx.match(key(3, 4)) == {"b": 2}
    idx.record(key(1), "a")           # [4, 3, 1]
    idx.record(key(5), "c")           # [4, 3, 1, 5] -> 4 evicted -> [3, 1, 5]
    assert [h for h in (1, 2, 3, 4, 5) if h in idx] == [1, 3, 5]
    assert idx.match(key(3, 4)) == {"b": 1}


def test_index_several_pods_and_forget():
    idx = PrefixIndex()
    idx.record(key(1, 2, 3), "a")
    idx.record(key(1, 2), "b")
    idx.record(key(1), "c")
    assert idx.match(key(1, 2, 3)) == {"a": 3, "b": 2, "c": 1}
    assert idx.pods(1) == ("a", "b", "c")
    idx.record(key(1), "a")           # a becomes the most recent holder of chunk 1
    assert idx.pods(1) == ("b", "c", "a")
    idx.forget("a")
    assert idx.match(key(1, 2, 3)) == {"b": 2, "c": 1}
    assert 3 not in idx                # only a held chunk 3
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_pick_does_not_change_the_index():
    idx = PrefixIndex()
    pick(key(1, 2), [ep("a"), ep("b")], idx, CFG)
    assert len(idx) == 0


def test_config_errors():
    for bad in (dict(chunk_size=0), dict(eps=-0.1), dict(eps_no_affinity=-1.0), dict(rendezvous_chunks=0),
                dict(index_capacity=0)):
        with pytest.raises(ValueError):
            PickConfig(**bad)


def test_chat_anchor_is_the_same_in_every_turn_and_spreads_a_shared_system_prompt():
    system = {"role": "system", "content": "You are a careful assistant. " * 20}   # 580 chars
    turn1 = [system, {"role": "user", "content": "first question of conversation one"}]
    turn2 = turn1 + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}]
    other = [system, {"role": "user", "content": "a different opening question"}]
    k1, k2, ko = (route_key("m", "r1", None, CFG, messages=m) for m in (turn1, turn2, other))
    # anchor = the last chunk hash of the system + first user message: turn 1's whole chain
    assert k1.anchor == k1.chunks[-1] == k2.anchor
    assert ko.anchor != k1.anchor
    # the first 8 chunks (rendezvous_chunks 2 x 4 chars, in the system prompt) are shared by all
    assert k1.chunks[:8] == ko.chunks[:8]
    # with the system prompt recorded on every pod, the tie is broken by the anchor's weight
    idx = PrefixIndex()
    sys_only = route_key("m", "r1", None, CFG, messages=[system])
    for p in "abc":
        idx.record(sys_only, p)
    eps = [ep("a"), ep("b"), ep("c")]
    n_sys = len(render_messages([system])) // 4        # full 4-char chunks of the system line
    for k in (k1, k2, ko):
        got = pick(k, eps, idx, CFG)
        assert got.pod == max("abc", key=lambda p: weight(k.anchor, p))
        assert got.reason == "affinity" and got.matched_chunks == n_sys
    # completions have no anchor
    assert route_key("m", "r1", None, CFG, prompt="abc").anchor is None


# ------------------------------------------------------------------------------- cost picking
COST = PickConfig(cost=True, chunk_size=4, rendezvous_chunks=8, request_cost=2, recompute_weight=1.0)


def test_prefix_index_holds_open_requests():
    idx = PrefixIndex()
    idx.hold(key(1, 2, 3), "a")
    idx.hold(key(1, 2), "a")
    idx.hold(key(1, 9), "b")
    # a holds chunks 1, 2, 3 (two open requests share 1, 2); b holds 1 and 9 (not 2)
    assert idx.match(key(1, 2, 3, 4)) == {"a": 3, "b": 1}
    assert len(idx) == 0 and idx.held() == 4            # nothing recorded; chunks 1, 2, 3, 9 held
    idx.unhold(key(1, 2, 3), "a")                       # a's other request still holds 1, 2
    assert idx.match(key(1, 2, 3, 4)) == {"a": 2, "b": 1}
    idx.record(key(1, 2, 3), "c")                       # a recorded send counts beside the holds
    assert idx.match(key(1, 2, 3, 4)) == {"a": 2, "b": 1, "c": 3}
    idx.forget("a")                                     # a left: its holds go too
    assert idx.match(key(1, 2, 3, 4)) == {"b": 1, "c": 3}
    idx.unhold(key(1, 2), "a")                          # a late release of a forgotten hold: ignored
    idx.unhold(key(1, 9), "b")
    assert idx.held() == 0


@pytest.mark.parametrize("work_a, w, pod, reason, cost", [
    # n = 5 chunks; a holds 3 (added 2), b none (5), c 1 (4); least added 2; request_cost 2.
    # w 1: a = 10 + 2 + 2 + 0 = 14, b = 0 + 5 + 2 + 3 = 10, c = 4 + 4 + 2 + 2 = 12 -> b
    (10, 1.0, "b", "load_bound_fallback", 7),
    # a's work 5: a = 9 < b 10 -> a keeps the request; it adds 2 + 2
    (5, 1.0, "a", "affinity", 4),
    # a's work 6: a = 10 = b 10 -> the higher rendezvous weight (key 5's order: see below)
    (6, 1.0, "tie", None, None),
    # w 0 (latency only): a = 14, b = 7, c = 10 -> b
    (10, 0.0, "b", "load_bound_fallback", 7),
    # w 3: a = 14, b = 0 + 5 + 2 + 9 = 16, c = 4 + 4 + 2 + 6 = 16 -> a
    (10, 3.0, "a", "affinity", 4),
])
def test_cost_scores_by_hand(work_a, w, pod, reason, cost):
    idx = PrefixIndex()
    idx.record(key(1, 2, 3), "a")
    idx.record(key(1, 7), "c")
    eps = [ep("a", 1, work=work_a), ep("b", 0, work=0), ep("c", 1, work=4)]
    cfg = PickConfig(cost=True, chunk_size=4, rendezvous_chunks=8, request_cost=2, recompute_weight=w)
    got = pick(key(1, 2, 3, 4, 5), eps, idx, cfg)
    if pod == "tie":  # rendezvous key = chunk min(5, 8) = 5: the higher weight of a and b
        want = max("ab", key=lambda p: weight(5, p))
        assert got.pod == want
        assert got.cost == (4 if want == "a" else 7)
    else:
        assert got == Pick(pod, reason, {"a": 3, "b": 0, "c": 1}[pod], cost, cost - 2)


def test_cost_cold_burst_stays_on_two_pods():
    """16 requests sharing a new 24-chunk prefix (+1 chunk of their own), each open when the
    next is picked. n = 25; request_cost 2; rendezvous key = chunk 8 (shared): one order
    P1 > P2 > P3 for all of them. Request 1: every pod 0 + 25 + 2 = 27 -> P1 (cost 27).
    Request k >= 2: P1 holds 24 (pending) -> 27 + 3 (k - 2) + 1 + 2; P2, P3: 25 + 2 + 24 = 51.
    P1 while 30 + 3 (k - 2) <= 51 (ties: P1's weight): k <= 9 -> 9 requests, work 51.
    Request 10: P1 54 > 51 -> P2 (cost 27); P2 then takes j more while 30 + 3 j <= 51: all 6
    left (j <= 6). Split 9 / 7 / 0."""
    prefix = tuple(range(1000, 1024))
    order = sorted("xyz", key=lambda p: -weight(prefix[7], p))
    idx = PrefixIndex()
    work = {p: 0 for p in "xyz"}
    got = []
    for i in range(16):
        k = RouteKey("m", "r1", None, prefix + (5000 + i,))
        choice = pick(k, [ep(p, 0, work=work[p]) for p in "xyz"], idx, COST)
        idx.hold(k, choice.pod)
        work[choice.pod] += choice.cost
        got.append(choice)
    assert [c.pod for c in got] == [order[0]] * 9 + [order[1]] * 7
    assert [c.cost for c in got] == [27] + [3] * 8 + [27] + [3] * 6
    assert [c.prefill for c in got] == [25] + [1] * 8 + [25] + [1] * 6   # cost less request_cost 2
    assert got[0].reason == "rendezvous" and got[1].reason == "affinity" and got[9].reason == "load_bound_fallback"
    assert work == {order[0]: 51, order[1]: 45, order[2]: 0}
    # counting requests with the plain bound (eps_pending None, eps_no_affinity 0) spreads it over all 3
    idx, loads, pods = PrefixIndex(), {p: 0 for p in "xyz"}, set()
    for i in range(16):
        k = RouteKey("m", "r1", None, prefix + (5000 + i,))
        choice = pick(k, [ep(p, loads[p]) for p in "xyz"], idx,
                      PickConfig(cost=False, chunk_size=4, eps_pending=None))
        idx.hold(k, choice.pod)
        loads[choice.pod] += 1
        pods.add(choice.pod)
    assert pods == {"x", "y", "z"}


def test_count_cold_burst_a_pending_prefill_counts_as_held():
    """The same burst, count picking (``cost=False``) with its defaults (eps 0.25, eps_no_affinity 0, eps_pending
    1). Request k sees k - 1 open; P1 > P2 > P3 by weight. 1: P1 (rendezvous). 2: P1 holds 24
    pending, over ceil(1.25 * 2 / 3) = 1, within ceil(2 * 2 / 3) = 2: P1. 3: P1 (2) over 2 and 2:
    fallback P2. 4: P1, P2 both hold 24 (no gain: bound ceil(4 / 3) = 2): P1 (2) over, P2 (1) is
    the fallback. k >= 5: both over ceil(k / 3), both within ceil(2k / 3), P3 holds nothing: the
    holder with fewer open, P1 on ties: P1, P2, P1, ... -> 8 / 8 / 0."""
    prefix = tuple(range(1000, 1024))
    p1, p2, p3 = sorted("xyz", key=lambda p: -weight(prefix[7], p))
    idx, loads, got = PrefixIndex(), {p: 0 for p in "xyz"}, []
    for i in range(16):
        k = RouteKey("m", "r1", None, prefix + (5000 + i,))
        choice = pick(k, [ep(p, loads[p]) for p in "xyz"], idx, PickConfig(cost=False, chunk_size=4))
        idx.hold(k, choice.pod)
        loads[choice.pod] += 1
        got.append(choice)
    assert [c.pod for c in got] == [p1, p1, p2, p2] + [p1, p2] * 6
    assert [c.reason for c in got] == (["rendezvous", "affinity", "load_bound_fallback", "load_bound_fallback"]
                                       + ["affinity"] * 12)
    assert loads == {p1: 8, p2: 8, p3: 0}
    # once the prefix was answered there (recorded, no longer pending only) the plain bound applies
    idx2 = PrefixIndex()
    k = RouteKey("m", "r1", None, prefix + (7000,))
    idx2.record(k, p1)
    idx2.hold(k, p1)
    later = RouteKey("m", "r1", None, prefix + (7001,))
    assert pick(later, [ep(p1, 1), ep(p2, 0), ep(p3, 0)], idx2, PickConfig(cost=False, chunk_size=4)).pod != p1


def test_cost_continuation_goes_home_on_a_replica_that_never_saw_it():
    # empty index; a continuation of 4 chunks (anchor 77): its home (top weight of 77) is taken
    # to hold 3 -> home 0 + 1 + 2 + 0 = 3; others 0 + 4 + 2 + 3 = 9
    home = max("abc", key=lambda p: weight(77, p))
    later = RouteKey("m", "r1", None, (7, 8, 9, 10), 77, continuation=True)
    eps = [ep(p, 0) for p in "abc"]
    assert pick(later, eps, PrefixIndex(), COST) == Pick(home, "rendezvous", 0, 3, 1)
    # home's work 6: 9 vs 9 -> still home (its weight); 7: 10 > 9 -> the top weight of the others
    eps = [ep(p, 0, work=6 if p == home else 0) for p in "abc"]
    assert pick(later, eps, PrefixIndex(), COST).pod == home
    eps = [ep(p, 0, work=7 if p == home else 0) for p in "abc"]
    other = max((p for p in "abc" if p != home), key=lambda p: weight(77, p))
    assert pick(later, eps, PrefixIndex(), COST) == Pick(other, "load_bound_fallback", 0, 6, 4)
    # a new conversation (not a continuation) gets no such credit: 6 vs 6 + 7 -> the least work
    new = RouteKey("m", "r1", None, (7, 8, 9, 10), 77)
    assert pick(new, eps, PrefixIndex(), COST).pod == other


def test_cost_respects_limits():
    idx = PrefixIndex()
    idx.record(key(1, 2), "a")
    # a holds all of it but is at its limits (2 >= 1 + 1): b or c, equal scores -> weight of chunk 2
    eps = [ep("a", 2, max_num_seqs=1, max_waiting=1), ep("b", 0), ep("c", 0)]
    got = pick(key(1, 2), eps, idx, COST)
    assert got == Pick(max("bc", key=lambda p: weight(2, p)), "rendezvous", 0, 4, 2)
    assert pick(key(1, 2), [eps[0]], idx, COST) == Pick(None, "full", 0)
    assert pick(key(1, 2), [], idx, COST) == Pick(None, "full", 0)
