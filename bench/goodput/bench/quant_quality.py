"""Quality and speed of ``--quantization none|int8|int4`` against the bf16 reference.

For each configuration (dtype, quantization, what the LM head gets) on the same GGUF:

- perplexity on ``bench/data/quant-eval/text.txt`` (one prefill, next-token cross-entropy over every
  position, ``exp(mean NLL)``);
- greedy agreement with the reference (bf16, no quantization) over a fixed prompt set of N
  prompts × M tokens: *teacher-forced* top-1 agreement (the configuration reads the reference's
  own continuation and predicts each next token: matches / (N·M), so one early divergence does not
  hide the rest) and *free-running* (each generates M tokens itself: mean length of the common
  prefix with the reference, and how many of the N continuations are identical);
- the largest |Δ logit| against the reference of the same dtype over the teacher-forced rows;
- decode step time at batch 1 and 32 (median of timed ``ModelRunner.execute`` steps, sampling
  included, after warm-up), the weight bytes a step reads, and a ``torch.profiler`` table of the
  ops that take the step's time.

Writes ``<out>.md`` and ``<out>.json``. Usage::

    python -m goodput.bench.quant_quality --out bench/results/2026-12-01-quant --threads 1
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

from goodput.bench.prompts import FIXED_PROMPTS

TEXT = Path(__file__).resolve().parents[2] / "data" / "quant-eval" / "text.txt"

PROMPTS = FIXED_PROMPTS

# name, dtype, --quantization, LM-head override (None: the quantization's default)
CONFIGS = [
    ("bf16 (reference)", "bfloat16", "none", None),
    ("int8", "bfloat16", "int8", None),
    ("int8, bf16 LM head", "bfloat16", "int8", "none"),
    ("int4", "bfloat16", "int4", None),
    ("int4, int8 LM head", "bfloat16", "int4", "int8"),
    ("fp32", "float32", "none", None),
    ("int4 fp32", "float32", "int4", None),
]


def _runner(dtype: str, quantization: str, head: str | None, num_blocks: int):
    from goodput.worker.model.llama import _Linear
    from goodput.worker.model.quant import make_linear
    from goodput.worker.model.runner import ModelRunner

    r = ModelRunner("smollm2", dtype=dtype, quantization=quantization, num_blocks=num_blocks,
                    block_size=16, attention_backend="torch")
    m = r.model
    if head is not None and head != m.lm_head_quantization:
        if not m.config.tie_word_embeddings:
            raise SystemExit("LM-head override is written for a tied embedding")
        m.lm_head = (_Linear(m.embed, m.prepacked) if head == "none"
                     else make_linear(head, m.embed, m.dtype))
        m.lm_head_quantization = head
    return r


def weight_bytes(model) -> int:
    """Bytes of every linear's stored weights (+ scales/zeros): what one decode step reads."""
    total = 0
    for lin in [x for layer in model.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]:
        for name in ("weight", "packed", "qweight", "scales", "scales_zeros"):
            t = getattr(lin, name, None)
            if t is not None and hasattr(t, "element_size"):
                if getattr(t, "is_mkldnn", False):
                    total += lin.out_features * lin.in_features * 2
                else:
                    total += t.numel() * t.element_size()
    return total


def _chunk(rid, ids, start, blocks, sample=False):
    from goodput.worker.engine.outputs import ScheduledChunk
    from goodput.worker.engine.sampling_params import SamplingParams
    return ScheduledChunk(rid, tuple(ids), start, tuple(blocks), sample, SamplingParams(temperature=0.0))


def _blocks(i: int, per: int) -> list[int]:
    return list(range(i * per, (i + 1) * per))


