"""The ``cpu`` attention backend: decode rows through goodput's C++ paged-attention kernel,
which reads each sequence's keys and values in place through its block table (no per-layer gather
into a padded buffer, no padding mask); bfloat16 prefill chunks through the C++ paged prefill kernel
(``csrc/paged_prefill.cpp``: FlashAttention-2 tiles on ATen's AMX / AVX-512 BF16 brgemm, K/V packed
from the cache pages, causal mask by position), where this CPU has that brgemm; other prefill
chunks (float32, CPUs without it) through the torch reference.

Why: torch's CPU SDPA over gathered K/V reads every decode step's KV twice plus padding (the
gather copies it, SDPA reads the copy) and its flash kernel is slow for one query row per KV-head
group; at 16 sequences × 2k tokens that made decode attention ~4× what its bytes explain
(``bench/results/*-cpu.md``, "How cost grows with context"). For prefill, the torch path gathers
each chunk's whole context per layer and runs SDPA with an additive [chunk, context] mask: an
8,000-token prompt in 512-token chunks spent ~3/4 of its CPU time there at ~200 GFLOP/s per core;
the prefill kernel runs the same chunks at ~400 (``bench/results/2026-12-04-prefill-cpu.md``).
Kernels: ``cpu_kernels.py``.
"""
from __future__ import annotations

import torch
from goodput.worker.model import cpu_kernels
from goodput.worker.model.attention.base import AttentionMetadata
from goodput.worker.model.attention.torch_ref import TorchReferenceBackend, _Plan, _PrefillSeq


class CpuPagedBackend(TorchReferenceBackend):
    """Implements ``attention.base.AttentionBackend``; RuntimeError at construction when the C++
    kernels cannot be built here (``cpu_kernels.load_error()`` says why)."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._mod = cpu_kernels.load()
        if self._mod is None:
            raise RuntimeError(f"the cpu attention backend's C++ kernel is unavailable: {cpu_kernels.load_error()}")
        # bfloat16 prefill chunks through the C++ kernel (needs ATen's packed bf16 brgemm); False: torch's
        self.native_prefill = bool(getattr(self._mod, "paged_prefill_supported", lambda: False)())

    def _prefill_native(self, dtype: torch.dtype) -> bool:
        return self.native_prefill and dtype == torch.bfloat16

    def _needs_prefill_mask(self, dtype: torch.dtype) -> bool:
        return not self._prefill_native(dtype)

    def _prefill(self, p: _PrefillSeq, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, scale: float) -> None:
        """One prefill chunk through ``paged_prefill_attention`` (reads K/V through the block table,
        writes rows [p.q_start, p.q_end) of out in place); the torch reference's otherwise."""
        if not (self._prefill_native(q.dtype) and k_cache.dtype == q.dtype and q.stride(2) == 1
                and q.stride(1) == q.shape[2] and out.is_contiguous()):
            return super()._prefill(p, q, k_cache, v_cache, out, scale)
        if p.table is None:  # once per step (the plan), not per layer; the kernel checks the ids
            p.table = p.blocks.to(torch.int32).contiguous()
        self._mod.paged_prefill_attention(q[p.q_start:p.q_end], k_cache, v_cache, p.table, p.context_len,
                                          out[p.q_start:p.q_end], scale)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """One C++ pass (``write_kv`` in ``csrc/paged_attention.cpp``) instead of two index_copy_
        and a padding mask; k, v may be views of the fused QKV output. Slots < 0 are skipped."""
        if k.stride(1) != k.shape[2] or v.stride(1) != v.shape[2] or k.dtype != k_cache.dtype:
            return super().write_kv(k, v, k_cache, v_cache, slot_mapping)
        self._mod.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self._pool = (k_cache.shape[0], k_cache.shape[2])  # (num_blocks, n_kv) for the step's plan
        return super().forward(q, k_cache, v_cache, meta, scale)

    def decode_only_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a step whose rows are all decode rows (one new token per sequence, rows in sequence
        order): (block tables int32 [B, nb], lengths int32 [B], splits) exactly as :meth:`forward`
        passes them to the kernel this step (block ids checked against the pool); None for any
        other step. Shares :meth:`forward`'s per-step plan (built once per ``meta``)."""
        block_size = k_cache.shape[1]
        self._pool = (k_cache.shape[0], k_cache.shape[2])
        if meta is not self._plan_meta or block_size != self._plan_block_size:
            self._plan = self._make_plan(meta, block_size, k_cache.device, k_cache.dtype)
            self._plan_meta, self._plan_block_size = meta, block_size
        plan = self._plan
        if plan is None or not plan.only_dec or not plan.num_dec:
            return None
        return plan.dec_tables, plan.dec_lens, plan.dec_splits

    def _plan_decode(self, plan: _Plan, meta: AttentionMetadata, dec: list[int], seq_lens: list[int],
                     block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        num_blocks, kv_heads = self._pool
        lens = [seq_lens[i] for i in dec]
        nb = -(-max(lens) // block_size)
        idx = torch.tensor(dec, dtype=torch.long, device=device)
        tables = meta.block_tables.index_select(0, idx)[:, :nb].to(torch.int32).contiguous()
        # once per step, not per layer: the kernel reads the pool at these ids unchecked
        if int(tables.min()) < 0 or int(tables.max()) >= num_blocks:
            raise ValueError(f"block id outside the pool [0, {num_blocks})")
        plan.dec_tables = tables
        plan.dec_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        plan.dec_splits = cpu_kernels.num_splits(len(dec) - meta.draft_rows, kv_heads, max(lens))

    def _decode(self, plan: _Plan, qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scale: float) -> torch.Tensor:
        return cpu_kernels.checked_call(self._mod, qd, k_cache, v_cache, plan.dec_tables, plan.dec_lens,
                                        scale, plan.dec_splits)
