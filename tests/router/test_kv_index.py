"""The router's exact KV index (kv_index.py): the merge table, and the picker's prefix scores
when it is on (pods in sync score what their caches hold; the others what they were sent).
Every expected value is computed by hand in the comments."""
from __future__ import annotations

import pytest
from goodput.api.kv_events import KvEvent, parse_event, parse_snapshot
from goodput.router.kv_index import GAP, INSTANCE, OK, ExactIndex
from goodput.router.picker import PickConfig, PrefixIndex, RouteKey, pick
from test_picker import ep


def ev(seq, kind="stored", keys=(), instance="i1"):
    return KvEvent(instance, seq, kind, tuple(keys))


# (events applied in order after reset(pod "a", "i1", seq 3, keys {1, 2})) -> (results, keys, seq)
@pytest.mark.parametrize("events, results, keys, seq", [
    ([ev(4, keys=[5]), ev(5, "evicted", [1])], [OK, OK], {2, 5}, 5),
    ([ev(3, keys=[9])], [OK], {1, 2}, 3),                         # a replay: already applied
    ([ev(5, keys=[9])], [GAP], None, None),                       # 4 is missing
    ([ev(4, keys=[9], instance="i2")], [INSTANCE], None, None),   # the engine restarted
    ([ev(3, "heartbeat")], [OK], {1, 2}, 3),                      # alive, nothing new
    ([ev(4, "heartbeat")], [GAP], None, None),                    # the stream missed event 4
    ([ev(4, "cleared"), ev(5, keys=[7])], [OK, OK], {7}, 5),
    ([ev(4, "evicted", [99])], [OK], {1, 2}, 4),                  # unknown key: nothing to drop
])
def test_merge_table(events, results, keys, seq):
    ix = ExactIndex()
    ix.reset("a", "i1", 3, {1, 2})
    assert [ix.apply("a", e) for e in events] == results
    if keys is None:
        assert not ix.synced("a") and ix.pods(1) == frozenset() and len(ix) == 0
    else:
        st = ix.state("a")
        assert st.keys == keys and st.seq == seq
        assert {k for k in keys if "a" in ix.pods(k)} == keys


def test_two_pods_share_a_key_until_one_evicts_it():
    ix = ExactIndex()
    ix.reset("a", "i1", 0, {1})
    ix.reset("b", "j1", 7, {1, 2})
    assert ix.pods(1) == {"a", "b"} and len(ix) == 2
    assert ix.apply("b", ev(8, "evicted", [1], instance="j1")) == OK
    assert ix.pods(1) == {"a"} and ix.size("b") == 1
    ix.drop("a")
    assert ix.pods(1) == frozenset() and len(ix) == 1
    assert ix.apply("a", ev(1)) == GAP  # not in sync: resync


def test_prefix_scores_with_the_exact_index():
    """Chunks (10, 11, 12, 13). Pod a in sync holding keys {10, 11} (it was also sent all four:
    the history no longer counts for it): 2. Pod b not in sync, sent (10, 11, 12): 3. Pod c in
    sync holding {10, 11, 12, 13} though never sent anything by this router: 4. Pod d in sync
    holding {11} only: 0 (the chain breaks at chunk 10). A pending hold on a for the whole key
    counts: a 4."""
    idx = PrefixIndex()
    ix = idx.exact = ExactIndex()
    key = RouteKey("m", "r", None, (10, 11, 12, 13))
    idx.record(key, "a")
    idx.record(RouteKey("m", "r", None, (10, 11, 12)), "b")
    ix.reset("a", "ia", 1, {10, 11})
    ix.reset("c", "ic", 5, {10, 11, 12, 13})
    ix.reset("d", "id", 2, {11})
    assert idx.match(key) == {"a": 2, "b": 3, "c": 4}
    idx.hold(key, "a")
    assert idx.match(key) == {"a": 4, "b": 3, "c": 4}
    assert idx.match(key, pending=False) == {"a": 2, "b": 3, "c": 4}
    idx.unhold(key, "a")
    # a restart seen by the router (forget): a leaves both indexes
    idx.forget("a")
    assert not ix.synced("a") and idx.match(key) == {"b": 3, "c": 4}


def test_an_evicted_prefix_no_longer_attracts_the_request():
    """Events on, 2 idle pods: a was sent the 4-chunk prompt and its cache evicted it (in sync,
    no keys); b holds all 4. History alone would send it to a (4 chunks sent); events send it to
    b (affinity, 4)."""
    key = RouteKey("m", "r", None, (10, 11, 12, 13))
    idx = PrefixIndex()
    idx.record(key, "a")
    cfg = PickConfig(chunk_size=4)
    assert pick(key, [ep("a", 0), ep("b", 0)], idx, cfg).pod == "a"
    ix = idx.exact = ExactIndex()
    ix.reset("a", "ia", 9, set())
    ix.reset("b", "ib", 3, {10, 11, 12, 13})
    got = pick(key, [ep("a", 0), ep("b", 0)], idx, cfg)
    assert (got.pod, got.reason, got.matched_chunks) == ("b", "affinity", 4)


def test_wire_lines_parse_and_bad_ones_are_refused():
    e = parse_event('{"instance":"ab12","seq":4,"kind":"evicted","keys":["00000000000000ff"]}')
    assert e == KvEvent("ab12", 4, "evicted", (255,))
    s = parse_snapshot('{"instance":"ab12","seq":0,"chunk_size":256,"keys":[]}')
    assert (s.instance, s.seq, s.keys, s.chunk_size) == ("ab12", 0, frozenset(), 256)
    for bad in ('[]', '{"instance":"ab12","seq":-1,"kind":"stored","keys":[]}',
                '{"instance":"AB","seq":1,"kind":"stored","keys":[]}',
                '{"instance":"ab","seq":1,"kind":"moved","keys":[]}',
                '{"instance":"ab","seq":1,"kind":"stored","keys":[255]}', 'not json'):
        with pytest.raises(ValueError):
            parse_event(bad)
    with pytest.raises(ValueError, match="chunk_size"):
        parse_snapshot('{"instance":"ab12","seq":0,"keys":[]}')