def perplexity(r, ids: list[int]) -> float:
    import torch
    from goodput.worker.engine.outputs import SchedulerOutput
    per = -(-len(ids) // 16)
    logits = r.forward_logits(SchedulerOutput([_chunk("ppl", ids, 0, _blocks(0, per))]))["ppl"]
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def greedy(r, prompts: list[list[int]], m: int) -> list[list[int]]:
    """Free-running greedy continuations of M tokens (KV cache, one batch)."""
    from goodput.worker.engine.outputs import SchedulerOutput
    per = -(-max(len(p) + m for p in prompts) // 16)
    out: list[list[int]] = [[] for _ in prompts]
    chunks = [_chunk(str(i), p, 0, _blocks(i, per)) for i, p in enumerate(prompts)]
    for step in range(m):
        logits = r.forward_logits(SchedulerOutput(chunks))
        for i in range(len(prompts)):
            out[i].append(int(logits[str(i)][-1].argmax()))
        chunks = [_chunk(str(i), [out[i][-1]], len(p) + step, _blocks(i, per))
                  for i, p in enumerate(prompts)]
    return out


def teacher_forced(r, prompts: list[list[int]], conts: list[list[int]]):
    """Logits [N, M, V] predicting each token of the reference continuations."""
    import torch
    from goodput.worker.engine.outputs import SchedulerOutput
    per = -(-max(len(p) + len(c) for p, c in zip(prompts, conts)) // 16)
    out = r.forward_logits(SchedulerOutput(
        [_chunk(str(i), p + c, 0, _blocks(i, per)) for i, (p, c) in enumerate(zip(prompts, conts))]))
    return torch.stack([out[str(i)][len(p) - 1:len(p) - 1 + len(c)] for i, (p, c) in
                        enumerate(zip(prompts, conts))])


def step_times(r, batch: int, steps: int, prompt: list[int], profile_steps: int = 5):
    """Median decode step (s) at ``batch`` after a prefill and 3 warm-up steps, and the
    profiler's top ops over ``profile_steps`` more steps (self CPU ms per step)."""
    from goodput.worker.engine.outputs import SchedulerOutput
    total = 3 + steps + profile_steps
    per = -(-(len(prompt) + total + 1) // 16)
    r.execute(SchedulerOutput([_chunk(str(i), prompt, 0, _blocks(i, per), True) for i in range(batch)]))
    pos = len(prompt)
    last = [prompt[-1]] * batch

    def one():
        nonlocal pos
        out = r.execute(SchedulerOutput([_chunk(str(i), [last[i]], pos, _blocks(i, per), True)
                                         for i in range(batch)]))
        for i in range(batch):
            last[i] = out.sampled_token_ids[str(i)]
        pos += 1

    for _ in range(3):
        one()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profile_steps):
            one()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [(e.key, e.self_cpu_time_total / 1000 / profile_steps, e.count // profile_steps) for e in rows[:6]]
    return statistics.median(times), top


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output path without suffix (.md and .json are written)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--tokens", type=int, default=32, help="M: greedy tokens per prompt")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--configs", default=None, help="indices into CONFIGS to run (default: all; 0 first)")
    ap.add_argument("--machine-note", default="", help="how busy the machine was (goes into the report)")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    batches = [int(x) for x in a.batches.split(",")]

    results = []
    ref_conts = ref_logits = None
    fp32_logits = None
    chosen = CONFIGS if a.configs is None else [CONFIGS[int(i)] for i in a.configs.split(",")]
    for name, dtype, quant, head in chosen:
        t0 = time.perf_counter()
        r = _runner(dtype, quant, head, num_blocks=16 * max(len(PROMPTS), max(batches)) + 64)
        load_s = time.perf_counter() - t0
        tok = r.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS]
        text_ids = tok.encode(TEXT.read_text())
        row = {"name": name, "dtype": dtype, "quantization": quant, "lm_head": r.model.lm_head_quantization,
               "load_s": round(load_s, 1), "weight_bytes": weight_bytes(r.model),
               "ppl": perplexity(r, text_ids), "ppl_tokens": len(text_ids)}
        if ref_conts is None:
            ref_conts = greedy(r, prompts, a.tokens)
        tf = teacher_forced(r, prompts, ref_conts)
        ref = torch.tensor(ref_conts)
        row["tf_agree"] = float((tf.argmax(-1) == ref).float().mean())
        if ref_logits is None:
            ref_logits = tf
        if dtype == "float32" and fp32_logits is None:
            fp32_logits = tf
        same = fp32_logits if dtype == "float32" else ref_logits
        row["max_abs_dlogit_same_dtype"] = float((tf - same).abs().max())
        gen = ref_conts if quant == "none" and dtype == "bfloat16" else greedy(r, prompts, a.tokens)
        prefix = [next((j for j, (x, y) in enumerate(zip(g, c)) if x != y), len(c)) for g, c in zip(gen, ref_conts)]
        row["free_prefix_mean"] = statistics.mean(prefix)
        row["free_identical"] = sum(p == a.tokens for p in prefix)
        row["sample"] = tok.decode(gen[2])
        row["steps"] = {}
        for b in batches:
            med, top = step_times(r, b, a.steps, prompts[2])
            row["steps"][b] = {"median_ms": med * 1000, "top_ops": top}
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
        del r

    meta = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "threads": a.threads,
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "N": len(PROMPTS), "M": a.tokens, "note": a.machine_note}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    out.with_suffix(".md").write_text(report(meta, results, batches))
    print(f"wrote {out}.md and {out}.json")
    return 0


def report(meta: dict, results: list[dict], batches: list[int]) -> str:
    ref = results[0]
    lines = [
        "| config | LM head | weight bytes/step | PPL (Δ vs bf16) | teacher-forced agreement | "
        "free-run: mean common prefix / identical | max abs Δlogit (same dtype) | "
        + " | ".join(f"step ms B={b}" for b in batches) + " |",
        "|---" * (7 + len(batches)) + "|",
    ]
    for r in results:
        d = r["ppl"] - ref["ppl"]
        lines.append(
            f"| {r['name']} | {r['lm_head']} | {r['weight_bytes'] / 1e6:.1f} MB | {r['ppl']:.3f} ({d:+.3f}) | "
            f"{r['tf_agree'] * 100:.1f}% | {r['free_prefix_mean']:.1f} / {r['free_identical']} of {meta['N']} | "
            f"{r['max_abs_dlogit_same_dtype']:.4f} | "
            + " | ".join(f"{r['steps'][b]['median_ms']:.1f}" for b in batches) + " |")
    prof = []
    for r in results:
        for b in batches:
            ops = "; ".join(f"{k} {ms:.1f} ms ×{n}" for k, ms, n in r["steps"][b]["top_ops"])
            prof.append(f"- **{r['name']}, B={b}**: {ops}")
    return "\n".join([
        f"Measured {meta['date_utc']} UTC, torch {meta['torch']}, {meta['threads']} thread(s) on a "
        f"{meta['cores']}-core machine. {meta['note']}",
        "",
        f"Agreement is with the bf16 reference's greedy tokens over N = {meta['N']} prompts × M = "
        f"{meta['M']} tokens (`PROMPTS` in `bench/goodput/bench/quant_quality.py`); perplexity on "
        f"`bench/data/quant-eval/text.txt` ({ref['ppl_tokens']} tokens).",
        "",
        *lines,
        "",
        "Profile (torch.profiler, self CPU time per decode step, top ops):",
        "",
        *prof,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
