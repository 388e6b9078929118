"""The native decode step (``csrc/decode_step.cpp`` via ``LlamaModel._forward_native``).

1. Small shapes, random 4-bit weights: after each layer l, the step's residual stream equals a
   float64 reference of the same layers (written here from the architecture, not from the model's
   code) over the exact weights the blocks encode. Bound: float32 throughout; every dot product has
   at most K = 128 terms, so each linear errs by ≤ γ_K·Σ|terms| ≈ 7.6e-6 relative (Higham §3.1, the
   block kernel's own bound in test_block_linear.py); RoPE's, RMSNorm's and the softmax's
   exponentials add ~1e-7 relative each (the kernels' polynomials). With activations of size ~1
   over three layers, 1e-4 absolute leaves an order of magnitude of headroom; a wrong head, slot,
   rotation or residual is off by ~1.
2. The same step with 1 thread and with 2 is bit for bit the same (each output element is one
   function of its inputs, whichever thread computes it).
3. The real model (bundled SmolLM2, float32 and bfloat16): batches of 1 to 4 sequences, the native
   step and the per-operator path give the same greedy tokens and bit-identical logits — the
   native step runs the same inner loops on the same inputs.
"""
from __future__ import annotations

import math
import shutil

import pytest
import torch
from goodput.worker.model import cpu_kernels
from goodput.worker.model.block_linear import BlockLinear

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the CPU kernels")


@pytest.fixture(scope="module")
def mod():
    m = cpu_kernels.load()
    assert m is not None, cpu_kernels.load_error()
    if not m.block_linear_vectorized("float32"):
        pytest.skip("no vectorized block kernel on this CPU: the native step is never chosen here")
    return m


