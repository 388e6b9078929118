"""Triton kernels over the paged KV cache: KV write, paged attention, split-KV decode.

Cache layout (fixed in :mod:`goodput.worker.model.attention.base`): per layer, ``k_cache`` and
``v_cache`` of shape ``[num_blocks, block_size, n_kv_heads, head_dim]``; a token at position p of
a sequence lives in physical block ``block_table[p // block_size]`` at offset ``p % block_size``.

Kernels
-------
``write_kv``
    Scatters each new token's K and V into its cache slot (``slot_mapping``; slots < 0 skipped).
    The "reshape and cache" step of PagedAttention (Kwon et al., SOSP 2023).
``paged_attention``
    One launch for a flat mixed batch: prefill chunks (causal within the chunk, full attention to
    the cached context before it) and single-token decodes, with variable query lengths given by
    ``query_start_loc``. Each program owns one tile of ``BLOCK_Q`` query tokens of one sequence
    times the ``G = n_heads // n_kv_heads`` query heads that share one KV head (GQA packing), so
    each K/V tile loaded from the cache serves all ``G`` heads. Softmax is the online (streaming)
    softmax of FlashAttention / FlashAttention-2 (Dao et al., 2022; Dao, 2023) in fp32, in base 2
    (``exp2`` with ``log2(e)`` folded into the scale).
    Programs are laid out over "query blocks": sequence i owns programs
    ``[qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1)``, at least ``ceil(len_i / BLOCK_Q)`` of
    them, so the grid ``T // BLOCK_Q + B`` covers every sequence without a host-side map;
    a program finds its sequence by binary search over ``query_start_loc``.
Split-KV decode (``num_kv_splits > 1``)
    Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023): for a decode-only batch whose
    ``B * n_kv_heads`` programs would leave most SMs idle, each sequence's context is split into
    ``num_kv_splits`` ranges handled by separate programs that write partial (max, sum, output)
    triples in fp32; a second kernel combines them with the log-sum-exp rule. The rule that picks
    the split count is :func:`choose_num_kv_splits`.

Dtypes: q, k_cache, v_cache in float32, float16 or bfloat16 (all the same); accumulation and
softmax are fp32; the output has q's dtype. Under ``TRITON_INTERPRET=1`` (the CPU interpreter used
by the tests) the operands of ``tl.dot`` are converted to fp32 first, because the interpreter does
bf16 arithmetic on the raw bit patterns (triton-lang/triton#11584); on GPUs the dots run in the
input dtype with fp32 accumulation (and ``ieee`` precision for fp32 inputs, not TF32).

Tested in tests/worker/model/attention/: on CPU by test_triton_attention.py (interpreter, vs a naive
fp64 reference) and triton_compile_check.py (every kernel lowered to PTX and assembled for sm_90
without a GPU); on a GPU by bench/gpu_check.sh.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Split-KV rule constants (see choose_num_kv_splits).
MIN_TOKENS_PER_SPLIT = 256
MAX_KV_SPLITS = 32
PROGRAMS_PER_SM = 2


# --------------------------------------------------------------------------------------------
# KV write
# --------------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_kv_heads, head_dim, block_size,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    # One program moves BLOCK_T tokens; each token's n_kv_heads * head_dim values are one row.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    offs_hd = tl.arange(0, BLOCK_HD)
    h = offs_hd // head_dim
    d = offs_hd % head_dim
    mask = (slot >= 0)[:, None] & (offs_hd < num_kv_heads * head_dim)[None, :]
    k = tl.load(k_ptr + offs_t[:, None] * stride_kt + h[None, :] * stride_kh + d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(v_ptr + offs_t[:, None] * stride_vt + h[None, :] * stride_vh + d[None, :] * stride_vd,
                mask=mask)
    tl.store(k_cache_ptr + blk[:, None] * stride_kcb + off[:, None] * stride_kcs
             + h[None, :] * stride_kch + d[None, :] * stride_kcd, k, mask=mask)
    tl.store(v_cache_ptr + blk[:, None] * stride_vcb + off[:, None] * stride_vcs
             + h[None, :] * stride_vch + d[None, :] * stride_vcd, v, mask=mask)


# --------------------------------------------------------------------------------------------
# Attention: shared inner loop
# --------------------------------------------------------------------------------------------
@triton.jit
def _attend_kv_range(
    acc, m_i, l_i, q, q_pos, row_valid,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    key_start, key_end, qk_scale, block_size, head_dim,
    TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) over keys [key_start, key_end) of one sequence.

    q: [BLOCK_M, BLOCK_D] query rows; q_pos: [BLOCK_M] absolute position of each row (a row
    sees keys <= its position); scores are in the log2 domain (qk_scale = scale * log2(e)).
    """
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    for start in range(key_start, key_end, TILE_N):
        kk = start + offs_n
        k_valid = kk < key_end
        phys = tl.load(bt_row_ptr + kk // block_size, mask=k_valid, other=0).to(tl.int64)
        in_block = kk % block_size
        k_t = tl.load(k_cache_ptr + phys[None, :] * stride_kcb + in_block[None, :] * stride_kcs
                      + kv_head * stride_kch + offs_d[:, None] * stride_kcd,
                      mask=k_valid[None, :] & d_mask[:, None], other=0.0)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q, k_t)
        s = s * qk_scale
        valid = k_valid[None, :] & (kk[None, :] <= q_pos[:, None]) & row_valid[:, None]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + phys[:, None] * stride_vcb + in_block[:, None] * stride_vcs
                    + kv_head * stride_vch + offs_d[None, :] * stride_vcd,
                    mask=k_valid[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


# --------------------------------------------------------------------------------------------
# Attention: one launch for a mixed prefill/decode batch
# --------------------------------------------------------------------------------------------
@triton.jit
def _paged_attention_kernel(
    o_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, qsl_ptr, seq_lens_ptr,
    num_seqs, qk_scale, block_size, head_dim,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bt,
    QPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Largest sequence i with qsl[i] // BLOCK_Q + i <= pid (binary search; qsl is sorted).
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first_block <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_tok = q_block * BLOCK_Q + offs_m // QPK
    head = kv_head * QPK + offs_m % QPK
    row_valid = (offs_m < BLOCK_Q * QPK) & (q_tok < q_len)
    q_pos = ctx_len + q_tok
    # Keys this tile needs: up to its last query token's position (0 keys for an idle program).
    tile_end = tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    key_end = tl.where(q_block * BLOCK_Q < q_len, ctx_len + tile_end, 0)

    io_mask = row_valid[:, None] & (offs_d[None, :] < head_dim)
    q = tl.load(q_ptr + (q_start + q_tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=io_mask, other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, row_valid,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head,
        stride_kcb, stride_kcs, stride_kch, stride_kcd,
        stride_vcb, stride_vcs, stride_vch, stride_vcd,
        0, key_end, qk_scale, block_size, head_dim,
        TILE_N, BLOCK_D, DOT_FP32, DOT_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + (q_start + q_tok)[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :] * stride_od, out.to(o_ptr.dtype.element_ty), mask=io_mask)


# --------------------------------------------------------------------------------------------
# Split-KV decode (Flash-Decoding): partial pass + reduce
# --------------------------------------------------------------------------------------------
@triton.jit
def _paged_decode_split_kernel(
    part_o_ptr, part_m_ptr, part_l_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, qsl_ptr, seq_lens_ptr,
    qk_scale, block_size, head_dim, split_len,
    stride_qt, stride_qh, stride_qd,
    stride_pb, stride_ph, stride_ps,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bt,
    QPK: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start   # 1, or 0 for an unused slot
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * QPK + offs_m
    row_valid = offs_m < tl.where(q_len > 0, QPK, 0)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1
    key_start = split * split_len
    key_end = tl.where(q_len > 0, tl.minimum(seq_len, key_start + split_len), key_start)

    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + q_start * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, row_valid,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head,
        stride_kcb, stride_kcs, stride_kch, stride_kcd,
        stride_vcb, stride_vcs, stride_vch, stride_vcd,
        key_start, key_end, qk_scale, block_size, head_dim,
        TILE_N, BLOCK_D, DOT_FP32, DOT_PRECISION)

    # Partials: unnormalised acc, running max (log2 domain) and sum; an empty split stores
    # m = -1e30, l = 0 and gets weight 0 in the reduce.
    h_mask = offs_m < QPK
    base = seq * stride_pb + split * stride_ps
    part_row = base + head * stride_ph   # part_o is part_m's layout times BLOCK_D
    tl.store(part_o_ptr + part_row[:, None] * BLOCK_D + offs_d[None, :], acc,
             mask=h_mask[:, None] & d_mask[None, :])
    tl.store(part_m_ptr + part_row, m_i, mask=h_mask)
    tl.store(part_l_ptr + part_row, l_i, mask=h_mask)


@triton.jit
def _split_reduce_kernel(
    o_ptr, part_o_ptr, part_m_ptr, part_l_ptr, qsl_ptr,
    head_dim, num_splits,
    stride_ot, stride_oh, stride_od,
    stride_pb, stride_ph, stride_ps,
    S_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = seq * stride_pb + head * stride_ph + offs_s * stride_ps
    m = tl.load(part_m_ptr + base, mask=s_mask, other=-1.0e30)
    l = tl.load(part_l_ptr + base, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * l, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    part = tl.load(part_o_ptr + base[:, None] * BLOCK_D + offs_d[None, :],
                   mask=s_mask[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    out = tl.sum(part * w[:, None], 0) / denom
    tl.store(o_ptr + q_start * stride_ot + head * stride_oh + offs_d * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=offs_d < tl.where(q_len > 0, head_dim, 0))


# --------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------
def is_interpreted() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_FP32, DOT_PRECISION): fp32 operands in the interpreter or for fp32 data."""
    if is_interpreted() or dtype == torch.float32:
        return True, "ieee"
    return False, "tf32"  # precision is unused for fp16/bf16 operands


def _check_cache(name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, n_kv_heads, head_dim], "
                         f"got shape {tuple(cache.shape)}")
    if cache.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype {cache.dtype} is not supported (float32, float16, bfloat16)")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, check: bool = True) -> None:
    """Write new keys/values into the paged cache in place (PagedAttention "reshape and cache").

    k, v: [T, n_kv_heads, head_dim], the caches' dtype and device.
    k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim].
    slot_mapping: integer [T]; token t goes to block ``slot // block_size``, offset
        ``slot % block_size``; entries < 0 (padding) are skipped.
    check: validate the arguments (callers repeating a validated call, e.g. the layers of one
        step, pass False to save host time). One program per 4 tokens (16 interpreted).
    Raises ValueError on mismatched shapes, dtypes or devices.
    """
    if check:
        _validate_write(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    _, block_size, n_kv, head_dim = k_cache.shape
    T = k.shape[0]
    block_t = 4 if k.is_cuda else 16  # the interpreter pays per program, the GPU wants many
    _write_kv_kernel[(triton.cdiv(T, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, T,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        n_kv, head_dim, block_size,
        BLOCK_T=block_t, BLOCK_HD=triton.next_power_of_2(n_kv * head_dim),
    )


def _validate_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    _, _, n_kv, head_dim = k_cache.shape
    if k.dim() != 3 or k.shape[1:] != (n_kv, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                         f"[T, {n_kv}, {head_dim}] to match the cache")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} differ from the cache's {k_cache.dtype}")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"k, v, caches and slot_mapping must be on one device, got {devices}")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                         num_sms: int) -> int:
    """How many KV splits (Flash-Decoding) to use for one attention launch; 1 = no split.

    Rule: split only a decode-only batch (``max_query_len == 1``) whose ``num_seqs * num_kv_heads``
    programs fill less than one wave of ``num_sms`` streaming multiprocessors, and only when the
    longest context has at least ``2 * MIN_TOKENS_PER_SPLIT`` tokens. Then
    ``splits = min(ceil(PROGRAMS_PER_SM * num_sms / programs), max_seq_len // MIN_TOKENS_PER_SPLIT,
    MAX_KV_SPLITS)``: enough programs for ~2 per SM, each with at least 256 keys so the partial
    write and the reduce stay small next to the KV reads.
    Example (H200, 132 SMs, 3 KV heads, context 1024): batch 1 -> 4, batch 16 -> 4, batch 64 -> 1.
    """
    if max_query_len != 1 or num_seqs <= 0:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= num_sms or max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    splits = min(-(-PROGRAMS_PER_SM * num_sms // programs), max_seq_len // MIN_TOKENS_PER_SPLIT,
                 MAX_KV_SPLITS)
    return max(1, splits)


@functools.cache
def _device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the CPU interpreter: never split unless asked to


def _validate_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> None:
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    _, _, n_kv, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [T, n_heads, {head_dim}], got {tuple(q.shape)}")
    n_heads = q.shape[1]
    if n_heads % n_kv != 0:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype} must match")
    num_seqs = seq_lens.shape[0]
    if (block_tables.dim() != 2 or block_tables.shape[0] != num_seqs
            or query_start_loc.shape != (num_seqs + 1,)):
        raise ValueError(f"block_tables {tuple(block_tables.shape)}, query_start_loc "
                         f"{tuple(query_start_loc.shape)} and seq_lens {tuple(seq_lens.shape)} "
                         "must be [B, max_blocks], [B + 1] and [B]")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor, got {t.dtype}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    *,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Paged attention for a flat mixed batch of prefill chunks and decodes.

    q: [T, n_heads, head_dim] (float32/float16/bfloat16); rows of sequence i are
        ``query_start_loc[i]:query_start_loc[i+1]``; rows past ``query_start_loc[-1]`` (padding)
        are left untouched in ``out`` (zeros when ``out`` is None).
    k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim], q's dtype and device; the
        new tokens' K/V must already be written (:func:`write_kv`).
    block_tables: int32 [B, max_blocks_per_seq]; query_start_loc: int32 [B + 1];
    seq_lens: int32 [B] (cached + new tokens). A sequence with 0 new tokens is skipped.
    max_query_len, max_seq_len: host ints (launch sizes; max_seq_len sizes the splits).
    scale: softmax scale, usually ``head_dim ** -0.5``.
    num_kv_splits: None = :func:`choose_num_kv_splits` with the device's SM count; 1 = never
        split; n > 1 = force the split-KV decode path (requires ``max_query_len <= 1``).
    block_m, tile_n: tile sizes (query rows per program, keys per inner step); powers of two >= 16.
    check: validate shapes, dtypes and devices (False skips it for a repeat of a validated call).
    Returns out: [T, n_heads, head_dim] in q's dtype. Raises ValueError on bad shapes/dtypes.
    """
    if check:
        _validate_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    _, block_size, n_kv, head_dim = k_cache.shape
    n_heads = q.shape[1]
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.zeros_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}")
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    qpk = n_heads // n_kv
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_fp32, precision = _dot_config(q.dtype)
    qk_scale = float(scale) * _LOG2E
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_seqs, n_kv, max_query_len, max_seq_len,
                                             _device_num_sms(q.device))
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if tile_n is None:
        tile_n = 64 if q.is_cuda else 32
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")

    if num_kv_splits > 1:
        if max_query_len > 1:
            raise ValueError("the split-KV path is for decode-only batches (max_query_len <= 1), "
                             f"got max_query_len={max_query_len}")
        rows = max(16, triton.next_power_of_2(qpk))
        split_len = -(-max(max_seq_len, 1) // num_kv_splits)
        split_len = -(-split_len // tile_n) * tile_n
        part_o = torch.empty((num_seqs, n_heads, num_kv_splits, block_d), dtype=torch.float32,
                             device=q.device)
        part_m = torch.empty((num_seqs, n_heads, num_kv_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        _paged_decode_split_kernel[(num_seqs, n_kv, num_kv_splits)](
            part_o, part_m, part_l,
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
            qk_scale, block_size, head_dim, split_len,
            *q.stride(), *part_m.stride(), *k_cache.stride(), *v_cache.stride(),
            block_tables.stride(0),
            QPK=qpk, BLOCK_M=rows, TILE_N=tile_n, BLOCK_D=block_d,
            DOT_FP32=dot_fp32, DOT_PRECISION=precision,
        )
        _split_reduce_kernel[(num_seqs, n_heads)](
            out, part_o, part_m, part_l, query_start_loc,
            head_dim, num_kv_splits,
            *out.stride(), *part_m.stride(),
            S_PAD=max(2, triton.next_power_of_2(num_kv_splits)), BLOCK_D=block_d,
        )
        return out

    if block_m is None:
        block_m = 16 if max_query_len <= 1 else 64
    block_m = max(block_m, triton.next_power_of_2(qpk))
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    block_q = block_m // qpk
    grid = (q.shape[0] // block_q + num_seqs, n_kv)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        num_seqs, qk_scale, block_size, head_dim,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        QPK=qpk, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, BLOCK_D=block_d,
        DOT_FP32=dot_fp32, DOT_PRECISION=precision,
    )
    return out


__all__ = [
    "MAX_KV_SPLITS",
    "MIN_TOKENS_PER_SPLIT",
    "PROGRAMS_PER_SM",
    "choose_num_kv_splits",
    "is_interpreted",
    "paged_attention",
    "write_kv",
]
