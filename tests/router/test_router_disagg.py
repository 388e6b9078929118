"""The router's per-request disaggregation decision (goodput.router.disagg.decide): named cases with
the answer worked out by hand from the rules in docs/disaggregation.md."""
from __future__ import annotations

import pytest

from goodput.router.disagg import DEFERRED, decide, defer_when_full, min_chunks
from goodput.router.picker import Endpoint, PickConfig, PrefixIndex, RouteKey

CFG = PickConfig()
KEY = RouteKey("m", "", None, tuple(range(100, 110)))  # a 10-chunk prompt
OTHER = RouteKey("m", "", None, tuple(range(500, 510)))


def ep(name: str, in_flight: int = 0, **kw) -> Endpoint:
    return Endpoint(name=name, url=f"http://{name}", in_flight=in_flight, **kw)


def index_with(*records: tuple[RouteKey, str, int]) -> PrefixIndex:
    """An index where pod was sent the first n chunks of key."""
    ix = PrefixIndex()
    for key, pod, n in records:
        ix.record(RouteKey(key.model, key.revision, key.cache_salt, key.chunks[:n]), pod)
    return ix


ROLES = {"d1": "decode", "d2": "decode", "p1": "prefill", "p2": "prefill", "b1": "both"}


@pytest.mark.parametrize("case, decode, held, pods, index, threshold, want", [
    ("no threshold is off", "d1", 0, ["d1", "p1"], PrefixIndex(), None, (None, "off", 0)),
    ("threshold 0: any uncached chunk goes remote", "d1", 9, ["d1", "p1"], PrefixIndex(), 0, ("p1", "remote", 1)),
    ("threshold 0, all cached: short", "d1", 10, ["d1", "p1"], PrefixIndex(), 0, (None, "short", 0)),
    ("decode pod holds all but 2 chunks: short", "d1", 8, ["d1", "p1"], PrefixIndex(), 2, (None, "short", 2)),
    ("3 uncached > 2: remote on the only prefill pod", "d1", 7, ["d1", "p1"], PrefixIndex(), 2, ("p1", "remote", 3)),
    ("nothing cached anywhere: remote", "d1", 0, ["d1", "p1", "p2"], PrefixIndex(), 4, ("p1|p2", "remote", 10)),
    ("the prefill pod holding the prefix wins", "d1", 0, ["d1", "p1", "p2"],
     index_with((KEY, "p2", 6), (KEY, "p1", 2)), 4, ("p2", "remote", 10)),
    ("a decode-only pod is never a prefill pod", "d1", 0, ["d1", "d2"], PrefixIndex(), 1, (None, "no_prefill_pod", 10)),
    ("a 'both' pod can prefill for others", "d1", 0, ["d1", "d2", "b1"], PrefixIndex(), 1, ("b1", "remote", 10)),
    ("the decode pod itself is not its own prefill pod", "b1", 0, ["b1", "d1"], PrefixIndex(), 1,
     (None, "no_prefill_pod", 10)),
    ("a prefill-role pod picked to serve decodes colocated", "p1", 0, ["p1", "p2"], PrefixIndex(), 1,
     (None, "decode_pod_is_prefill", 0)),
])
def test_decision_table(case, decode, held, pods, index, threshold, want):
    d = decide(KEY, decode, held, [ep(p) for p in pods], ROLES, index, CFG, threshold)
    prefill, reason, uncached = want
    assert (d.reason, d.uncached) == (reason, uncached), case
    if prefill is None:
        assert d.prefill is None, case
    else:
        assert d.prefill in prefill.split("|"), case


def test_prefill_pod_at_its_limits_is_skipped_and_load_moves_the_rest():
    full = ep("p1", in_flight=4, max_num_seqs=2, max_waiting=2)  # in_flight >= 2 + 2: at its limits
    d = decide(KEY, "d1", 0, [ep("d1"), full, ep("p2")], ROLES, PrefixIndex(), CFG, 1)
    assert (d.prefill, d.reason) == ("p2", "remote")
    d = decide(KEY, "d1", 0, [ep("d1"), full], ROLES, PrefixIndex(), CFG, 1)
    assert (d.prefill, d.reason) == (None, "no_prefill_pod")


def test_prefix_affinity_gives_way_to_the_load_bound_with_the_count_picker():
    # p2 holds the prefix but carries 9 of the 10 requests in flight: ceil(1.25 * 11 / 2) = 7 < 10
    ix, count = index_with((KEY, "p2", 10)), PickConfig(cost=False)
    d = decide(KEY, "d1", 0, [ep("d1"), ep("p1", 1), ep("p2", 9)], ROLES, ix, count, 1)
    assert d.prefill == "p1"
    d = decide(KEY, "d1", 0, [ep("d1"), ep("p1", 1), ep("p2", 1)], ROLES, ix, count, 1)
    assert d.prefill == "p2"


