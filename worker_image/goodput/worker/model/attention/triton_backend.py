"""Triton paged-attention backend (the GPU default) over the shared paged KV cache layout.

Implements :class:`goodput.worker.model.attention.base.AttentionBackend` with the kernels in
:mod:`goodput.worker.model.attention.triton_ops`: ``write_kv`` scatters new K/V by slot mapping;
``forward`` runs one launch for the whole mixed prefill/decode batch, or the split-KV
(Flash-Decoding) pair of launches for small decode-only batches with long contexts
(rule: :func:`~goodput.worker.model.attention.triton_ops.choose_num_kv_splits`).
"""
from __future__ import annotations

import torch
from goodput.worker.model.attention import triton_ops
from goodput.worker.model.attention.base import AttentionMetadata


class TritonAttentionBackend:
    """Paged attention with Triton kernels (CUDA, or the CPU interpreter with TRITON_INTERPRET=1).

    num_kv_splits: None = choose per call by the documented rule and the device's SM count;
        1 = never split; n > 1 = always split decode-only batches into n ranges.
    block_m, tile_n: optional tile sizes (query rows per program, keys per step; powers of 2 >= 16).
    """

    name = "triton"

    def __init__(self, num_kv_splits: int | None = None, block_m: int | None = None,
                 tile_n: int | None = None) -> None:
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be None or >= 1, got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits
        self.block_m = block_m
        self.tile_n = tile_n
        # Arguments validated for the current step: the layers of one step repeat the same
        # metadata and shapes, so only the first call pays for the host-side checks.
        self._checked_write: tuple | None = None
        self._checked_attn: tuple | None = None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [T, n_kv_heads, head_dim]; caches [num_blocks, block_size, n_kv_heads, head_dim];
        slot_mapping int [T] (entries < 0 skipped). Writes in place."""
        key = (slot_mapping.data_ptr(), k.shape, k.dtype, k.device, k_cache.shape, k_cache.dtype)
        check = key != self._checked_write
        triton_ops.write_kv(k, v, k_cache, v_cache, slot_mapping, check=check)
        if check:
            self._checked_write = key

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, n_heads, head_dim] -> [T, n_heads, head_dim] (q's dtype); softmax in fp32.

        Rows of q past ``query_start_loc[-1]`` (padding) come back as zeros.
        """
        num_kv_splits = self.num_kv_splits
        if num_kv_splits is not None and num_kv_splits > 1 and meta.max_query_len > 1:
            num_kv_splits = 1  # forced splitting only applies to decode-only batches
        key = (id(meta), meta.block_tables.data_ptr(), q.shape, q.dtype, q.device, k_cache.shape,
               k_cache.dtype)
        check = key != self._checked_attn
        out = None
        qsl = meta.query_start_loc_list
        if qsl is not None and qsl[-1] == q.shape[0]:
            out = torch.empty_like(q)  # every row is written: skip the zero fill
        result = triton_ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            meta.max_query_len, meta.max_seq_len, scale,
            num_kv_splits=num_kv_splits, out=out, block_m=self.block_m, tile_n=self.tile_n,
            check=check)
        if check:
            self._checked_attn = key
        return result
