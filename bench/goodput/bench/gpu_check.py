"""GPU check of the Triton attention path (driven by bench/gpu_check.sh).

Sub-commands (each prints a plain-text table; nothing is asserted by timing):

``e2e``
    Greedy tokens for 4 prompts, chunk-prefilled under an 8-token budget so prefill chunks and
    decodes share steps: CPU fp32 with the torch backend (the reference) vs CUDA fp32
    Triton (must be identical: a hard failure otherwise), CUDA bf16 Triton and CUDA bf16 torch
    (reported as the common-prefix length with the reference; bf16 may legitimately diverge at a
    near-tie).
``kernel-bench``
    Decode attention at batch 1, 16, 64, 256 with context 1024 (block size 16, bf16): our paged
    kernel (auto split rule, and forced single pass) vs ``torch.nn.functional.
    scaled_dot_product_attention`` on the same K/V already gathered into contiguous
    ``[B, n_kv, ctx, d]`` tensors, and vs gather + SDPA (what the torch reference backend pays).
    Fraction of HBM bandwidth = KV bytes read / kernel time / measured copy bandwidth.
``decode-bench``
    Whole decode steps of the engine's ModelRunner (bf16, Triton attention) at batch 1, 16, 64,
    256 with every sequence's context at 1024 tokens (prefilled for real first). Bytes per step =
    all weight bytes (each weight is read once per step; the tied embedding/LM head counts once)
    + KV bytes of every sequence's context; achieved fraction = bytes / step time / copy
    bandwidth, where copy bandwidth = (read + written bytes) / time of a large device copy.

``--smoke`` shrinks every size so the script's own code paths can be checked on a CPU
(kernels under ``TRITON_INTERPRET=1``); without it, a missing CUDA device is an error.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
]


def _die(msg: str) -> None:
    print(f"GPU CHECK FAILED: {msg}", file=sys.stderr)
    raise SystemExit(1)


def _device(smoke: bool):
    import torch
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        _die("no CUDA device visible to torch (torch.cuda.is_available() is False); "
             "this check needs a GPU (use --smoke only to test the script on a CPU)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        _die("--smoke on a CPU needs TRITON_INTERPRET=1 in the environment")
    return torch.device("cpu")


def _time_ms(fn, device, reps: int = 50) -> float:
    """Median milliseconds of fn(): CUDA events via triton.testing.do_bench (L2 flushed
    between runs), or a host timer on CPU."""
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=max(reps, 25), return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _close(got, want) -> tuple[bool, float]:
    """bf16 outputs agree within 2e-2 + 1e-2 * |want| (about one bf16 ulp at |want| < 8), and
    the max abs difference."""
    diff = (got.float() - want.float()).abs()
    return bool((diff <= 2e-2 + 1e-2 * want.float().abs()).all()), diff.max().item()


def copy_bandwidth(device, smoke: bool) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    import torch
    n = (1 << 20) if smoke else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device)
    return 2 * n / (ms / 1e3)


# ------------------------------------------------------------------------------------------
# Kernel benchmark
# ------------------------------------------------------------------------------------------
def _kernel_case(name, H, KV, D, B, ctx, bs, dtype, sms, bw, device, g) -> None:
    """One row of the kernel table: decode attention for B sequences of ``ctx`` tokens."""
    import torch
    import torch.nn.functional as F
    from goodput.worker.model.attention import triton_ops

    nblk = -(-(ctx) // bs)
    num_blocks = B * nblk
    k_cache = torch.randn((num_blocks, bs, KV, D), generator=g).to(device, dtype)
    v_cache = torch.randn((num_blocks, bs, KV, D), generator=g).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_tables = perm.view(B, nblk).to(device)
    q = torch.randn((B, H, D), generator=g).to(device, dtype)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    scale = D ** -0.5
    splits = triton_ops.choose_num_kv_splits(B, KV, 1, ctx, sms)

    def ours(n=None):
        return triton_ops.paged_attention(q, k_cache, v_cache, block_tables, qsl, seq_lens,
                                          1, ctx, scale, num_kv_splits=n)

    bt_long = block_tables.long()

    def gather():
        kg = k_cache[bt_long].view(B, nblk * bs, KV, D)[:, :ctx].transpose(1, 2)
        vg = v_cache[bt_long].view(B, nblk * bs, KV, D)[:, :ctx].transpose(1, 2)
        return kg.contiguous(), vg.contiguous()

    kg, vg = gather()
    q4 = q.view(B, H, 1, D)

    def sdpa():
        return F.scaled_dot_product_attention(q4, kg, vg, scale=scale, enable_gqa=True)

    def gather_sdpa():
        k2, v2 = gather()
        return F.scaled_dot_product_attention(q4, k2, v2, scale=scale, enable_gqa=True)

    ok, err = _close(ours(), sdpa().view(B, H, D))
    t_ours = _time_ms(ours, device)
    t_one = _time_ms(lambda: ours(1), device)
    t_sdpa = _time_ms(sdpa, device)
    t_gs = _time_ms(gather_sdpa, device)
    kv_bytes = 2 * B * ctx * KV * D * k_cache.element_size()

    def pct(ms: float) -> float:
        return 100.0 * kv_bytes / (ms / 1e3) / bw

    print(f"{name:14} {B:>4} {splits:>6} {t_ours:>8.4f} {t_one:>8.4f} {t_sdpa:>8.4f} "
          f"{t_gs:>9.4f} {t_sdpa / t_ours:>8.2f}x {kv_bytes / 1e6:>8.1f} {pct(t_ours):>7.1f}% "
          f"{pct(t_sdpa):>7.1f}% {err:>7.1e}")
    if not ok:
        _die(f"kernel output differs from SDPA by {err:.3g} ({name}, B={B})")


def kernel_bench(args) -> None:
    import torch

    device = _device(args.smoke)
    bw = copy_bandwidth(device, args.smoke)
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    shapes = [("smollm2-135m", 9, 3, 64), ("llama-8b-like", 32, 8, 128)]
    batches = [1, 2] if args.smoke else [1, 16, 64, 256]
    ctx = 64 if args.smoke else 1024
    bs = 16
    dtype = torch.bfloat16
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 1)
    print(f"decode attention, context {ctx}, block {bs}, {dtype}, {sms} SMs; times are medians (ms)")
    header = (f"{'shape':14} {'B':>4} {'splits':>6} {'ours':>8} {'1-pass':>8} {'sdpa':>8} "
              f"{'gath+sdpa':>9} {'sdpa/ours':>9} {'KV MB':>8} {'ours %BW':>8} {'sdpa %BW':>8} "
              f"{'maxerr':>7}")
    print(header)
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, H, KV, D in shapes:
        for B in batches:
            _kernel_case(name, H, KV, D, B, ctx, bs, dtype, sms, bw, device, g)
    print(f"prefill attention (one launch, context 0, causal), {dtype}; times are medians (ms)")
    print(f"{'shape':14} {'B x len':>9} {'ours':>8} {'sdpa':>8} {'sdpa/ours':>9} {'TFLOP/s':>8} {'maxerr':>7}")
    for name, H, KV, D in shapes:
        for B, n in ([(1, 64), (2, 48)] if args.smoke else [(1, 2048), (8, 512)]):
            _prefill_case(name, H, KV, D, B, n, bs, dtype, device, g)
    if device.type == "cuda":
        _tile_sweep(device, ctx, bs, dtype)


def _prefill_case(name, H, KV, D, B, n, bs, dtype, device, g) -> None:
    """B prompts of n tokens each, no cached context: ours (paged) vs SDPA causal (contiguous)."""
    import torch
    import torch.nn.functional as F
    from goodput.worker.model.attention import triton_ops

    nblk = -(-n // bs)
    k = torch.randn((B, n, KV, D), generator=g).to(device, dtype)
    v = torch.randn((B, n, KV, D), generator=g).to(device, dtype)
    q = torch.randn((B * n, H, D), generator=g).to(device, dtype)
    k_cache = torch.zeros((B * nblk, bs, KV, D), device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.arange(B * nblk, dtype=torch.int32, device=device).view(B, nblk)
    slots = (block_tables.long()[:, :, None] * bs + torch.arange(bs, device=device)).view(B, -1)[:, :n]
    triton_ops.write_kv(k.view(B * n, KV, D), v.view(B * n, KV, D), k_cache, v_cache,
                        slots.reshape(-1).contiguous())
    qsl = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=device)
    seq_lens = torch.full((B,), n, dtype=torch.int32, device=device)
    scale = D ** -0.5
    ours = functools.partial(triton_ops.paged_attention, q, k_cache, v_cache, block_tables, qsl,
                             seq_lens, n, n, scale)
    q4 = q.view(B, n, H, D).transpose(1, 2)
    k4, v4 = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    sdpa = functools.partial(F.scaled_dot_product_attention, q4, k4, v4, is_causal=True, scale=scale,
                             enable_gqa=True)
    ref = sdpa().transpose(1, 2).reshape(B * n, H, D)
    ok, err = _close(ours(), ref)
    t_ours, t_sdpa = _time_ms(ours, device), _time_ms(sdpa, device)
    flops = 4 * B * H * D * n * n / 2  # QK^T and PV over the causal half
    print(f"{name:14} {f'{B}x{n}':>9} {t_ours:>8.4f} {t_sdpa:>8.4f} {t_sdpa / t_ours:>8.2f}x "
          f"{flops / (t_ours / 1e3) / 1e12:>8.1f} {err:>7.1e}")
    if not ok:
        _die(f"prefill output differs from SDPA by {err:.3g} ({name}, {B}x{n})")


def _tile_sweep(device, ctx: int, bs: int, dtype) -> None:
    """Single-pass decode time vs keys per inner step (tile_n), for the future tuner."""
    import torch
    from goodput.worker.model.attention import triton_ops

    print("tile_n sweep (smollm2 shape, single pass, ms):")
    H, KV, D = 9, 3, 64
    for B in (16, 256):
        nblk = -(-ctx // bs)
        k_cache = torch.randn((B * nblk, bs, KV, D), device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        block_tables = torch.randperm(B * nblk, device=device).to(torch.int32).view(B, nblk)
        q = torch.randn((B, H, D), device=device, dtype=dtype)
        qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
        seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        row = []
        for tn in (16, 32, 64, 128):
            run = functools.partial(triton_ops.paged_attention, q, k_cache, v_cache, block_tables,
                                    qsl, seq_lens, 1, ctx, D ** -0.5, num_kv_splits=1, tile_n=tn)
            row.append(f"tile_n={tn}: {_time_ms(run, device):.4f}")
        print(f"  B={B}: " + ", ".join(row))


# ------------------------------------------------------------------------------------------
# Engine: end-to-end greedy tokens and decode-step benchmark
# ------------------------------------------------------------------------------------------
def _engine(model: str, dtype: str, device: str, backend: str, kv_bytes: int, max_num_seqs: int = 8,
            max_num_batched_tokens: int = 512):
    from goodput.worker.engine_args import EngineArgs, build_engine
    return build_engine(EngineArgs(
        model=model, dtype=dtype, device=device, attention_backend=backend,
        kv_cache_memory=kv_bytes, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False))


def _greedy(engine, max_tokens: int) -> list[list[int]]:
    from goodput.worker.engine.sampling_params import SamplingParams
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [ids for ids, _, _ in engine.generate(prompts, params)]


def e2e(args) -> None:
    device = _device(args.smoke)
    n = 2 if args.smoke else args.max_tokens
    runs = [("cpu fp32 torch (reference)", "float32", "cpu", "torch")]
    runs += [(f"{device.type} fp32 triton", "float32", device.type, "triton"),
             (f"{device.type} bf16 triton", "bfloat16", device.type, "triton"),
             (f"{device.type} bf16 torch", "bfloat16", device.type, "torch")]
    results = {}
    for label, dtype, dev, backend in runs:
        t0 = time.perf_counter()
        # A 8-token budget chunk-prefills the prompts alongside the others' decodes (mixed batches).
        engine = _engine(args.model, dtype, dev, backend, 64 << 20, max_num_batched_tokens=8)
        results[label] = _greedy(engine, n)
        print(f"{label:28} done in {time.perf_counter() - t0:.1f} s")
        del engine
    ref = results[runs[0][0]]
    failed = False
    print(f"greedy tokens, {n} per prompt; 'same' = common prefix with the CPU fp32 reference")
    for label, *_ in runs[1:]:
        same = []
        for a, b in zip(ref, results[label]):
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            same.append(k)
        exact = all(k == n for k in same)
        print(f"  {label:28} same {same} of {n}: {'IDENTICAL' if exact else 'diverges'}")
        if "fp32 triton" in label and not exact:
            failed = True
    for i, p in enumerate(PROMPTS):
        print(f"  prompt {i} {p!r}: ref {ref[i]}")
    if failed:
        _die("fp32 Triton greedy tokens differ from the CPU fp32 reference")


def _weight_bytes(obj, skip_ids: set[int]) -> int:
    """Bytes of every distinct tensor reachable from obj's attributes (weights), minus skip_ids."""
    import torch
    seen: set[int] = set()
    total = 0
    stack, visited = [obj], set()
    while stack:
        o = stack.pop()
        if id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, torch.Tensor):
            key = o.untyped_storage().data_ptr()
            if key not in seen and key not in skip_ids:
                seen.add(key)
                total += o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            stack.extend(vars(o).values())
    return total


