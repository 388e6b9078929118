"""The C++ paged decode-attention kernel (``cpu_kernels``) and the ``cpu`` backend built on it,
against a float64 reference that walks each sequence's block table position by position.

Needs a C++ compiler (the kernel is built on first use); without one these tests skip and the
selector falls back to the torch reference (tested below either way).
"""
from __future__ import annotations

import shutil

import pytest
import torch
from goodput.worker.model import cpu_kernels
from attention_meta import attention_meta

needs_kernel = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                  reason="no C++ compiler to build the CPU kernel")


def paged_case(lens, *, bs=16, n_kv=3, g=3, d=64, dtype=torch.float32, seed=0, extra_blocks=5):
    """Random pool whose blocks are a permutation (no sequence is contiguous), random q, tables."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [max(1, -(-L // bs)) for L in lens]
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in nblk:
        tables.append(perm[i:i + n])
        i += n
    width = max(nblk)
    bt = torch.zeros((len(lens), width), dtype=torch.int32)
    for r, t in enumerate(tables):
        bt[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
    k = torch.randn((num_blocks, bs, n_kv, d), generator=gen).to(dtype)
    v = torch.randn((num_blocks, bs, n_kv, d), generator=gen).to(dtype)
    q = torch.randn((len(lens), n_kv * g, d), generator=gen).to(dtype)
    return q, k, v, bt, torch.tensor(lens, dtype=torch.int32), tables


def reference(q, k, v, tables, lens, scale):
    """float64: out[b, h] = softmax(scale · K_b q_bh) V_b over positions [0, lens[b]) of b."""
    q, k, v = q.double(), k.double(), v.double()
    bs, n_kv = k.shape[1], k.shape[2]
    g = q.shape[1] // n_kv
    out = torch.zeros_like(q)
    for b, (table, L) in enumerate(zip(tables, lens)):
        if L == 0:
            continue
        keys = torch.stack([k[table[p // bs], p % bs] for p in range(L)])   # [L, n_kv, d]
        vals = torch.stack([v[table[p // bs], p % bs] for p in range(L)])
        for h in range(q.shape[1]):
            p = torch.softmax(keys[:, h // g] @ q[b, h] * scale, 0)
            out[b, h] = p @ vals[:, h // g]
    return out


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lens,d,g,bs", [
    ([1, 16, 17, 100, 300], 64, 3, 16),      # SmolLM2's shape: lengths at and across block edges
    ([5, 33, 64], 64, 1, 4),                 # MHA, small blocks
    ([7, 70, 130], 32, 4, 16),               # head dim without the AVX-512 specialization
    ([65, 129], 64, 9, 8),                   # more query heads per KV head than the fast path
])
def test_kernel_matches_reference(dtype, tol, lens, d, g, bs):
    q, k, v, bt, sl, tables = paged_case(lens, bs=bs, g=g, d=d, dtype=dtype, seed=len(lens) + d)
    scale = d ** -0.5
    want = reference(q, k, v, tables, lens, scale)
    for splits in (1, 3):  # split-K partials must combine to the same result
        got = cpu_kernels.paged_decode_attention(q, k, v, bt, sl, scale, splits)
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.double() - want).abs().max().item() < tol, splits
    # q as a strided view (rows of a wider tensor, as the fused QKV output) and as a dense permuted view
    wide = torch.cat([q, torch.zeros_like(q)], dim=1)[:, :q.shape[1]]
    perm = q.transpose(0, 1).contiguous().transpose(0, 1)
    for view in (wide, perm):
        got = cpu_kernels.paged_decode_attention(view, k, v, bt, sl, scale)
        assert (got.double() - want).abs().max().item() < tol


@needs_kernel
def test_zero_length_row_is_zero_and_splits_longer_than_context():
    q, k, v, bt, sl, tables = paged_case([0, 3], seed=7)
    got = cpu_kernels.paged_decode_attention(q, k, v, bt, sl, 0.125, 8)  # 8 splits of a 3-token context
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert (got[1].double() - reference(q, k, v, tables, [0, 3], 0.125)[1]).abs().max() < 2e-5


@needs_kernel
def test_bad_inputs_raise_clear_errors():
    q, k, v, bt, sl, _ = paged_case([20, 40])
    bad = bt.clone()
    bad[1, 0] = k.shape[0]
    with pytest.raises(ValueError, match="block id outside the pool"):
        cpu_kernels.paged_decode_attention(q, k, v, bad, sl, 0.125)
    with pytest.raises(ValueError, match="seq_lens outside"):
        cpu_kernels.paged_decode_attention(q, k, v, bt, torch.tensor([20, 10_000], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernels.paged_decode_attention(q.double(), k, v, bt, sl, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_kernels.paged_decode_attention(q, k, v, bt.long(), sl, 0.125)


@pytest.mark.parametrize("args,expected", [
    ((1, 3, 100, 2), 1),      # short context: not worth splitting
    ((1, 3, 8192, 2), 4),     # 3 (seq, head) pairs for 2 threads: 3 parts = 9 units >= 8, 4 = 12 even
    ((1, 3, 8192, 4), 8),     # 16 units wanted: 6 parts = 18 and 7 = 21 are not multiples of 4, 8 = 24 is
    ((1, 3, 1024, 4), 4),     # ... but 1024 // 256 caps it at 4 (12 units, even)
    ((1, 3, 700, 2), 2),      # capped at 2 parts (6 units, even)
    ((32, 3, 8192, 2), 1),    # 96 units already
    ((1, 1, 1000, 4), 3),     # capped by 256-token parts: 1000 // 256 = 3
])
def test_num_splits(args, expected):
    assert cpu_kernels.num_splits(*args) == expected


@needs_kernel
@pytest.mark.parametrize("seqs", [[(40, 1), (0, 9), (130, 1), (16, 5)], [(299, 1)], [(3, 1), (200, 1)]])
def test_cpu_backend_equals_torch_reference_on_mixed_batches(seqs):
    """Decode rows through the kernel, prefill chunks through the torch path: the same outputs as
    the torch reference backend for decode-only and mixed decode + prefill batches."""
    from goodput.worker.model.attention.cpu_backend import CpuPagedBackend
    from goodput.worker.model.attention.torch_ref import TorchReferenceBackend
    lens = [c + n for c, n in seqs]
    _, k, v, bt, _, _ = paged_case(lens, seed=11)
    q = torch.randn(sum(n for _, n in seqs), 9, 64, generator=torch.Generator().manual_seed(1))
    meta = attention_meta(seqs, bt)
    want = TorchReferenceBackend().forward(q, k, v, meta, 0.125)
    be = CpuPagedBackend()
    got = be.forward(q, k, v, meta, 0.125)
    assert (got - want).abs().max().item() < 2e-5
    assert torch.equal(be.forward(q, k, v, meta, 0.125), got)  # the step's plan, reused by the next layer
    bad = bt.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="block id outside the pool"):
        CpuPagedBackend().forward(q, k, v, attention_meta(seqs, bad), 0.125)


def test_selector_cpu_backend(monkeypatch):
    from goodput.worker.model.attention.selector import select_backend
    with pytest.raises(ValueError, match="runs on the CPU"):
        select_backend("cpu", "cuda")
    monkeypatch.setenv("GOODPUT_CPU_KERNELS", "0")  # as on a machine where the kernel cannot build
    assert select_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="could not be built here"):
        select_backend("cpu", "cpu")
    monkeypatch.delenv("GOODPUT_CPU_KERNELS")
    if cpu_kernels.available():
        assert select_backend("auto", "cpu").name == "cpu"
        assert select_backend("cpu", "cpu").name == "cpu"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_write_kv_equals_the_torch_scatter(dtype):
    """K/V as views of a fused QKV row (as llama.py passes them), padding slots (-1) skipped."""
    from goodput.worker.model.attention.cpu_backend import CpuPagedBackend
    from goodput.worker.model.attention.torch_ref import TorchReferenceBackend
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, (9 + 3 + 3) * 64, generator=gen).to(dtype)
    k, v = qkv[:, 576:768].view(6, 3, 64), qkv[:, 768:].view(6, 3, 64)
    slots = torch.tensor([5, 17, -1, 0, 63, -1], dtype=torch.int64)
    caches = []
    for be in (TorchReferenceBackend(), CpuPagedBackend()):
        kc, vc = torch.zeros(4, 16, 3, 64, dtype=dtype), torch.zeros(4, 16, 3, 64, dtype=dtype)
        be.write_kv(k, v, kc, vc, slots)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[1][0].view(-1, 3, 64)[17], k[1])
    kc = torch.zeros(4, 16, 3, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="outside the cache"):
        CpuPagedBackend().write_kv(k, v, kc, kc.clone(), torch.tensor([0, 1, 2, 3, 4, 64]))
