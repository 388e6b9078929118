"""AttentionMetadata for hand-made attention test cases (shared by the kernel tests)."""
from __future__ import annotations

import torch
from goodput.worker.model.attention.base import AttentionMetadata


def attention_meta(seqs: list[tuple[int, int]], block_tables: torch.Tensor) -> AttentionMetadata:
    """AttentionMetadata for (context_len, query_len) sequences over ``block_tables`` int32 [B, nb];
    the slot mapping is zeros (the tests write K/V themselves)."""
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    lens = [c + n for c, n in seqs]
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32), block_tables=block_tables,
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64), max_query_len=max(n for _, n in seqs),
        max_seq_len=max(lens), query_start_loc_list=qsl, seq_lens_list=lens)
