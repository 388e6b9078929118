"""The C++ paged prefill-attention kernel (``csrc/paged_prefill.cpp``) and the ``cpu`` backend's
prefill path on it: against a float64 reference over the gathered context and against the torch
reference backend, on random tiny shapes with several block sizes, GQA ratios and chunk offsets
(no context, a cached prefix, a chunked continuation that ends mid-block).

Needs a C++ compiler (the kernels are built on first use) and ATen's packed bfloat16 brgemm
(AMX or AVX-512 BF16); without them these tests skip.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from goodput.worker.model import cpu_kernels
from attention_meta import attention_meta


def _supported() -> bool:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return False
    mod = cpu_kernels.load()
    return mod is not None and mod.paged_prefill_supported()


needs_prefill_kernel = pytest.mark.skipif("not _supported()",
                                          reason="no C++ kernels or no packed bf16 brgemm on this CPU")


def case(ctx: int, n: int, *, bs: int, kv: int, g: int, d: int, seed: int, extra: int = 5):
    """Random bf16 pool whose blocks are a permutation, one sequence's table, q [n, kv·g, d]."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-(ctx + n) // bs)
    num_blocks = nb + extra
    table = torch.randperm(num_blocks, generator=gen)[:nb].to(torch.int32)
    k = torch.randn((num_blocks, bs, kv, d), generator=gen).bfloat16()
    v = torch.randn((num_blocks, bs, kv, d), generator=gen).bfloat16()
    q = torch.randn((n, kv * g, d), generator=gen).bfloat16()
    return q, k, v, table


def reference(q, k, v, table, ctx):
    """float64: query i (position ctx + i) over positions [0, ctx + i] of the sequence."""
    n, H, D = q.shape
    kv = k.shape[2]
    S = ctx + n
    K = k[table.long()].reshape(-1, kv, D)[:S].double()
    V = v[table.long()].reshape(-1, kv, D)[:S].double()
    qd = q.double().view(n, kv, H // kv, D)
    s = torch.einsum("nkgd,skd->kgns", qd, K) * D ** -0.5
    allowed = torch.arange(S)[None, :] <= (ctx + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("kgns,skd->nkgd", s.softmax(-1), V).reshape(n, H, D)


@needs_prefill_kernel
@pytest.mark.parametrize("ctx,n,bs,kv,g,d", [
    (0, 1, 16, 3, 3, 64),        # one token, no context
    (0, 77, 16, 3, 3, 64),       # SmolLM2's heads, first chunk (plain causal)
    (512, 512, 16, 3, 3, 64),    # a full 512-token chunk after one cached
    (300, 70, 8, 3, 3, 64),      # continuation starting mid-block
    (517, 300, 4, 2, 4, 32),     # several key blocks of the kernel, small cache blocks, g = 4
    (1000, 130, 32, 1, 1, 64),   # MHA-like: one query head per KV head, many query tiles
    (65, 200, 16, 1, 9, 16),     # many query heads per KV head, small head dim
    (1536, 3, 16, 3, 3, 64),     # context ending exactly on a key-block edge
])
def test_kernel_matches_reference(ctx, n, bs, kv, g, d):
    q, k, v, table = case(ctx, n, bs=bs, kv=kv, g=g, d=d, seed=ctx + n + bs)
    out = torch.full_like(q, float("nan"))
    cpu_kernels.load().paged_prefill_attention(q, k, v, table, ctx, out, d ** -0.5)
    want = reference(q, k, v, table, ctx)
    assert (out.double() - want).abs().max().item() < 2e-2
    # q as the strided view of a fused QKV output (token stride wider than H·D)
    wide = torch.cat([q, torch.zeros_like(q)], dim=1)[:, :q.shape[1]]
    out2 = torch.empty_like(q)
    cpu_kernels.load().paged_prefill_attention(wide, k, v, table, ctx, out2, d ** -0.5)
    assert torch.equal(out, out2)


@needs_prefill_kernel
def test_kernel_rejects_bad_inputs():
    mod = cpu_kernels.load()
    q, k, v, table = case(20, 10, bs=16, kv=3, g=3, d=64, seed=0)
    out = torch.empty_like(q)
    bad = table.clone()
    bad[1] = k.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        mod.paged_prefill_attention(q, k, v, bad, 20, out, 0.125)
    with pytest.raises(RuntimeError, match="beyond the block table"):
        mod.paged_prefill_attention(q, k, v, table, 40, out, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        mod.paged_prefill_attention(q.float(), k.float(), v.float(), table, 20, out.float(), 0.125)


@needs_prefill_kernel
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("seqs", [
    [(0, 40)],                                # one prompt, first chunk
    [(40, 1), (0, 9), (130, 1), (16, 37)],    # decodes mixed with a new prompt and a continuation
    [(600, 64), (3, 1), (64, 100)],           # continuations with cached prefixes
])
def test_cpu_backend_prefill_equals_torch_reference(seqs, bs):
    """bfloat16 batches: the cpu backend's prefill chunks (C++ kernel) against the torch reference
    backend (gather + SDPA), to bf16 rounding; float32 prefill chunks still run the torch path
    (decode rows: the decode kernel, as before)."""
    from goodput.worker.model.attention.cpu_backend import CpuPagedBackend
    from goodput.worker.model.attention.torch_ref import TorchReferenceBackend
    gen = torch.Generator().manual_seed(len(seqs) + bs)
    lens = [c + n for c, n in seqs]
    nblk = [-(-L // bs) for L in lens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros((len(seqs), max(nblk)), dtype=torch.int32)
    i = 0
    for r, nb in enumerate(nblk):
        bt[r, :nb] = perm[i:i + nb].to(torch.int32)
        i += nb
    k = torch.randn((num_blocks, bs, 3, 64), generator=gen)
    v = torch.randn((num_blocks, bs, 3, 64), generator=gen)
    q = torch.randn((sum(n for _, n in seqs), 9, 64), generator=gen)
    meta = attention_meta(seqs, bt)
    be = CpuPagedBackend()
    assert be.native_prefill
    want = TorchReferenceBackend().forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), meta, 0.125)
    got = be.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), meta, 0.125)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    assert torch.equal(be.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), meta, 0.125), got)  # plan reused
    got32 = CpuPagedBackend().forward(q, k, v, attention_meta(seqs, bt), 0.125)
    assert (got32 - TorchReferenceBackend().forward(q, k, v, attention_meta(seqs, bt), 0.125)).abs().max().item() < 2e-5


@needs_prefill_kernel
def test_cpu_backend_prefill_off_is_the_torch_path():
    """native_prefill False (or a CPU without the brgemm): bf16 prefill chunks through the torch
    reference, the same values bit for bit."""
    from goodput.worker.model.attention.cpu_backend import CpuPagedBackend
    from goodput.worker.model.attention.torch_ref import TorchReferenceBackend
    q, k, v, table = case(50, 30, bs=16, kv=3, g=3, d=64, seed=3)
    meta = attention_meta([(50, 30)], table[None])
    be = CpuPagedBackend()
    be.native_prefill = False
    assert torch.equal(be.forward(q, k, v, meta, 0.125),
                       TorchReferenceBackend().forward(q, k, v, attention_meta([(50, 30)], table[None]), 0.125))
