"""Any llama-architecture GGUF loads: a synthetic tiny model with other shapes than SmolLM2.

We write a small random llama GGUF with gguf's own writer (2 layers, width 64, 4 query heads,
2 KV heads, head_dim 16, untied output.weight, RoPE theta 5e5, context 128, Q/K rows in
llama.cpp's permuted order) with SmolLM2's byte-level vocabulary, then compare our runner with
Hugging Face transformers loading the same file: logits and paged greedy decoding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from goodput.worker.engine.outputs import ScheduledChunk, SchedulerOutput
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.model.gguf_loader import load_gguf
from goodput.worker.model.runner import ModelRunner

pytestmark = pytest.mark.slow

L, D, H, KV, FF, CTX, THETA, EPS = 2, 64, 4, 2, 96, 128, 500000.0, 1e-5


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: rotate-half rows -> interleaved-pair rows, per head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    import gguf

    meta = load_gguf("smollm2", "float32").metadata
    tokens, types, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], \
        meta["tokenizer.ggml.merges"]
    V = len(tokens)
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-random-llama")
    w.add_block_count(L)
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(EPS)
    w.add_vocab_size(V)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def rnd(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    hd = D // H
    w.add_tensor("token_embd.weight", rnd(V, D, scale=0.5))
    w.add_tensor("output.weight", rnd(V, D, scale=0.2))
    w.add_tensor("output_norm.weight", 1 + rnd(D, scale=0.1))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1 + rnd(D, scale=0.1))
        w.add_tensor(p + "ffn_norm.weight", 1 + rnd(D, scale=0.1))
        w.add_tensor(p + "attn_q.weight", llama_cpp_permute(rnd(H * hd, D, scale=0.3), H))
        w.add_tensor(p + "attn_k.weight", llama_cpp_permute(rnd(KV * hd, D, scale=0.3), KV))
        w.add_tensor(p + "attn_v.weight", rnd(KV * hd, D))
        w.add_tensor(p + "attn_output.weight", rnd(D, H * hd))
        w.add_tensor(p + "ffn_gate.weight", rnd(FF, D))
        w.add_tensor(p + "ffn_up.weight", rnd(FF, D))
        w.add_tensor(p + "ffn_down.weight", rnd(D, FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hf_tiny(tiny_gguf):
    import os

    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(tiny_gguf), gguf_file=os.path.basename(tiny_gguf),
                                             dtype=torch.float32)
    return m.eval()


def test_tiny_llama_config_and_logits_match_hf(tiny_gguf, hf_tiny, tmp_path):
    r = ModelRunner(tiny_gguf, dtype="float32", block_size=4, num_blocks=64, attention_backend="torch",
                    weight_cache_dir=tmp_path)
    c = r.model_config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (L, D, H, KV, D // H)
    assert (c.intermediate_size, c.max_position_embeddings, c.rope_theta) == (FF, CTX, THETA)
    assert not c.tie_word_embeddings
    assert r.kv_bytes_per_token == 2 * L * KV * (D // H) * 4
    ids = r.tokenizer.encode("Hello tiny model, how are you today? 1234")
    ours = r.forward_logits(SchedulerOutput([
        ScheduledChunk("x", tuple(ids), 0, tuple(range(20, 20 + -(-len(ids) // 4))), False,
                       SamplingParams(temperature=0.0))]))["x"]
    with torch.inference_mode():
        ref = hf_tiny(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    # paged greedy decode (prompt in two chunks, then decodes) vs HF's full recompute
    g = SamplingParams(temperature=0.0)
    table = tuple(range(40, 40 + 8))
    r.execute(SchedulerOutput([ScheduledChunk("y", tuple(ids[:5]), 0, table[:2], False, g)]))
    out = r.execute(SchedulerOutput([ScheduledChunk("y", tuple(ids[5:]), 5, table, True, g)]))
    toks = [out.sampled_token_ids["y"]]
    for _ in range(5):
        out = r.execute(SchedulerOutput([ScheduledChunk("y", (toks[-1],), len(ids) + len(toks) - 1, table, True,
                                                        g, len(toks))]))
        toks.append(out.sampled_token_ids["y"])
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(6):
            seq.append(int(hf_tiny(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert toks == seq[len(ids):]
    # weights were cached under tmp_path; a second load reads them back identically
    again = load_gguf(tiny_gguf, "float32", cache_dir=tmp_path)
    assert again.from_cache and torch.equal(again.tensors["output.weight"], load_gguf(
        tiny_gguf, "float32", cache_dir=False).tensors["output.weight"])
