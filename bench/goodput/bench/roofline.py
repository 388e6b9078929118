"""Roofline of one decode step on this machine (Williams, Waterman, Patterson, CACM 2009).

Measured with torch on the current thread count:
- peak matmul throughput (GFLOP/s) for fp32 and bf16: best of several [n x n] @ [n x n]
  (2 n^3 FLOPs each);
- memory bandwidth (GB/s): best of several reductions over a buffer far larger than the caches
  (bytes read / time), copies (bytes read + written / time), and bf16 matrix-vector products
  ([1 x K] @ [N x K]^T over a 256 MiB weight: weight bytes / time, the access pattern of a
  batch-1 decode step). The bound uses the best read rate of the reduction and the GEMV
  (:func:`read_bandwidth`): a rate some code on this machine reaches, so a fair roof.

Model costs of ONE decode step at batch B with `ctx` tokens of KV per sequence, from the GGUF
metadata (no hard-coded model numbers):
- weight bytes = every matmul weight once (q, k, v, o, gate, up, down per layer + the
  [vocab x d] lm_head, tied or not) + norms, at `bytes_per_param`; read once per step whatever B;
  the embedding lookup reads only B rows (ignored);
- KV bytes = B * ctx * layers * 2 * kv_heads * head_dim * bytes_per_kv;
- FLOPs = 2 * B * (matmul params) + B * layers * 4 * ctx * heads * head_dim (QK^T and PV).
Lower bound = max(bytes / bandwidth, FLOPs / peak). Achieved fraction = bound / measured step.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from .prompts import resolve_model


def model_shape(gguf_path: str) -> dict:
    from gguf import GGUFReader
    r = GGUFReader(gguf_path)
    arch = r.fields["general.architecture"].contents()
    f = lambda k: r.fields[f"{arch}.{k}"].contents()
    d, h, kv, L = f("embedding_length"), f("attention.head_count"), f("attention.head_count_kv"), f("block_count")
    hd = f("attention.key_length") if f"{arch}.attention.key_length" in r.fields else d // h
    ff = f("feed_forward_length")
    vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    matmul = L * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * ff) + vocab * d
    norms = L * 2 * d + d
    file_weight_bytes = sum(int(t.n_bytes) for t in r.tensors)
    return {"arch": arch, "layers": L, "d_model": d, "heads": h, "kv_heads": kv, "head_dim": hd, "ffn": ff,
            "vocab": vocab, "matmul_params": matmul, "norm_params": norms,
            "gguf_tensor_bytes": file_weight_bytes}


def step_cost(shape: dict, batch: int, ctx: int, bytes_per_param: float, bytes_per_kv: float) -> dict:
    w = (shape["matmul_params"] + shape["norm_params"]) * bytes_per_param
    kvb = batch * ctx * shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * bytes_per_kv
    flops = 2 * batch * shape["matmul_params"] + batch * shape["layers"] * 4 * ctx * shape["heads"] * shape["head_dim"]
    return {"weight_bytes": w, "kv_bytes": kvb, "bytes": w + kvb, "flops": flops}


def bound_seconds(cost: dict, peak_flops: float, bandwidth: float) -> float:
    return max(cost["bytes"] / bandwidth, cost["flops"] / peak_flops)


def measure_matmul_gflops(dtype_name: str, n: int = 1024, seconds: float = 1.5) -> float:
    import torch
    dt = getattr(torch, dtype_name)
    a = torch.randn(n, n).to(dt)
    b = torch.randn(n, n).to(dt)
    for _ in range(2):
        torch.mm(a, b)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return best / 1e9


def measure_matvec_gflops(dtype_name: str, rows: int = 4096, cols: int = 4096, batch: int = 32,
                          seconds: float = 1.0) -> float:
    """A [batch x cols] @ [cols x rows]^T product: the shape of a decode step's linear layers."""
    import torch
    dt = getattr(torch, dtype_name)
    w = torch.randn(rows, cols).to(dt)
    x = torch.randn(batch, cols).to(dt)
    torch.nn.functional.linear(x, w)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = max(best, 2 * batch * rows * cols / (time.perf_counter() - t))
    return best / 1e9


