"""Runner plumbing, KV sizing, the GGUF loader's pieces and the torch paged-attention backend.

The attention backend is compared with a naive reference written here: per query, an explicit
loop over the sequence's positions through its block table, softmax in float64.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from goodput.worker.engine.outputs import ScheduledChunk, SchedulerOutput
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.model.attention.base import AttentionMetadata
from goodput.worker.model.attention.torch_ref import TorchReferenceBackend
from goodput.worker.model.config import ModelConfig, UnsupportedModelError
from goodput.worker.model.gguf_loader import gguf_revision, parse_dtype, resolve_model_path, unpermute_qk
from goodput.worker.model.kv_cache import allocate_kv_caches, kv_cache_bytes_per_token, num_blocks_for_budget
from goodput.worker.model.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------- KV sizing (m = 2·L·n_kv·d·b·T)
def test_kv_bytes_per_token_formula():
    # SmolLM2-135M: L=30, n_kv=3, d=64 -> 2*30*3*64 = 11520 elements per token
    assert kv_cache_bytes_per_token(30, 3, 64, 2) == 23040
    assert kv_cache_bytes_per_token(30, 3, 64, 4) == 46080
    # Llama-2-7B (L=32, 32 KV heads, d=128, fp16): 512 KiB per token, the PagedAttention paper's number
    assert kv_cache_bytes_per_token(32, 32, 128, 2) == 524288
    with pytest.raises(ValueError):
        kv_cache_bytes_per_token(0, 3, 64, 2)


def test_num_blocks_for_budget_floors_and_rejects_tiny_budgets():
    per_block = 23040 * 16
    assert num_blocks_for_budget(1 << 30, 30, 3, 64, 2, 16) == (1 << 30) // per_block == 2912
    assert num_blocks_for_budget(per_block * 7 + per_block - 1, 30, 3, 64, 2, 16) == 7
    with pytest.raises(ValueError, match="smaller than one block"):
        num_blocks_for_budget(per_block - 1, 30, 3, 64, 2, 16)


def test_allocate_kv_caches_layout():
    caches = allocate_kv_caches(3, 5, 4, 2, 8, torch.bfloat16)
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (5, 4, 2, 8) and k.dtype == torch.bfloat16
        assert k.is_contiguous() and not k.any()
    caches[0][0].fill_(1)
    assert not caches[0][1].any() and not caches[1][0].any()  # distinct storage per layer and K/V


# ---------------------------------------------------------------- loader pieces
def test_unpermute_qk_inverts_llama_cpp_permutation():
    n_heads, d, cols = 3, 8, 5
    w = np.arange(n_heads * d * cols, dtype=np.float32).reshape(n_heads * d, cols)
    # llama.cpp's converter: per head, rows (0..d/2-1 | d/2..d-1) are interleaved as pairs
    permuted = w.reshape(n_heads, 2, d // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_heads), w)
    with pytest.raises(UnsupportedModelError):
        unpermute_qk(np.zeros((10, 2), np.float32), 3)


def test_config_reads_everything_from_metadata():
    meta = {"general.architecture": "llama", "general.name": "tiny", "llama.block_count": 2,
            "llama.embedding_length": 32, "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": 2, "llama.feed_forward_length": 64,
            "llama.context_length": 128, "llama.rope.freq_base": 500000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.tokens": ["a"] * 77,
            "tokenizer.ggml.eos_token_id": 5}
    c = ModelConfig.from_gguf_metadata(meta, ["token_embd.weight", "output.weight"])
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 32, 4, 2, 8)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (64, 77, 128)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings, c.eos_token_id) == (500000.0, 1e-6, False, 5)
    assert ModelConfig.from_gguf_metadata(meta, ["token_embd.weight"]).tie_word_embeddings
    assert ModelConfig.from_gguf_metadata({**meta, "llama.attention.key_length": 16,
                                           "llama.attention.value_length": 16,
                                           "llama.rope.dimension_count": 16}).head_dim == 16
    for bad, match in [({"general.architecture": "gpt2"}, "not supported"),
                       ({"llama.attention.head_count_kv": 3}, "multiple"),
                       ({"llama.rope.dimension_count": 4}, "partial RoPE"),
                       ({"llama.rope.scaling.type": "yarn"}, "scaling")]:
        with pytest.raises(UnsupportedModelError, match=match):
            ModelConfig.from_gguf_metadata({**meta, **bad})
    missing = dict(meta)
    del missing["llama.block_count"]
    with pytest.raises(UnsupportedModelError, match="llama.block_count"):
        ModelConfig.from_gguf_metadata(missing)


def test_resolve_model_path_and_revision(tmp_path):
    path = resolve_model_path("smollm2")
    assert path.endswith(".gguf")
    with pytest.raises(FileNotFoundError, match="neither a bundled name"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    # revision: stable, content-sensitive, cheap
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(100))
    r1 = gguf_revision(f)
    assert r1 == gguf_revision(f) and len(r1) == 64
    f.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    assert gguf_revision(f) != r1
    big = tmp_path / "big.gguf"  # sampled mode (> 32 windows): a change inside the header counts
    data = bytearray(40 * 1024)
    big.write_bytes(bytes(data))
    r2 = gguf_revision(big, window=1024)
    data[100] = 1
    big.write_bytes(bytes(data))
    assert gguf_revision(big, window=1024) != r2
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        parse_dtype("int8")


def test_loader_rejects_non_gguf_file(tmp_path):
    from goodput.worker.model.gguf_loader import load_gguf

    f = tmp_path / "x.gguf"
    f.write_bytes(b"not a gguf" + struct.pack("<Q", 7) * 10)
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        load_gguf(str(f), cache_dir=False)


# ---------------------------------------------------------------- torch paged attention backend
def naive_paged_attention(q, k_cache, v_cache, seqs, block_size, scale):
    """seqs: list of (q_start, q_len, context_len, block_table). Float64 loops, for reference."""
    out = torch.zeros_like(q, dtype=torch.float64)
    H, KV = q.shape[1], k_cache.shape[2]
    for q_start, q_len, ctx, table in seqs:
        for i in range(q_len):
            pos = ctx + i
            keys = [k_cache[table[p // block_size], p % block_size] for p in range(pos + 1)]
            vals = [v_cache[table[p // block_size], p % block_size] for p in range(pos + 1)]
            K = torch.stack(keys).double()  # [pos+1, KV, d]
            V = torch.stack(vals).double()
            for h in range(H):
                kvh = h // (H // KV)
                s = (K[:, kvh] @ q[q_start + i, h].double()) * scale
                out[q_start + i, h] = torch.softmax(s, 0) @ V[:, kvh]
    return out


def build_meta(seqs, block_size):
    qsl, seq_lens, ctx_lens, slots = [0], [], [], []
    for _, q_len, ctx, table in seqs:
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(ctx + q_len)
        ctx_lens.append(ctx)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len)]
    nb = max(len(t) for *_, t in seqs)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor([list(t) + [0] * (nb - len(t)) for *_, t in seqs], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(s[1] for s in seqs),
        max_seq_len=max(seq_lens), query_start_loc_list=qsl, seq_lens_list=seq_lens)


@pytest.mark.parametrize("decodes_first", [True, False])
@pytest.mark.parametrize("H, KV", [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_backend_matches_naive_reference(H, KV, dtype, tol, decodes_first):
    torch.manual_seed(0)
    bs, d, num_blocks = 4, 8, 24
    # (q_start, q_len, context_len, block_table): decodes (one at a block boundary, one with
    # context 0), then a pure prefill and a chunk continuing mid-block after cached context
    specs = [(1, 6, [3, 1]), (1, 8, [5, 7, 2]), (1, 0, [9]), (5, 0, [10, 11]), (6, 5, [12, 13, 14])]
    if not decodes_first:  # decode rows interleaved with prefill rows (not at 0..B-1)
        specs = [specs[3], specs[0], specs[4], specs[1], specs[2]]
    seqs, start = [], 0
    for q_len, ctx, table in specs:
        seqs.append((start, q_len, ctx, table))
        start += q_len
    T = start
    k_cache = torch.randn(num_blocks, bs, KV, d).to(dtype)
    v_cache = torch.randn(num_blocks, bs, KV, d).to(dtype)
    q = torch.randn(T, H, d).to(dtype)
    k_new, v_new = torch.randn(T, KV, d).to(dtype), torch.randn(T, KV, d).to(dtype)
    meta = build_meta(seqs, bs)
    be = TorchReferenceBackend()
    be.write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    for row, slot in enumerate(meta.slot_mapping.tolist()):
        assert torch.equal(k_cache.view(-1, KV, d)[slot], k_new[row])
    scale = d ** -0.5
    out = be.forward(q, k_cache, v_cache, meta, scale)
    ref = naive_paged_attention(q, k_cache, v_cache, seqs, bs, scale)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # a second layer's call with the same metadata reuses the plan and gives the same answer
    torch.testing.assert_close(be.forward(q, k_cache, v_cache, meta, scale), out)


@pytest.mark.parametrize("specs", [
    [(1, 9, [4, 5, 6])],                      # one decode, consecutive blocks: read in place
    [(1, 9, [6, 2, 4])],                      # one decode, scattered blocks: gathered
    [(1, 9, [4, 5, 6]), (1, 3, [0]), (1, 5, [8, 9])],  # decode-only batch
])
@pytest.mark.parametrize("pooled", [True, False])
def test_torch_backend_decode_paths_match_naive_reference(specs, pooled):
    """Decode-only steps (the fast paths: in-place view, a gather buffer reused by every layer),
    with caches that are slices of one pool (as the runner allocates them) or separate tensors;
    two layers in one step must each read their own cache."""
    torch.manual_seed(1)
    bs, d, H, KV, num_blocks = 4, 8, 6, 2, 12
    if pooled:
        caches = allocate_kv_caches(2, num_blocks, bs, KV, d, torch.float32)
        for kc, vc in caches:
            kc.copy_(torch.randn_like(kc))
            vc.copy_(torch.randn_like(vc))
    else:
        caches = [(torch.randn(num_blocks, bs, KV, d), torch.randn(num_blocks, bs, KV, d)) for _ in range(2)]
    seqs, start = [], 0
    for q_len, ctx, table in specs:
        seqs.append((start, q_len, ctx, table))
        start += q_len
    meta = build_meta(seqs, bs)
    be = TorchReferenceBackend()
    scale = d ** -0.5
    for kc, vc in caches:  # layer after layer with the same metadata, as the model calls it
        q = torch.randn(start, H, d)
        be.write_kv(torch.randn(start, KV, d), torch.randn(start, KV, d), kc, vc, meta.slot_mapping)
        out = be.forward(q, kc, vc, meta, scale)
        ref = naive_paged_attention(q, kc, vc, seqs, bs, scale)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # a padding row past the last sequence comes back as zeros
    q = torch.randn(start + 1, H, d)
    meta = build_meta(seqs, bs)
    out = be.forward(q, *caches[0], meta, scale)
    assert out.shape == q.shape and out[start].eq(0).all()
    torch.testing.assert_close(out.double(), naive_paged_attention(q, *caches[0], seqs, bs, scale),
                               atol=1e-5, rtol=1e-5)


def test_write_kv_skips_negative_slots():
    be = TorchReferenceBackend()
    kc, vc = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    be.write_kv(k, 2 * k, kc, vc, torch.tensor([5, -1, 0]))
    assert kc.view(-1, 1, 2)[[0, 5]].eq(1).all() and vc.view(-1, 1, 2)[[0, 5]].eq(2).all()
    assert int(kc.ne(0).sum()) == 4  # two slots x head_dim 2, nothing else written


# ---------------------------------------------------------------- runner plumbing (real model)
@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner("smollm2", dtype="float32", block_size=4, num_blocks=32, attention_backend="torch")


@pytest.mark.slow
def test_runner_sizes_kv_from_budget(runner):
    c = runner.model_config
    assert runner.kv_bytes_per_token == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert runner.kv_caches[0][0].shape == (32, 4, c.num_kv_heads, c.head_dim)
    assert runner.kv_capacity_tokens == 128
    assert len(runner.kv_caches) == c.num_layers
    assert runner.tokenizer.eos_token_id == c.eos_token_id
    assert len(runner.revision) == 64


@pytest.mark.slow
def test_runner_budget_rule():
    r = ModelRunner("smollm2", dtype="bfloat16", block_size=16, kv_cache_memory_bytes=10 * 23040 * 16 + 5)
    assert r.num_blocks == 10 and r.kv_cache_bytes == 10 * 16 * 23040


@pytest.mark.slow
def test_runner_rejects_malformed_chunks_and_writes_nothing(runner):
    c = runner.model_config
    before = [k.clone() for k, _ in runner.kv_caches[:1]]
    good = dict(request_id="r", token_ids=(1, 2, 3), start_pos=0, block_table=(0,), sample=True,
                sampling_params=GREEDY)
    cases = [
        (dict(token_ids=()), "empty chunk"),
        (dict(token_ids=(1, 2, 3, 4, 5)), "block table"),
        (dict(block_table=(32,)), "block id"),
        (dict(block_table=(-1,)), "block id"),
        (dict(token_ids=(c.vocab_size,)), "vocabulary"),
        (dict(token_ids=(-3,)), "vocabulary"),
        (dict(start_pos=c.max_position_embeddings - 1, block_table=tuple(range(32))), "context length"),
    ]
    for override, match in cases:
        with pytest.raises(ValueError, match=match):
            runner.execute(SchedulerOutput([ScheduledChunk(**{**good, **override})]))
    with pytest.raises(ValueError, match="twice"):
        runner.execute(SchedulerOutput([ScheduledChunk(**good), ScheduledChunk(**{**good, "block_table": (1,)})]))
    assert torch.equal(runner.kv_caches[0][0], before[0])


@pytest.mark.slow
def test_runner_samples_only_final_chunks(runner):
    assert runner.execute(SchedulerOutput()).sampled_token_ids == {}
    ids = tuple(runner.tokenizer.encode("The capital of France is"))
    with_lp = SamplingParams(temperature=0.0, logprobs=2)
    out = runner.execute(SchedulerOutput([
        ScheduledChunk("x", ids[:3], 0, (0,), False, GREEDY),
        ScheduledChunk("y", ids, 0, (1, 2), True, with_lp),
        ScheduledChunk("w", ids, 0, (3, 4), True, GREEDY)]))
    assert set(out.sampled_token_ids) == {"y", "w"} and set(out.logprobs) == {"y"}  # only who asked
    lp = out.logprobs["y"]
    assert lp.logprob <= 0.0 and math.isfinite(lp.logprob) and lp.top[0] == (lp.token_id, lp.logprob)
    assert runner.tokenizer.decode([out.sampled_token_ids["y"]]).strip() == "Paris"


@pytest.mark.slow
def test_seeded_sampling_through_runner_is_reproducible(runner):
    ids = tuple(runner.tokenizer.encode("Once upon a time"))
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    a = runner.execute(SchedulerOutput([ScheduledChunk("a", ids, 0, (3, 4), True, p)]))
    b = runner.execute(SchedulerOutput([
        ScheduledChunk("z", ids[:2], 0, (6,), True, SamplingParams(temperature=1.0)),
        ScheduledChunk("b", ids, 0, (7, 8), True, p)]))
    assert a.sampled_token_ids["a"] == b.sampled_token_ids["b"]


def test_rope_tables_follow_theta_and_frequency_factors():
    """cos/sin tables = cos/sin(pos · theta^(-2i/d) / factor_i), computed here in float64."""
    from goodput.worker.model.llama import LlamaModel

    c = ModelConfig(architecture="llama", name="t", num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1,
                    head_dim=4, intermediate_size=4, vocab_size=3, max_position_embeddings=16,
                    rope_theta=100.0, rope_dim=4, rms_norm_eps=1e-5, tie_word_embeddings=True)
    t = {"token_embd.weight": torch.zeros(3, 8), "output_norm.weight": torch.ones(8),
         "blk.0.attn_norm.weight": torch.ones(8), "blk.0.ffn_norm.weight": torch.ones(8),
         "blk.0.attn_q.weight": torch.zeros(8, 8), "blk.0.attn_k.weight": torch.zeros(4, 8),
         "blk.0.attn_v.weight": torch.zeros(4, 8), "blk.0.attn_output.weight": torch.zeros(8, 8),
         "blk.0.ffn_gate.weight": torch.zeros(4, 8), "blk.0.ffn_up.weight": torch.zeros(4, 8),
         "blk.0.ffn_down.weight": torch.zeros(8, 4)}
    pos = torch.arange(16, dtype=torch.float64)[:, None]
    inv = torch.tensor([1.0, 100.0 ** -0.5], dtype=torch.float64)
    plain = LlamaModel(c, t)
    torch.testing.assert_close(plain._cos.double(), torch.cos(pos * inv), atol=1e-6, rtol=0)
    scaled = LlamaModel(c, {**t, "rope_freqs.weight": torch.tensor([1.0, 8.0])})
    torch.testing.assert_close(scaled._sin.double(), torch.sin(pos * inv / torch.tensor([1.0, 8.0]).double()),
                               atol=1e-6, rtol=0)
