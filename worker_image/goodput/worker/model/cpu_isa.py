"""Instruction-set levels of the prebuilt C++ CPU kernels, and the pure choice of one for a CPU.

The worker image ships the kernels (``cpu_kernels``) compiled once per level below instead of once
for the build machine (``-march=native``): a node whose CPU lacks a level's instructions would die
of SIGILL in it, one that has more would leave speed unused. At start-up :func:`pick` chooses the
highest built level whose instructions this CPU has (its ``/proc/cpuinfo`` flags) and says why.

What the levels change in the kernels (``csrc/``): the AVX-512 paths (paged attention, the fused
layer ops, the GGUF block linear in float32) need AVX-512 F/BW/VL (x86-64-v4); the block linear's
bfloat16 path needs AVX-512 BF16 too (Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and
later); AMX is oneDNN's (torch's bfloat16 matmuls pick it at run time), not ours. Below AVX-512 the
kernels run their portable C++ loops, which the compiler vectorizes for AVX2/FMA (x86-64-v3) or
SSE4.2 (x86-64-v2); the worker's start-up log then says "no AVX-512 ... path" for the block linear.
Stdlib only.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# /proc/cpuinfo names of the x86-64 micro-architecture levels' features (psABI; "pni" is SSE3,
# "abm" LZCNT, "xsave" stands for OSXSAVE)
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Level:
    """One prebuilt level: ``name`` (in the kernel file's name), the CPU flags it ``needs``
    (``/proc/cpuinfo`` spelling), the compiler's ``cflags`` that select it, and what it ``gives``."""
    name: str
    needs: frozenset[str]
    cflags: tuple[str, ...]
    gives: str


# best first; the image builds every one (images/worker/Containerfile)
LEVELS: tuple[Level, ...] = (
    Level("avx512bf16", _V4 | {"avx512_bf16"}, ("-march=x86-64-v4", "-mavx512bf16"),
          "AVX-512 kernels, bfloat16 block linear"),
    Level("avx512", _V4, ("-march=x86-64-v4",), "AVX-512 kernels, float32 block linear only"),
    Level("avx2", _V3, ("-march=x86-64-v3",), "portable loops vectorized for AVX2/FMA"),
    Level("baseline", _V2, ("-march=x86-64-v2",), "portable loops vectorized for SSE4.2"),
)
BY_NAME = {lv.name: lv for lv in LEVELS}


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first ``flags`` line of ``/proc/cpuinfo`` text (empty if none)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def pick(flags: Iterable[str], built: Iterable[str], forced: str | None = None) -> tuple[Level | None, str]:
    """The best level among ``built`` (level names) that a CPU with ``flags`` runs, and why.

    ``forced`` (``GOODPUT_CPU_KERNELS_LEVEL``) picks that level instead, if built and supported.
    Returns (None, why) when no built level fits. Unknown names in ``built`` are ignored.
    """
    have, ready = frozenset(flags), set(built)
    candidates = [lv for lv in LEVELS if lv.name in ready]
    if not candidates:
        return None, "no prebuilt level is installed"
    if forced:
        lv = BY_NAME.get(forced)
        if lv is None or lv.name not in ready:
            return None, f"GOODPUT_CPU_KERNELS_LEVEL={forced} is not among the built levels ({_levels(candidates)})"
        if missing := lv.needs - have:
            return None, f"GOODPUT_CPU_KERNELS_LEVEL={forced} needs {_names(missing)}, which this CPU lacks"
        return lv, f"forced by GOODPUT_CPU_KERNELS_LEVEL={forced}"
    for i, lv in enumerate(candidates):
        if lv.needs <= have:
            skipped = "; ".join(f"not {above.name} (lacks {_names(above.needs - have)})" for above in candidates[:i])
            return lv, f"{lv.gives}" + (f"; {skipped}" if skipped else "; the best built level")
    lowest = candidates[-1]
    return None, f"this CPU lacks {_names(lowest.needs - have)} of the lowest built level {lowest.name}"


def _names(flags: Iterable[str]) -> str:
    return ", ".join(sorted(flags))


def _levels(levels: Iterable[Level]) -> str:
    return ", ".join(lv.name for lv in levels)
