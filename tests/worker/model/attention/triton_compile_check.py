"""Compile every Triton attention kernel for a CUDA target without a GPU (run as a script).

The CPU interpreter cannot catch errors that only the compiler sees (types in loops, layouts,
dot shapes), so ``test_triton_attention.py`` runs this in a subprocess WITHOUT
``TRITON_INTERPRET``: Triton lowers each kernel to PTX and its bundled ptxas assembles it for
sm_90 (H100/H200). Prints one line per variant (OK/FAIL) and exits 1 on any failure.
Usage: python tests/worker/model/attention/triton_compile_check.py [--quick] [ARCH]   (default 90; --quick compiles
the bf16 kernels and the fp32 decode tile only, for CI)
"""
from __future__ import annotations

import inspect
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: this compiles the kernels for a GPU")

import triton
from goodput.worker.model.attention import triton_ops as T
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def signature(fn, types: dict[str, str], constexprs: dict) -> dict[str, str]:
    out = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            out[name] = "constexpr"
        elif name.endswith("_ptr"):
            out[name] = types.get(name, types["ptr"])
        else:
            out[name] = types.get(name, "i32")
    return out


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--quick"]
    quick = "--quick" in sys.argv[1:]
    arch = int(args[0]) if args else 90
    target = GPUTarget("cuda", arch, 32)
    failures = 0

    def build(fn, types, constexprs, label):
        nonlocal failures
        try:
            k = triton.compile(ASTSource(fn=fn, signature=signature(fn, types, constexprs),
                                         constexprs=constexprs), target=target)
            ptx = k.asm["ptx"]
            mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "no mma"
            print(f"OK   sm_{arch} {label}: {mma}, shared {k.metadata.shared} B")
        except Exception as e:  # noqa: BLE001 -- report every variant, then fail
            failures += 1
            print(f"FAIL sm_{arch} {label}: {type(e).__name__}: {str(e)[:3000]}")

    meta_ptrs = {"block_tables_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32"}
    for dt in ("bf16", "fp32") if quick else ("bf16", "fp16", "fp32"):
        fp32 = dt == "fp32"
        dot = {"DOT_FP32": fp32, "DOT_PRECISION": "ieee" if fp32 else "tf32"}
        types = {"ptr": f"*{dt}", "qk_scale": "fp32", **meta_ptrs}
        tiles = ((16, 3, 64), (64, 3, 64), (64, 1, 128))
        if quick:
            tiles = ((16, 3, 64),) if fp32 else tiles[:2]
        for block_m, qpk, head_dim in tiles:
            c = {"QPK": qpk, "BLOCK_M": block_m, "BLOCK_Q": block_m // qpk, "TILE_N": 64,
                 "BLOCK_D": head_dim, **dot}
            build(T._paged_attention_kernel, types, c,
                  f"paged_attention {dt} BLOCK_M={block_m} QPK={qpk} D={head_dim}")
        if quick and fp32:
            continue
        build(T._paged_decode_split_kernel,
              {**types, "part_o_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"},
              {"QPK": 3, "BLOCK_M": 16, "TILE_N": 64, "BLOCK_D": 64, **dot}, f"decode_split {dt}")
        build(T._split_reduce_kernel, {"ptr": "*fp32", "o_ptr": f"*{dt}", "qsl_ptr": "*i32"},
              {"S_PAD": 4, "BLOCK_D": 64}, f"split_reduce {dt}")
        build(T._write_kv_kernel, {"ptr": f"*{dt}", "slot_ptr": "*i64"},
              {"BLOCK_T": 4, "BLOCK_HD": 256}, f"write_kv {dt}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
