"""Paged KV-cache block manager with prefix caching (torch-free bookkeeping only).

The KV cache is a pool of ``num_blocks`` fixed-size blocks of ``block_size`` token slots; each
request owns a *block table* (list of block ids), so position p of the request lives in block
``block_table[p // block_size]`` at offset ``p % block_size`` (PagedAttention: Kwon et al.,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023).

Blocks are reference-counted so several requests can share identical prefixes. Prefix caching
(as in vLLM's automatic prefix caching) keys every FULL block by a hash chain::

    h_i = blake2b(h_{i-1} || identity || tokens of block i)

where ``identity`` covers the model name + revision (``EngineConfig.cache_identity``) and the
request's optional ``cache_salt``. A block keeps its hash, parent hash, identity and tokens after
its last reference is dropped ("cached but free"), so a later request can re-use it (ref 0 -> 1,
taken out of the free list) until it is evicted for a new allocation. A hit is verified by
comparing the stored tokens, parent hash and identity, not just the hash.

Free list order: blocks are popped for allocation from the front. A freed block that holds no
cached content goes to the front (it is worth nothing), a freed cached block to the back, so
cached blocks are evicted least-recently-freed first (LRU). A request's blocks are released tail
first, so its prefix (most shareable) outlives its suffix.

All per-step operations are O(blocks touched); only ``check_invariants`` scans the pool.

KV events (``attach_kv_events``): a block hash entering the prefix cache or leaving it (evicted
for a new allocation) is told to a :class:`KvEventLog` after the cache map changed; O(1) each.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Sequence

from goodput.worker.engine.kv_events import KvEventLog
from goodput.worker.engine.request import Request


class _Block:
    """One KV block's record: its reference count and, while it holds cached content, the
    prefix-cache key (hash, parent hash, identity, tokens) that a hit is verified against."""

    __slots__ = ("ref", "hash", "parent", "ident", "tokens")

    def __init__(self) -> None:
        self.ref = 0
        self.forget()

    def forget(self) -> None:
        """Drop the cached content (the block is then worth nothing to the prefix cache)."""
        self.hash: bytes | None = None
        self.parent: bytes | None = None
        self.ident: bytes | None = None
        self.tokens: tuple[int, ...] | None = None


class BlockManager:
    """Allocator of KV blocks: ref counts, LRU free list, prefix cache, per-request block tables.

    num_blocks: blocks in the pool (>= 1). block_size: token slots per block (>= 1).
    enable_prefix_caching: when False, nothing is hashed and ``get_computed_blocks`` never hits.
    cache_identity: model identity string mixed into every block hash (model name + revision).

    Not thread-safe: the engine calls it from one thread (inside scheduler steps).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_identity: str = "") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_identity = cache_identity
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._identity_cache: dict[str | None, bytes] = {}
        # Prefix-cache counters, in tokens (vLLM's prefix_cache_queries / hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.kv_events: KvEventLog | None = None

    @classmethod
    def from_config(cls, config) -> "BlockManager":
        """Build from an ``EngineConfig`` (num_blocks, block_size, prefix caching, identity)."""
        return cls(config.num_blocks, config.block_size, config.enable_prefix_caching,
                   config.cache_identity)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached-but-free blocks included)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one block table."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """KV usage ratio in [0, 1]: referenced blocks / all blocks (cached-but-free = free)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (referenced or free)."""
        return len(self._cached)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def attach_kv_events(self, log: KvEventLog) -> None:
        """Tell ``log`` every block hash that enters or leaves the prefix cache from now on (and
        let it ask whether a hash is cached)."""
        log.is_cached = self._cached.__contains__
        self.kv_events = log

    def prompt_block_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """The prefix-cache hashes of the full blocks of ``token_ids`` (the chain a request with
        these tokens and salt gets); pure, any thread."""
        out: list[bytes] = []
        self._extend_chain(out, self._identity(cache_salt), token_ids, len(token_ids) // self.block_size)
        return out

    # ---- hashing ---------------------------------------------------------------------------
    def _identity(self, cache_salt: str | None) -> bytes:
        ident = self._identity_cache.get(cache_salt)
        if ident is None:
            # Length-prefixed fields, so no (identity, salt) pair can spell another one.
            h = hashlib.blake2b(digest_size=32)
            for part in (self.cache_identity, cache_salt):
                raw = b"" if part is None else part.encode()
                h.update(b"\x00" if part is None else b"\x01" + len(raw).to_bytes(8, "little") + raw)
            ident = h.digest()
            if len(self._identity_cache) < 4096:  # salts are per tenant; bound the memo anyway
                self._identity_cache[cache_salt] = ident
        return ident

    @staticmethod
    def hash_block(parent: bytes | None, identity: bytes, tokens: Sequence[int]) -> bytes:
        """Chained block hash: blake2b-256(parent || identity || tokens as int64)."""
        h = hashlib.blake2b(parent or b"\x00" * 32, digest_size=32)
        h.update(identity)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def _update_block_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes = req.block_hashes
        if len(hashes) >= num_full_blocks:
            return
        self._extend_chain(hashes, self._identity(req.cache_salt), req.all_token_ids, num_full_blocks)

    def _extend_chain(self, hashes: list[bytes], ident: bytes, token_ids: Sequence[int], num_full_blocks: int) -> None:
        """Append to ``hashes`` (the chain of the first ``len(hashes)`` full blocks of
        ``token_ids``) the hashes of the blocks up to ``num_full_blocks``."""
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            parent = self.hash_block(parent, ident, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)

    # ---- prefix cache lookup ----------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest verified prefix of ``req`` already in the cache.

        Returns (block ids, number of hit tokens = len(blocks) * block_size). The blocks are NOT
        referenced yet: pass them to ``allocate_slots``. Hits are capped at
        ``(num_tokens - 1) // block_size`` blocks because the last token must be computed to
        produce logits. Returns ([], 0) for a request that already holds blocks or when prefix
        caching is off.
        """
        if not self.enable_prefix_caching or req.block_ids:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return [], 0
        self._update_block_hashes(req, max_blocks)
        ident = self._identity(req.cache_salt)
        bs = self.block_size
        toks = req.all_token_ids
        blocks: list[int] = []
        parent: bytes | None = None
        for i in range(max_blocks):
            h = req.block_hashes[i]
            bid = self._cached.get(h)
            if bid is None:
                break
            # Verify: a hash match alone must never hand out another tenant's or prefix's KV.
            blk = self._blocks[bid]
            if (blk.ident != ident or blk.parent != parent
                    or blk.tokens != tuple(toks[i * bs:(i + 1) * bs])):
                break
            blocks.append(bid)
            parent = h
        return blocks, len(blocks) * bs

    # ---- allocation -------------------------------------------------------------------------
    def _num_new_blocks(self, req: Request, num_new_tokens: int, computed: Sequence[int]) -> int:
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return max(0, self.blocks_for_tokens(total) - len(req.block_ids) - len(computed))

    def can_allocate(self, req: Request, num_new_tokens: int,
                     new_computed_blocks: Sequence[int] = ()) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed (no side effects)."""
        need = self._num_new_blocks(req, num_new_tokens, new_computed_blocks)
        # Cached-but-free hit blocks leave the free list too, so they count against it.
        taken = sum(1 for b in new_computed_blocks if self._blocks[b].ref == 0)
        return need + taken <= len(self._free)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> bool:
        """Reserve KV slots so that ``req`` can compute ``num_new_tokens`` more tokens.

        All or nothing: on success the block table covers positions
        ``[0, num_computed_tokens + num_new_tokens)`` and True is returned; on failure nothing
        changes and False is returned.

        new_computed_blocks: prefix-cache hits from ``get_computed_blocks`` (only for a request
            without blocks); they are referenced (ref += 1, out of the free list), appended to the
            table, and ``req.num_computed_tokens`` advances by their tokens. This also counts the
            prefix-cache query (``req.num_tokens`` tokens) and hits.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if new_computed_blocks and (req.block_ids or req.num_computed_tokens):
            raise ValueError(f"request {req.request_id!r} already has KV; prefix hits only apply "
                             "to a request without blocks")
        owner = self._tables.get(req.request_id)
        if owner is not None and owner is not req.block_ids:
            raise ValueError(f"another request with id {req.request_id!r} holds blocks")
        if not self.can_allocate(req, num_new_tokens, new_computed_blocks):
            return False
        need = self._num_new_blocks(req, num_new_tokens, new_computed_blocks)
        is_first = not req.block_ids
        table = req.block_ids
        for bid in new_computed_blocks:
            blk = self._blocks[bid]
            if blk.ref == 0:
                del self._free[bid]
            blk.ref += 1
            table.append(bid)
        for _ in range(need):
            table.append(self._pop_free())
        if table:
            self._tables[req.request_id] = table
        req.num_computed_tokens += len(new_computed_blocks) * self.block_size
        if is_first and self.enable_prefix_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        return True

    def _pop_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        blk = self._blocks[bid]
        if blk.hash is not None:  # evict its cached content
            if self._cached.get(blk.hash) == bid:
                del self._cached[blk.hash]
                if self.kv_events is not None:
                    self.kv_events.block_evicted(blk.hash)
            blk.forget()
        blk.ref = 1
        return bid

    def cache_full_blocks(self, req: Request) -> None:
        """Offer ``req``'s newly completed full blocks (KV computed) to the prefix cache.

        Call after a step's KV is written (the scheduler does it when committing a step). A block
        whose hash is already cached by another block (two requests computed the same prefix at
        once) stays uncached; it is recycled first when freed.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if num_full <= req.num_cached_blocks:
            return
        self._update_block_hashes(req, num_full)
        ident = self._identity(req.cache_salt)
        bs = self.block_size
        toks = req.all_token_ids
        for i in range(req.num_cached_blocks, num_full):
            blk = self._blocks[req.block_ids[i]]
            h = req.block_hashes[i]
            if blk.hash is not None or h in self._cached:  # already cached (hit, fork or twin)
                continue
            blk.hash = h
            blk.parent = req.block_hashes[i - 1] if i else None
            blk.ident = ident
            blk.tokens = tuple(toks[i * bs:(i + 1) * bs])
            self._cached[h] = req.block_ids[i]
            if self.kv_events is not None:
                self.kv_events.block_stored(h)
        req.num_cached_blocks = num_full

    def free(self, req: Request) -> None:
        """Drop ``req``'s references to its blocks (tail first); empty its block table.

        Blocks reaching ref 0 go to the free list; cached ones stay reusable until evicted.
        Idempotent: freeing a request without blocks does nothing.
        """
        table = req.block_ids
        owner = self._tables.pop(req.request_id, None)
        if owner is not None and owner is not table:
            self._tables[req.request_id] = owner
            raise ValueError(f"request {req.request_id!r} does not own the blocks registered under its id")
        for bid in reversed(table):
            blk = self._blocks[bid]
            if blk.ref <= 0:
                raise RuntimeError(f"block {bid} freed more often than referenced")
            blk.ref -= 1
            if blk.ref == 0:
                self._free[bid] = None
                if blk.hash is None:
                    self._free.move_to_end(bid, last=False)
        table.clear()
        req.num_cached_blocks = 0

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` (same tokens, no blocks yet) share ``parent``'s computed FULL blocks.

        Copy-on-write rule for the partial last block: it is never shared. The child references
        the parent's full blocks (ref += 1 each) and its ``num_computed_tokens`` is set to the
        full-block boundary, so the tokens of the parent's partial tail block are recomputed
        into a fresh block on the child's next step ("copy by recompute"; at most
        block_size - 1 tokens). Hence no block that anyone still appends to is ever shared, and
        the runner needs no block-copy operation. The child always keeps at least one token to
        compute (a prompt that ends on a block boundary shares one block fewer), so it gets
        logits of its own.
        """
        if child.block_ids or child.num_computed_tokens:
            raise ValueError(f"fork target {child.request_id!r} already has KV")
        if child.request_id in self._tables or child.request_id == parent.request_id:
            raise ValueError(f"fork target id {child.request_id!r} is already in use")
        if child.cache_salt != parent.cache_salt:
            raise ValueError("fork across cache salts would share KV between tenants")
        if child.all_token_ids[:parent.num_computed_tokens] != \
                parent.all_token_ids[:parent.num_computed_tokens]:
            raise ValueError("fork target's tokens differ from the parent's computed tokens")
        # the child keeps at least one token to compute: it needs logits of its own to sample
        num_full = min(parent.num_computed_tokens // self.block_size, len(parent.block_ids),
                       (child.num_tokens - 1) // self.block_size)
        for bid in parent.block_ids[:num_full]:
            self._blocks[bid].ref += 1
            child.block_ids.append(bid)
        if child.block_ids:
            self._tables[child.request_id] = child.block_ids
        child.num_computed_tokens = num_full * self.block_size
        child.block_hashes = list(parent.block_hashes[:num_full])
        child.num_cached_blocks = min(parent.num_cached_blocks, num_full)

    # ---- maintenance / checks ------------------------------------------------------------------
    def block_ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def free_block_order(self) -> list[int]:
        """Free block ids in allocation (eviction) order; O(pool), for tests and debugging."""
        return list(self._free)

    def check_invariants(self, requests: Iterable[Request] | None = None) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent. O(pool); tests only.

        Checks: allocated (ref > 0) + free == pool; no block with ref > 0 in the free list and no
        ref-0 block outside it; every ref count equals the number of block-table references; no
        table lists a block twice; the prefix-cache map points at blocks carrying that hash.
        requests: optionally the running requests; each must own exactly its registered table
        and its blocks must be referenced (never freed or reused under it).
        """
        counts = [0] * self.num_blocks
        for rid, table in self._tables.items():
            assert table, f"empty table registered for {rid}"
            assert len(set(table)) == len(table), f"request {rid} lists a block twice: {table}"
            for bid in table:
                assert 0 <= bid < self.num_blocks, f"block id {bid} out of range"
                counts[bid] += 1
        allocated = 0
        for bid in range(self.num_blocks):
            ref = self._blocks[bid].ref
            assert ref == counts[bid], f"block {bid}: ref {ref} != {counts[bid]} table references"
            if ref > 0:
                allocated += 1
                assert bid not in self._free, f"block {bid} has ref {ref} but is in the free list"
            else:
                assert bid in self._free, f"block {bid} has ref 0 but is not in the free list"
        assert allocated + len(self._free) == self.num_blocks, "allocated + free != pool"
        assert allocated <= self.num_blocks
        for h, bid in self._cached.items():
            assert self._blocks[bid].hash == h, f"cache map entry for block {bid} does not match its hash"
        if requests is not None:
            for req in requests:
                if req.block_ids:
                    assert self._tables.get(req.request_id) is req.block_ids, \
                        f"request {req.request_id} table not registered"
                for bid in req.block_ids:
                    assert self._blocks[bid].ref > 0 and bid not in self._free, \
                        f"block {bid} of live request {req.request_id} is free"
                assert len(req.block_ids) * self.block_size >= req.num_computed_tokens, \
                    f"request {req.request_id} computed tokens exceed its table"
