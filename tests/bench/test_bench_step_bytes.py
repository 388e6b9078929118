"""Bytes one decode step reads (bench/goodput/bench/step_bytes.py), against numbers computed by
hand for SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads of 64, intermediate 1536,
vocabulary 49152, LM head tied to the embedding.

Per layer the linears hold q 576·576 + k 192·576 + v 192·576 + o 576·576 + gate/up/down
3·1536·576 = 3,538,944 weights in 5,184 output rows; 30 layers = 106,168,320 weights and
155,520 rows; the head 49152·576 = 28,311,552 weights in 49,152 rows; norms (2·30 + 1)·576 =
35,136 weights.
"""
import pytest
from goodput.bench.step_bytes import (gguf_step_tensors, gguf_weight_bytes, kv_bytes_per_step, linear_bytes,
                                      linear_shapes, ours_weight_bytes)

SMOLLM2 = {"layers": 30, "d_model": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "ffn": 1536, "vocab": 49152}


def test_linear_shapes_cover_every_matmul_weight_once():
    lin = linear_shapes(SMOLLM2)
    assert len(lin) == 30 * 7 + 1 and lin[-1] == ("lm_head", 49152, 576)
    assert sum(n * k for _, n, k in lin) == 106_168_320 + 28_311_552
    assert sum(n for _, n, _ in lin[:-1]) == 155_520


def test_bf16_and_fp32():
    b = ours_weight_bytes(SMOLLM2, 2)
    assert b == {"layers": 212_336_640, "lm_head": 56_623_104, "norms": 70_272, "total": 269_030_016}
    assert ours_weight_bytes(SMOLLM2, 4)["total"] == 538_060_032


def test_int8_one_byte_per_weight_plus_a_bf16_scale_per_row():
    b = ours_weight_bytes(SMOLLM2, 2, "int8")
    assert b["layers"] == 106_168_320 + 155_520 * 2
    assert b["lm_head"] == 28_311_552 + 49_152 * 2
    assert b["total"] == 134_959_488


def test_int4_groups_of_32_with_an_int8_head():
    # half a byte per weight + (scale, zero) in bf16 per 32 inputs = 0.625 bytes per weight
    b = ours_weight_bytes(SMOLLM2, 2, "int4", lm_head_scheme="int8")
    assert b["layers"] == 53_084_160 + 13_271_040 == 66_355_200
    assert b["lm_head"] == 28_409_856
    assert b["total"] == 94_835_328
    # an int4 head instead: 28,311,552 · 0.625
    assert ours_weight_bytes(SMOLLM2, 2, "int4")["lm_head"] == 17_694_720


def test_linear_bytes_rejects_bad_input():
    with pytest.raises(ValueError, match="group"):
        linear_bytes(4, 48, "int4", 2)
    with pytest.raises(ValueError, match="scheme"):
        linear_bytes(4, 64, "fp8", 2)


def _gguf_like(tied: bool) -> dict:
    """SmolLM2's Q4_1 GGUF by hand: Q4_1 = 20 bytes per block of 32 weights, Q8_0 = 34, F32 = 4 per weight
    (ggml-common.h block_q4_1 / block_q8_0)."""
    t = {"token_embd.weight": ("Q8_0", 28_311_552 * 34 // 32), "output_norm.weight": ("F32", 576 * 4),
         "rope_freqs.weight": ("F32", 128)}
    for i in range(30):
        for name, n, k in (("attn_q", 576, 576), ("attn_k", 192, 576), ("attn_v", 192, 576),
                           ("attn_output", 576, 576), ("ffn_gate", 1536, 576), ("ffn_up", 1536, 576),
                           ("ffn_down", 576, 1536)):
            t[f"blk.{i}.{name}.weight"] = ("Q4_1", n * k * 20 // 32)
        t[f"blk.{i}.attn_norm.weight"] = ("F32", 2304)
        t[f"blk.{i}.ffn_norm.weight"] = ("F32", 2304)
    if not tied:
        t["output.weight"] = ("Q6_K", 28_311_552 * 210 // 256)
    return t


def test_gguf_tied_head_reads_the_whole_embedding():
    g = gguf_weight_bytes(_gguf_like(tied=True))
    # layers 30 · (3,538,944 · 0.625 + 2 · 2304) + output norm + the Q8_0 embedding as the head
    assert g["total"] == 30 * (2_211_840 + 4_608) + 2_304 + 30_081_024 == 96_576_768
    assert g["lm_head"] == 30_081_024 and g["lm_head_tensor"] == "token_embd.weight"
    assert g["by_type"] == {"Q4_1": 66_355_200, "F32": 140_544, "Q8_0": 30_081_024}


def test_gguf_untied_head_skips_the_embedding():
    names = gguf_step_tensors(_gguf_like(tied=False))
    assert "token_embd.weight" not in names and "rope_freqs.weight" not in names
    assert gguf_weight_bytes(_gguf_like(tied=False))["lm_head"] == 23_224_320


def test_bundled_gguf_matches_the_hand_count():
    from gguf import GGUFReader
    from goodput.bench.prompts import bundled_model_path
    r = GGUFReader(bundled_model_path())
    g = gguf_weight_bytes({t.name: (t.tensor_type.name, int(t.n_bytes)) for t in r.tensors})
    assert g["total"] == 96_576_768


def test_kv_bytes():
    # 2 (K, V) · 30 layers · 3 heads · 64 · 2 bytes = 23,040 bytes per token
    assert kv_bytes_per_step(30, 3, 64, 2, 1) == 23_040
    assert kv_bytes_per_step(30, 3, 64, 2, 8192, batch=16) == 23_040 * 8192 * 16 == 3_019_898_880
