"""Attention backend interface over the paged KV cache.

Cache layout (one for every backend): per layer, ``k_cache`` and ``v_cache`` each of shape
``[num_blocks, block_size, n_kv_heads, head_dim]``. Token at absolute position p of a request
lives in physical block ``block_table[p // block_size]`` at offset ``p % block_size``; its flat
slot is ``block * block_size + offset`` (the ``slot_mapping``). Sources: PagedAttention
(Kwon et al., SOSP 2023), vLLM's flash-attn varlen metadata.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Flat mixed batch of B sequences and T = sum of query lengths tokens.

    query_start_loc: int32 [B + 1], cumulative query lengths (sequence i's new tokens are
        rows ``query_start_loc[i]:query_start_loc[i+1]`` of q).
    seq_lens: int32 [B], context length after this step (cached + new tokens).
    context_lens: int32 [B], tokens already cached before this step (= seq_lens - query lens).
    block_tables: int32 [B, max_blocks_per_seq], padded with 0 past each sequence's blocks.
    slot_mapping: int64 [T], flat cache slot for each new token (-1 = padding, do not write).
    max_query_len, max_seq_len: Python ints (kernel launch sizes).
    Queries attend causally within their own chunk and fully to the sequence's cached context.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # CPU copies as Python lists, so the torch reference avoids device syncs.
    query_start_loc_list: list[int] | None = None
    seq_lens_list: list[int] | None = None
    # Decode rows that are a drafted decode's extra positions (speculative decoding: one decode
    # row per position of one request); split-KV kernels size their splits by the requests, so a
    # draft never changes the arithmetic of its request's positions.
    draft_rows: int = 0


class AttentionBackend(Protocol):
    """One paged-attention implementation (torch reference, Triton, ...)."""

    name: str

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter new keys/values into the cache in place.

        k, v: [T, n_kv_heads, head_dim]; caches: [num_blocks, block_size, n_kv_heads, head_dim];
        slot_mapping: int64 [T] (entries < 0 are skipped).
        """
        ...

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention for every query row; q: [T, n_heads, head_dim] -> [T, n_heads, head_dim].

        GQA: query head h reads KV head ``h // (n_heads // n_kv_heads)``. Softmax in fp32.
        The new tokens' K/V must already be written (call ``write_kv`` first).
        """
        ...
