"""The block kernel (``csrc/block_linear.cpp`` via ``block_linear.py``) against a float64
reference over the exact weights gguf-py dequantizes, with an error bound derived from float32
summation; its layout round trip; and the model's few-row path against its float path.

Bound: the kernel computes Σ_b d_b·(Σ_j x_j·(c + q_j)) + (m_b − c·d_b)·(Σ_j x_j) in float32, with
c = 128 for 4-bit codes and bfloat16 x (the codes enter as bfloat16(128 + q), see the kernel's
header) and c = 0 otherwise (bfloat16 x times a small integer is exact; float32 x times an exact
float32 weight is rounded once). Each term passes through at most n = K + K/16 + 16 roundings
(≤ 32 in its block's sum, one scaling or m − c·d, ≤ K/32 across blocks, ≤ 16 in the final
reductions and additions), so the float32 result errs by at most γ_n·A with γ_n = n·u / (1 − n·u),
u = 2⁻²⁴ (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., §3.1, Lemma 3.4 and
§3.1's summation bound) and A = Σ_b |d_b|·Σ_j |x_j|·|c + q_j| + |m_b − c·d_b|·Σ_j |x_j| ≥ Σ|terms|.
The output is then rounded once to x's dtype: at most u_out·|y| more (u_out = 2⁻²⁴ float32, 2⁻⁸
bfloat16).
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from goodput.worker.model import block_linear, cpu_kernels
from goodput.worker.model.block_linear import BlockLinear, from_parts
from goodput.worker.model.quant import Q4Blocks, unpack_gguf_q4, unpack_gguf_q8_0
from runner_steps import greedy_steps

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the CPU kernels")
U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def mod():
    m = cpu_kernels.load()
    assert m is not None, cpu_kernels.load_error()
    return m


def gguf_blocks(kind: str, N: int, K: int, seed: int) -> tuple[Q4Blocks, torch.Tensor]:
    """Random weights quantized by gguf-py itself, unpacked, and gguf-py's dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) * 0.05 + rng.standard_normal((N, 1)) * 0.01).astype(np.float32)
    raw = quantize(w, getattr(GGMLQuantizationType, kind))
    ref = torch.from_numpy(dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(N, K).copy())
    blocks = (unpack_gguf_q8_0 if kind == "Q8_0" else unpack_gguf_q4)(raw, kind, N, K)
    return blocks, ref


