"""Bytes one decode step reads: weights (by storage scheme) and the attention KV cache.

Pure arithmetic, no torch. A decode step of a Llama model multiplies every linear weight once
whatever the batch (q, k, v, o, gate, up, down in each layer, then the LM head: ``output.weight``,
or the token embedding when the head is tied to it) and reads the RMSNorm weights; the
embedding lookup gathers only the B rows of the batch's tokens, which is not counted.

Storage schemes of our engine (``worker/model/quant.py``), per linear of ``N`` outputs and
``K`` inputs, with ``b`` = bytes of the serving dtype (2 for bfloat16, 4 for float32):

- ``none``: ``N·K·b``;
- ``int8``: int8 weights and one scale per output row: ``N·K + N·b``;
- ``int4``: two 4-bit codes per byte and a (scale, zero) pair per group of ``G`` inputs:
  ``N·K/2 + 2·N·(K/G)·b``.

llama.cpp reads the GGUF tensors as stored (block-quantized, e.g. Q4_1 = 20 bytes per 32
weights), so its figure is the sum of the file's tensor sizes over the same tensors.

KV bytes read by attention in one decode step, per sequence of ``T`` cached tokens:
``2·L·n_kv·d_head·bytes·T`` (K and V of every layer); a batch of B sequences reads B times that.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

SCHEMES = ("none", "int8", "int4")


def linear_shapes(shape: Mapping) -> list[tuple[str, int, int]]:
    """The (name, N outputs, K inputs) of every linear one decode step multiplies, LM head last.

    shape: ``layers``, ``d_model``, ``heads``, ``kv_heads``, ``head_dim``, ``ffn``, ``vocab``
    (as ``roofline.model_shape`` reads them from GGUF metadata).
    """
    L, D, H, KV, d, I = (int(shape[k]) for k in ("layers", "d_model", "heads", "kv_heads", "head_dim", "ffn"))
    out = []
    for i in range(L):
        out += [(f"blk.{i}.attn_q", H * d, D), (f"blk.{i}.attn_k", KV * d, D), (f"blk.{i}.attn_v", KV * d, D),
                (f"blk.{i}.attn_output", D, H * d), (f"blk.{i}.ffn_gate", I, D), (f"blk.{i}.ffn_up", I, D),
                (f"blk.{i}.ffn_down", D, I)]
    out.append(("lm_head", int(shape["vocab"]), D))
    return out


def linear_bytes(n: int, k: int, scheme: str, dtype_bytes: int, group: int = 32) -> int:
    """Bytes of one [n x k] linear's weights in ``scheme`` (module docstring). ValueError for an
    unknown scheme or, for int4, k not a multiple of ``group``."""
    if scheme == "none":
        return n * k * dtype_bytes
    if scheme == "int8":
        return n * k + n * dtype_bytes
    if scheme == "int4":
        if k % group or k % 2:
            raise ValueError(f"int4 needs K ({k}) a multiple of the group size {group}")
        return n * k // 2 + 2 * n * (k // group) * dtype_bytes
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def ours_weight_bytes(shape: Mapping, dtype_bytes: int, scheme: str = "none",
                      lm_head_scheme: str | None = None, group: int = 32) -> dict:
    """Weight bytes our engine reads per decode step.

    dtype_bytes: 2 (bfloat16) or 4 (float32), the serving dtype (norms, scales, unquantized
    weights); scheme: of the layers' linears; lm_head_scheme: of the LM head (default: scheme).
    Returns {"layers", "lm_head", "norms", "total"} in bytes.
    """
    head_scheme = scheme if lm_head_scheme is None else lm_head_scheme
    lin = linear_shapes(shape)
    layers = sum(linear_bytes(n, k, scheme, dtype_bytes, group) for _, n, k in lin[:-1])
    _, n, k = lin[-1]
    head = linear_bytes(n, k, head_scheme, dtype_bytes, group)
    norms = (2 * int(shape["layers"]) + 1) * int(shape["d_model"]) * dtype_bytes
    return {"layers": layers, "lm_head": head, "norms": norms, "total": layers + head + norms}


def gguf_step_tensors(names: Iterable[str]) -> list[str]:
    """The GGUF tensors a llama.cpp decode step reads in full: every ``blk.*`` weight, the final
    norm, and ``output.weight`` (or ``token_embd.weight`` when the head is tied to the embedding,
    i.e. the file has no ``output.weight``). Rotary tables (``rope_*``) are excluded."""
    names = list(names)
    keep = [n for n in names if n.startswith("blk.") or n == "output_norm.weight"]
    keep.append("output.weight" if "output.weight" in names else "token_embd.weight")
    return keep


def gguf_weight_bytes(tensors: Mapping[str, tuple[str, int]]) -> dict:
    """Bytes llama.cpp reads per decode step from a GGUF file's tensors.

    tensors: name -> (ggml type name, bytes stored). Returns {"total", "lm_head", "by_type":
    {type: bytes}, "lm_head_tensor"}; KeyError when the file has neither head tensor.
    """
    names = gguf_step_tensors(tensors)
    by_type: dict[str, int] = {}
    for n in names:
        t, b = tensors[n]
        by_type[t] = by_type.get(t, 0) + int(b)
    head = names[-1]
    return {"total": sum(by_type.values()), "lm_head": int(tensors[head][1]), "by_type": by_type,
            "lm_head_tensor": head}


def kv_bytes_per_step(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float, tokens: int,
                      batch: int = 1) -> float:
    """K and V bytes attention reads in one decode step: ``2·L·n_kv·d_head·bytes·T`` per sequence
    of T cached tokens, times the batch."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes * tokens * batch
