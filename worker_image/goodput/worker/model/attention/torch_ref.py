"""Torch reference attention over the paged KV cache (the CPU default backend).

For every sequence of a flat mixed batch, gather its blocks via the block table and run
``F.scaled_dot_product_attention``: queries attend causally within their own chunk and fully to
the context cached before it (PagedAttention, Kwon et al. 2023; the varlen layout of vLLM's
flash-attn metadata). Decode rows (query length 1) are batched into one gather and one SDPA call
with a key-padding mask, so a decode step costs O(1) Python calls per layer, not O(batch).

GQA without copying K/V per query head: the ``g = n_heads // n_kv_heads`` query heads that share
a KV head are laid out as extra query rows of that KV head (query head h reads KV head h // g).
Softmax precision: float32 caches use float32 throughout; for bf16/fp16 torch's CPU SDPA
kernels accumulate the softmax in float32 (opmath), and the math fallback upcasts likewise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from goodput.worker.model.attention.base import AttentionMetadata


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> additive 0 / -inf mask in the query dtype (SDPA would
    otherwise convert the bool mask on every layer)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


@dataclass
class _PrefillSeq:
    q_start: int
    q_end: int
    seq_len: int
    context_len: int
    blocks: torch.Tensor          # [ceil(seq_len / block_size)] physical block ids
    mask: torch.Tensor | None     # [q_len, seq_len] additive; None: plain causal (no cached context) or not built
    table: torch.Tensor | None = None  # int32 [ceil(seq_len / block_size)]: blocks, for a C++ kernel


@dataclass
class _Plan:
    """Per-step gather indices and masks, shared by every layer of the step."""

    dec_rows: torch.Tensor | None   # [Bd] query rows of decode sequences (None: rows 0..Bd-1)
    num_dec: int
    dec_blocks: torch.Tensor | None  # [Bd * nb] block ids, row-major (one index_select per layer)
    dec_mask: torch.Tensor | None    # [Bd, 1, 1, nb * block_size] additive: 0 attend, -inf padding
    prefills: list[_PrefillSeq]
    # one decode sequence whose blocks are consecutive in the pool: (first block, seq_len);
    # attention then reads the cache in place (a view), with no gather and no mask
    dec_run: tuple[int, int] | None = None
    dec_buf: torch.Tensor | None = None  # [2, Bd * nb, block_size, n_kv, d] K/V gather target, reused by layers
    only_dec: bool = False           # every query row is a decode row, in order (rows 0..Bd-1)
    # the C++ kernel's inputs (cpu_backend.py): int32 [Bd, nb] block tables, int32 [Bd] lengths, splits
    dec_tables: torch.Tensor | None = None
    dec_lens: torch.Tensor | None = None
    dec_splits: int = 1


class TorchReferenceBackend:
    """Paged attention in plain torch; implements ``attention.base.AttentionBackend``."""

    name = "torch"

    def __init__(self) -> None:
        self._plan_meta: AttentionMetadata | None = None
        self._plan_block_size = 0
        self._plan: _Plan | None = None
        self._slots: torch.Tensor | None = None  # slot_mapping whose padding check is cached
        self._slots_keep: torch.Tensor | None = None

    # -- KV write --------------------------------------------------------------------------
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter k, v [T, n_kv, d] into the caches at flat slots ``slot_mapping`` (< 0 skipped)."""
        if slot_mapping.numel() == 0:
            return
        kc = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
        vc = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
        slots = slot_mapping
        if slots is not self._slots:  # once per step, not once per layer (a device sync)
            self._slots = slots
            self._slots_keep = (slots >= 0) if bool((slots < 0).any()) else None
        keep = self._slots_keep
        if keep is not None:
            slots, k, v = slots[keep], k[keep], v[keep]
        kc.index_copy_(0, slots, k.to(kc.dtype))
        vc.index_copy_(0, slots, v.to(vc.dtype))

    # -- attention -------------------------------------------------------------------------
    def _make_plan(self, meta: AttentionMetadata, block_size: int, device: torch.device,
                   dtype: torch.dtype) -> _Plan:
        qsl = meta.query_start_loc_list
        if qsl is None:
            qsl = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_list
        if seq_lens is None:
            seq_lens = meta.seq_lens.tolist()
        dec, pre = [], []
        for i in range(len(seq_lens)):
            qlen = qsl[i + 1] - qsl[i]
            if qlen == 1:
                dec.append(i)
            elif qlen > 1:
                pre.append(i)
        plan = _Plan(None, len(dec), None, None, [])
        if dec:
            rows = [qsl[i] for i in dec]
            if rows != list(range(len(dec))):
                plan.dec_rows = torch.tensor(rows, dtype=torch.long, device=device)
            self._plan_decode(plan, meta, dec, seq_lens, block_size, device, dtype)
        for i in pre:
            s, e, sl = qsl[i], qsl[i + 1], seq_lens[i]
            ctx = sl - (e - s)
            nb = -(-sl // block_size)
            blocks = meta.block_tables[i, :nb].long()
            p = _PrefillSeq(s, e, sl, ctx, blocks, None)
            if ctx > 0 and self._needs_prefill_mask(dtype):
                p.mask = self._prefill_mask(p, device, dtype)
            plan.prefills.append(p)
        plan.only_dec = not pre and plan.dec_rows is None and len(dec) == qsl[-1]
        return plan

    def _plan_decode(self, plan: _Plan, meta: AttentionMetadata, dec: list[int], seq_lens: list[int],
                     block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        """Decode rows' per-step state: gather indices and padding mask (or an in-place run)."""
        lens = torch.tensor([seq_lens[i] for i in dec], dtype=torch.long, device=device)
        nb = -(-max(seq_lens[i] for i in dec) // block_size)
        idx = torch.tensor(dec, dtype=torch.long, device=device)
        plan.dec_blocks = meta.block_tables.index_select(0, idx)[:, :nb].long().reshape(-1)
        if len(dec) == 1:
            ids = plan.dec_blocks.tolist()
            if ids == list(range(ids[0], ids[0] + nb)):
                plan.dec_run = (ids[0], seq_lens[dec[0]])
        if plan.dec_run is None:
            pos = torch.arange(nb * block_size, device=device)
            plan.dec_mask = _additive((pos[None, :] < lens[:, None])[:, None, None, :], dtype)

    def _decode(self, plan: _Plan, qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scale: float) -> torch.Tensor:
        """Attention of the decode rows qd [B, n_heads, d] -> [B, n_heads, d]: one SDPA over the
        gathered (or, for one sequence on consecutive blocks, in-place) K/V."""
        B, H, D = qd.shape
        block_size, KV = k_cache.shape[1], k_cache.shape[2]
        qd = qd.view(B, KV, H // KV, D)
        if plan.dec_run is not None:  # in place: a view of the consecutive blocks
            b0, sl = plan.dec_run
            nb = -(-sl // block_size)
            kd = k_cache[b0:b0 + nb].view(1, nb * block_size, KV, D)[:, :sl].transpose(1, 2)
            vd = v_cache[b0:b0 + nb].view(1, nb * block_size, KV, D)[:, :sl].transpose(1, 2)
        else:
            S = plan.dec_blocks.shape[0] // B * block_size
            kg, vg = self._gather_dec(plan, k_cache, v_cache)
            kd = kg.view(B, S, KV, D).transpose(1, 2)
            vd = vg.view(B, S, KV, D).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.dec_mask, scale=scale)
        return od.reshape(B, H, D)

    @staticmethod
    def _gather_dec(plan: _Plan, k_cache: torch.Tensor, v_cache: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows' blocks, row-major: two [Bd * nb, block_size, n_kv, d] tensors, written
        into one buffer that every layer of the step reuses (no per-layer allocation).
        index_select on dim 0 copies whole contiguous blocks and is parallel; a single
        index_select over a [2, ...] K+V view (dim 1) measured slower with 2 threads."""
        n = plan.dec_blocks.shape[0]
        buf = plan.dec_buf
        if buf is None or buf.dtype != k_cache.dtype or buf.shape[2:] != k_cache.shape[1:]:
            buf = plan.dec_buf = k_cache.new_empty((2, n, *k_cache.shape[1:]))
        torch.index_select(k_cache, 0, plan.dec_blocks, out=buf[0])
        torch.index_select(v_cache, 0, plan.dec_blocks, out=buf[1])
        return buf[0], buf[1]

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, n_heads, d] -> [T, n_heads, d] (rows of zero-length sequences untouched: zeros)."""
        T, H, D = q.shape
        block_size = k_cache.shape[1]
        if meta is not self._plan_meta or block_size != self._plan_block_size:
            self._plan = self._make_plan(meta, block_size, q.device, q.dtype)
            self._plan_meta, self._plan_block_size = meta, block_size
        plan = self._plan
        assert plan is not None
        if plan.num_dec:
            B = plan.num_dec
            qd = q[:B] if plan.dec_rows is None else q.index_select(0, plan.dec_rows)
            od = self._decode(plan, qd, k_cache, v_cache, scale)
            if plan.only_dec and B == T:
                return od
        out = q.new_zeros(T, H, D) if plan.num_dec + sum(p.q_end - p.q_start for p in plan.prefills) < T \
            else torch.empty_like(q)
        if plan.num_dec:
            if plan.dec_rows is None:
                out[:plan.num_dec] = od
            else:
                out.index_copy_(0, plan.dec_rows, od)

        for p in plan.prefills:
            self._prefill(p, q, k_cache, v_cache, out, scale)
        return out

    def _prefill(self, p: _PrefillSeq, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, scale: float) -> None:
        """One prefill chunk: rows [p.q_start, p.q_end) of out [T, H, D] from those of q, causal
        within the chunk and over the p.context_len cached positions before it: the sequence's
        blocks gathered (index_select) and one SDPA over them, the g query heads of a KV head as
        extra rows of its expanded K/V."""
        H, D = q.shape[1], q.shape[2]
        KV = k_cache.shape[2]
        g = H // KV
        n = p.q_end - p.q_start
        qp = q[p.q_start:p.q_end].view(n, KV, g, D).permute(1, 2, 0, 3)          # [KV, g, n, D]
        kp = k_cache.index_select(0, p.blocks).view(-1, KV, D)[:p.seq_len].permute(1, 0, 2)  # [KV, S, D]
        vp = v_cache.index_select(0, p.blocks).view(-1, KV, D)[:p.seq_len].permute(1, 0, 2)
        kp = kp.unsqueeze(1).expand(KV, g, p.seq_len, D)
        vp = vp.unsqueeze(1).expand(KV, g, p.seq_len, D)
        if p.context_len == 0:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
        else:
            mask = p.mask
            if mask is None:  # a subclass's plan that left the mask out
                mask = self._prefill_mask(p, q.device, q.dtype)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
        out[p.q_start:p.q_end] = op.permute(2, 0, 1, 3).reshape(n, H, D)

    @staticmethod
    def _prefill_mask(p: _PrefillSeq, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Additive [q_len, seq_len] mask of a chunk after p.context_len cached positions: query i
        (position context_len + i) attends to positions <= its own."""
        qpos = torch.arange(p.context_len, p.seq_len, device=device)
        return _additive(torch.arange(p.seq_len, device=device)[None, :] <= qpos[:, None], dtype)

    def _needs_prefill_mask(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`_prefill` of this step's chunks reads ``_PrefillSeq.mask`` (built once
        per step in the plan); a subclass whose kernel masks by position says no."""
        return True