def test_prefix_affinity_gives_way_to_queued_work_with_the_cost_picker():
    # p2 holds all 10 chunks: its score is its work; p1 would prefill 10 chunks that p2 would not,
    # counted twice (its own wait + recompute_weight 1 x 10): 0 + 10 + 10 = 20
    ix = index_with((KEY, "p2", 10))
    d = decide(KEY, "d1", 0, [ep("d1"), ep("p1"), ep("p2", 9, work=21)], ROLES, ix, CFG, 1)
    assert d.prefill == "p1"  # 21 > 20
    d = decide(KEY, "d1", 0, [ep("d1"), ep("p1"), ep("p2", 9, work=19)], ROLES, ix, CFG, 1)
    assert d.prefill == "p2"  # 19 < 20


def test_unknown_pods_default_to_both():
    d = decide(OTHER, "x", 0, [ep("x"), ep("y")], {}, PrefixIndex(), CFG, 1)
    assert (d.prefill, d.reason) == ("y", "remote")


@pytest.mark.parametrize("tokens, chunk_size, want", [
    (None, 256, None), (0, 256, 0), (512, 256, 8), (100, 256, 2), (64, 256, 1), (65, 256, 2), (512, 64, 32)])
def test_min_chunks_is_tokens_times_4_chars_over_the_chunk_size_rounded_up(tokens, chunk_size, want):
    assert min_chunks(tokens, chunk_size) == want


def test_static_urls_carry_roles():
    from goodput.router.discovery_static import StaticDiscovery
    [(_, pods)] = StaticDiscovery(["m=http://127.0.0.1:1#prefill,http://127.0.0.1:2/#decode,http://127.0.0.1:3"]).services()
    assert [(p.name, p.url, p.role) for p in pods] == [
        ("127.0.0.1:1", "http://127.0.0.1:1", "prefill"), ("127.0.0.1:2", "http://127.0.0.1:2", "decode"),
        ("127.0.0.1:3", "http://127.0.0.1:3", "both")]
    with pytest.raises(ValueError, match="role 'fast' of 'http://127.0.0.1:1' is not one of"):
        StaticDiscovery(["m=http://127.0.0.1:1#fast"]).services()


@pytest.mark.parametrize("ready, coming, want", [
    (1, 1, True),    # one prefill pod serving and full, one more starting: refuse (429)
    (3, 2, True),
    (1, 0, False),   # nothing coming: the decode pod prefills, the only way to serve it
    (0, 2, False),   # no prefill pod serving (scaled to zero, all down): the decode pod prefills
    (0, 0, False),
])
def test_defer_when_full(ready, coming, want):
    assert defer_when_full(ready, coming) is want


def test_a_full_prefill_pool_that_grows_defers_the_prompt():
    full = ep("p1", in_flight=4, max_num_seqs=2, max_waiting=2)  # at its limits: the picker skips it
    # p1 Ready and full, one prefill pod coming: refused, not prefilled on d1
    d = decide(KEY, "d1", 0, [ep("d1"), full], ROLES, PrefixIndex(), CFG, 1, prefill_coming=1)
    assert (d.prefill, d.reason, d.uncached) == (None, DEFERRED, 10)
    # nothing coming: d1 prefills it itself
    d = decide(KEY, "d1", 0, [ep("d1"), full], ROLES, PrefixIndex(), CFG, 1, prefill_coming=0)
    assert (d.prefill, d.reason) == (None, "no_prefill_pod")
    # no Ready prefill pod at all, two coming: d1 prefills it (refusing would refuse every long prompt)
    d = decide(KEY, "d1", 0, [ep("d1"), ep("d2")], ROLES, PrefixIndex(), CFG, 1, prefill_coming=2)
    assert (d.prefill, d.reason) == (None, "no_prefill_pod")
    # a prefill pod with room: remote whatever is coming
    d = decide(KEY, "d1", 0, [ep("d1"), full, ep("p2")], ROLES, PrefixIndex(), CFG, 1, prefill_coming=1)
    assert (d.prefill, d.reason) == ("p2", "remote")
    # a short prompt stays local before anything is asked of the prefill pool
    d = decide(KEY, "d1", 9, [ep("d1"), full], ROLES, PrefixIndex(), CFG, 1, prefill_coming=1)
    assert d.reason == "short"
