"""Llama forward pass over a flat mixed batch with a paged KV cache.

Architecture (Touvron et al. 2023, "LLaMA"): token embedding; per layer
``x += W_o · Attn(RoPE(W_q·n(x)), RoPE(W_k·n(x)), W_v·n(x))`` and
``x += W_down · (SiLU(W_gate·n(x)) ⊙ W_up·n(x))`` with RMSNorm n (Zhang & Sennrich 2019);
final RMSNorm and the LM head (tied to the embedding when the file has no ``output.weight``).
RoPE (Su et al. 2021) in the rotate-half convention of Hugging Face's Llama, theta from the
GGUF metadata. Grouped-query attention (Ainslie et al. 2023) through an attention backend
(``attention/base.py``) over the paged cache.

CPU speed: Q/K/V and gate/up projections are fused into one matmul each (weights concatenated
at load), RoPE cos/sin are gathered once per step, logits are computed only for the rows that
sample, and where goodput's C++ CPU kernels build (``cpu_kernels``) each layer's element-wise work
runs as four fused ops (residual add + RMSNorm, RoPE in place, SiLU·up) instead of ~25 small
torch ops — at batch 1 per-op dispatch, not arithmetic, was most of that time. Numerics follow Hugging Face's LlamaForCausalLM: RMSNorm in float32 then cast,
cos/sin computed in float32 and cast to the model dtype, residual stream in the model dtype.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from goodput.worker.model.attention.base import AttentionBackend, AttentionMetadata
from goodput.worker.model.block_linear import MAX_ROWS, BlockLinear, calibrate_max_rows, from_parts
from goodput.worker.model.config import ModelConfig
from goodput.worker.model.quant import Int4Linear, Int8Linear, Q4Blocks, check_supported, make_linear


def _can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    # oneDNN's bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on other CPUs (e.g. AVX2-only
    # nodes) the reorder raises, so the weights stay plain and F.linear runs them
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and _onednn_packs_bf16())


@functools.cache
def _onednn_packs_bf16() -> bool:
    """Whether this CPU has oneDNN's bf16 linear path: packing needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and an AVX2-only CPU raises ``RuntimeError`` ("bf16 path needs the cpu support
    ..."); asked once with a tiny weight, so such a CPU runs the plain matmul instead."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


class _Linear:
    """``y = x @ W.T``; on CPU in bf16 the weight is pre-packed once into oneDNN's blocked
    layout (AMX/AVX-512 VNNI), instead of being re-laid-out by every matmul call. With ``small``
    (the same weights in the file's own blocks), calls of at most ``small_rows`` rows run the
    block kernel instead (fewer bytes per decode step of few sequences; the limit is measured at
    load by ``LlamaModel.calibrate_small_rows``, at most ``block_linear.MAX_ROWS``)."""

    def __init__(self, weight: torch.Tensor, prepack: bool, small: BlockLinear | None = None):
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.packed = None
        if prepack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
            self.weight = None  # the packed copy replaces it
        # the same weights as the file's blocks, for calls of few rows (block_linear.py)
        self.small = small
        # calls of at most this many rows run the block kernel (-1: never, not even 0 rows);
        # LlamaModel.calibrate_small_rows measures it on this machine
        self.small_rows = MAX_ROWS[small.kind] if small is not None else -1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_rows:
            return self.small(x)
        return self.dense(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The float weights' matmul (oneDNN's packed bf16 path where packed)."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


Linear = _Linear | Int8Linear | Int4Linear

# What the LM head (or the tied embedding used as one) becomes under each --quantization. The
# head is ~21% of SmolLM2-135M's weight bytes, but its logits decide every greedy token and a
# Q8_0 table has no lossless form in these kernels (per-channel int8, group int4), so under int4
# (whose linears are the file's own blocks) it stays in the serving dtype
# (bench/results/*-quant.md measures the alternatives).
LM_HEAD_QUANTIZATION = {"none": "none", "int8": "int8", "int4": "none"}


@dataclass
class _Layer:
    attn_norm: torch.Tensor   # [D]
    qkv: Linear               # [(H + 2·KV)·d, D]
    o: Linear                 # [D, H·d]
    ffn_norm: torch.Tensor    # [D]
    gate_up: Linear           # [2·I, D]
    down: Linear              # [D, I]


