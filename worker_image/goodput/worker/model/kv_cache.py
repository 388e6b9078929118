"""Paged KV cache sizing and allocation.

Memory of the KV cache for T tokens (PagedAttention, Kwon et al., SOSP 2023):
``m = 2 · L · n_kv · d_head · b · T`` bytes — keys and values (2) for every layer (L), KV head
(n_kv) and head dimension (d_head) at b bytes per element. The pool is cut into blocks of
``block_size`` tokens; per layer the cache is ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, n_kv_heads, head_dim]`` (the layout in ``attention/base.py``).
"""
from __future__ import annotations

import torch


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V for one token over all layers: ``2 · L · n_kv · d_head · b``."""
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if int(v) <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                          dtype_bytes: int, block_size: int) -> int:
    """Whole blocks that fit in ``budget_bytes``: ``floor(budget / (bytes_per_token · block_size))``.

    Raises ValueError when the budget holds less than one block (the message names both sizes).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    per_block = kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes) * block_size
    n = int(budget_bytes) // per_block
    if n < 1:
        raise ValueError(f"KV cache budget of {int(budget_bytes)} bytes is smaller than one block "
                         f"({per_block} bytes = {block_size} tokens)")
    return n


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu"
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, n_kv_heads, head_dim]``.

    One zero-filled allocation of ``[L, 2, num_blocks, block_size, n_kv, d]`` viewed per layer
    (zeros so never-written padding slots hold finite values).
    """
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
    pool = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                       dtype=dtype, device=device)
    return [(pool[i, 0], pool[i, 1]) for i in range(num_layers)]
