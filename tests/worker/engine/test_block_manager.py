"""BlockManager: allocation, LRU free list, prefix caching (identity, salt, verification), fork,
and a hypothesis state machine that checks the invariants and a simulated KV content store after
every operation."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from goodput.worker.engine.block_manager import BlockManager
from goodput.worker.engine.kv_events import KvEventLog
from goodput.worker.engine.request import Request
from goodput.worker.engine.sampling_params import SamplingParams

_ids = iter(range(10**9))


def mkreq(tokens, salt=None) -> Request:
    return Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=64), cache_salt=salt)


def prefill(bm: BlockManager, req: Request) -> tuple[bool, int]:
    """Admit ``req`` the way the scheduler does: prefix hits, then the rest in one chunk; mark the
    KV computed and offer full blocks to the cache. Returns (allocated, hit tokens)."""
    blocks, hit = bm.get_computed_blocks(req)
    if not bm.allocate_slots(req, req.num_tokens - hit, blocks):
        return False, hit
    assert req.num_computed_tokens == hit
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return True, hit


def test_allocate_exact_blocks_and_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = mkreq(range(10))
    assert bm.allocate_slots(a, 10)
    assert a.block_ids == [0, 1, 2]  # ceil(10 / 4) = 3, taken from the front of the free list
    assert bm.usage == pytest.approx(3 / 4)
    b = mkreq(range(5))
    assert not bm.can_allocate(b, 5)
    assert not bm.allocate_slots(b, 5)  # needs 2, 1 free: nothing changes
    assert b.block_ids == [] and bm.num_free_blocks == 1
    # Growing a: 10 computed + 2 new = 12 tokens still fit 3 blocks; 13 needs a 4th.
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 2) and a.block_ids == [0, 1, 2]
    assert bm.allocate_slots(a, 3) and a.block_ids == [0, 1, 2, 3]
    assert bm.usage == 1.0
    bm.check_invariants([a])
    bm.free(a)
    assert bm.usage == 0.0 and a.block_ids == []
    bm.check_invariants()


def test_free_order_uncached_first_then_lru_of_cached():
    bm = BlockManager(num_blocks=4, block_size=4)
    reqs = [mkreq([10 * k + i for i in range(4)]) for k in range(3)]  # one full block each
    for r in reqs:
        assert prefill(bm, r)[0]
    assert [r.block_ids for r in reqs] == [[0], [1], [2]]
    for r in reqs:
        bm.free(r)
    # Block 3 was never used (holds nothing): evicted first; then cached blocks by free time.
    assert bm.free_block_order() == [3, 0, 1, 2]
    d = mkreq(range(100, 108))
    assert bm.allocate_slots(d, 8) and d.block_ids == [3, 0]  # evicts reqs[0]'s block
    again0 = mkreq(reqs[0].prompt_token_ids + (1,))
    again1 = mkreq(reqs[1].prompt_token_ids + (1,))
    assert bm.get_computed_blocks(again0) == ([], 0)
    assert bm.get_computed_blocks(again1) == ([1], 4)
    bm.check_invariants([d])


def test_request_blocks_freed_tail_first_partial_block_recycled_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = mkreq(range(10))  # blocks: 2 full (cached) + 1 partial
    assert prefill(bm, a)[0] and a.block_ids == [0, 1, 2]
    bm.free(a)
    # Partial block 2 holds no cached content -> front; full blocks tail first -> 1 before 0.
    assert bm.free_block_order() == [2, 3, 1, 0]


def test_prefix_hit_same_identity_miss_other_salt_or_revision():
    bm = BlockManager(num_blocks=16, block_size=4, cache_identity="smollm2@rev1")
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    a = mkreq(prompt)
    assert prefill(bm, a) == (True, 0)
    b = mkreq(prompt + [99])
    ok, hit = prefill(bm, b)
    assert ok and hit == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert bm.block_ref_count(a.block_ids[0]) == 2
    assert bm.prefix_cache_queries == 10 + 11 and bm.prefix_cache_hits == 8
    # Same tokens, other tenant salt: no sharing.
    c = mkreq(prompt, salt="tenant-b")
    assert bm.get_computed_blocks(c) == ([], 0)
    # Same tokens and salt as an earlier salted request: hit.
    assert prefill(bm, c) == (True, 0)
    d = mkreq(prompt, salt="tenant-b")
    assert bm.get_computed_blocks(d) == (c.block_ids[:2], 8)
    # Another model revision hashes the same tokens differently, so it never reads rev1's KV.
    other = BlockManager(num_blocks=16, block_size=4, cache_identity="smollm2@rev2")
    e = mkreq(prompt)
    assert prefill(other, e) == (True, 0)
    assert set(e.block_hashes).isdisjoint(a.block_hashes) and len(e.block_hashes) == 2
    assert bm.get_computed_blocks(mkreq(prompt)) == (a.block_ids[:2], 8)
    bm.check_invariants([a, b, c])


def test_divergent_prompt_hits_only_common_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = mkreq(list(range(12)) + [50])
    prefill(bm, a)
    b = mkreq(list(range(6)) + [7, 7, 7, 7, 7, 7, 7])  # diverges inside block 1
    assert bm.get_computed_blocks(b) == (a.block_ids[:1], 4)


def test_last_token_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = mkreq(range(8))  # exactly 2 full blocks
    prefill(bm, a)
    b = mkreq(range(8))
    # (8 - 1) // 4 = 1 block: the model must still compute the last prompt token for logits.
    assert bm.get_computed_blocks(b) == (a.block_ids[:1], 4)
    assert bm.get_computed_blocks(mkreq(range(4))) == ([], 0)
    assert bm.get_computed_blocks(mkreq(range(5))) == (a.block_ids[:1], 4)


def test_hit_is_verified_by_tokens_not_only_hash(monkeypatch):
    # Make every block of every request collide on the hash: only verification separates them.
    monkeypatch.setattr(BlockManager, "hash_block", staticmethod(lambda parent, ident, toks: b"h" * 32))
    bm = BlockManager(num_blocks=8, block_size=4)
    a = mkreq([1, 2, 3, 4, 5])
    prefill(bm, a)
    assert bm.get_computed_blocks(mkreq([9, 9, 9, 9, 9])) == ([], 0)
    assert bm.get_computed_blocks(mkreq([1, 2, 3, 4, 9])) == (a.block_ids[:1], 4)
    assert bm.get_computed_blocks(mkreq([1, 2, 3, 4, 5], salt="x")) == ([], 0)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = mkreq(range(9))
    prefill(bm, a)
    assert bm.get_computed_blocks(mkreq(range(9))) == ([], 0)
    assert bm.num_cached_blocks == 0 and bm.prefix_cache_queries == 0
    bm.free(a)
    assert bm.free_block_order()[:3] == [0, 1, 2]  # nothing cached: all recycled first


def test_hit_blocks_that_are_free_count_against_the_free_list():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = mkreq(range(5))
    prefill(bm, a)
    bm.free(a)
    assert bm.usage == 0.0 and bm.num_cached_blocks == 1
    # 13 tokens: 1 hit block (free, cached) + 3 new = 4 blocks > 3, although 3 new <= 3 free.
    big = mkreq(list(range(5)) + [8] * 8)
    blocks, hit = bm.get_computed_blocks(big)
    assert (blocks, hit) == ([0], 4)
    assert not bm.can_allocate(big, 9, blocks)
    assert not bm.allocate_slots(big, 9, blocks)
    assert bm.is_free(0) and bm.num_cached_blocks == 1 and big.num_computed_tokens == 0
    # 9 tokens: hit + 2 new = 3 blocks: fits; the hit block goes ref 0 -> 1.
    ok = mkreq(list(range(5)) + [8] * 4)
    blocks, hit = bm.get_computed_blocks(ok)
    assert bm.allocate_slots(ok, 5, blocks)
    assert ok.block_ids[0] == 0 and bm.block_ref_count(0) == 1 and not bm.is_free(0)
    assert ok.num_computed_tokens == 4 and bm.usage == 1.0
    bm.check_invariants([ok])


def test_fork_shares_full_blocks_and_recomputes_partial_tail():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = mkreq(range(6))
    prefill(bm, parent)
    assert parent.block_ids == [0, 1]
    child = mkreq(range(6))
    bm.fork(parent, child)
    assert child.block_ids == [0] and child.num_computed_tokens == 4
    assert bm.block_ref_count(0) == 2 and bm.block_ref_count(1) == 1
    # The child recomputes positions 4..5 into its own block; the parent's partial block 1 is
    # never shared, so both can append without copy-on-write.
    assert bm.allocate_slots(child, 2) and child.block_ids[1] not in parent.block_ids
    bm.check_invariants([parent, child])
    bm.free(parent)
    assert not bm.is_free(0) and bm.block_ref_count(0) == 1
    bm.check_invariants([child])
    with pytest.raises(ValueError):
        bm.fork(child, mkreq([5, 5, 5, 5, 5]))  # different tokens
    with pytest.raises(ValueError):
        bm.fork(child, mkreq(range(6), salt="other-tenant"))


def test_check_invariants_detects_corruption():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = mkreq(range(4))
    bm.allocate_slots(a, 4)
    bm._blocks[a.block_ids[0]].ref += 1
    with pytest.raises(AssertionError, match="table references"):
        bm.check_invariants()
    bm._blocks[a.block_ids[0]].ref -= 1
    bm._free[a.block_ids[0]] = None
    with pytest.raises(AssertionError, match="free list"):
        bm.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits), decodes, forks and frees over a small pool.

    Besides the bookkeeping invariants, a fake KV store records which token was written into
    each slot: every live request must always read its own tokens through its block table,
    so a block handed to the wrong request, reused while referenced, or a wrong cache hit fails.
    A KvEventLog is attached: each admitted prompt's full blocks are tied to a key each (before
    or after the admission), and the keys it holds must always be those of the tied blocks in the
    prefix cache, its events replayed from 0 giving the same set.
    """

    live = Bundle("live")

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.reqs: dict[str, Request] = {}
        self.kv: dict[int, int] = {}
        self.log = KvEventLog()
        self.bm.attach_kv_events(self.log)
        self.tied: set[bytes] = set()

    def _tie(self, req: Request) -> None:
        hashes = self.bm.prompt_block_hashes(req.prompt_token_ids, req.cache_salt)
        self.log.annotate([(h, int.from_bytes(h[:8], "big")) for h in hashes])
        self.tied.update(hashes)

    def _write(self, req: Request, start: int, end: int) -> None:
        bs = self.bm.block_size
        for p in range(start, end):
            self.kv[req.block_ids[p // bs] * bs + p % bs] = req.all_token_ids[p]

    def _admit(self, req: Request):
        blocks, hit = self.bm.get_computed_blocks(req)
        free_before = self.bm.num_free_blocks
        if not self.bm.allocate_slots(req, req.num_tokens - hit, blocks):
            assert self.bm.num_free_blocks == free_before and not req.block_ids
            return None
        self._write(req, hit, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        self.bm.cache_full_blocks(req)
        self.reqs[req.request_id] = req
        return req

    @rule(target=live, prompt=st.lists(st.integers(1, 2), min_size=1, max_size=12),
          salt=st.sampled_from([None, "t"]))
    def admit(self, prompt, salt):
        r = mkreq(prompt, salt)
        if len(prompt) % 2:  # tie before the blocks are cached (the usual order) or after
            self._tie(r)
        req = self._admit(r)
        if not len(prompt) % 2:
            self._tie(r)
        return req if req is not None else mkreq([1])  # a dummy with no blocks

    @rule(req=live, tok=st.integers(1, 2))
    def decode(self, req, tok):
        if req.request_id not in self.reqs:
            return
        req.all_token_ids.append(tok)
        req.output_token_ids.append(tok)
        if self.bm.allocate_slots(req, 1):
            self._write(req, req.num_computed_tokens, req.num_computed_tokens + 1)
            req.num_computed_tokens += 1
            self.bm.cache_full_blocks(req)
        else:  # preemption by recompute: drop the KV, re-admit later
            self.bm.free(req)
            req.num_computed_tokens = 0
            del self.reqs[req.request_id]

    @rule(target=live, req=live)
    def fork(self, req):
        if req.request_id not in self.reqs:
            return mkreq([1])
        child = mkreq(req.all_token_ids, req.cache_salt)
        self.bm.fork(req, child)
        if self.bm.allocate_slots(child, child.num_tokens - child.num_computed_tokens):
            self._write(child, child.num_computed_tokens, child.num_tokens)
            child.num_computed_tokens = child.num_tokens
            self.bm.cache_full_blocks(child)
            self.reqs[child.request_id] = child
        else:
            self.bm.free(child)
            child.num_computed_tokens = 0
        return child

    @rule(req=consumes(live))
    def free(self, req):
        self.bm.free(req)
        self.reqs.pop(req.request_id, None)
        assert req.block_ids == []

    @rule(req=live)
    def readmit(self, req):
        if req.request_id in self.reqs:
            return
        self._admit(req)

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants(list(self.reqs.values()))
        bs = self.bm.block_size
        for req in self.reqs.values():
            for p in range(req.num_computed_tokens):
                assert self.kv[req.block_ids[p // bs] * bs + p % bs] == req.all_token_ids[p], \
                    f"{req.request_id} reads a foreign token at position {p}"
        assert 0 <= self.bm.usage <= 1
        cached = {int.from_bytes(h[:8], "big") for h in self.tied if h in self.bm._cached}
        seq, held = self.log.snapshot()
        assert held == cached
        replay: set[int] = set()
        for _, kind, keys in self.log.since(0):
            (replay.update if kind == "stored" else replay.difference_update)(keys)
        assert replay == held and seq == self.log.seq


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