class LlamaModel:
    """Llama decoder for inference; weights are plain tensors in the serving dtype.

    tensors: GGUF-named float tensors in torch ``[out, in]`` layout with Q/K rows already in
    rotate-half order (see ``gguf_loader``); they are moved/cast to ``dtype`` on ``device`` and the
    per-layer Q/K/V and gate/up weights are concatenated (the originals can then be freed).
    quantization: "none" | "int8" | "int4": weight-only quantized linears (``quant.py``; CPU,
        bfloat16 or float32 only, else ValueError); the embedding lookup stays in ``dtype``.
    q4_blocks: the file's own 4-bit blocks by GGUF name (``gguf_loader.load_q4_blocks``); int4
        repacks those instead of re-quantizing.
    lm_head_quantization: override of :data:`LM_HEAD_QUANTIZATION` for the LM head.
    blocks: the file's own blocks of 32 by GGUF name (``gguf_loader.load_blocks``) and
        ``block_kernels`` (``block_linear.choose``'s module): with quantization "none", each linear
        whose parts all have blocks keeps them beside its float weights for calls of few rows
        (at most ``block_linear.MAX_ROWS``, as measured here by :meth:`calibrate_small_rows`);
        ``small_batch_bytes`` is what they add to resident memory.
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 prepack: bool | None = None, quantization: str = "none",
                 q4_blocks: Mapping[str, Q4Blocks] | None = None, lm_head_quantization: str | None = None,
                 blocks: Mapping[str, Q4Blocks] | None = None, block_kernels=None):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        check_supported(quantization, dtype, self.device)
        self.quantization = quantization
        head_q = LM_HEAD_QUANTIZATION[quantization] if lm_head_quantization is None else lm_head_quantization
        check_supported(head_q, dtype, self.device)
        self.lm_head_quantization = head_q

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype)

        self.prepacked = _can_prepack(dtype, self.device) if prepack is None else bool(prepack)
        self.small_batch_bytes = 0
        file_blocks = blocks

        def lin(*names: str, quantization: str = quantization) -> Linear:
            # one linear from GGUF tensors whose rows are concatenated (fused Q/K/V, gate/up)
            t = torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0]).contiguous()
            if quantization == "none":
                small = None
                if file_blocks is not None and block_kernels is not None:
                    small = from_parts([file_blocks.get(n) for n in names], block_kernels)
                    self.small_batch_bytes += small.nbytes if small is not None else 0
                return _Linear(t, self.prepacked, small)
            blocks = [q4_blocks.get(n) for n in names] if q4_blocks is not None else [None]
            return make_linear(quantization, t, dtype, None if None in blocks else blocks)

        self.embed = w("token_embd.weight")
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"blk.{i}."
            self.layers.append(_Layer(
                attn_norm=w(p + "attn_norm.weight"),
                qkv=lin(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
                o=lin(p + "attn_output.weight"),
                ffn_norm=w(p + "ffn_norm.weight"),
                gate_up=lin(p + "ffn_gate.weight", p + "ffn_up.weight"),
                down=lin(p + "ffn_down.weight"),
            ))
        self.norm = w("output_norm.weight")
        self.lm_head = lin("token_embd.weight" if c.tie_word_embeddings else "output.weight",
                           quantization=head_q)
        self.small_rows = self.calibrate_small_rows()

        # RoPE tables [max_pos, d/2] in float32 (cast per step, as HF casts cos/sin to x's dtype)
        d = c.head_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if "rope_freqs.weight" in tensors:
            # Llama 3.1-style frequency scaling baked into the file (llama.cpp divides each
            # rotation frequency by its factor)
            inv_freq = inv_freq / tensors["rope_freqs.weight"].float().reshape(-1)
        pos = torch.arange(c.max_position_embeddings, dtype=torch.int64).float()
        if c.rope_scaling_type == "linear":
            pos = pos / c.rope_scaling_factor
        freqs = torch.outer(pos, inv_freq)
        self._cos = freqs.cos().to(self.device)
        self._sin = freqs.sin().to(self.device)
        # full-width rows for a 4-op RoPE: [max_pos, 2, d] = ((cos, cos), (-sin, sin))
        self._cos_sin = torch.stack((torch.cat((self._cos, self._cos), -1),
                                     torch.cat((-self._sin, self._sin), -1)), 1)
        self.scale = d ** -0.5
        # fused C++ layer ops on CPU (cpu_kernels; None = the torch ops below everywhere)
        self.fused_ops = None
        if self.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            from goodput.worker.model import cpu_kernels
            self.fused_ops = cpu_kernels.loaded()
        # the native decode step (csrc/decode_step.cpp): steps of decode rows only, where every
        # layer linear runs the block kernel; False keeps the per-operator path (benchmarks, tests)
        self.native_step = True
        # float64 [3] to which native steps add ns in linears, attention, layer ops (bench); None: off
        self.native_phase_ns: torch.Tensor | None = None
        self._native = None            # (the DecodeStack, the kv_caches list it was built on)
        self._native_linears = [lin for ly in self.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)]

    def calibrate_small_rows(self) -> dict[int, int]:
        """Measure, per block kind (0: 4-bit layers, 1: the 8-bit LM head), up to how many rows the
        block kernel beats the float weights' matmul on this machine (``block_linear.calibrate_max_rows``),
        and set every linear's ``small_rows`` to it. Returns {kind: rows} (empty when no linear
        has blocks). ~0.5 s at load.

        Why measured: the crossover depends on the CPU and its memory. In bf16 the float path
        reads 3.2x the bytes of 4-bit blocks but costs about the same for 1 to 9 rows (oneDNN,
        AMX); the block kernel's cost grows with every row. Whole decode steps on one AVX-512 + AMX
        machine: 9.0 ms at 1 row and 22.3 ms at 5 on the kernel, 16.6 and 17.6 on oneDNN; on the
        machine ``block_linear.MAX_ROWS`` was first set on, the kernel won up to 5 rows.
        """
        kinds: dict[int, list[_Linear]] = {}
        for lin in [x for ly in self.layers for x in (ly.qkv, ly.o, ly.gate_up, ly.down)] + [self.lm_head]:
            if isinstance(lin, _Linear) and lin.small is not None:
                kinds.setdefault(lin.small.kind, []).append(lin)
        rows = calibrate_max_rows(kinds, self.dtype)
        for kind, lins in kinds.items():
            for lin in lins:
                lin.small_rows = rows[kind]
        return rows

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
                logits_indices: torch.Tensor | None = None, float_logits: bool = True) -> torch.Tensor:
        """Logits for the selected rows of a flat batch.

        input_ids, positions: int64 [T]; meta: the batch's AttentionMetadata; kv_caches: per layer
        (k_cache, v_cache) [num_blocks, block_size, n_kv, d] (written in place with the new
        tokens' K/V); logits_indices: int64 [S] rows whose logits are wanted (None = all T).
        Returns [S, vocab_size], float32 (``float_logits``) or the model's dtype (the caller
        converts what it needs: greedy sampling needs no float32 copy).
        """
        # RoPE rows gathered and cast once per step for every layer: x·cos + rotate_half(x)·sin
        # with rotate_half(x) = (-x2, x1) written as (x2, x1)·(-sin, sin) (the same roundings as
        # HF's x1·cos - x2·sin, x2·cos + x1·sin).
        cs = self._cos_sin.index_select(0, positions).to(self.dtype)            # [T, 2, d]
        x = self.embed.index_select(0, input_ids)                                # [T, D]
        args = self._native_args(x.shape[0], meta, kv_caches, backend)
        if args is not None:
            logits = self._forward_native(x, cs, meta, kv_caches, args, logits_indices)
        else:
            layers = self._forward_fused if self.fused_ops is not None else self._forward_torch
            logits = layers(x, cs, meta, kv_caches, backend, logits_indices)
        return logits.float() if float_logits else logits

    def _forward_torch(self, x: torch.Tensor, cs: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
                       logits_indices: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward`'s layers and head with torch ops (every device); logits in the model's dtype."""
        c = self.config
        H, KV, d = c.num_heads, c.num_kv_heads, c.head_dim
        T = x.shape[0]
        half, I, HKd = d // 2, c.intermediate_size, (H + KV) * d
        cos, sin = cs[:, 0, None, :], cs[:, 1, None, :]                          # [T, 1, d]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = self._rms_norm(x, layer.attn_norm)
            qkv = layer.qkv(h)                                                    # [T, (H+2KV)·d]
            qk = qkv[:, :HKd].view(T, H + KV, d)
            rot = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos
            qk += rot * sin                                                       # rotate-half RoPE
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, HKd:].view(T, KV, d)
            backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            o = backend.forward(q, k_cache, v_cache, meta, self.scale)             # [T, H, d]
            x += layer.o(o.reshape(T, H * d))                # x is this step's own buffer
            h = self._rms_norm(x, layer.ffn_norm)
            gu = layer.gate_up(h)                                               # [T, 2I]
            a = F.silu(gu[:, :I])
            a *= gu[:, I:]
            x += layer.down(a)

        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return self.lm_head(self._rms_norm(x, self.norm))

    def _forward_fused(self, x: torch.Tensor, cs: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
                       logits_indices: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward` with the element-wise work of each layer in four fused C++ ops
        (``csrc/layer_ops.cpp``): residual add + RMSNorm, RoPE in place on the QKV output, SiLU·up.
        Same roundings as the torch path in bf16; float32 differs by ulps (RMSNorm's sum order)."""
        c, ops = self.config, self.fused_ops
        H, KV, d = c.num_heads, c.num_kv_heads, c.head_dim
        T, Hd, HKd, eps = x.shape[0], H * c.head_dim, (H + KV) * d, c.rms_norm_eps
        layers = self.layers
        h = ops.rms_norm(x, layers[0].attn_norm, eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches)):
            qkv = layer.qkv(h)                                                    # [T, (H+2KV)·d]
            ops.rope_(qkv, cs, H + KV, d)                                         # q, k rotated in place
            q = qkv[:, :Hd].view(T, H, d)
            backend.write_kv(qkv[:, Hd:HKd].view(T, KV, d), qkv[:, HKd:].view(T, KV, d), k_cache, v_cache,
                             meta.slot_mapping)
            o = backend.forward(q, k_cache, v_cache, meta, self.scale)             # [T, H, d]
            h = ops.add_rms_norm_(x, layer.o(o.reshape(T, Hd)), layer.ffn_norm, eps)
            a = ops.silu_mul(layer.gate_up(h))                                    # [T, I]
            nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else self.norm
            h = ops.add_rms_norm_(x, layer.down(a), nxt, eps)                     # next layer's input
        if logits_indices is not None:
            h = h.index_select(0, logits_indices)
        return self.lm_head(h)

    def native_eligible(self, rows: int) -> bool:
        """Whether a step of ``rows`` decode rows can run as one native call: the native step is on,
        the C++ kernels have it, and every layer linear would run its block kernel at ``rows``
        (``_Linear.small_rows``, measured at load)."""
        if not self.native_step or self.fused_ops is None or not hasattr(self.fused_ops, "DecodeStack"):
            return False
        return all(isinstance(lin, _Linear) and lin.small is not None and rows <= lin.small_rows
                   for lin in self._native_linears)

    def _native_args(self, rows: int, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(block tables, lengths, splits) for :meth:`_forward_native` when this step can run natively
        (:meth:`native_eligible`, the ``cpu`` attention backend, decode rows only, caches in the
        model's dtype); else None (the per-operator path)."""
        plan = getattr(backend, "decode_only_plan", None)
        if plan is None or not self.native_eligible(rows) or kv_caches[0][0].dtype != self.dtype:
            return None
        return plan(meta, kv_caches[0][0])

    def _native_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """The C++ ``DecodeStack`` over these caches (built once per kv_caches list: it holds the
        weights' and caches' memory)."""
        if self._native is not None and self._native[1] is kv_caches:
            return self._native[0]
        c, codes, ds, ms, kinds = self.config, [], [], [], []
        for lin in self._native_linears:
            codes.append(lin.small.codes)
            ds.append(lin.small.d)
            ms.append(lin.small._m)
            kinds.append(lin.small.kind)
        norms = [n for ly in self.layers for n in (ly.attn_norm, ly.ffn_norm)] + [self.norm]
        stack = self.fused_ops.DecodeStack(norms, codes, ds, ms, kinds, [k for k, _ in kv_caches],
                                           [v for _, v in kv_caches], c.num_heads, c.num_kv_heads, c.head_dim,
                                           c.rms_norm_eps, self.scale)
        self._native = (stack, kv_caches)
        return stack

    def _forward_native(self, x: torch.Tensor, cs: torch.Tensor, meta: AttentionMetadata,
                        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                        args: tuple[torch.Tensor, torch.Tensor, int],
                        logits_indices: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward`'s layers as one native call (``csrc/decode_step.cpp``): the same inner
        loops as :meth:`_forward_fused` with the block linears, so the same values bit for bit;
        x [B, D] is updated in place; the LM head runs here as there."""
        tables, lens, splits = args
        h = torch.empty_like(x)
        phase = self.native_phase_ns if self.native_phase_ns is not None else _NO_PHASES
        self._native_stack(kv_caches).step(x, cs, meta.slot_mapping, tables, lens, splits, meta.draft_rows == 0, h,
                                           phase)
        if logits_indices is not None:
            h = h.index_select(0, logits_indices)
        return self.lm_head(h)


_NO_PHASES = torch.empty(0, dtype=torch.float64)