def q4_linear(N: int, K: int, g: torch.Generator, mod) -> BlockLinear:
    """Random Q4_1 blocks (codes 0..15, float16 d and m) as the block kernel holds them."""
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    d = (torch.rand(N, K // 32, generator=g) * 0.02 + 0.005).half().float()
    m = (-8 * d + torch.randn(N, K // 32, generator=g) * 0.002).half().float()
    return BlockLinear.from_blocks("Q4_1", q, d, m, mod)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [B, heads, d] at positions pos [B] (float64)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]
    rot = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    return x * cos + rot * sin


class Tiny:
    """L layers of D = 64, H = 4 query and KV = 2 key/value heads of d = 16, I = 128, float32, a
    paged cache of 16 blocks of 4 tokens filled with random history."""

    L, D, H, KV, d, I, eps, theta, bs, nblocks = 3, 64, 4, 2, 16, 128, 1e-5, 10000.0, 4, 16

    def __init__(self, mod, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        L, D, H, KV, d, I = self.L, self.D, self.H, self.KV, self.d, self.I
        self.lins = [[q4_linear(n, k, g, mod) for n, k in (((H + 2 * KV) * d, D), (D, H * d), (2 * I, D), (D, I))]
                     for _ in range(L)]
        self.norms = [1 + 0.1 * torch.randn(D, generator=g) for _ in range(2 * L + 1)]
        self.k = [torch.randn(self.nblocks, self.bs, KV, d, generator=g) for _ in range(L)]
        self.v = [torch.randn(self.nblocks, self.bs, KV, d, generator=g) for _ in range(L)]

    def stack(self, mod, layers: int, k, v):
        """A DecodeStack over the first `layers` layers; its last norm is layer `layers`'s attn_norm
        (or the final norm), so h_out is the next layer's normed input."""
        lins = [lin for ly in self.lins[:layers] for lin in ly]
        norms = self.norms[:2 * layers] + [self.norms[2 * layers]]
        return mod.DecodeStack(norms, [x.codes for x in lins], [x.d for x in lins], [x._m for x in lins],
                               [x.kind for x in lins], k[:layers], v[:layers], self.H, self.KV, self.d, self.eps,
                               self.d ** -0.5)

    def reference(self, x, pos, tables, layers: int):
        """float64: the residual stream after `layers` layers and the next norm's output."""
        H, KV, d, I, bs = self.H, self.KV, self.d, self.I, self.bs
        x = x.double()
        k_all = [k.double().clone() for k in self.k]
        v_all = [v.double().clone() for v in self.v]
        for li in range(layers):
            wqkv, wo, wgu, wd = (lin.dequantize().double() for lin in self.lins[li])
            h = rms(x, self.norms[2 * li].double(), self.eps)
            qkv = h @ wqkv.T
            q = rope(qkv[:, :H * d].view(-1, H, d), pos, self.theta)
            k = rope(qkv[:, H * d:(H + KV) * d].view(-1, KV, d), pos, self.theta)
            v = qkv[:, (H + KV) * d:].view(-1, KV, d)
            out = torch.empty(x.shape[0], H, d, dtype=torch.float64)
            for b in range(x.shape[0]):
                p = int(pos[b])
                k_all[li][tables[b][p // bs], p % bs] = k[b]
                v_all[li][tables[b][p // bs], p % bs] = v[b]
                ks = torch.stack([k_all[li][tables[b][t // bs], t % bs] for t in range(p + 1)])  # [T, KV, d]
                vs = torch.stack([v_all[li][tables[b][t // bs], t % bs] for t in range(p + 1)])
                for hh in range(H):
                    kh = hh // (H // KV)
                    w = torch.softmax(ks[:, kh] @ q[b, hh] / math.sqrt(d), 0)
                    out[b, hh] = w @ vs[:, kh]
            x = x + out.reshape(-1, H * d) @ wo.T
            gu = rms(x, self.norms[2 * li + 1].double(), self.eps) @ wgu.T
            x = x + (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ wd.T
        return x, rms(x, self.norms[2 * layers].double(), self.eps)


def step_inputs(t: Tiny, pos: list[int], seed: int = 1):
    """Embedded rows, RoPE rows (the model's (cos‖cos, -sin‖sin) layout), slots, block tables
    (each sequence on scattered blocks), lengths."""
    g = torch.Generator().manual_seed(seed)
    B, nbt = len(pos), max(pos) // t.bs + 1
    perm = torch.randperm(t.nblocks, generator=g).tolist()
    tables = [perm[b * nbt:(b + 1) * nbt] for b in range(B)]
    inv = 1.0 / t.theta ** (torch.arange(0, t.d, 2, dtype=torch.int64).float() / t.d)
    ang = torch.outer(torch.tensor(pos, dtype=torch.float32), inv)
    cs = torch.stack((torch.cat((ang.cos(), ang.cos()), -1), torch.cat((-ang.sin(), ang.sin()), -1)), 1)
    slots = torch.tensor([tables[b][p // t.bs] * t.bs + p % t.bs for b, p in enumerate(pos)], dtype=torch.int64)
    return (torch.randn(B, t.D, generator=g), cs.contiguous(), slots, torch.tensor(tables, dtype=torch.int32),
            torch.tensor([p + 1 for p in pos], dtype=torch.int32), tables)


@pytest.mark.parametrize("one_row", [True, False])  # RoPE + KV write inside the attention units, or apart
@pytest.mark.parametrize("pos,splits", [([5], 1), ([9, 0, 13], 1), ([13, 6], 3), ([3, 11, 7, 12], 2)])
def test_each_layer_equals_a_float64_reference(mod, pos, splits, one_row):
    t = Tiny(mod)
    x0, cs, slots, tables, lens, table_list = step_inputs(t, pos)
    for layers in range(1, t.L + 1):
        k, v = [c.clone() for c in t.k], [c.clone() for c in t.v]
        x, h = x0.clone(), torch.empty_like(x0)
        t.stack(mod, layers, k, v).step(x, cs, slots, tables, lens, splits, one_row, h,
                                        torch.empty(0, dtype=torch.float64))
        ref_x, ref_h = t.reference(x0, torch.tensor(pos), table_list, layers)
        assert (x.double() - ref_x).abs().max().item() < 1e-4, f"residual after layer {layers}"
        assert (h.double() - ref_h).abs().max().item() < 1e-4, f"normed output after layer {layers}"
        for li in range(layers):  # the new token's key and value, and nothing else, written
            changed = (k[li] != t.k[li]).any(-1).any(-1).nonzero().tolist()
            assert changed == sorted([int(s) // t.bs, int(s) % t.bs] for s in slots)


@pytest.mark.parametrize("splits", [1, 2])
def test_drafted_rows_of_one_sequence_read_each_others_new_kv(mod, splits):
    """Speculative decoding's layout: rows at positions 6, 7, 8 of one sequence (one block table)
    and a row of another; each row attends to the keys and values the earlier rows write in the
    same step (so RoPE and the KV write run before attention: one_row_per_seq False)."""
    t = Tiny(mod, seed=5)
    pos = [6, 7, 8, 4]
    x0, cs, _, _, _, table_list = step_inputs(t, pos, seed=6)
    table_list = [table_list[0]] * 3 + [table_list[3]]
    tables = torch.tensor(table_list, dtype=torch.int32)
    slots = torch.tensor([table_list[b][p // t.bs] * t.bs + p % t.bs for b, p in enumerate(pos)], dtype=torch.int64)
    lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32)
    k, v = [c.clone() for c in t.k], [c.clone() for c in t.v]
    x, h = x0.clone(), torch.empty_like(x0)
    t.stack(mod, t.L, k, v).step(x, cs, slots, tables, lens, splits, False, h, torch.empty(0, dtype=torch.float64))
    ref_x, _ = t.reference(x0, torch.tensor(pos), table_list, t.L)
    assert (x.double() - ref_x).abs().max().item() < 1e-4


@pytest.mark.parametrize("splits", [1, 2])
def test_threads_do_not_change_a_bit(mod, splits):
    t = Tiny(mod, seed=3)
    x0, cs, slots, tables, lens, _ = step_inputs(t, [14, 2, 9], seed=4)
    outs, threads = [], torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            k, v = [c.clone() for c in t.k], [c.clone() for c in t.v]
            x, h = x0.clone(), torch.empty_like(x0)
            phases = torch.zeros(3, dtype=torch.float64)
            t.stack(mod, t.L, k, v).step(x, cs, slots, tables, lens, splits, True, h, phases)
            assert (phases > 0).all()  # linears, attention, layer ops each timed
            outs.append((x, h, k, v))
    finally:
        torch.set_num_threads(threads)
    (x1, h1, k1, v1), (x2, h2, k2, v2) = outs
    assert torch.equal(x1, x2) and torch.equal(h1, h2)
    assert all(torch.equal(a, b) for a, b in zip(k1 + v1, k2 + v2))


def test_bad_inputs_raise(mod):
    t = Tiny(mod)
    x, cs, slots, tables, lens, _ = step_inputs(t, [5, 6])
    stack = t.stack(mod, 1, [c.clone() for c in t.k], [c.clone() for c in t.v])
    none = torch.empty(0, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        stack.step(x, cs, torch.tensor([0, t.nblocks * t.bs]), tables, lens, 1, True, torch.empty_like(x), none)
    with pytest.raises(RuntimeError, match="outside the block table"):
        stack.step(x, cs, slots, tables, torch.tensor([5, 99], dtype=torch.int32), 1, True, torch.empty_like(x),
                   none)
    with pytest.raises(RuntimeError, match="model's dtype"):
        stack.step(x.double(), cs, slots, tables, lens, 1, True, torch.empty_like(x), none)
    with pytest.raises(RuntimeError, match="4 linears per layer"):
        mod.DecodeStack(t.norms[:3], [], [], [], [], t.k[:1], t.v[:1], t.H, t.KV, t.d, t.eps, 0.25)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4, 5,"]


def greedy_batch(runner, prompts: list[str], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Each prompt prefilled alone, then `steps` decode steps of all of them together; the token
    ids and the decode steps' logits [steps, B, vocab]."""
    from goodput.worker.engine.outputs import ScheduledChunk, SchedulerOutput
    from goodput.worker.engine.sampling_params import SamplingParams
    sp, nb = SamplingParams(temperature=0.0), 4
    seqs = [list(runner.tokenizer.encode(p)) for p in prompts]

    def chunk(i: int, start: int, n_out: int) -> ScheduledChunk:
        ids = seqs[i]
        return ScheduledChunk(request_id=f"r{i}", token_ids=tuple(ids[start:]), start_pos=start,
                              block_table=tuple(range(i * nb, (i + 1) * nb)), sample=True, sampling_params=sp,
                              num_output_tokens=n_out, prompt_token_ids=tuple(ids))
    for i, ids in enumerate(seqs):
        out = runner.forward_logits(SchedulerOutput(chunks=[chunk(i, 0, 0)], num_batched_tokens=len(ids)))
        ids.append(int(out[f"r{i}"][-1].argmax()))
    logits = []
    for s in range(steps):
        chunks = [chunk(i, len(ids) - 1, s + 1) for i, ids in enumerate(seqs)]
        out = runner.forward_logits(SchedulerOutput(chunks=chunks, num_batched_tokens=len(chunks)))
        rows = torch.stack([out[f"r{i}"][-1] for i in range(len(seqs))])
        logits.append(rows)
        for i, ids in enumerate(seqs):
            ids.append(int(rows[i].argmax()))
    return seqs, torch.stack(logits)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_native_step_equals_per_operator_path(dtype, monkeypatch):
    from goodput.worker.model.runner import ModelRunner
    runner = ModelRunner("smollm2", dtype=dtype, num_blocks=16, block_size=16)
    model = runner.model
    if not model.small_batch_bytes or not hasattr(model.fused_ops, "DecodeStack"):
        pytest.skip("block kernel not chosen on this CPU")
    for lin in model._native_linears:  # the block kernel up to 4 rows in both paths, whatever load measured
        lin.small_rows = 4
    calls = []
    native = model._forward_native
    monkeypatch.setattr(model, "_forward_native", lambda *a: calls.append(a[0].shape[0]) or native(*a))
    for B in (1, 2, 3, 4):
        model.native_step = True
        calls.clear()
        tokens, logits = greedy_batch(runner, PROMPTS[:B], 6)
        assert calls == [B] * 6  # every decode step native, no prefill
        model.native_step = False
        ref_tokens, ref_logits = greedy_batch(runner, PROMPTS[:B], 6)
        assert len(calls) == 6
        assert tokens == ref_tokens
        assert torch.equal(logits, ref_logits)


@pytest.mark.slow
def test_model_native_step_only_where_eligible():
    """Not for more rows than the block kernel serves, nor with the torch attention backend."""
    from goodput.worker.model.runner import ModelRunner
    runner = ModelRunner("smollm2", dtype="float32", num_blocks=16, block_size=16, attention_backend="torch")
    model = runner.model
    if not model.small_batch_bytes or not hasattr(model.fused_ops, "DecodeStack"):
        pytest.skip("block kernel not chosen on this CPU")
    for lin in model._native_linears:
        lin.small_rows = 2
    assert model.native_eligible(2) and not model.native_eligible(3)
    model._native_linears[5].small_rows = 1
    assert not model.native_eligible(2)
    greedy_batch(runner, PROMPTS[:1], 2)
    assert model._native is None  # the torch backend has no decode-only plan: per-operator path


@pytest.mark.slow
def test_two_builds_in_one_process_each_run_their_own_step(mod):
    """`cpu_kernels --levels` imports several builds into one process (the worker image's build):
    each registers its own DecodeStack (module-local), and the portable build's step (the avx2
    level's loops) agrees with this CPU's."""
    other = cpu_kernels.build(level="avx2")  # cached after the first build
    if other is None:
        pytest.skip("this CPU cannot run the avx2 level")
    assert other.DecodeStack is not mod.DecodeStack
    t = Tiny(mod, seed=7)
    x0, cs, slots, tables, lens, _ = step_inputs(t, [10, 3], seed=8)
    outs = []
    for m in (mod, other):
        x, h = x0.clone(), torch.empty_like(x0)
        t.stack(m, t.L, [c.clone() for c in t.k], [c.clone() for c in t.v]).step(
            x, cs, slots, tables, lens, 1, True, h, torch.empty(0, dtype=torch.float64))
        outs.append(x)
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4  # float32 sums in another order (bound above)
