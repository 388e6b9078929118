"""The fused C++ layer ops (``csrc/layer_ops.cpp``) against the torch ops they replace in
``llama.py``, and the model's fused forward against its torch forward on the real model.

bfloat16 must match the torch ops bit for bit (each intermediate rounded like torch rounds it);
float32 matches exactly where no reduction order or exp is involved (residual add, RoPE) and to a
few ulps otherwise (RMSNorm's sum of squares, SiLU's exp).
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from goodput.worker.model import cpu_kernels
from runner_steps import greedy_steps

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the CPU kernels")
EPS = 1e-5
H, KV, D_HEAD, HIDDEN, INTER = 9, 3, 64, 576, 1536   # SmolLM2-135M's shapes


@pytest.fixture(scope="module")
def ops():
    mod = cpu_kernels.load()
    assert mod is not None, cpu_kernels.load_error()
    return mod


def rms_ref(x, w):  # llama.py's torch path (Hugging Face LlamaRMSNorm)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * xf.to(x.dtype)


def data(dtype, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, HIDDEN, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    return g, x, w


def assert_matches(got, want, dtype, rel=4e-6):
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=rel, atol=rel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_residual_add(ops, dtype):
    g, x, w = data(dtype)
    assert_matches(ops.rms_norm(x, w, EPS), rms_ref(x, w), dtype)
    wide = torch.randn(7, HIDDEN + 64, generator=g).to(dtype)[:, :HIDDEN]  # rows with a stride
    assert_matches(ops.rms_norm(wide, w, EPS), rms_ref(wide, w), dtype)
    delta = torch.randn(7, HIDDEN, generator=g).to(dtype)
    x_fused, x_torch = x.clone(), x.clone()
    y = ops.add_rms_norm_(x_fused, delta, w, EPS)
    x_torch += delta
    assert torch.equal(x_fused, x_torch)  # the residual stream itself: exact in both dtypes
    assert_matches(y, rms_ref(x_torch, w), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_equals_the_torch_rotate_half(ops, dtype):
    g = torch.Generator().manual_seed(1)
    T = 5
    qkv = torch.randn(T, (H + 2 * KV) * D_HEAD, generator=g).to(dtype)
    cs = torch.randn(T, 2, D_HEAD, generator=g).to(dtype)
    half = D_HEAD // 2
    qk = qkv[:, :(H + KV) * D_HEAD].view(T, H + KV, D_HEAD)
    rot = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    want = qk * cs[:, 0, None, :]
    want += rot * cs[:, 1, None, :]
    got = qkv.clone()
    ops.rope_(got, cs, H + KV, D_HEAD)
    assert torch.equal(got[:, :(H + KV) * D_HEAD].view(T, H + KV, D_HEAD), want)
    assert torch.equal(got[:, (H + KV) * D_HEAD:], qkv[:, (H + KV) * D_HEAD:])  # V untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(ops, dtype):
    gu = (3 * torch.randn(6, 2 * INTER, generator=torch.Generator().manual_seed(2))).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    want = F.silu(gu[:, :INTER])
    want *= gu[:, INTER:]
    assert_matches(ops.silu_mul(gu), want, dtype, rel=2e-6)


def test_silu_mul_bf16_every_gate_value(ops):
    """All 65,536 bfloat16 gate values (the vectorized loop, 16 lanes, and its masked tail: odd I)
    against torch's silu·up, bit for bit; NaN gates give NaN."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[:-3]
    up = torch.full_like(gate, 1.5)
    got = ops.silu_mul(torch.cat([gate, up])[None])[0]
    want = F.silu(gate)
    want *= up
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_bad_inputs_raise(ops):
    x = torch.randn(3, HIDDEN)
    with pytest.raises(RuntimeError, match="2-D CPU tensor"):
        ops.rms_norm(x[0], torch.ones(HIDDEN), EPS)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(x.half(), torch.ones(HIDDEN).half(), EPS)
    with pytest.raises(RuntimeError, match="w must be"):
        ops.rms_norm(x, torch.ones(HIDDEN + 1), EPS)
    with pytest.raises(RuntimeError, match="delta must match"):
        ops.add_rms_norm_(x, x[:2].clone(), torch.ones(HIDDEN), EPS)
    with pytest.raises(RuntimeError, match="cs must be"):
        ops.rope_(torch.randn(3, 960), torch.randn(2, 2, 64), 12, 64)
    with pytest.raises(RuntimeError, match="even number of columns"):
        ops.silu_mul(torch.randn(3, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [1, 5, 16, 17, 1000, 49152])
def test_argmax_rows_is_torch_max_indices(ops, dtype, V):
    """Greedy sampling's argmax over the model-dtype logits: torch.max's index for every row —
    ties (the first index), all equal, a NaN (the first NaN), all -inf, +inf last, masked tails."""
    x = torch.randn(7, V, generator=torch.Generator().manual_seed(V)).to(dtype)
    x[1] = 0.0
    if V > 3:
        x[2, 3] = x[2, V - 1] = float("nan")
        x[3] = float("-inf")
        x[4, V // 2] = x[4, V - 1] = 100.0
    x[5, -1] = float("inf")
    assert torch.equal(ops.argmax_rows(x), x.max(dim=-1).indices)
    if V > 1:  # rows with a stride (a view)
        view = x[:, :V - 1]
        assert torch.equal(ops.argmax_rows(view), view.max(dim=-1).indices)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 0.25)])
def test_fused_forward_equals_torch_forward(dtype, tol):
    """The real model over a prefill chunk and two decode steps, once through the fused ops and
    once through the torch ops (the path used where the kernels cannot be built)."""
    from goodput.worker.model.runner import ModelRunner
    runner = ModelRunner("smollm2", dtype=dtype, num_blocks=8, block_size=16, attention_backend="torch")
    assert runner.model.fused_ops is not None
    model = runner.model
    for lin in [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]:
        lin.small_rows = -1  # the float weights' matmuls in both runs: this test is about the element-wise ops
    outs = {}
    for name, fused in (("fused", runner.model.fused_ops), ("torch", None)):
        runner.model.fused_ops = fused
        outs[name] = greedy_steps(runner, "The capital of France is", 3)
    assert outs["fused"][0] == outs["torch"][0]  # the same greedy tokens
    assert (outs["fused"][1] - outs["torch"][1]).abs().max().item() < tol