def abs_terms(x: torch.Tensor, b: Q4Blocks) -> torch.Tensor:
    """A of the module docstring, float64 [M, N]."""
    M, K = x.shape
    ax = x.double().abs().reshape(M, K // 32, 32)
    c = 128.0 if b.kind != "Q8_0" and x.dtype == torch.bfloat16 else 0.0
    d = b.d.double()
    if b.kind == "Q4_0":  # d·(q − 8) = d·q + (−8d): the kernel's form
        m = -8 * d
    else:
        m = b.m.double() if b.m is not None else torch.zeros_like(d)
    aq = (c + b.q.double()).abs().reshape(-1, K // 32, 32)
    dq = torch.einsum("mbj,nbj,nb->mn", ax, aq, d.abs())
    return dq + torch.einsum("mb,nb->mn", ax.sum(-1), (m - c * d).abs())


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# K = 64, 576, 96, 1536, 32, 992, 384: groups 2; 16+2; 2+1; 3×16; 1; 16+8+4+2+1; 8+4
@pytest.mark.parametrize("M,N,K", [(1, 48, 64), (2, 40, 576), (3, 17, 96), (9, 64, 1536), (17, 16, 32), (2, 24, 992),
                                   (1, 8, 384)])
def test_matches_float64_reference_within_the_summation_bound(mod, kind, dtype, M, N, K):
    blocks, ref_w = gguf_blocks(kind, N, K, seed=M * 1000 + N)
    lin = BlockLinear.from_blocks(kind, blocks.q, blocks.d, blocks.m, mod)
    assert torch.equal(lin.dequantize(), ref_w)  # the kernel's weights are the file's, exactly
    g = torch.Generator().manual_seed(K + M)
    wide = torch.randn(M, K + 32, generator=g).to(dtype)
    for x in (wide[:, :K].contiguous(), wide[:, 32:]):  # contiguous and strided rows
        y = lin(x)
        assert y.dtype == dtype and y.shape == (M, N)
        ref = x.double() @ ref_w.double().T
        n = K + K // 16 + 16
        gamma = n * U32 / (1 - n * U32)
        u_out = 2.0 ** -8 if dtype == torch.bfloat16 else U32
        bound = gamma * abs_terms(x, blocks) + u_out * (ref.abs() + gamma * abs_terms(x, blocks))
        err = (y.double() - ref).abs()
        assert (err <= bound).all(), float((err / bound).max())


def test_layout_round_trip_and_fused_parts(mod):
    a, wa = gguf_blocks("Q4_1", 32, 96, 1)   # odd number of blocks per row (3): a padded pair
    b, wb = gguf_blocks("Q4_0", 16, 96, 2)
    fused = from_parts([a, b], mod)
    assert fused is not None and fused.kind == 0 and fused.codes.shape == (48, 64)
    assert torch.equal(fused.dequantize(), torch.cat([wa, wb]))
    q8, w8 = gguf_blocks("Q8_0", 16, 96, 3)
    assert from_parts([a, q8], mod) is None      # 4- and 8-bit rows do not share one layout
    assert from_parts([a, None], mod) is None    # a part without blocks
    assert torch.equal(from_parts([q8], mod).dequantize(), w8)
    x = torch.randn(2, 96)
    torch.testing.assert_close(fused(x), x @ torch.cat([wa, wb]).T, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise(mod):
    b, _ = gguf_blocks("Q4_1", 16, 64, 4)
    lin = BlockLinear.from_blocks("Q4_1", b.q, b.d, b.m, mod)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        lin(torch.randn(64, 2).T)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        lin(torch.randn(1, 64).half())
    with pytest.raises(RuntimeError, match=r"d must be .*\[N, K/32\]"):
        lin(torch.randn(1, 96))                      # K does not match the blocks
    with pytest.raises(ValueError, match="block kind"):
        BlockLinear.from_blocks("Q5_K", b.q, b.d, b.m, mod)
    with pytest.raises(ValueError, match="not a float16 value"):
        BlockLinear.from_blocks("Q4_1", b.q, b.d + 1e-6, b.m, mod)


def test_choose_says_why_not(monkeypatch):
    assert block_linear.choose(torch.device("cuda"), torch.bfloat16, "none")[0] is None
    mod, why = block_linear.choose(torch.device("cpu"), torch.bfloat16, "int4")
    assert mod is None and "int4" in why
    monkeypatch.setenv("GOODPUT_CPU_KERNELS", "0")
    mod, why = block_linear.choose(torch.device("cpu"), torch.bfloat16, "none")
    assert mod is None and "unavailable" in why


@pytest.mark.slow
# bfloat16: the block path multiplies by the file's exact weights, the float path by them rounded
# to bfloat16 (≤ 2⁻⁹ relative each), and both round every activation to bfloat16 across 30
# layers: logits of magnitude ~16 (bf16 ulp 0.125) differ by a few ulps
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 1.0)])
def test_model_few_row_path_equals_its_float_path(dtype, tol):
    """The real model: prefill, then decode steps of one row through the block linears, and the
    same steps with them turned off (the float weights, oneDNN / MKL): the same greedy tokens."""
    from goodput.worker.model.runner import ModelRunner
    runner = ModelRunner("smollm2", dtype=dtype, num_blocks=16, block_size=16)
    model = runner.model
    if not model.small_batch_bytes:
        pytest.skip("block kernel not chosen on this CPU")
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    linears.append(model.lm_head)
    assert all(lin.small is not None for lin in linears)
    rows = {id(lin): lin.small_rows for lin in linears}
    outs = {}
    for name in ("blocks", "float"):
        for lin in linears:
            lin.small_rows = rows[id(lin)] if name == "blocks" else -1
        outs[name] = greedy_steps(runner, "The capital of France is", 6)
    assert outs["blocks"][0] == outs["float"][0]
    assert (outs["blocks"][1] - outs["float"][1]).abs().max().item() < tol


def test_kernels_release_the_gil(mod):
    """A kernel call lets other Python threads run (the server's event loop streams tokens and answers
    /health while the engine thread sits in a kernel): while one long block_linear call runs in a
    thread, this thread wakes every 2 ms and records the time. With the GIL held it could only run
    in the few bytecodes between the recorded start and the kernel's entry (at most a couple of
    wake-ups); released, it runs all through the call (~100 wake-ups on an idle machine)."""
    import threading
    import time
    N, K, M = 4096, 4096, 256                                     # ~4 GMAC: ~0.4 s here
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    d = torch.full((N, K // 32), 0.01).half().float()
    lin = BlockLinear.from_blocks("Q4_1", q, d, torch.zeros_like(d), mod)
    x = torch.randn(M, K)
    span: list[float] = []
    started = threading.Event()

    def call():
        started.set()
        span.append(time.perf_counter())
        lin(x)                                                    # one call: no bytecode inside
        span.append(time.perf_counter())

    t = threading.Thread(target=call)
    t.start()
    started.wait()
    seen = []
    while t.is_alive():
        seen.append(time.perf_counter())
        time.sleep(0.002)
    t.join()
    assert len(span) == 2
    inside = sum(1 for s in seen if span[0] < s < span[1])
    assert inside >= 10, f"{inside} wake-ups in {span[1] - span[0]:.2f} s of kernel call: it holds the GIL"
