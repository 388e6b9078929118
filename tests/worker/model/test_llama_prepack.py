"""The bf16 weights are pre-packed for oneDNN only where oneDNN can run its bf16 path: on a CPU
without AVX-512 BW/VL/DQ or AVX-NE-CONVERT (e.g. an AVX2-only node) the reorder raises, and a
worker that tried it would fail to load the model (what the worker image hit on such a node)."""
from __future__ import annotations

import torch
from goodput.worker.model.llama import _can_prepack


def test_prepack_is_chosen_exactly_where_the_reorder_works():
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 64).bfloat16(), 1)
        works = True
    except RuntimeError:
        works = False
    assert _can_prepack(torch.bfloat16, torch.device("cpu")) == works
    assert not _can_prepack(torch.float32, torch.device("cpu"))
