"""One long prompt's prefill in-process, the cpu backend's C++ prefill kernel against the torch path,
interleaved, with where the time goes.

    python -m goodput.bench.prefill_profile --tokens 8000 --chunk 512 --threads 1 --clock cpu --repeats 3
    python -m goodput.bench.prefill_profile --threads 2 --clock wall --no-breakdown

A real ``ModelRunner`` (bfloat16, ``cpu`` attention backend) prefills ``--tokens`` random token ids in
chunks of ``--chunk`` (the engine's default token budget is 512: a prompt alone in the server is
prefilled in chunks of that many tokens) on a random permutation of KV blocks, through
``LlamaModel.forward`` with the step metadata the runner would build; the last chunk computes the
logits of its last row only. Per repeat, each mode once: ``old`` (``native_prefill`` off: gather
+ SDPA per chunk) then ``new`` (``csrc/paged_prefill.cpp``); medians reported, with the GEMM bound
of ``perf.prefill_bound_s`` at ``--peak-gflops`` as a fraction of each.

``--clock cpu`` times process CPU seconds: with ``--threads 1`` that is the prefill's own work,
which the other processes of a shared machine barely change (wall time under a load of 3-7 on 2
cores was 4-10x the quiet figure, with OpenMP threads spinning). The breakdown wraps the linears'
matmuls, the attention backend (``forward``, ``write_kv``), and the fused layer ops (norms, RoPE,
SiLU·up) with timers; "other" is the rest (embedding, RoPE table, Python).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per step)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="old,new", help="comma list of old (torch path), new (C++ kernel)")
    ap.add_argument("--peak-gflops", type=float, default=1643.0, help="bf16 GEMM peak of the bound (2 cores)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    a = ap.parse_args(argv)

    import torch
    torch.set_num_threads(a.threads)
    from goodput.worker.model.attention.base import AttentionMetadata
    from goodput.worker.model.runner import ModelRunner

    from .decode_steps import _Timed

    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    bs = 16
    # twice the prompt's blocks, so the table below is a random pick of the pool
    r = ModelRunner("smollm2", dtype="bfloat16", attention_backend="cpu", block_size=bs,
                    num_blocks=2 * -(-a.tokens // bs) + 8)
    m, be = r.model, r.attention_backend
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, r.model_config.vocab_size - 100, (a.tokens,), generator=gen)
    table = torch.randperm(r.num_blocks, generator=gen)[: -(-a.tokens // bs)].tolist()

    acc: dict[str, float] = {}
    attend = be  # what forward gets: the backend, or its timed stand-in
    if a.breakdown:  # decode_steps' stand-ins, on this clock
        for ly in m.layers:
            for nm in ("qkv", "o", "gate_up", "down"):
                setattr(ly, nm, _Timed(getattr(ly, nm), acc, "linears", clock=clock))
        m.lm_head = _Timed(m.lm_head, acc, "lm_head", clock=clock)
        attend = _Timed(be, acc, None, {"forward": "attention", "write_kv": "write_kv"}, clock=clock)
        if m.fused_ops is not None:
            m.fused_ops = _Timed(m.fused_ops, acc, None, dict.fromkeys(
                ("rms_norm", "add_rms_norm_", "rope_", "silu_mul"), "norms_rope_silu"), clock=clock)

    def prefill(n: int):
        t0 = clock()
        for s in range(0, n, a.chunk):
            e = min(n, s + a.chunk)
            nb = -(-e // bs)
            meta = AttentionMetadata(
                query_start_loc=torch.tensor([0, e - s], dtype=torch.int32),
                seq_lens=torch.tensor([e], dtype=torch.int32), context_lens=torch.tensor([s], dtype=torch.int32),
                block_tables=torch.tensor([table[:nb]], dtype=torch.int32),
                slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in range(s, e)], dtype=torch.int64),
                max_query_len=e - s, max_seq_len=e, query_start_loc_list=[0, e - s], seq_lens_list=[e])
            logits = m.forward(ids[s:e], torch.arange(s, e), meta, r.kv_caches, attend,
                               logits_indices=torch.tensor([e - s - 1]))
        return clock() - t0, logits

    from goodput.bench.perf import prefill_bound_s
    from goodput.bench.roofline import model_shape
    bound = prefill_bound_s(model_shape(r.model_path), a.tokens, a.peak_gflops * 1e9)
    modes = a.modes.split(",")
    prefill(min(a.tokens, 2 * a.chunk))  # warm-up: kernels' first calls, allocator
    tot = {md: [] for md in modes}
    parts = {md: collections.defaultdict(float) for md in modes}
    last = {}
    for i in range(a.repeats):
        for md in modes:
            be.native_prefill = md == "new"
            acc.clear()
            t, last[md] = prefill(a.tokens)
            tot[md].append(t)
            for k, v in acc.items():
                parts[md][k] += v
            print(f"repeat {i} {md}: {t:.3f} s, load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    print(f"{a.tokens} tokens in chunks of {a.chunk}, {a.threads} thread(s), {a.clock} seconds; "
          f"GEMM bound {bound:.3f} s at {a.peak_gflops:.0f} GFLOP/s")
    for md in modes:
        med = statistics.median(tot[md])
        # the bound is for the 2 cores: at 1 thread, CPU seconds / 2 is the quiet 2-core estimate
        est = med / 2 if a.clock == "cpu" and a.threads == 1 else med
        print(f"{md}: median {med:.3f} s (all {', '.join(f'{x:.3f}' for x in tot[md])}); "
              f"bound / {'(median / 2)' if est != med else 'median'} = {100 * bound / est:.0f}%")
        if a.breakdown:
            shown = 0.0
            for k, v in sorted(parts[md].items(), key=lambda x: -x[1]):
                print(f"  {k:16s} {v / a.repeats:7.3f} s  {100 * v / a.repeats / med:3.0f}%")
                shown += v / a.repeats
            print(f"  {'other':16s} {med - shown:7.3f} s")
    if len(modes) == 2:
        x, y = (last[md].float() for md in modes)
        print(f"last position's logits: max |old - new| {(x - y).abs().max().item():.3f}, "
              f"argmax {int(x.argmax())} / {int(y.argmax())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