def decode_bench(args) -> None:
    import torch
    from goodput.worker.engine.outputs import ScheduledChunk, SchedulerOutput
    from goodput.worker.engine.sampling_params import SamplingParams

    device = _device(args.smoke)
    bw = copy_bandwidth(device, args.smoke)
    batches = [1, 2] if args.smoke else [1, 16, 64, 256]
    ctx = 32 if args.smoke else 1024
    steps = 2 if args.smoke else 20
    bs = 16
    nblk = -(-(ctx + steps + 1) // bs)
    max_b = max(batches)
    dtype = "float32" if args.smoke else "bfloat16"
    from goodput.worker.model.runner import ModelRunner
    runner = ModelRunner(args.model, dtype=dtype, device=device.type, block_size=bs,
                         num_blocks=max_b * nblk, attention_backend="triton")
    if runner.attention_backend.name != "triton":
        _die(f"runner picked attention backend {runner.attention_backend.name!r}, not triton")
    mc = runner.model_config
    per_tok = runner.kv_bytes_per_token
    cache_ids = set()
    for t in _iter_tensors(getattr(runner, "kv_caches", None)):
        cache_ids.add(t.untyped_storage().data_ptr())
    wbytes = _weight_bytes(getattr(runner, "model", runner), cache_ids)
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s; weights {wbytes / 1e6:.1f} MB; "
          f"KV {per_tok} bytes/token; context {ctx}, {dtype}, Triton attention")
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = mc.vocab_size
    print(f"{'B':>4} {'step ms':>9} {'tok/s':>9} {'MB/step':>9} {'TB/s':>6} {'%copyBW':>8}")
    for B in batches:
        tables = [tuple(range(i * nblk, (i + 1) * nblk)) for i in range(B)]
        # Prefill every sequence to `ctx` tokens (16 sequences per step), then decode.
        last = {}
        for s in range(0, B, 16):
            chunks = []
            for i in range(s, min(B, s + 16)):
                ids = torch.randint(0, vocab, (ctx,), generator=g).tolist()
                chunks.append(ScheduledChunk(f"r{i}", tuple(ids), 0, tables[i], True, greedy, 0))
            out = runner.execute(SchedulerOutput(chunks=chunks, num_batched_tokens=ctx * len(chunks)))
            last.update(out.sampled_token_ids)
        pos = ctx
        times = []
        for step in range(steps):
            chunks = [ScheduledChunk(f"r{i}", (last[f"r{i}"],), pos, tables[i], True, greedy, step + 1)
                      for i in range(B)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = runner.execute(SchedulerOutput(chunks=chunks, num_batched_tokens=B))
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            last.update(out.sampled_token_ids)
            pos += 1
        step_s = statistics.median(times[1:] if len(times) > 2 else times)
        kv = B * (ctx + steps // 2) * per_tok
        total = wbytes + kv
        print(f"{B:>4} {step_s * 1e3:>9.3f} {B / step_s:>9.1f} {total / 1e6:>9.1f} "
              f"{total / step_s / 1e12:>6.2f} {100 * total / step_s / bw:>7.1f}%")


def _iter_tensors(obj):
    import torch
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m goodput.bench.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["e2e", "kernel-bench", "decode-bench"])
    ap.add_argument("--model", default=os.environ.get("GOODPUT_MODEL", "smollm2"),
                    help="GGUF path or 'smollm2' (the bundled model); env GOODPUT_MODEL")
    ap.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per prompt (e2e)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; allows a CPU (interpreter)")
    args = ap.parse_args(argv)
    {"e2e": e2e, "kernel-bench": kernel_bench, "decode-bench": decode_bench}[args.what](args)


if __name__ == "__main__":
    main()
