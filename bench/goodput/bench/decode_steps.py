"""Time our engine's decode steps in-process at a given batch and context, without prefill.

    python -m goodput.bench decode-steps --batches 1,16 --contexts 512,2048,8192 --out x.json
    python -m goodput.bench decode-steps --quantization int4 --batches 1,32 --contexts 107
    python -m goodput.bench decode-steps --batches 1,4 --contexts 128 --native both --small-rows 4 \
        --breakdown-batches 1,4      # native decode step vs per-operator path, and where a step goes

A real ``ModelRunner`` (the worker's model, attention backend and sampler) executes decode steps
of B sequences whose KV cache already holds T - 1 tokens each: the cache is filled with random
values instead of a prefill (a step's cost depends on the bytes it reads, not their values), and
every sequence gets its own run of consecutive blocks (as a fresh server allocates a prompt's
blocks), so a batch reads B·T distinct tokens of KV as a server would with B different prompts
(shared-prefix blocks could be served from the last-level cache and flatter the result). Each (B, T) shape runs ``--warmup`` untimed steps, then ``--repeats``
timed ones; the median is reported (the minimum too: on a shared machine it is the least
disturbed estimate).

Also reports the weight bytes the loaded model actually holds for a decode step (every linear's
tensors, LM head included, norms; not the embedding table, of which a step gathers B rows),
summed from the live tensors' ``nbytes``.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantization", default="none", help="none | int8 | int4 (when the worker has it)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="512,2048,8192", help="tokens each sequence attends to")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--profile-batches", default="",
                   help="also profile these batch sizes (torch.profiler, first context): top ops per step")
    p.add_argument("--native", default="on", choices=["on", "off", "both"],
                   help="the native decode step (one C++ call per step where eligible): on, off (the "
                        "per-operator path), or both, one after the other at every point")
    p.add_argument("--small-rows", type=int, default=None,
                   help="set every layer linear's block-kernel row limit to this instead of the one "
                        "measured at load (which moves with the machine's load)")
    p.add_argument("--breakdown-batches", default="",
                   help="per-step breakdown at these batch sizes (first context): linears, attention, "
                        "layer ops, everything else")
    p.add_argument("--out", default=None, help="JSON result path")


def _tensor_bytes(obj) -> int:
    import torch
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, torch.Tensor))


def model_weight_bytes(model) -> dict | None:
    """{"layers", "lm_head", "norms", "total", "small_batch_blocks"}: bytes of the tensors a decode
    step multiplies (small_batch_blocks: the file's blocks that steps of few rows read instead),
    from a live ``LlamaModel`` (its ``layers[i].{qkv,o,gate_up,down}``, norms and ``lm_head``);
    None when the model does not have that structure."""
    try:
        layers = sum(_tensor_bytes(getattr(ly, n)) for ly in model.layers for n in ("qkv", "o", "gate_up", "down"))
        norms = sum(_tensor_bytes(ly.attn_norm) + _tensor_bytes(ly.ffn_norm) for ly in model.layers)
        norms += _tensor_bytes(model.norm)
        head = _tensor_bytes(model.lm_head)
    except AttributeError:
        return None
    # linears that also hold the file's blocks (block_linear.py) read those at few rows instead
    small = sum(getattr(getattr(lin, "small", None), "nbytes", 0)
                for lin in [getattr(ly, n) for ly in model.layers for n in ("qkv", "o", "gate_up", "down")]
                + [model.lm_head])
    return {"layers": layers, "lm_head": head, "norms": norms, "total": layers + head + norms,
            "small_batch_blocks": small}


def make_runner(model: str, dtype: str, quantization: str, num_blocks: int, block_size: int,
                threads: int | None):
    """A ModelRunner with `num_blocks` KV blocks; ValueError when the worker has no
    ``quantization`` argument and one other than "none" is asked for."""
    from goodput.worker.model.runner import ModelRunner
    kw = dict(dtype=dtype, device="cpu", num_blocks=num_blocks, block_size=block_size, num_threads=threads)
    if "quantization" in inspect.signature(ModelRunner.__init__).parameters:
        kw["quantization"] = quantization
    elif quantization != "none":
        raise ValueError(f"this worker has no quantization support (asked for {quantization!r})")
    return ModelRunner(model, **kw)


def decode_batch(batch: int, ctx: int, block_size: int, first_block: int = 0):
    """A SchedulerOutput of `batch` greedy decode chunks at position ctx - 1, sequence i on blocks
    [first_block + i·nb, first_block + (i+1)·nb) with nb = ceil(ctx / block_size)."""
    from goodput.worker.engine.outputs import ScheduledChunk, SchedulerOutput
    from goodput.worker.engine.sampling_params import SamplingParams
    nb = -(-ctx // block_size)
    sp = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    chunks = [ScheduledChunk(request_id=f"s{i}", token_ids=(100 + i,), start_pos=ctx - 1,
                             block_table=tuple(range(first_block + i * nb, first_block + (i + 1) * nb)),
                             sample=True, sampling_params=sp, num_output_tokens=1,
                             prompt_token_ids=(1,) * (ctx - 1))
              for i in range(batch)]
    return SchedulerOutput(chunks=chunks, num_batched_tokens=batch)


def time_steps(runner, batch: int, ctx: int, repeats: int, warmup: int) -> list[float]:
    """Seconds of `repeats` timed ``runner.execute`` decode steps at (batch, ctx)."""
    sched = decode_batch(batch, ctx, runner.block_size)
    for _ in range(warmup):
        runner.execute(sched)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        runner.execute(sched)
        out.append(time.perf_counter() - t)
    return out


class _Traced:
    """Stands in for goodput's C++ kernel module while profiling: each call runs inside
    ``record_function("goodput::<name>")``, so torch.profiler lists the kernels (pybind functions
    are not torch ops and would otherwise count as time outside ops)."""

    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name):
        import torch
        fn = getattr(self._mod, name)

        def traced(*args, **kw):
            with torch.profiler.record_function(f"goodput::{name}"):
                return fn(*args, **kw)
        return traced


def _trace_kernels(runner) -> list[tuple[object, str, object]]:
    """Swap the runner's C++ kernel module for a :class:`_Traced` one; returns what to restore."""
    swapped = []
    model = getattr(runner, "model", None)
    linears = [getattr(ly, n, None) for ly in getattr(model, "layers", []) for n in ("qkv", "o", "gate_up", "down")]
    linears.append(getattr(model, "lm_head", None))
    blocks = [(lin.small, "_mod") for lin in linears if getattr(lin, "small", None) is not None]  # block_linear.py
    for obj, attr in ((model, "fused_ops"), (getattr(runner, "attention_backend", None), "_mod"), *blocks):
        mod = getattr(obj, attr, None) if obj is not None else None
        if mod is not None:
            setattr(obj, attr, _Traced(mod))
            swapped.append((obj, attr, mod))
    return swapped


def profile_steps(runner, batch: int, ctx: int, steps: int = 5, top: int = 12) -> dict:
    """torch.profiler over `steps` decode steps at (batch, ctx) after one warm-up: per step the
    wall time, the summed self time of all ops, and the `top` ops by self time
    ({name, self_ms, calls} per step). wall − ops ≈ time outside torch ops (Python, dispatch
    gaps), inflated somewhat by the profiler's own per-op cost."""
    from torch.profiler import ProfilerActivity, profile
    sched = decode_batch(batch, ctx, runner.block_size)
    runner.execute(sched)
    swapped = _trace_kernels(runner)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                runner.execute(sched)
            wall = (time.perf_counter() - t) / steps
    finally:
        for obj, attr, mod in swapped:
            setattr(obj, attr, mod)
    ka = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    ka.sort(key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ka) / 1e3 / steps
    ops = [{"name": e.key, "self_ms": e.self_cpu_time_total / 1e3 / steps, "calls": e.count / steps}
           for e in ka[:top]]
    return {"batch": batch, "ctx": ctx, "steps": steps, "wall_ms": wall * 1e3, "ops_self_ms": total, "top": ops}


# the kernel modules' functions by breakdown category (None: not timed; the rest of a step is
# "other": Python, dispatch, the runner's inputs, the row gather, sampling)
KERNEL_CATEGORIES = {"rms_norm": "layer_ops", "add_rms_norm_": "layer_ops", "rope_": "layer_ops",
                     "silu_mul": "layer_ops", "write_kv": "layer_ops", "paged_decode_attention": "attention"}
PHASES = ("linears", "attention", "layer_ops")  # the native step's phase_ns order (csrc/decode_step.h)


class _Timed:
    """Stands in for a kernel module, a linear or the native decode step's stack while a breakdown
    runs: adds the seconds of each call (of the object, or of its methods) to ``acc[category]``;
    ``categories`` maps method names to a category (None: passed through untimed); ``clock``:
    seconds now (wall by default; ``time.process_time`` for CPU seconds)."""

    def __init__(self, obj, acc: dict, category: str | None, categories: dict | None = None,
                 clock=time.perf_counter):
        self._obj, self._acc, self._cat, self._cats, self._clock = obj, acc, category, categories, clock

    def _timed(self, fn, cat):
        def call(*args, **kw):
            t0 = self._clock()
            try:
                return fn(*args, **kw)
            finally:
                self._acc[cat] = self._acc.get(cat, 0.0) + self._clock() - t0
        return call

    def __call__(self, *args, **kw):
        return self._timed(self._obj, self._cat)(*args, **kw)

    def __getattr__(self, name):
        attr = getattr(self._obj, name)
        cat = self._cats.get(name) if self._cats is not None else None
        return self._timed(attr, cat) if cat is not None and callable(attr) else attr


def _time_kernels(runner, acc: dict) -> list[tuple[object, str, object]]:
    """Swap in :class:`_Timed` stand-ins: every layer linear and the LM head (``linears``), the
    layer-op and attention kernels (:data:`KERNEL_CATEGORIES`) and a built native step's stack
    (``native``); returns what to restore."""
    model, backend = runner.model, runner.attention_backend
    swaps = [(ly, n, "linears", None) for ly in model.layers for n in ("qkv", "o", "gate_up", "down")]
    swaps += [(model, "lm_head", "linears", None), (model, "fused_ops", None, KERNEL_CATEGORIES),
              (backend, "_mod", None, KERNEL_CATEGORIES)]
    swapped = []
    for obj, attr, cat, cats in swaps:
        cur = getattr(obj, attr, None)
        if cur is not None:
            setattr(obj, attr, _Timed(cur, acc, cat, cats))
            swapped.append((obj, attr, cur))
    native = getattr(model, "_native", None)
    if native is not None:
        swapped.append((model, "_native", native))
        model._native = (_Timed(native[0], acc, None, {"step": "native"}), native[1])
    return swapped


def step_breakdown(runner, batch: int, ctx: int, steps: int = 10, rounds: int = 5) -> dict:
    """Where a decode step's time goes, ms per step, the median of ``rounds`` runs of ``steps``
    steps with every kernel call timed (:func:`_time_kernels`: ~1 µs per call): linears (layer
    linears and the LM head), attention, layer ops (norms, RoPE, KV write, SiLU·up), and ``other``
    = the step's wall time minus those (Python, dispatch, the runner's inputs, the row gather,
    sampling). A native step's call is split by the phases its calling thread timed
    (``native_phase_ns``; barrier waits count in the phase they end)."""
    import torch
    sched = decode_batch(batch, ctx, runner.block_size)
    model = runner.model
    runner.execute(sched)
    runner.execute(sched)  # builds the native stack, if any, before it is swapped
    per_round = []
    for _ in range(rounds):
        acc: dict = {}
        phases = torch.zeros(3, dtype=torch.float64)
        swapped = _time_kernels(runner, acc)
        model.native_phase_ns = phases
        try:
            t0 = time.perf_counter()
            for _ in range(steps):
                runner.execute(sched)
            wall = time.perf_counter() - t0
        finally:
            model.native_phase_ns = None
            for obj, attr, cur in reversed(swapped):
                setattr(obj, attr, cur)
        out = {c: acc.get(c, 0.0) * 1e3 / steps for c in PHASES}
        out["native"] = acc.get("native", 0.0) * 1e3 / steps
        timed = phases.sum().item()
        for c, ns in zip(PHASES, phases.tolist()):
            out[c] += out["native"] * ns / timed if timed else 0.0
        out["wall"] = wall * 1e3 / steps
        out["other"] = out["wall"] - sum(out[c] for c in PHASES)
        per_round.append(out)
    med = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    return {"batch": batch, "ctx": ctx, "rounds": rounds, "steps": steps, **{f"{k}_ms": v for k, v in med.items()}}


def run(a: argparse.Namespace) -> dict:
    import torch
    batches = [int(x) for x in a.batches.split(",") if x]
    contexts = [int(x) for x in a.contexts.split(",") if x]
    need = max(batches) * -(-max(contexts) // a.block_size)
    t0 = time.perf_counter()
    runner = make_runner(a.model, a.dtype, a.quantization, need, a.block_size, a.threads)
    if max(contexts) > runner.max_model_len:
        raise ValueError(f"context {max(contexts)} exceeds the model's {runner.max_model_len}")
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:  # views of one pool; random values (uniform: cheaper than normal on GBs)
        k.uniform_(-1.0, 1.0, generator=g)
        v.uniform_(-1.0, 1.0, generator=g)
    c = runner.model_config
    dtype_bytes = torch.empty((), dtype=runner.dtype).element_size()
    model = runner.model
    if a.small_rows is not None:
        for lin in getattr(model, "_native_linears", []):
            lin.small_rows = a.small_rows if getattr(lin, "small", None) is not None else lin.small_rows
    modes = {"on": [True], "off": [False], "both": [True, False]}[a.native]
    points, breakdowns = [], []
    for b in batches:
        for t in contexts:
            for native in modes:
                if hasattr(model, "native_step"):
                    model.native_step = native
                s = time_steps(runner, b, t, a.repeats, a.warmup)
                med = statistics.median(s)
                used = bool(getattr(model, "native_eligible", lambda _: False)(b)) and native
                points.append({"batch": b, "ctx": t, "native": used, "step_s_median": med, "step_s_min": min(s),
                               "steps_s": s, "tok_s": b / med})
                print(f"decode B={b:3d} T={t:5d} {'native' if used else 'per-op'}: {med * 1e3:8.2f} ms/step "
                      f"(min {min(s) * 1e3:.2f}), {b / med:7.1f} tok/s", file=sys.stderr, flush=True)
    for b in [int(x) for x in a.breakdown_batches.split(",") if x]:
        for native in modes:
            if hasattr(model, "native_step"):
                model.native_step = native
            bd = step_breakdown(runner, b, contexts[0])
            bd["native_step"] = native
            breakdowns.append(bd)
            print("breakdown B={batch} T={ctx} (native call {native_ms:.2f} ms): wall {wall_ms:.2f} = linears "
                  "{linears_ms:.2f} + attention {attention_ms:.2f} + layer ops {layer_ops_ms:.2f} + other "
                  "{other_ms:.2f} ms".format(**bd), file=sys.stderr, flush=True)
    profiles = [profile_steps(runner, int(b), contexts[0]) for b in a.profile_batches.split(",") if b]
    return {"model": a.model, "dtype": a.dtype, "quantization": a.quantization, "profiles": profiles,
            "breakdowns": breakdowns, "native": a.native, "small_rows": getattr(model, "small_rows", None),
            "small_rows_forced": a.small_rows,
            "threads": torch.get_num_threads(), "block_size": a.block_size, "load_s": load_s,
            "attention_backend": type(runner.attention_backend).__name__,
            "shape": {"layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                      "dtype_bytes": dtype_bytes},
            "kv_bytes_per_token": runner.kv_bytes_per_token,
            "weight_bytes": model_weight_bytes(runner.model), "repeats": a.repeats, "points": points}


def main(a: argparse.Namespace) -> None:
    res = run(a)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    else:
        print(json.dumps({k: v for k, v in res.items() if k != "points"}, indent=1))
