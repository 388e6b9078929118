"""Linears kept in a GGUF file's own 4-bit / 8-bit blocks, run by goodput's C++ kernel
(``csrc/block_linear.cpp``): the fast path for decode steps of a few rows on CPU.

A decode step of a few sequences is memory-bound: it reads every weight once for a handful of
rows. The file's blocks (``Q4_1``: 0.625 bytes per weight; ``Q8_0``: 1.06) are ~3× and ~2× fewer
bytes than bfloat16, and the kernel multiplies by the *exact* weights the file encodes
(``Q4_1``: ``d·q + m``; ``Q4_0``: ``d·(q − 8)``; ``Q8_0``: ``d·q``, llama.cpp's ggml-quants.c) —
the float32 model's weights; a bfloat16 model's weights are those rounded to bfloat16 (relative
difference ≤ 2⁻⁹ per weight), so in bfloat16 the two paths differ by that rounding and by the
order of float32 sums. Large batches keep the bfloat16 oneDNN matmul (AMX), which is faster
there (``llama.py`` chooses per call by the number of rows).
"""
from __future__ import annotations

import torch

KINDS = {"Q4_0": 0, "Q4_1": 0, "Q8_0": 1}  # GGUF type -> kernel layout (0: 4-bit codes, 1: int8)


class BlockLinear:
    """``y = x @ W.T`` for W [N, K] stored as blocks of 32 (layout in ``csrc/block_linear.cpp``).

    Build with :meth:`from_blocks`. ``x`` [M, K] float32 or bfloat16 with contiguous rows;
    returns [M, N] in x's dtype. ``nbytes``: the bytes one call reads.
    """

    def __init__(self, kind: int, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, mod):
        self.kind, self.codes, self.d, self.m, self._mod = kind, codes, d, m, mod
        self.out_features, self.in_features = d.shape[0], d.shape[1] * 32
        self._m = m if m is not None else torch.empty(0, dtype=torch.float16)
        self.nbytes = codes.numel() * codes.element_size() + d.numel() * 2 + (m.numel() * 2 if m is not None else 0)

    @classmethod
    def from_blocks(cls, kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, mod) -> BlockLinear:
        """From unpacked blocks (``quant.Q4Blocks`` fields): ``q`` codes [N, K] (uint8 0..15 for
        Q4_0/Q4_1, int8 for Q8_0), ``d`` and ``m`` float32 [N, K/32] holding float16 values (``m``
        None for Q4_0 and Q8_0). Raises ValueError for an unknown kind, K not a multiple of 32 or
        scales that are not float16 values."""
        if kind not in KINDS:
            raise ValueError(f"block kind must be one of {sorted(KINDS)}, got {kind!r}")
        N, K = q.shape
        if K % 32 or d.shape != (N, K // 32) or (m is not None and m.shape != d.shape):
            raise ValueError(f"need K % 32 == 0 and [N, K/32] scales, got q {tuple(q.shape)}, d {tuple(d.shape)}")
        if kind == "Q4_0":  # d·(q − 8) = d·q + (−8d); −8d is exact in float16 unless it overflows
            m, kind = -8 * d, "Q4_1"
        d16 = d.to(torch.float16)
        m16 = m.to(torch.float16) if m is not None else None
        for name, a, a16 in (("d", d, d16), ("m", m, m16)):
            if a is not None and not torch.equal(a16.float(), a.float()):
                raise ValueError(f"block scale {name} is not a float16 value (not a GGUF block)")
        if KINDS[kind] == 1:
            codes = q.to(torch.int8).contiguous()
        else:
            codes = pack_codes(q.to(torch.uint8).reshape(N, K // 2, 2)[:, step_order(K // 32)].reshape(N, K // 32, 32))
        return cls(KINDS[kind], codes, d16.contiguous(), m16.contiguous() if m16 is not None else None, mod)

    def dequantize(self) -> torch.Tensor:
        """The exact weights float32 [N, K] (for tests): d·q + m (4-bit) or d·q (8-bit)."""
        N, K = self.out_features, self.in_features
        if self.kind == 1:
            q = self.codes.float()
        else:
            q = torch.empty(N, K // 2, 2)
            q[:, step_order(K // 32)] = unpack_codes(self.codes, K // 32).reshape(N, K // 2, 2).float()
            q = q.reshape(N, K)
        w = q.reshape(N, K // 32, 32) * self.d.float()[..., None]
        if self.m is not None:
            w = w + self.m.float()[..., None]
        return w.reshape(N, K)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._mod.block_linear(x, self.kind, self.codes, self.d, self._m)


def groups(nb: int) -> list[tuple[int, int]]:
    """(first block, blocks) of a 4-bit row's groups: 16 blocks while 16 remain, then 8, 4, 2, 1 for
    the bits of ``nb`` mod 16 (``csrc/block_linear.cpp``, "lanes = blocks")."""
    out = [(g0, 16) for g0 in range(0, nb - nb % 16, 16)]
    g0 = nb - nb % 16
    for t in (8, 4, 2, 1):
        if nb % 16 & t:
            out.append((g0, t))
            g0 += t
    return out


def step_order(nb: int) -> torch.Tensor:
    """int64 [nb·16]: the weight pair (block·16 + pair in block) at each (step, lane) of a 4-bit row,
    step-major — lane l of step s of the group (g0, T) holds pair (l mod L)·T + s of block
    g0 + l // L, L = 16 / T. The kernel permutes x the same way."""
    order = []
    for g0, t in groups(nb):
        lanes = 16 // t
        order += [(g0 + lane // lanes) * 16 + (lane % lanes) * t + s for s in range(t) for lane in range(16)]
    return torch.tensor(order, dtype=torch.int64)


def pack_codes(steps: torch.Tensor) -> torch.Tensor:
    """uint8 [N, nb, 32] codes (0..15) in step order -> the row bytes [N, ceil(nb/2)·32]: a group of
    T >= 4 blocks as steps in fours (16-bit word i = Σ_k code(t₀ + k, i) << 4k, little-endian: the low
    byte holds steps t₀, t₀ + 1, the high byte t₀ + 2, t₀ + 3), a group of T <= 2 as steps in twos
    (byte i = code(t₀, i) | code(t₀ + 1, i) << 4, a missing step 0)."""
    N, nb, _ = steps.shape
    parts = []
    for g0, t in groups(nb):
        s = steps[:, g0:g0 + t]
        if t == 1:
            s = torch.cat([s, torch.zeros_like(s)], 1)
        if t >= 4:
            s = s.reshape(N, t // 4, 4, 32)
            low, high = s[:, :, 0] | s[:, :, 1] << 4, s[:, :, 2] | s[:, :, 3] << 4
            parts.append(torch.stack([low, high], -1).reshape(N, -1))
        else:
            parts.append((s[:, 0] | s[:, 1] << 4).reshape(N, -1))
    return torch.cat(parts, 1).contiguous()


def unpack_codes(codes: torch.Tensor, nb: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: uint8 [N, nb, 32] in step order."""
    N = codes.shape[0]
    out, at = [], 0
    for _, t in groups(nb):
        if t >= 4:
            b = codes[:, at:at + 16 * t].reshape(N, t // 4, 32, 2)
            lo, hi = b[..., 0], b[..., 1]
            out.append(torch.stack([lo & 15, lo >> 4, hi & 15, hi >> 4], 2).reshape(N, t, 32))
            at += 16 * t
        else:
            b = codes[:, at:at + 32]
            out.append(torch.stack([b & 15, b >> 4], 1)[:, :t])
            at += 32
    return torch.cat(out, 1)


# Calls with at most this many rows use the block kernel, larger ones the bf16 oneDNN matmul.
# First measured on whole decode steps (2 threads, SmolLM2, context 128, medians of 20 steps; the 4-bit
# layers on the block kernel vs on oneDNN, LM head as chosen): B = 1 7.3 vs 31 ms (a disturbed
# float run; 15.9 in another), 2: 9.5 vs 16.1, 4: 14.4 vs 17.3, 5: 15.7 vs 17.4, 6: 18.4 vs 17.8,
# 8: 23.1 vs 19.0 — the kernel's cost grows with every row (one BF16 dot product per row per 32
# weights), oneDNN's (AMX) stays flat. The 8-bit LM head (49152 x 576) gains 0.2 ms at B = 1 and
# nothing measurable at 2.
# Upper bounds: LlamaModel.calibrate_small_rows measures the crossover on the machine at load.
MAX_ROWS = {0: 5, 1: 5}


def calibrate_max_rows(kinds: dict[int, list], dtype: torch.dtype, repeats: int = 3) -> dict[int, int]:
    """Per block kind, the most rows (0..``MAX_ROWS[kind]``) for which the linears' block kernels
    (``lin.small``) are no slower than their float matmuls (``lin.dense``) at every row count up to
    it. kinds: {kind: every linear of that kind} — all of them, so that the weights stream from
    memory as in a real step (one layer's weights stay in cache and flatter the float path ~3x).
    Timing: for each row count and path, the least disturbed (minimum) of ``repeats`` passes, the
    kinds one after the other in each pass (each evicts the other). Stops a kind at the first row
    count where the matmul wins."""
    import time
    best = dict.fromkeys(kinds, 0)
    live = set(kinds)
    with torch.inference_mode():
        for rows in range(1, max(MAX_ROWS[k] for k in kinds) + 1 if kinds else 1):
            live = {k for k in live if rows <= MAX_ROWS[k]}
            if not live:
                break
            xs = {k: {lin.in_features: torch.randn(rows, lin.in_features, dtype=dtype) for lin in kinds[k]}
                  for k in live}
            cost = {(k, path): float("inf") for k in live for path in ("small", "dense")}
            for _ in range(repeats + 1):  # the first pass warms up
                for path in ("small", "dense"):
                    for k in live:
                        t0 = time.perf_counter()
                        for lin in kinds[k]:
                            getattr(lin, path)(xs[k][lin.in_features])
                        cost[k, path] = min(cost[k, path], time.perf_counter() - t0)
            for k in list(live):
                if cost[k, "small"] > cost[k, "dense"]:
                    live.discard(k)
                else:
                    best[k] = rows
    return best


def from_parts(parts: list, mod) -> BlockLinear | None:
    """One BlockLinear for the rows of several GGUF tensors stacked (fused Q/K/V, gate/up), from
    their ``quant.Q4Blocks``; None when a part is missing or the parts mix 4- and 8-bit layouts."""
    if not parts or any(p is None or p.kind not in KINDS for p in parts):
        return None
    if len({KINDS[p.kind] for p in parts}) != 1:
        return None
    if len(parts) == 1:
        p = parts[0]
        return BlockLinear.from_blocks(p.kind, p.q, p.d, p.m, mod)
    if KINDS[parts[0].kind] == 1:
        return BlockLinear.from_blocks("Q8_0", torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), None, mod)
    m = torch.cat([p.m if p.m is not None else -8 * p.d for p in parts])  # Q4_0: d·(q − 8) = d·q − 8d
    return BlockLinear.from_blocks("Q4_1", torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m, mod)


def choose(device: torch.device, dtype: torch.dtype, quantization: str) -> tuple[object | None, str]:
    """Whether decode steps of few rows run on the block kernel here: (the kernels' module or None,
    why, for the start-up log). Needs a CPU, float32 or bfloat16, no --quantization, and the C++
    kernels with their SIMD path for this dtype (``cpu_kernels``; GOODPUT_CPU_KERNELS=0 turns
    them off)."""
    if device.type != "cpu":
        return None, f"not on CPU ({device.type})"
    if quantization != "none":
        return None, f"--quantization {quantization} chosen"
    if dtype not in (torch.float32, torch.bfloat16):
        return None, f"dtype {dtype} (needs float32 or bfloat16)"
    from goodput.worker.model import cpu_kernels
    mod = cpu_kernels.loaded()
    if mod is None:
        return None, f"C++ CPU kernels unavailable ({cpu_kernels.load_error() or 'GOODPUT_CPU_KERNELS=0'})"
    name = str(dtype).removeprefix("torch.")
    if not hasattr(mod, "block_linear_vectorized") or not mod.block_linear_vectorized(name):
        return None, f"this CPU/compiler has no AVX-512{' BF16' if name == 'bfloat16' else ''} path for {name}"
    return mod, "CPU with AVX-512 and the file's own blocks"