def measure_bandwidth_gbs(mib: int = 512, seconds: float = 1.5) -> dict:
    """{"read_gbs" (fp32 sum), "copy_gbs" (read + write), "gemv_bf16_gbs" (weight bytes of a
    bf16 [1 x 8192] @ [16384 x 8192]^T product / time)}: best of the repeats in `seconds`."""
    import torch
    import torch.nn.functional as F
    n = mib * 2 ** 20 // 4
    a = torch.ones(n, dtype=torch.float32)
    b = torch.empty_like(a)
    a.sum()
    b.copy_(a)
    read = copy = 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        a.sum()
        read = max(read, n * 4 / (time.perf_counter() - t))
        t = time.perf_counter()
        b.copy_(a)
        copy = max(copy, 2 * n * 4 / (time.perf_counter() - t))
    del a, b
    # 256 MiB of weights; the values do not change a dense kernel's speed
    w = torch.full((16384, 8192), 0.01, dtype=torch.bfloat16)
    x = torch.full((1, 8192), 0.5, dtype=torch.bfloat16)
    F.linear(x, w)
    gemv, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        F.linear(x, w)
        gemv = max(gemv, w.nbytes / (time.perf_counter() - t))
    return {"read_gbs": read / 1e9, "copy_gbs": copy / 1e9, "gemv_bf16_gbs": gemv / 1e9}


def read_bandwidth(machine: dict) -> float:
    """Bytes/s the bound uses: the best read rate measured (reduction or bf16 GEMV)."""
    bw = machine["bandwidth"]
    return max(bw["read_gbs"], bw.get("gemv_bf16_gbs", 0.0)) * 1e9


def measure_machine(seconds: float = 1.5) -> dict:
    """Peaks on the current torch thread count; `seconds` per measurement (best of the repeats)."""
    import torch
    bw = measure_bandwidth_gbs(seconds=seconds)
    return {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "matmul_gflops": {d: measure_matmul_gflops(d, seconds=seconds) for d in ("float32", "bfloat16")},
            "decode_linear_gflops_b32": {d: measure_matvec_gflops(d, seconds=seconds * 2 / 3)
                                         for d in ("float32", "bfloat16")},
            "bandwidth": bw}


def table(machine: dict, shape: dict, batches: list[int], ctx: int, measured_step_s: dict | None = None) -> tuple[str, list]:
    """Markdown table of bounds per dtype and batch; with measured step times {(dtype, B): s},
    also the achieved fraction. Returns (markdown, rows)."""
    bw = read_bandwidth(machine)
    rows = []
    lines = ["| dtype | B | weight MB | KV MB | GFLOP | t_mem ms | t_compute ms | bound ms | bound tok/s | "
             "measured step ms | achieved |", "|" + "---|" * 11]
    for dtype, bpp in (("float32", 4), ("bfloat16", 2)):
        peak = machine["matmul_gflops"][dtype] * 1e9
        for b in batches:
            c = step_cost(shape, b, ctx, bpp, bpp)
            lb = bound_seconds(c, peak, bw)
            meas = (measured_step_s or {}).get((dtype, b))
            frac = lb / meas if meas else None
            rows.append({"dtype": dtype, "batch": b, "ctx": ctx, **c, "t_mem_s": c["bytes"] / bw,
                         "t_compute_s": c["flops"] / peak, "bound_s": lb, "measured_step_s": meas,
                         "achieved_fraction": frac})
            lines.append(f"| {dtype} | {b} | {c['weight_bytes'] / 1e6:.0f} | {c['kv_bytes'] / 1e6:.1f} | "
                         f"{c['flops'] / 1e9:.2f} | {c['bytes'] / bw * 1e3:.1f} | {c['flops'] / peak * 1e3:.1f} | "
                         f"{lb * 1e3:.1f} | {b / lb:.0f} | {meas * 1e3 if meas else float('nan'):.1f} | "
                         f"{'–' if frac is None else f'{frac * 100:.0f}%'} |")
    return "\n".join(lines), rows


def main(a: argparse.Namespace) -> None:
    shape = model_shape(resolve_model("smollm2"))
    machine = measure_machine()
    md, rows = table(machine, shape, [int(x) for x in a.batches.split(",")], a.context)
    print(json.dumps(machine, indent=1))
    print(json.dumps(shape, indent=1))
    print(md)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"machine": machine, "shape": shape, "rows": rows}, f, indent=1)
