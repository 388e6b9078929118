"""KvEventLog: chunk keys stored / evicted / cleared as the prefix cache changes, the bounded ring,
snapshots; and through a real BlockManager (invariants kept). Expected events computed by hand."""
from __future__ import annotations

import pytest
from test_block_manager import mkreq, prefill

from goodput.worker.engine.block_manager import BlockManager
from goodput.worker.engine.kv_events import KvEventLog


def log_with(cached: set[bytes], **kw) -> KvEventLog:
    return KvEventLog(is_cached=cached.__contains__, **kw)


def test_annotated_keys_follow_their_blocks():
    cached: set[bytes] = set()
    log = log_with(cached)
    log.annotate([(b"h1", 11), (b"h2", 12)])
    assert log.seq == 0 and log.snapshot() == (0, frozenset())
    cached.add(b"h1")
    log.block_stored(b"h1")
    cached.add(b"h2")
    log.block_stored(b"h2")
    log.block_stored(b"h2")            # told twice: counted once
    log.block_stored(b"zz")            # not annotated: nothing
    log.annotate([(b"h1", 13)])        # a key tied to a block already cached: stored at once
    log.annotate([(b"h1", 13)])        # the same tie again: nothing
    cached.discard(b"h2")
    log.block_evicted(b"h2")
    assert log.since(0) == [(1, "stored", (11,)), (2, "stored", (12,)), (3, "stored", (13,)),
                            (4, "evicted", (12,))]
    assert log.since(2) == [(3, "stored", (13,)), (4, "evicted", (12,))]
    assert log.since(4) == []
    assert log.since(5) is None        # ahead of the log
    assert log.snapshot() == (4, frozenset({11, 13}))
    log.clear()
    assert log.since(4) == [(5, "cleared", ())]
    assert log.snapshot() == (5, frozenset())
    assert log.events_total == {"stored": 3, "evicted": 1, "cleared": 1}
    assert log.keys_total == {"stored": 3, "evicted": 1}


def test_a_key_tied_to_two_blocks_stays_until_both_leave():
    # the same text tokenized two ways (e.g. chat and completions) ties key 7 to blocks a and b
    cached = {b"a", b"b"}
    log = log_with(cached)
    log.annotate([(b"a", 7)])
    log.annotate([(b"b", 7)])
    assert log.since(0) == [(1, "stored", (7,))]
    cached.discard(b"a")
    log.block_evicted(b"a")
    assert log.seq == 1 and log.held() == 1
    cached.discard(b"b")
    log.block_evicted(b"b")
    assert log.since(1) == [(2, "evicted", (7,))]


def test_the_ring_is_bounded_and_a_reader_behind_it_resyncs():
    cached: set[bytes] = set()
    log = log_with(cached, capacity=2)
    for i in range(4):
        h = bytes([i])
        log.annotate([(h, 100 + i)])
        cached.add(h)
        log.block_stored(h)
    # events 1..4 happened; the ring keeps 3 and 4
    assert log.since(1) is None and log.since(0) is None
    assert log.since(2) == [(3, "stored", (102,)), (4, "stored", (103,))]
    assert log.snapshot() == (4, frozenset({100, 101, 102, 103}))


def test_annotations_are_bounded_and_a_dropped_live_one_evicts_its_keys():
    cached = {b"a", b"b", b"c"}
    log = log_with(cached, max_annotations=2)
    log.annotate([(b"a", 1), (b"b", 2)])    # one annotate call: one stored event for both keys
    assert log.since(0) == [(1, "stored", (1, 2))]
    log.annotate([(b"c", 3)])               # a (least recently annotated) is dropped: key 1 goes
    assert log.since(1) == [(2, "evicted", (1,)), (3, "stored", (3,))]
    assert log.snapshot() == (3, frozenset({2, 3}))


def test_through_the_block_manager():
    """block_size 4, 4 blocks. A 9-token prompt: full blocks 0 (tokens 0-3) and 1 (4-7); key 'A'
    tied to block 0, 'B' to block 1. Prefill -> stored A (1), stored B (2). Freed: free list
    [2, 3, 1, 0] (the uncached tail block first, then 3, then the cached blocks tail first). A
    16-token prompt of other tokens takes all 4 blocks: evicts block 1 (B, 3), then 0 (A, 4)."""
    bm = BlockManager(num_blocks=4, block_size=4, cache_identity="m@r")
    log = KvEventLog()
    bm.attach_kv_events(log)
    r = mkreq(range(9))
    h = bm.prompt_block_hashes(r.prompt_token_ids, None)
    assert len(h) == 2
    log.annotate([(h[0], 0xA), (h[1], 0xB)])
    assert prefill(bm, r) == (True, 0)
    assert r.block_hashes[:2] == h               # the same chain the engine computes
    assert log.since(0) == [(1, "stored", (0xA,)), (2, "stored", (0xB,))]
    bm.free(r)
    assert bm.free_block_order() == [2, 3, 1, 0]
    # a second request with the same prefix hits both blocks; nothing changes in the log
    r2 = mkreq(range(9))
    assert prefill(bm, r2) == (True, 8)
    assert log.seq == 2
    bm.free(r2)
    other = mkreq(range(100, 116))
    assert prefill(bm, other) == (True, 0)
    assert log.since(2) == [(3, "evicted", (0xB,)), (4, "evicted", (0xA,))]
    assert log.snapshot() == (4, frozenset())
    bm.check_invariants([other])


def test_a_salt_changes_the_block_hashes():
    bm = BlockManager(num_blocks=4, block_size=4, cache_identity="m@r")
    assert bm.prompt_block_hashes(list(range(8)), "t1") != bm.prompt_block_hashes(list(range(8)), None)
    assert bm.prompt_block_hashes(list(range(7)), None)[:1] == bm.prompt_block_hashes(list(range(8)), None)[:1]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        KvEventLog(capacity=0)
