"""Triton KV-write and paged-attention kernels vs a naive reference.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported); on a CUDA machine (bench/gpu_check.sh) the same tests run compiled on the GPU.
The reference here is deliberately naive and independent of every backend: per sequence, gather
the keys/values position by position through the block table, build the causal mask explicitly
and do the softmax in float64.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import random

import pytest
import torch

DEVICE = os.environ.get("GOODPUT_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from goodput.worker.model.attention import triton_ops
from goodput.worker.model.attention.base import AttentionMetadata

if DEVICE == "cpu" and not triton_ops.is_interpreted():
    # Imported earlier in this process without TRITON_INTERPRET: rebuild the kernels interpreted.
    triton_ops = importlib.reload(triton_ops)

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


# ----------------------------------------------------------------------------------------------
# Batch construction and the naive reference
# ----------------------------------------------------------------------------------------------
class Batch:
    """A paged cache with random context K/V, new tokens to write, and the metadata.

    seqs: list of (context_len, query_len). Physical blocks are a random permutation of the pool,
    so no sequence's blocks are contiguous. ``pad_rows`` extra query rows (slot -1) follow the
    last sequence, as a runner padding T would add.
    """

    def __init__(self, seqs, *, block_size, n_kv, qpk, head_dim, dtype, seed=0, pad_rows=0,
                 extra_blocks=3):
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.block_size, self.dtype = seqs, block_size, dtype
        self.n_kv, self.n_heads, self.head_dim = n_kv, n_kv * qpk, head_dim
        nblk = [-(-(c + n) // block_size) for c, n in seqs]
        num_blocks = sum(nblk) + extra_blocks
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.tables, i = [], 0
        for n in nblk:
            self.tables.append(perm[i:i + n])
            i += n
        shape = (num_blocks, block_size, n_kv, head_dim)
        # Whole pool random (stale data in unused slots must never be read).
        self.k_cache = torch.randn(shape, generator=g).to(dtype)
        self.v_cache = torch.randn(shape, generator=g).to(dtype)
        T = sum(n for _, n in seqs) + pad_rows
        self.q = torch.randn((T, self.n_heads, head_dim), generator=g).to(dtype)
        self.k_new = torch.randn((T, n_kv, head_dim), generator=g).to(dtype)
        self.v_new = torch.randn((T, n_kv, head_dim), generator=g).to(dtype)
        slots, qsl = [], [0]
        for (c, n), table in zip(seqs, self.tables):
            for p in range(c, c + n):
                slots.append(table[p // block_size] * block_size + p % block_size)
            qsl.append(qsl[-1] + n)
        slots += [-1] * pad_rows
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        width = max([len(t) for t in self.tables] + [1])
        bt = torch.zeros((len(seqs), width), dtype=torch.int32)
        for r, t in enumerate(self.tables):
            bt[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
        seq_lens = [c + n for c, n in seqs]
        self.meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
            block_tables=bt, slot_mapping=self.slot_mapping,
            max_query_len=max([n for _, n in seqs] + [0]),
            max_seq_len=max(seq_lens + [0]),
            query_start_loc_list=qsl, seq_lens_list=seq_lens)
        self.scale = head_dim ** -0.5

    def expected_cache(self):
        """Caches after writing the new tokens, by plain Python indexing."""
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        for t, slot in enumerate(self.slot_mapping.tolist()):
            if slot >= 0:
                kc[slot // self.block_size, slot % self.block_size] = self.k_new[t]
                vc[slot // self.block_size, slot % self.block_size] = self.v_new[t]
        return kc, vc

    def to(self, device):
        for name in ("k_cache", "v_cache", "q", "k_new", "v_new", "slot_mapping"):
            setattr(self, name, getattr(self, name).to(device))
        m = self.meta
        for name in ("query_start_loc", "seq_lens", "context_lens", "block_tables"):
            setattr(m, name, getattr(m, name).to(device))
        m.slot_mapping = self.slot_mapping
        return self


def naive_attention(q, k_cache, v_cache, tables, seqs, scale):
    """float64 reference: out[T, n_heads, head_dim] (rows of no sequence stay 0)."""
    q, k_cache, v_cache = (x.detach().cpu().double() for x in (q, k_cache, v_cache))
    bs, n_kv = k_cache.shape[1], k_cache.shape[2]
    qpk = q.shape[1] // n_kv
    out = torch.zeros_like(q)
    row = 0
    for (ctx, n), table in zip(seqs, tables):
        L = ctx + n
        keys = torch.stack([k_cache[table[p // bs], p % bs] for p in range(L)]) if L else None
        vals = torch.stack([v_cache[table[p // bs], p % bs] for p in range(L)]) if L else None
        for j in range(n):
            pos = ctx + j
            for h in range(q.shape[1]):
                kvh = h // qpk
                s = (keys[:, kvh] @ q[row + j, h]) * scale          # [L]
                s[pos + 1:] = float("-inf")                         # causal: keys <= pos
                out[row + j, h] = torch.softmax(s, 0) @ vals[:, kvh]
        row += n
    return out


def run_kernels(b: Batch, **kw):
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    triton_ops.write_kv(b.k_new, b.v_new, k_cache, v_cache, b.slot_mapping)
    m = b.meta
    out = triton_ops.paged_attention(b.q, k_cache, v_cache, m.block_tables, m.query_start_loc,
                                     m.seq_lens, m.max_query_len, m.max_seq_len, b.scale, **kw)
    return k_cache, v_cache, out


def check(b: Batch, **kw):
    b.to(DEVICE)
    k_cache, v_cache, out = run_kernels(b, **kw)
    exp_k, exp_v = b.expected_cache()
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v), "write_kv wrote wrong slots"
    ref = naive_attention(b.q, exp_k, exp_v, b.tables, b.seqs, b.scale)
    got = out.detach().cpu().double()
    err = (got - ref).abs().max().item()
    assert err <= TOL[b.dtype], f"max abs error {err:.3g} > {TOL[b.dtype]}"
    return out


# ----------------------------------------------------------------------------------------------
# Cases: (name, seqs [(context_len, query_len)], block_size, n_kv, qpk, head_dim, dtype, kwargs)
# ----------------------------------------------------------------------------------------------
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = [
    # context 0, two prompts, one longer than a tile and crossing blocks
    ("pure_prefill", [(0, 7), (0, 37)], 16, 2, 1, 32, F32, {"block_m": 16, "tile_n": 16}),
    # pure decode, GQA 3, a context ending exactly on a block boundary (31 + 1 = 32)
    ("pure_decode_gqa3", [(5, 1), (31, 1), (40, 1)], 16, 1, 3, 32, F32, {}),
    # decode + prefill chunk starting mid-block (ctx 10, 13 new tokens), block_size 32
    ("mixed_mid_block_bs32", [(20, 1), (10, 13), (0, 5)], 32, 2, 3, 16, F32, {"block_m": 16}),
    # chunk ending exactly on a block boundary (16 + 16 = 32) and tiles wider than a block
    ("chunk_ends_on_block", [(16, 16), (0, 32)], 16, 1, 1, 16, F32, {"tile_n": 32}),
    # an unused slot (zero-length sequence) mid-batch and padded rows with slot -1
    ("padded_slot", [(9, 1), (0, 0), (3, 4)], 16, 1, 3, 16, F32, {"pad_rows": 2}),
    # non-power-of-two head_dim (masked lanes)
    ("head_dim_24", [(6, 3), (17, 1)], 16, 1, 1, 24, F32, {}),
    # low precision: the mixed case in bf16 and fp16
    ("mixed_bf16", [(20, 1), (10, 13)], 16, 1, 3, 32, BF16, {"block_m": 16}),
    ("mixed_fp16", [(20, 1), (10, 13)], 32, 2, 1, 32, F16, {}),
]


@pytest.mark.parametrize("name,seqs,bs,n_kv,qpk,hd,dtype,kw", CASES, ids=[c[0] for c in CASES])
def test_kernels_match_reference(name, seqs, bs, n_kv, qpk, hd, dtype, kw):
    kw = dict(kw)
    pad_rows = kw.pop("pad_rows", 0)
    b = Batch(seqs, block_size=bs, n_kv=n_kv, qpk=qpk, head_dim=hd, dtype=dtype, pad_rows=pad_rows)
    out = check(b, **kw)
    if pad_rows:
        assert torch.count_nonzero(out[-pad_rows:]) == 0, "padding rows must stay untouched"


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed):
    """Seeded random batch compositions, shapes and tile sizes (kinds of sequence: decode,
    prefill from 0, chunk after a cached context, no new tokens)."""
    rng = random.Random(seed)
    bs = rng.choice([16, 32])
    seqs = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["decode", "prefill", "chunk", "idle"])
        ctx = 0 if kind == "prefill" else rng.randint(0 if kind != "decode" else 1, 3 * bs)
        n = {"decode": 1, "idle": 0}.get(kind, rng.randint(1, 2 * bs))
        seqs.append((ctx, n))
    kw = {"block_m": rng.choice([16, 32, 64]), "tile_n": rng.choice([16, 32, 64])}
    if all(n <= 1 for _, n in seqs):
        kw["num_kv_splits"] = rng.choice([None, 1, 2, 3])
    b = Batch(seqs, block_size=bs, n_kv=rng.choice([1, 2]), qpk=rng.choice([1, 2, 3]),
              head_dim=rng.choice([16, 32, 64]), dtype=rng.choice([F32, BF16]), seed=seed,
              pad_rows=rng.choice([0, 1]))
    check(b, **kw)


@pytest.mark.parametrize("dtype,splits,bs", [(F32, 3, 16), (BF16, 4, 32)])
def test_split_kv_decode(dtype, splits, bs):
    # Contexts of different lengths, one shorter than a split (its later splits are empty),
    # one ending on a block boundary, and an unused slot.
    seqs = [(70, 1), (3, 1), (0, 0), (bs * 4 - 1, 1)]
    b = Batch(seqs, block_size=bs, n_kv=2, qpk=3, head_dim=32, dtype=dtype, seed=1)
    check(b, num_kv_splits=splits, tile_n=16)


def test_split_kv_equals_single_pass():
    b = Batch([(50, 1), (33, 1)], block_size=16, n_kv=1, qpk=3, head_dim=16, dtype=F32, seed=2)
    b.to(DEVICE)
    _, _, one = run_kernels(b, num_kv_splits=1)
    _, _, split = run_kernels(b, num_kv_splits=3, tile_n=16)
    assert (one - split).abs().max().item() < 1e-5


@pytest.mark.parametrize("args,expected", [
    # (num_seqs, n_kv_heads, max_query_len, max_seq_len, num_sms) -> splits, by the docstring rule
    ((1, 3, 1, 1024, 132), 4),      # min(ceil(264/3)=88, 1024//256=4, 32)
    ((16, 3, 1, 1024, 132), 4),     # min(ceil(264/48)=6, 4)
    ((32, 3, 1, 4096, 132), 3),     # min(ceil(264/96)=3, 16)
    ((1, 8, 1, 32768, 132), 32),    # min(33, 128, 32)
    ((64, 3, 1, 1024, 132), 1),     # 192 programs >= 132 SMs
    ((1, 3, 1, 511, 132), 1),       # context below 2 * 256
    ((1, 3, 5, 4096, 132), 1),      # not decode-only
])
def test_choose_num_kv_splits(args, expected):
    assert triton_ops.choose_num_kv_splits(*args) == expected


def test_split_path_rejects_prefill():
    b = Batch([(4, 3)], block_size=16, n_kv=1, qpk=1, head_dim=16, dtype=F32).to(DEVICE)
    with pytest.raises(ValueError, match="decode-only"):
        run_kernels(b, num_kv_splits=2)


def test_bad_inputs_raise_clear_errors():
    b = Batch([(4, 2)], block_size=16, n_kv=1, qpk=3, head_dim=16, dtype=F32).to(DEVICE)
    m = b.meta
    with pytest.raises(ValueError, match="must match"):
        triton_ops.paged_attention(b.q.double(), b.k_cache, b.v_cache, m.block_tables,
                                   m.query_start_loc, m.seq_lens, 2, 6, 1.0)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        triton_ops.paged_attention(b.q[:, :2], b.k_cache.expand(-1, -1, 3, -1), b.v_cache.expand(
            -1, -1, 3, -1), m.block_tables, m.query_start_loc, m.seq_lens, 2, 6, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_ops.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.slot_mapping[:1])
    with pytest.raises(ValueError, match="k_cache"):
        triton_ops.write_kv(b.k_new, b.v_new, b.k_cache[0], b.v_cache, b.slot_mapping)


# ----------------------------------------------------------------------------------------------
# The backend object, the selector, and B's torch reference backend
# ----------------------------------------------------------------------------------------------
def _torch_ref_backend():
    mod = pytest.importorskip("goodput.worker.model.attention.torch_ref",
                              reason="torch reference backend not landed yet")
    return mod.TorchReferenceBackend()


@pytest.mark.parametrize("splits", [None, 2])
def test_backend_interface(splits):
    from goodput.worker.model.attention.triton_backend import TritonAttentionBackend
    be = TritonAttentionBackend(num_kv_splits=splits, tile_n=16)
    for seqs in ([(12, 1), (40, 1)], [(12, 1), (5, 6)]):   # decode-only (splits), then mixed
        b = Batch(seqs, block_size=16, n_kv=1, qpk=3, head_dim=16, dtype=F32, seed=3).to(DEVICE)
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        be.write_kv(b.k_new, b.v_new, k_cache, v_cache, b.slot_mapping)
        out = be.forward(b.q, k_cache, v_cache, b.meta, b.scale)
        ref = naive_attention(b.q, k_cache, v_cache, b.tables, b.seqs, b.scale)
        assert (out.cpu().double() - ref).abs().max().item() < 1e-4
    # Layers repeat validated calls without re-checking; a changed (bad) call is still checked.
    with pytest.raises(ValueError, match="must match"):
        be.forward(b.q.double(), k_cache, v_cache, b.meta, b.scale)
    with pytest.raises(ValueError, match="differ from the cache"):
        be.write_kv(b.k_new.double(), b.v_new.double(), k_cache, v_cache, b.slot_mapping)


@pytest.mark.parametrize("seqs,dtype", [([(20, 1), (10, 13), (0, 5)], F32),
                                        ([(3, 1), (17, 16)], BF16)])
def test_matches_torch_reference_backend(seqs, dtype):
    from goodput.worker.model.attention.triton_backend import TritonAttentionBackend
    ref_be = _torch_ref_backend()
    b = Batch(seqs, block_size=16, n_kv=3, qpk=3, head_dim=64, dtype=dtype, seed=4).to(DEVICE)
    caches = []
    for be in (ref_be, TritonAttentionBackend()):
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        be.write_kv(b.k_new, b.v_new, k_cache, v_cache, b.slot_mapping)
        caches.append((k_cache, v_cache, be.forward(b.q, k_cache, v_cache, b.meta, b.scale)))
    (rk, rv, rout), (tk, tv, tout) = caches
    assert torch.equal(rk, tk) and torch.equal(rv, tv)
    err = (rout.float() - tout.float()).abs().max().item()
    assert err <= TOL[dtype], err


def test_selector():
    from goodput.worker.model.attention.selector import select_backend
    assert select_backend("triton", DEVICE).name == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", "cpu")
    if DEVICE == "cpu":
        os.environ.pop("TRITON_INTERPRET")
        try:
            with pytest.raises(ValueError, match="runs on CUDA devices"):
                select_backend("triton", "cpu")
        finally:
            os.environ["TRITON_INTERPRET"] = "1"
    _torch_ref_backend()
    assert select_backend("torch", DEVICE).name == "torch"
    from goodput.worker.model import cpu_kernels
    assert select_backend("auto", "cpu").name == ("cpu" if cpu_kernels.available() else "torch")
    if torch.cuda.is_available():
        assert select_backend("auto", "cuda").name == "triton"


def test_kernels_compile_for_sm90():
    """The compiler (not the interpreter) accepts every kernel: lower to PTX and assemble for
    sm_90 with Triton's bundled ptxas, in a subprocess without TRITON_INTERPRET."""
    import subprocess
    import sys
    from pathlib import Path
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile_check.py")
    r = subprocess.run([sys.executable, str(script), "--quick", "90"], env=env, check=False,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "FAIL" not in r.stdout, r.stdout + r.stderr[-3000:]
    assert r.stdout.count("OK ") == 6, r.stdout
