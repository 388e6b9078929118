"""Fit the simulator's step-time model t = a + b * batched_tokens + c * attended_context to the
real engine on this machine.

``python -m goodput.bench.fit_step_time [--model smollm2] [--dtype bfloat16] [--repeats 5]
[--out bench/goodput/bench/step_time_fits.json]``

Each point runs the REAL ``Scheduler`` + ``ModelRunner`` (the worker's defaults: bf16, block 16,
torch attention) on one step shape and keeps the MINIMUM of ``--repeats`` timings: the machine is
shared with other processes, and the minimum is the least disturbed estimate of the step's own
cost. Shapes: decode steps at batch B in {1, 8, 32} with 128 tokens of context per sequence and
B in {1, 8} with 1024, plus the prefill steps that fill them (512-token budget: chunks of
128..512 tokens after 0 or 512 cached tokens).
``batched_tokens`` = sum of chunk lengths; ``attended_context`` = sum over chunks of the context
each chunk attends to (start_pos + chunk length, i.e. the KV a step reads). Relative least squares
with numpy (rows weighted by 1/t), coefficients clipped at 0, written with the points and relative
residuals to ``--out`` under the key ``cpu-<model>``. The linear model ignores the O(n * context)
attention of the torch reference backend's prefill chunks, which is most of its residual.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time


def _steps(runner, config_kw: dict, batch: int, ctx: int, repeats: int) -> list[tuple[int, int, float]]:
    """Prefill ``batch`` sequences of ``ctx`` tokens, then time decode steps at that shape;
    also times the prefill chunks on the way. Returns (tokens, attended, seconds) points."""
    from goodput.worker.engine.config import EngineConfig
    from goodput.worker.engine.request import Request
    from goodput.worker.engine.sampling_params import SamplingParams
    from goodput.worker.engine.scheduler import Scheduler

    cfg = EngineConfig(num_blocks=runner.num_blocks, max_model_len=4096, block_size=runner.block_size,
                       max_num_seqs=max(64, batch), enable_prefix_caching=False, **config_kw)
    sched = Scheduler(cfg)
    for i in range(batch):
        sched.add_request(Request(f"r{i}", [(7 * i + j) % 1000 + 10 for j in range(ctx)],
                                  SamplingParams(max_tokens=64, ignore_eos=True)))
    points = []
    while True:
        out = sched.schedule()
        decode = all(c.num_tokens == 1 for c in out.chunks)
        t0 = time.perf_counter()
        ro = runner.execute(out)
        dt = time.perf_counter() - t0
        sched.update_from_output(out, ro)
        tokens = out.num_batched_tokens
        # decode steps of one shape differ only by +batch context per step: key them at ctx + 1
        attended = tokens * (ctx + 1) if decode else sum(c.seq_len for c in out.chunks)
        full_decode = decode and len(out.chunks) == batch
        if full_decode or not decode:   # partial decode batches (stragglers) are left out
            points.append((tokens, attended, dt, decode))
        if (full_decode and sum(1 for p in points if p[3]) >= repeats) or not sched.has_unfinished():
            break
    for r in list(sched.requests):
        sched.abort_request(r)
    return points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/goodput/bench/step_time_fits.json")
    args = ap.parse_args(argv)

    import numpy as np
    from goodput.worker.model.runner import ModelRunner

    # the worker's default KV budget (1 GiB): every shape below fits without preemption
    runner = ModelRunner(args.model, dtype=args.dtype, device="cpu", kv_cache_memory_bytes=1 << 30)
    runner.execute  # noqa: B018  (fail early if the API moved)
    by_shape: dict[tuple[int, int, bool], float] = {}
    shapes = [(b, 128) for b in (1, 8, 32)] + [(b, 1024) for b in (1, 8)]
    for batch, ctx in shapes:
        for tokens, attended, dt, decode in _steps(runner, {"max_num_batched_tokens": 512}, batch, ctx,
                                                   args.repeats):
            key = (tokens, attended, decode)
            by_shape[key] = min(dt, by_shape.get(key, float("inf")))
        print(f"batch {batch:3d} ctx {ctx:5d}: {len(by_shape)} distinct step shapes so far", flush=True)
    # the first step of each shape warms caches; the minimum over repeats of equal shapes drops it
    pts = sorted(by_shape.items())
    X = np.array([[1.0, k[0], k[1]] for k, _ in pts])
    y = np.array([v for _, v in pts])
    # relative least squares (rows scaled by 1/t): a 40 ms decode step weighs as much as a 1 s
    # prefill step, so the fit serves both; coefficients are physical costs, hence >= 0
    coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
    coef = np.clip(coef, 0.0, None)
    pred = X @ coef
    rel = np.abs(pred - y) / y
    fit = {
        "a_s": float(coef[0]), "b_s_per_token": float(coef[1]), "c_s_per_context_token": float(coef[2]),
        "model": args.model, "dtype": args.dtype, "device": "cpu",
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, shared with other processes "
                   "(minimum of repeats kept)",
        "repeats": args.repeats,
        "median_relative_error": float(np.median(rel)), "max_relative_error": float(rel.max()),
        "points": [{"batched_tokens": k[0], "attended_context": k[1], "decode": k[2], "seconds": v}
                   for k, v in pts],
    }
    out = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    out[f"cpu-{args.model}"] = fit
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"t = {fit['a_s'] * 1e3:.2f} ms + {fit['b_s_per_token'] * 1e3:.4f} ms/token + "
          f"{fit['c_s_per_context_token'] * 1e6:.4f} us/context-token; median rel. error "
          f"{fit['median_relative_error']:.1%}, max {fit['max_relative_error']:.1%} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
