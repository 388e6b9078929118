"""Weight-only quantized linears on torch's own CPU kernels (``--quantization int8|int4``).

Activations stay in the serving dtype (bfloat16 or float32); only the weights are stored in
fewer bits, so a memory-bound decode step reads fewer bytes. Both kernels dequantize in float32,
accumulate in float32 and round the output to the activation dtype once.

- :class:`Int8Linear`: symmetric per-output-channel int8, ``W[n, k] = s[n] · q[n, k]`` with
  ``q ∈ [-127, 127]``, ``s[n] = max_k |W[n, k]| / 127`` (round to nearest; the absmax scheme of
  LLM.int8()'s vector-wise quantization, Dettmers et al. 2022, without its outlier split);
  kernel ``aten._weight_int8pack_mm(x, q, s)``.
- :class:`Int4Linear`: asymmetric int4 in groups of ``G`` input channels,
  ``W[n, k] = (q[n, k] − 8) · s[g, n] + z[g, n]`` with ``q ∈ [0, 15]``, ``g = k // G``;
  kernels ``aten._convert_weight_to_int4pack_for_cpu`` (pack once) and
  ``aten._weight_int4pack_mm_for_cpu`` (GPTQ/AWQ-style grouped weights as in gpt-fast).

GGUF files whose linears are already 4-bit blocks of 32 (``Q4_1``: ``w = d·q + m``; ``Q4_0``:
``w = d·(q − 8)``; llama.cpp's ggml-quants.c) are *repacked*, not re-quantized: the file's own
``q`` is kept and ``s = d``, ``z = m + 8d`` (``Q4_0``: ``z = 0``). In float32 that represents every
weight exactly (:func:`int4_from_gguf_blocks` checks it); in bfloat16 the kernel needs ``s`` and
``z`` in bfloat16, so they are rounded once (relative error ≤ 2⁻⁸ each, the same size as the
rounding of the bf16 reference weights themselves). Any other tensor type is quantized from its
dequantized values by round-to-nearest (min/max per group).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from goodput.worker.engine.config import QUANTIZATIONS  # declared once, with the setting

log = logging.getLogger(__name__)

INT4_GROUP = 32  # GGUF's block size, so Q4_0/Q4_1 blocks map one-to-one onto groups
_DTYPES = (torch.float32, torch.bfloat16)


def check_supported(quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ValueError with the fix when ``quantization`` cannot run with this dtype/device."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "none":
        return
    if torch.device(device).type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on torch's CPU kernels only; "
                         f"use --device cpu, or --quantization none on {torch.device(device).type}")
    if dtype not in _DTYPES:
        raise ValueError(f"--quantization {quantization} needs --dtype bfloat16 or float32, got {dtype}")


class Int8Linear:
    """``y = x @ (s[:, None] · q).T`` with int8 ``q`` [N, K] and scales ``s`` [N] in ``x``'s dtype.

    Build with :meth:`from_float`. Input ``x`` [T, K] in ``dtype``; output [T, N] in ``dtype``.
    Weight bytes read per call: N·K + N·bytes(dtype) (half of bf16, a quarter of fp32).
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.shape != qweight.shape[:1]:
            raise ValueError("Int8Linear needs int8 [N, K] weights and [N] scales")
        self.out_features, self.in_features = qweight.shape
        self.qweight = qweight.contiguous()
        self.scales = scales.contiguous()

    @classmethod
    def from_float(cls, w: torch.Tensor, dtype: torch.dtype) -> Int8Linear:
        """Quantize float ``w`` [N, K]: ``s = absmax/127`` per row, rounded to ``dtype`` first so
        that ``q = round(w / s)`` is chosen for the scale the kernel actually uses."""
        wf = w.float()
        s = (wf.abs().amax(dim=1) / 127.0).to(dtype)
        sf = s.float()
        sf = torch.where(sf > 0, sf, torch.ones_like(sf))  # an all-zero row: q = 0 for any scale
        q = torch.round(wf / sf[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, s)

    def dequantize(self) -> torch.Tensor:
        """The weights the kernel multiplies by, float32 [N, K]."""
        return self.qweight.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)


