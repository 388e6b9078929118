"""Weight-only quantized linears (``model/quant.py``) and ``--quantization`` end to end.

Kernel checks compare against a float64 matmul of the dequantized weights. Both torch kernels
dequantize to float32, accumulate in float32 and round the output once to the activation dtype,
so |y − y_ref| ≤ γ_K·Σ_k|x_k·w_k| + u_out·|y_ref| with γ_K = K·2⁻²⁴ (float32 summation, Higham
2002 §3.1) and u_out the output's unit roundoff (2⁻⁸ bf16, 2⁻²⁴ fp32); the bound used is that,
doubled for slack in the order of operations.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from goodput.worker.model.quant import (Int4Linear, Int8Linear, check_supported,
                                        int4_from_gguf_blocks, unpack_gguf_q4)

U_OUT = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
SHAPES = [(1, 64, 32), (5, 96, 64), (33, 48, 128)]  # (T, N, K); int4: N % 16 == 0, K % 32 == 0


def _bound(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    K = x.shape[1]
    return ref, 2 * (K * 2.0 ** -24 * (xd.abs() @ wd.abs().T) + U_OUT[dtype] * ref.abs()) + 1e-30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,N,K", SHAPES)
def test_int8_linear_matches_dequantized_reference(T, N, K, dtype):
    g = torch.Generator().manual_seed(T * 1000 + N + K)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)  # rows of different scale
    lin = Int8Linear.from_float(w, dtype)
    s = lin.scales.float()
    # round to nearest with the scale the kernel uses: |w − s·q| ≤ s/2 (and q within ±127)
    assert lin.qweight.abs().max() <= 127
    assert ((lin.dequantize() - w).abs() <= s[:, None] / 2 * (1 + 1e-6)).all()
    x = torch.randn(T, K, generator=g).to(dtype)
    ref, tol = _bound(x.float(), lin.dequantize(), dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (T, N)
    assert ((y.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,N,K", SHAPES)
def test_int4_linear_matches_dequantized_reference(T, N, K, dtype):
    g = torch.Generator().manual_seed(T * 1000 + N + K + 1)
    w = torch.randn(N, K, generator=g) + torch.randn(N, 1, generator=g)  # groups off zero
    lin = Int4Linear.from_float(w, dtype)
    # RTN within a group: |w − ŵ| ≤ s/2, plus the dtype rounding of s (×15 at the group's top)
    # and of z
    sz = lin.scales_zeros.float()                           # [K/32, N, 2]
    s = sz[..., 0].T.repeat_interleave(32, 1)
    z = sz[..., 1].T.repeat_interleave(32, 1)
    slack = U_OUT[dtype] * (15 * s + z.abs())
    assert ((lin.dequantize() - w).abs() <= s / 2 + slack + 1e-6).all()
    x = torch.randn(T, K, generator=g).to(dtype)
    ref, tol = _bound(x.float(), lin.dequantize(), dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (T, N)
    assert ((y.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("N,K", [(16, 32), (96, 64), (48, 256)])
def test_int4_pack_unpack_round_trip(N, K):
    g = torch.Generator().manual_seed(N + K)
    q = torch.randint(0, 16, (N, K), generator=g)
    scales, zeros = torch.rand(N, K // 32, generator=g), torch.randn(N, K // 32, generator=g)
    lin = Int4Linear.from_codes(q, scales, zeros, torch.float32)
    assert torch.equal(lin.codes(), q.to(torch.int32))
    s, z = scales.repeat_interleave(32, 1), zeros.repeat_interleave(32, 1)
    want = (q.float() - 8) * s + z
    # the kernel may fuse the multiply-add (one rounding instead of two): ≤ 1 ulp of the terms
    assert ((lin.dequantize() - want).abs() <= 2.0 ** -23 * (8 * s + z.abs())).all()


def test_int4_rejects_bad_codes_and_shapes():
    with pytest.raises(ValueError, match="0..15"):
        Int4Linear.from_codes(torch.full((16, 32), 16), torch.ones(16, 1), torch.zeros(16, 1), torch.float32)
    with pytest.raises(ValueError, match="multiple of the group size"):
        Int4Linear.from_codes(torch.zeros(16, 48), torch.ones(16, 1), torch.zeros(16, 1), torch.float32)
    with pytest.raises(ValueError, match="divisible by 16"):
        Int4Linear.from_codes(torch.zeros(8, 32), torch.ones(8, 1), torch.zeros(8, 1), torch.float32)
    with pytest.raises(ValueError, match="divisible"):
        Int4Linear.from_float(torch.randn(16, 40), torch.bfloat16)


def test_int4_falls_back_to_int8_for_shapes_its_layout_cannot_hold():
    from goodput.worker.model.quant import make_linear
    assert isinstance(make_linear("int4", torch.randn(48, 64), torch.bfloat16), Int4Linear)
    for shape in [(40, 64), (48, 40)]:  # N % 16 != 0 (e.g. a vocabulary of 32001); K % 32 != 0
        lin = make_linear("int4", torch.randn(*shape), torch.bfloat16)
        assert isinstance(lin, Int8Linear) and lin(torch.randn(3, shape[1]).bfloat16()).shape == (3, shape[0])


def _random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes of ``kind`` with random float16 scales/minimums (real-model magnitudes)."""
    rng = np.random.default_rng(seed)
    nb = rows * cols // 32
    d = (rng.random(nb) * 0.02 + 1e-4).astype(np.float16)
    parts = [d.view(np.uint8).reshape(nb, 2)]
    if kind == "Q4_1":
        m = (-rng.random(nb) * 0.15).astype(np.float16)
        parts.append(m.view(np.uint8).reshape(nb, 2))
    parts.append(rng.integers(0, 256, (nb, 16), dtype=np.uint8))
    return np.concatenate(parts, axis=1).reshape(-1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_repack_exactly_in_float32(kind):
    """Unpacking agrees bit for bit with the gguf library's own dequantizer, and the int4 repack
    represents every weight exactly (float32 scales/zeros), so the repacked linear equals a
    float32 linear over the file's weights up to summation order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, cols = 48, 128
    raw = _random_blocks(kind, rows, cols, seed=len(kind))
    blocks = unpack_gguf_q4(raw, kind, rows, cols)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols).astype(np.float32))
    assert torch.equal(blocks.dequantize(), want)
    lin = int4_from_gguf_blocks([blocks], torch.float32)
    assert torch.equal(lin.dequantize(), want)
    x = torch.randn(7, cols)
    ref, tol = _bound(x, want, torch.float32)
    assert ((lin(x).double() - ref).abs() <= tol).all()
    # bf16: q is kept, s and z are rounded once to bf16 (unit roundoff 2^-8 each)
    lb = int4_from_gguf_blocks([blocks], torch.bfloat16)
    assert torch.equal(lb.codes(), blocks.q.to(torch.int32))
    d = blocks.d.repeat_interleave(32, 1)
    z = (blocks.m + 8 * blocks.d if blocks.m is not None else torch.zeros_like(blocks.d)).repeat_interleave(32, 1)
    assert ((lb.dequantize() - want).abs() <= 2.0 ** -8 * (8 * d + z.abs()) * (1 + 1e-6)).all()


def test_fused_rows_concatenate_blocks():
    a = unpack_gguf_q4(_random_blocks("Q4_1", 16, 64, 1), "Q4_1", 16, 64)
    b = unpack_gguf_q4(_random_blocks("Q4_0", 16, 64, 2), "Q4_0", 16, 64)
    lin = int4_from_gguf_blocks([a, b], torch.float32)
    assert torch.equal(lin.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_unsupported_combinations_are_clear_errors():
    check_supported("int4", torch.bfloat16, torch.device("cpu"))
    check_supported("none", torch.float16, torch.device("cuda"))
    with pytest.raises(ValueError, match="CPU kernels only"):
        check_supported("int8", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        check_supported("int4", torch.float16, torch.device("cpu"))
    with pytest.raises(ValueError, match="one of"):
        check_supported("int3", torch.float32, torch.device("cpu"))


# --------------------------------------------------------------------- setting plumbing
def test_quantization_flag_reaches_engine_args_and_bad_values_are_refused(capsys):
    from goodput.worker.cli import build_parser, engine_args_from
    from goodput.worker.engine.config import EngineArgs, to_cli_args

    assert EngineArgs().quantization == "none"
    a = engine_args_from(build_parser().parse_args(["serve", "--quantization", "int4"]))
    assert a.quantization == "int4"
    assert to_cli_args({"quantization": "int8"}) == ["--quantization", "int8"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="fp8")
    with pytest.raises(ValueError, match="CPU kernels only"):
        EngineArgs(quantization="int8", device="cuda")


def test_crd_carries_quantization_and_rejects_unknown_values():
    import pydantic
    from goodput.operator import resources as r
    from goodput.api.crd import InferenceServiceSpec
    from goodput.operator.crdgen import build_crd

    spec = InferenceServiceSpec.model_validate({"engine": {"quantization": "int4"}})
    args = r.worker_args(spec)
    assert args[args.index("--quantization") + 1] == "int4"
    with pytest.raises(pydantic.ValidationError):
        InferenceServiceSpec.model_validate({"engine": {"quantization": "int3"}})
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    engine = schema["properties"]["spec"]["properties"]["engine"]["properties"]
    assert engine["quantization"]["enum"] == ["none", "int8", "int4"]


# --------------------------------------------------------------------- the real model
PROMPTS = ["The capital of France is", "Q: What is 12 plus 7?\nA:", "The three primary colors are"]


@pytest.fixture(scope="module")
def smollm2():
    from goodput.worker.model.gguf_loader import load_gguf, load_q4_blocks
    m = load_gguf("smollm2", "float32")
    return m, load_q4_blocks(m)


@pytest.mark.slow
def test_real_gguf_blocks_repack_losslessly(smollm2):
    """Every Q4_1 linear of the bundled SmolLM2 GGUF, repacked to int4 in float32, holds exactly
    the loader's dequantized weights (so int4 there is the file's own quantization, not a new one)."""
    model, blocks = smollm2
    linears = [n for n in model.tensors if n.startswith("blk.") and not n.endswith("norm.weight")]
    assert linears and set(linears) <= set(blocks)
    for name in linears[:: max(1, len(linears) // 24)] + ["blk.0.attn_q.weight", "blk.29.attn_k.weight"]:
        assert torch.equal(int4_from_gguf_blocks([blocks[name]], torch.float32).dequantize(),
                           model.tensors[name]), name


def _generate(runner, prompts, n):
    from goodput.worker.engine.outputs import ScheduledChunk, SchedulerOutput
    from goodput.worker.engine.sampling_params import SamplingParams
    greedy = SamplingParams(temperature=0.0)
    ids = [list(runner.tokenizer.encode(p)) for p in prompts]
    out = [[] for _ in prompts]
    per = 4
    chunks = [ScheduledChunk(str(i), tuple(p), 0, tuple(range(i * per, (i + 1) * per)), True, greedy)
              for i, p in enumerate(ids)]
    for step in range(n):
        res = runner.execute(SchedulerOutput(chunks))
        for i in range(len(ids)):
            out[i].append(res.sampled_token_ids[str(i)])
        chunks = [ScheduledChunk(str(i), (out[i][-1],), len(p) + step, tuple(range(i * per, (i + 1) * per)),
                                 True, greedy) for i, p in enumerate(ids)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_greedy_text_is_sane(quantization):
    from goodput.worker.model.runner import ModelRunner
    r = ModelRunner("smollm2", dtype="bfloat16", quantization=quantization, block_size=16, num_blocks=16,
                    attention_backend="torch")
    kinds = {type(r.model.layers[0].qkv).__name__, type(r.model.layers[-1].down).__name__}
    assert kinds == {"Int8Linear" if quantization == "int8" else "Int4Linear"}
    out = _generate(r, PROMPTS[:2], 12)
    texts = [r.tokenizer.decode(o) for o in out]
    assert "Paris" in texts[0] and "19" in texts[1], texts


@pytest.mark.slow
def test_int4_fp32_equals_reference_of_the_same_weights():
    """int4 in float32 multiplies by exactly the file's weights, so the only difference from the
    unquantized float32 model is float32 summation order, and greedy
    tokens are equal (the LM head stays float32 under int4)."""
    from goodput.worker.model.runner import ModelRunner
    ref = ModelRunner("smollm2", dtype="float32", block_size=16, num_blocks=16, attention_backend="torch")
    q4 = ModelRunner("smollm2", dtype="float32", quantization="int4", block_size=16, num_blocks=16,
                     attention_backend="torch")
    assert q4.model.lm_head_quantization == "none"
    assert _generate(q4, PROMPTS, 12) == _generate(ref, PROMPTS, 12)


def test_cuda_or_float16_with_quantization_fails_before_loading():
    from goodput.worker.model.runner import ModelRunner
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        ModelRunner("smollm2", dtype="float16", quantization="int4", num_blocks=4)
