"""Build and call goodput's C++ CPU kernels (``csrc/``): paged decode attention
(``paged_attention.cpp``, used by the ``cpu`` attention backend) and fused decoder-layer ops
(``layer_ops.cpp``: RMSNorm, residual add + RMSNorm, RoPE, SiLU·up; used by ``llama.py``).

The extension is compiled on first use with torch's own ``torch.utils.cpp_extension.load``
(g++ with OpenMP, ``-O3 -march=native``) into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), named by a hash of the source,
the flags and this CPU's instruction-set flags, so a cache shared between different machines never
loads code built for another CPU. The first build takes ~1 minute on 2 cores; later loads are
instant. Where it cannot be built (no compiler, no Python headers) :func:`load` returns None with
the reason in :func:`load_error`: ``auto`` then picks the torch attention backend and the model
runs its torch ops. ``GOODPUT_CPU_KERNELS=0`` turns both off (:func:`available`).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / f for f in ("paged_attention.cpp", "layer_ops.cpp", "bindings.cpp")]
# no FMA contraction: the fused layer ops keep torch's separate roundings of a*b + c*d
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
_error: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension module, or None (see :func:`load_error`) when it cannot be built."""
    global _error
    try:
        from torch.utils import cpp_extension
        src = "\0".join(p.read_text() for p in SOURCES)
        key = hashlib.sha256("\0".join([src, " ".join(CFLAGS), _cpu_flags(), torch.__version__]).encode())
        name = f"goodput_cpu_kernels_{key.hexdigest()[:12]}"
        log.info("loading the C++ CPU kernels %s (the first build compiles them, ~1 min)", name)
        return cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means "use the torch path"
        _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("C++ CPU kernels unavailable (%s); using the torch reference ops", _error)
        return None


def load_error() -> str | None:
    """Why :func:`load` returned None (None when it has not failed)."""
    return _error


def available() -> bool:
    """True when the kernels build (or are cached) here; GOODPUT_CPU_KERNELS=0 says no."""
    return loaded() is not None


def loaded() -> ModuleType | None:
    """:func:`load`, or None when GOODPUT_CPU_KERNELS=0 (the torch reference ops everywhere)."""
    if os.environ.get("GOODPUT_CPU_KERNELS", "1") == "0":
        return None
    return load()


def num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, threads: int | None = None,
               min_tokens: int = 256) -> int:
    """Parts each sequence's context is split into so that every thread gets work when there are
    fewer (sequence, KV head) pairs than ~4 per thread, each part at least ``min_tokens`` long."""
    threads = threads or torch.get_num_threads()
    units = max(1, num_seqs * num_kv_heads)
    want = -(-4 * threads // units)
    return max(1, min(want, max_seq_len // min_tokens))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           splits: int = 1) -> torch.Tensor:
    """softmax(scale · q·Kᵀ) · V for one query token per sequence, reading K/V in place.

    q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KV, D] (q's dtype: float32 or
    bfloat16; H a multiple of KV); block_tables: int32 [B, max_blocks]; seq_lens: int32 [B]
    (sequence b attends to its positions [0, seq_lens[b])). Returns [B, H, D] in q's dtype;
    softmax and accumulation in float32. Raises ValueError for block ids outside the pool or
    lengths outside [0, max_blocks · block_size], RuntimeError when the kernels are unavailable
    and for shape/dtype mismatches (from the C++ checks).
    """
    mod = load()
    if mod is None:
        raise RuntimeError(f"C++ CPU kernels unavailable: {load_error()}")
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= nb):
        raise ValueError(f"block id outside the pool [0, {nb})")
    if seq_lens.numel() and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > block_tables.shape[1] * bs):
        raise ValueError(f"seq_lens outside [0, {block_tables.shape[1] * bs}]")
    return checked_call(mod, q, k_cache, v_cache, block_tables, seq_lens, scale, splits)


def checked_call(mod: ModuleType, q, k_cache, v_cache, block_tables, seq_lens, scale: float, splits: int):
    """The kernel without the value checks of :func:`paged_decode_attention` (a caller that
    validated block tables and lengths once per step calls this once per layer)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    return mod.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, float(scale), int(splits))