class Int4Linear:
    """``y = x @ W.T`` with ``W[n, k] = (q[n, k] − 8) · s[k // G, n] + z[k // G, n]``.

    ``packed``: torch's CPU int4 layout (uint8 [N, K/2]) from
    ``aten._convert_weight_to_int4pack_for_cpu``; ``scales_zeros``: [K/G, N, 2] (scale, zero) in
    the activation dtype. Input ``x`` [T, K]; output [T, N]. Weight bytes read per call:
    N·K/2 + 2·N·(K/G)·bytes(dtype) (bf16, G = 32: 0.625 bytes per weight).
    """

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int):
        self.out_features = packed.shape[0]
        self.in_features = scales_zeros.shape[0] * group_size
        self.packed = packed
        self.scales_zeros = scales_zeros.contiguous()
        self.group_size = group_size

    @classmethod
    def from_codes(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   dtype: torch.dtype, group_size: int = INT4_GROUP) -> Int4Linear:
        """Pack codes ``q`` (integers 0..15, [N, K]) with ``scales``/``zeros`` [N, K/G] (cast to
        ``dtype``). Raises ValueError for codes outside 0..15 or K not a multiple of G."""
        N, K = q.shape
        if N % 16:
            raise ValueError(f"int4 needs out_features ({N}) divisible by 16 (torch's CPU int4 layout)")
        if K % group_size or scales.shape != (N, K // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"int4 needs K ({K}) a multiple of the group size {group_size} and "
                             f"[N, K/G] scales and zeros")
        q32 = q.to(torch.int32).contiguous()
        if q32.numel() and (int(q32.min()) < 0 or int(q32.max()) > 15):
            raise ValueError("int4 codes must lie in 0..15")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1)
        sz = torch.stack([scales.to(dtype), zeros.to(dtype)], dim=-1).transpose(0, 1)
        return cls(packed, sz, group_size)

    @classmethod
    def from_float(cls, w: torch.Tensor, dtype: torch.dtype, group_size: int = INT4_GROUP) -> Int4Linear:
        """Round-to-nearest asymmetric quantization of float ``w`` [N, K] per group of ``G``
        inputs: ``s = (max − min)/15``, ``z = min + 8s`` (both rounded to ``dtype`` first),
        ``q = clamp(round((w − z)/s) + 8, 0, 15)``."""
        N, K = w.shape
        if K % group_size:
            raise ValueError(f"int4 needs in_features ({K}) divisible by the group size {group_size}")
        g = w.float().reshape(N, K // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15.0).to(dtype).float()
        s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: q = 0, w = z - 8 = min
        z = (lo + 8 * s).to(dtype).float()
        q = torch.round((g - z[..., None]) / s[..., None] + 8).clamp_(0, 15).reshape(N, K)
        return cls.from_codes(q, s, z, dtype, group_size)

    def dequantize(self) -> torch.Tensor:
        """The weights the kernel multiplies by, float32 [N, K], read back through the kernel
        itself (identity input in float32, so every output is one weight, exactly)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group_size, self.scales_zeros.float()).T.contiguous()

    def codes(self) -> torch.Tensor:
        """The unpacked codes ``q`` (int32 [N, K], 0..15): the pack/unpack inverse of
        :meth:`from_codes`, through the kernel with scale 1 and zero 8."""
        sz = torch.empty_like(self.scales_zeros, dtype=torch.float32)
        sz[..., 0], sz[..., 1] = 1.0, 8.0
        eye = torch.eye(self.in_features, dtype=torch.float32)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group_size, sz).T.round().to(torch.int32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed,
                                                          self.group_size, self.scales_zeros)


@dataclass
class Q4Blocks:
    """A GGUF tensor stored as blocks of 32 (``Q4_0``, ``Q4_1``, or ``Q8_0``), unpacked.

    q: codes [N, K], uint8 0..15 (4-bit kinds) or int8 (``Q8_0``); d, m: float32 [N, K/32] block
    scale and minimum (``m`` is None for ``Q4_0``, whose weights are ``d·(q − 8)``, and for
    ``Q8_0``: ``d·q``). Rows in the same order as the loader's dequantized tensor (Q/K rows
    already un-permuted).
    """

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] exactly as ``gguf.quants`` computes it (``d·q + m``; ``d·(q − 8)``; ``d·q``)."""
        N, K = self.q.shape
        qf = self.q.float().reshape(N, K // 32, 32)
        if self.kind == "Q8_0":
            w = qf * self.d[..., None]
        elif self.m is None:
            w = (qf - 8) * self.d[..., None]
        else:
            w = self.d[..., None] * qf + self.m[..., None]
        return w.reshape(N, K)


def unpack_gguf_q4(raw: np.ndarray, kind: str, rows: int, cols: int) -> Q4Blocks:
    """Unpack raw GGUF block bytes (``uint8``, ``rows·cols/32`` blocks) of type ``Q4_0``
    (d f16, 16 bytes of nibbles) or ``Q4_1`` (d f16, m f16, 16 bytes): within a block, element
    ``j < 16`` is the low nibble of byte ``j`` and element ``16 + j`` its high nibble
    (ggml-quants.c, ``dequantize_row_q4_1``)."""
    head = {"Q4_0": 2, "Q4_1": 4}[kind]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // 32, head + 16)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 32) if kind == "Q4_1" else None
    qs = b[:, head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(rows, cols)
    return Q4Blocks(kind, torch.from_numpy(q), torch.from_numpy(d),
                    None if m is None else torch.from_numpy(m))


def unpack_gguf_q8_0(raw: np.ndarray, kind: str, rows: int, cols: int) -> Q4Blocks:
    """Unpack raw GGUF ``Q8_0`` bytes (``rows·cols/32`` blocks of d f16 then 32 int8 codes;
    ggml-quants.c, ``dequantize_row_q8_0``: w = d·q)."""
    if kind != "Q8_0":
        raise ValueError(f"unpack_gguf_q8_0 reads Q8_0 blocks, not {kind}")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // 32, 34)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 32)
    q = b[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return Q4Blocks(kind, torch.from_numpy(q), torch.from_numpy(d), None)


def int4_from_gguf_blocks(blocks: list[Q4Blocks], dtype: torch.dtype) -> Int4Linear:
    """Repack the file's own 4-bit blocks (rows of several tensors concatenated, e.g. Q, K, V):
    ``s = d``, ``z = m + 8d`` (``Q4_0``: ``z = 0``). Lossless in float32 whenever ``m + 8d`` is a
    float32 number, which holds for float16 ``d`` and ``m`` unless their exponents differ by
    more than 13 (checked by the caller's tests against :meth:`Q4Blocks.dequantize`)."""
    q = torch.cat([b.q for b in blocks])
    d = torch.cat([b.d for b in blocks])
    z = torch.cat([b.m + 8 * b.d if b.m is not None else torch.zeros_like(b.d) for b in blocks])
    return Int4Linear.from_codes(q, d, z, dtype, 32)


def make_linear(quantization: str, weight: torch.Tensor, dtype: torch.dtype,
                blocks: list[Q4Blocks] | None = None):
    """A quantized linear for the float weight [N, K] (``blocks``: the file's own 4-bit blocks of
    the same rows, used by int4 when every part has them). Under int4, a shape torch's int4
    layout cannot hold (N not a multiple of 16, K not of 32) falls back to int8, with a warning."""
    if quantization == "int8":
        return Int8Linear.from_float(weight, dtype)
    if quantization == "int4":
        N, K = weight.shape
        if N % 16 or K % INT4_GROUP:
            # torch's int4 layout needs N % 16 == 0 and whole groups; int8 takes any shape
            log.warning("int4 cannot hold a [%d, %d] linear (needs out %% 16 == 0, in %% %d == 0); "
                        "it is int8 instead", N, K, INT4_GROUP)
            return Int8Linear.from_float(weight, dtype)
        if blocks is not None:
            return int4_from_gguf_blocks(blocks, dtype)
        return Int4Linear.from_float(weight, dtype)
    raise ValueError(f"unknown quantization {quantization!r}")
