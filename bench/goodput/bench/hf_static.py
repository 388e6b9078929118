"""HF transformers static batching baseline (in-process, no server).

Static batching as a user of plain `transformers` would do it: take the next B queued requests,
left-pad them into one batch, `generate` until the LONGEST of them has its tokens (greedy; EOS
suppressed with min_new_tokens so every request gets exactly its max_tokens, like --ignore-eos),
then take the next cohort. Output tokens counted = each request's own max_tokens (the padding
rows that keep decoding after a short request is done are wasted work, which is the point).
Weights: transformers' GGUF loader dequantizes the same GGUF file to the chosen dtype.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--specs", required=True,
                   help="JSON file: a list of {prompt, max_tokens} (run at every --batch-sizes), or "
                        "{\"jobs\": [{\"batch\": B, \"specs\": [...]}, ...]} (one model load for all)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--max-requests", type=int, default=None, help="per batch size (default: all)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", required=True, help="JSON result path")


def load_model(model: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .prompts import resolve_model
    path = resolve_model(model)
    d, f = os.path.dirname(path), os.path.basename(path)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype))
    m.eval()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return m, tok


def run_static(m, tok, specs: list[dict], batch: int) -> dict:
    """Serve `specs` in cohorts of `batch`; returns tokens, wall time, tok/s and slot utilization
    (useful tokens / (rows x decode steps))."""
    import torch
    t0 = time.perf_counter()
    useful = slots = 0
    cohorts = []
    for i in range(0, len(specs), batch):
        cohort = specs[i:i + batch]
        n_new = max(s["max_tokens"] for s in cohort)
        enc = tok([s["prompt"] for s in cohort], return_tensors="pt", padding=True)
        c0 = time.perf_counter()
        with torch.inference_mode():
            out = m.generate(**enc, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        assert out.shape[1] - enc["input_ids"].shape[1] == n_new
        useful += sum(s["max_tokens"] for s in cohort)
        slots += len(cohort) * n_new
        cohorts.append({"size": len(cohort), "steps": n_new, "seconds": time.perf_counter() - c0})
    wall = time.perf_counter() - t0
    return {"batch": batch, "requests": len(specs), "output_tokens": useful, "seconds": wall,
            "output_token_throughput": useful / wall, "slot_utilization": useful / slots if slots else None,
            "cohorts": cohorts}


def main(a: argparse.Namespace) -> None:
    import torch
    with open(a.specs) as f:
        specs = json.load(f)
    t = time.perf_counter()
    m, tok = load_model(a.model, a.dtype)
    res = {"dtype": a.dtype, "threads": torch.get_num_threads(), "load_seconds": time.perf_counter() - t,
           "points": []}
    run_static(m, tok, [{"prompt": "warm up", "max_tokens": 4}], 1)
    if isinstance(specs, dict):
        jobs = [(j["batch"], j["specs"]) for j in specs["jobs"]]
    else:
        jobs = [(int(x), specs) for x in a.batch_sizes.split(",")]
    for b, sp in jobs:
        sp = sp if a.max_requests is None else sp[: a.max_requests]
        r = run_static(m, tok, sp, b)
        print(f"HF static B={b}: {r['output_token_throughput']:.1f} out tok/s, "
              f"slot utilization {r['slot_utilization']:.2f}", file=sys.stderr)
        res["points"].append(r)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
