"""The whole engine with the Triton attention backend gives the torch backend's greedy tokens.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported), which is slow over 30 layers, so this runs two short prompts for a few tokens with a
tiny token budget: the longer prompt is chunk-prefilled across steps (chunk boundaries mid-block)
while the shorter one decodes, so the Triton kernels see mixed prefill/decode batches of the real
model. One model load serves both runs: the runner's attention backend is swapped between them,
and prefix caching is off so the second run recomputes every block.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.model.attention import triton_ops

PROMPTS = ["The capital of France is", "Write a haiku about the sea and the moon, please:"]
MAX_TOKENS = 2


@pytest.fixture(scope="module")
def engine():
    if not torch.cuda.is_available() and not triton_ops.is_interpreted():
        importlib.reload(triton_ops)  # imported before TRITON_INTERPRET was set: rebuild kernels
    from goodput.worker.engine_args import EngineArgs, build_engine
    return build_engine(EngineArgs(
        model="smollm2", dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu",
        attention_backend="torch", kv_cache_memory=8 << 20, block_size=16,
        max_num_batched_tokens=8, max_model_len=128, enable_prefix_caching=False))


@pytest.mark.slow
def test_triton_engine_matches_torch_backend(engine):
    from goodput.worker.model.attention.triton_backend import TritonAttentionBackend
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[1]) > 8, "the second prompt must need several prefill chunks"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    torch_backend = engine.runner.attention_backend
    assert torch_backend.name == "torch"
    want = [ids for ids, _, _ in engine.generate(prompts, params)]
    engine.runner.attention_backend = TritonAttentionBackend()
    try:
        got = [ids for ids, _, _ in engine.generate(prompts, params)]
    finally:
        engine.runner.attention_backend = torch_backend
    assert all(len(ids) == MAX_TOKENS for ids in want)
    assert got == want
