"""CPU decode performance against llama.cpp's own server, HF static batching and the roofline.

    bash bench/run_perf.sh                     # = python -m goodput.bench perf
    python -m goodput.bench perf --quick       # smoke scale (a few minutes)

One run, back to back on this machine, writes ``bench/results/<date>-cpu.md`` (``--name``) and
the raw JSON beside it (``bench/results/raw/<date>-perf/``, not committed):

1. Side by side, closed loop at 1, 8 and 32 streams, the same requests for every system: the
   four ~15-word prompts of :data:`PROMPTS` in turn, output lengths drawn uniformly from 16–256
   (seeded) and forced with ``ignore_eos``, greedy. Systems: our worker with default flags
   (bf16), plus ``--quantization int8`` / ``int4`` rows when ``goodput-worker serve --help``
   offers that flag; llama.cpp's ``llama-server`` restarted per point with ``--parallel`` = the
   streams and ``-c`` = streams × the per-slot need, same thread count, same GGUF
   (``llama_server.py``); llama-cpp-python's server as an extra row when its venv is already
   built; HF transformers static batching (``hf_static.py``, bf16). Throughput = forced output
   tokens of the completed requests / (last end − first send). Beside each: the weight bytes
   its decode step reads (``step_bytes.py``; ours also measured from the loaded model).
2. Roofline (``roofline.py``): read bandwidth and bf16 GEMM peak measured first, before any
   server starts; the bound of a decode step at batch B = max(bytes / bandwidth, FLOPs / peak)
   with bytes = weights + B × KV at the workload's mean decode context; % of bound = measured
   tok/s over bound tok/s, for the servers (closed loop at C = B) and for our runner alone
   (in-process decode steps, ``decode_steps.py``).
3. Context growth: our decode step in-process at batch 1 and 16 for 512, 2k and 8k tokens of
   context (KV bytes = 2·L·n_kv·d_head·bytes·T per sequence); a point is flagged when its extra
   time over the shortest context exceeds :data:`GROWTH_FLAG_FACTOR` × what its extra bytes (or
   FLOPs) explain at the measured bandwidth (peak).

Targets (ratios; none asserted): 1 stream ours ≥ 1.0× llama-server; 32 streams ours ≥ 2.5×
llama-server and ≥ 2× HF static; ≥ 50% of the bound at batch 32; no flagged context point.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import time

from .report import fmt, fmt_mb, fmt_pct, fmt_ratio
from .step_bytes import gguf_weight_bytes, kv_bytes_per_step, ours_weight_bytes

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), *[".."] * 3))

#: four ~15-word prompts, sent in turn
PROMPTS = (
    "Write a short story about a small robot who learns to paint in a quiet seaside village.",
    "Explain in simple words why the sky looks blue on a clear afternoon in the summer.",
    "List some practical tips for staying focused and calm while working from home every day.",
    "Describe how a bicycle works, from the pedals and the chain to the back wheel.",
)
#: a context point is flagged when its extra step time exceeds this multiple of what its extra
#: bytes explain at the measured bandwidth
GROWTH_FLAG_FACTOR = 2.0
#: the performance plan's targets: (key, label, goal). Ratios are ours / the other system at the
#: same stream count in the same run; % rows are a bound's time over the measured time. Batch 32 is
#: given three ways: the in-process step (the runner), the server while all 32 streams are in flight,
#: and the server's whole closed loop, whose drain runs smaller batches (32 streams, 64 requests).
TARGETS = (
    ("c1_vs_llama", "1 stream: ours / llama-server", 1.5),
    ("roof1", "1 stream: % of the bandwidth bound of the bytes it reads (server)", 0.50),
    ("c32_vs_llama", "32 streams: ours / llama-server", 4.0),
    ("c32_vs_hf", "32 streams: ours / HF static", 2.5),
    ("roof32_runner", "batch 32: % of the roofline bound (in-process step)", 0.40),
    ("roof32_full", "batch 32: % of the roofline bound (server, all 32 streams in flight)", 0.40),
    ("roof32", "batch 32: % of the roofline bound (server, whole closed loop)", 0.40),
    ("prefill8k", "prefill of 8,000 tokens: % of the GEMM bound (server TTFT)", 0.50),
)
PERCENT_TARGETS = ("roof", "prefill")  # keys shown as % (the rest as ×)
OURS_ROWS = {"none": "goodput bf16", "int8": "goodput int8", "int4": "goodput int4"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--date", default=_dt.datetime.now(_dt.timezone.utc).date().isoformat())
    p.add_argument("--name", default=None, help="results file stem (default: <date>-cpu)")
    p.add_argument("--results-dir", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--requests", default="1:4,8:16,32:64",
                   help="requests per point as C:N pairs (scaled by --scale; at least C)")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--quick", action="store_true",
                   help="smoke scale: --scale 0.25, contexts 256,1024, 3 repeats")
    p.add_argument("--output-len", default="16:256")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads for every system (ours --num-threads, llama-server -t/-tb, HF torch)")
    p.add_argument("--systems", default="auto",
                   help="comma list of goodput,goodput-int8,goodput-int4,llama-server,llama-cpp-python,hf "
                        "(auto: every one available)")
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--context-batches", default="1,16")
    p.add_argument("--roofline-batches", default="1,32")
    p.add_argument("--repeats", type=int, default=8, help="timed decode steps per in-process shape")
    p.add_argument("--skip-context", action="store_true")
    p.add_argument("--prefill", default="2048,8000",
                   help="prompt lengths (tokens) whose TTFT is measured, one request each ('' to skip)")
    p.add_argument("--note", default=None, help="a line for the results file (e.g. 'smoke run on a busy machine')")


# ----------------------------------------------------------------------------------------------
# pure helpers (unit-tested)

def parse_requests(spec: str, streams: list[int], scale: float) -> dict[int, int]:
    """'1:4,8:16' + streams -> {C: N}; N scaled and at least C; a C without a pair gets 2·C.
    ValueError on a malformed pair."""
    given = {}
    for part in filter(None, spec.split(",")):
        c, sep, n = part.partition(":")
        if not sep:
            raise ValueError(f"--requests wants C:N pairs, got {part!r}")
        given[int(c)] = int(n)
    return {c: max(c, int(round(given.get(c, 2 * c) * scale))) for c in streams}


def output_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """n output lengths uniform on [lo, hi] (inclusive), seeded."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def mean_decode_context(prompt_tokens: list[int], output_tokens: list[int]) -> float:
    """Mean KV length a decode step attends to over a workload: request r's decode steps
    k = 1..o_r - 1 (the first token comes from prefill) attend to p_r + k tokens."""
    num = den = 0
    for p, o in zip(prompt_tokens, output_tokens):
        steps = max(0, o - 1)
        num += steps * p + steps * (steps + 1) // 2
        den += steps
    return num / den if den else 0.0


def step_bound(weight_bytes: float, kv_bytes_per_token: float, batch: int, ctx: float,
               flops_per_token: float, peak_flops: float, bandwidth: float) -> dict:
    """Roofline of one decode step: bytes = weights + batch·ctx·kv_bytes_per_token, FLOPs =
    batch·flops_per_token(ctx); returns seconds of each limit, the bound and its tok/s."""
    nbytes = weight_bytes + batch * ctx * kv_bytes_per_token
    t_mem = nbytes / bandwidth
    t_cmp = batch * flops_per_token / peak_flops
    t = max(t_mem, t_cmp)
    return {"bytes": nbytes, "t_mem_s": t_mem, "t_compute_s": t_cmp, "bound_s": t, "bound_tok_s": batch / t}


def flops_per_token(shape: dict, ctx: float) -> float:
    """2·(matmul params) + attention QK^T and PV: 4·L·ctx·H·d_head."""
    return 2 * shape["matmul_params"] + 4 * shape["layers"] * ctx * shape["heads"] * shape["head_dim"]


def context_growth(points: list[dict], weight_bytes: float, kv_bytes_per_token: float, bandwidth: float,
                   shape: dict, peak_flops: float, factor: float = GROWTH_FLAG_FACTOR) -> list[dict]:
    """Per (batch, ctx) point: KV bytes, the bytes bound, and growth against the same batch's
    shortest context: extra time vs extra bytes / bandwidth (or extra FLOPs / peak, whichever
    is larger); ``flag`` when extra time > factor × that. points: {batch, ctx, step_s_median,
    optional step_s_min}; the growth compares the minima when given (the least disturbed
    estimate of each step's own cost on a shared machine), the rest uses the medians."""
    rows = []
    base = {}
    for p in sorted(points, key=lambda x: (x["batch"], x["ctx"])):
        b, t, step = p["batch"], p["ctx"], p["step_s_median"]
        best = p.get("step_s_min", step)
        kv = kv_bytes_per_token * t * b
        bound = step_bound(weight_bytes, kv_bytes_per_token, b, t, flops_per_token(shape, t), peak_flops,
                           bandwidth)
        row = {"batch": b, "ctx": t, "step_s": step, "step_min_s": best, "tok_s": b / step, "kv_bytes": kv,
               "bound_s": bound["bound_s"], "of_bound": bound["bound_s"] / step,
               "extra_s": None, "explained_s": None, "flag": False}
        if b in base:
            b0 = base[b]
            extra = best - b0["step_min_s"]
            explained = max((kv - b0["kv_bytes"]) / bandwidth,
                            b * (flops_per_token(shape, t) - flops_per_token(shape, b0["ctx"])) / peak_flops)
            row.update(extra_s=extra, explained_s=explained, flag=extra > factor * explained)
        else:
            base[b] = row
        rows.append(row)
    return rows


def prefill_bound_s(shape: dict, n_tokens: int, peak_flops: float) -> float:
    """Seconds a prefill of ``n_tokens`` needs at the GEMM peak: Σ over positions t < n of
    :func:`flops_per_token` at context t, i.e. n · flops_per_token(shape, (n − 1) / 2) (the
    attention term is linear in the context), less the LM head (2·vocab·d_model FLOPs) for all but
    the last position (a server computes logits for the token it samples only)."""
    head = 2 * shape.get("vocab", 0) * shape.get("d_model", 0)
    return (n_tokens * flops_per_token(shape, (n_tokens - 1) / 2) - (n_tokens - 1) * head) / peak_flops


def parse_proc_status(text: str) -> dict[str, float]:
    """Resident memory from a /proc/<pid>/status text (proc(5)): {"rss_mb": VmRSS, "peak_mb": VmHWM}
    in MB (10⁶ bytes; the file counts kB = 1024 bytes); keys absent when the lines are."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        name = {"VmRSS": "rss_mb", "VmHWM": "peak_mb"}.get(key)
        if name and rest.strip().endswith("kB"):
            out[name] = int(rest.split()[0]) * 1024 / 1e6
    return out


def _memory(pid: int) -> dict[str, float]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return parse_proc_status(f.read())
    except OSError:
        return {}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def full_batch_window(recs: list, c: int) -> tuple[int, float]:
    """(tokens, seconds) of a closed-loop run while all ``c`` of its streams were in flight: the
    union of the intervals in which ``c`` requests had been sent and not ended, and the output
    tokens that arrived inside them. recs: records with ``send_time``, ``end_time`` (None: never
    ended, counted as ending at the last end) and ``token_times`` (s, one clock). (0, 0.0) when
    ``c`` requests were never in flight at once."""
    ends = [r.end_time for r in recs if r.end_time is not None]
    last = max(ends, default=0.0)
    events = sorted([(r.send_time, 1) for r in recs] + [(r.end_time if r.end_time is not None else last, -1)
                                                         for r in recs], key=lambda e: (e[0], e[1]))
    windows, n, start = [], 0, None
    for t, step in events:          # ends before sends at one instant: a request replaced at once
        n += step                   # still dips below c for zero seconds, which adds nothing
        if n >= c and start is None:
            start = t
        elif n < c and start is not None:
            windows.append((start, t))
            start = None
    seconds = sum(b - a for a, b in windows)
    tokens = sum(1 for r in recs for t in r.token_times if any(a <= t <= b for a, b in windows))
    return tokens, seconds


def targets(side: dict, roof: dict, growth_rows: list[dict] | None, row: str,
            prefill: dict[int, float] | None = None) -> list[dict]:
    """The performance plan's targets (:data:`TARGETS`) for one of our rows: [{key, label, goal,
    value, met}] (value None = not measured). side: {system: {C: tok/s}}; roof: {system: {B:
    {"server": f, "server_full": f, "runner": f}}} (fractions of the roofline bound); prefill:
    {prompt tokens: fraction of the GEMM bound} of this row."""
    ours = side.get(row, {})
    llama = side.get("llama-server", {})
    hf = side.get("HF static", {})
    r1, r32 = ((roof.get(row) or {}).get(b) or {} for b in (1, 32))
    vals = {"c1_vs_llama": ratio(ours.get(1), llama.get(1)),
            "roof1": r1.get("server"),
            "c32_vs_llama": ratio(ours.get(32), llama.get(32)),
            "c32_vs_hf": ratio(ours.get(32), hf.get(32)),
            "roof32_runner": r32.get("runner"),
            "roof32_full": r32.get("server_full"),
            "roof32": r32.get("server"),
            "prefill8k": (prefill or {}).get(8000)}
    out = [{"key": k, "label": lab, "goal": g, "value": vals[k],
            "met": None if vals[k] is None else vals[k] >= g} for k, lab, g in TARGETS]
    if growth_rows is not None and row == "goodput bf16":
        flagged = [r for r in growth_rows if r["flag"]]
        out.append({"key": "growth", "label": "context growth: no step slower than its bytes explain",
                    "goal": None, "value": len(flagged), "met": not flagged if growth_rows else None})
    return out


# ----------------------------------------------------------------------------------------------
# rendering (pure: a results dict in, markdown out)

_f, _x, _pct, _mb = fmt, fmt_ratio, fmt_pct, fmt_mb


def _goal(t: dict) -> str:
    if t["key"] == "growth":
        return "0 flagged"
    return f"≥ {t['goal'] * 100:.0f}%" if t["key"].startswith(PERCENT_TARGETS) else f"≥ {t['goal']:g}×"


def _shown(t: dict) -> str:
    if t["value"] is None:
        return "not measured"
    if t["key"] == "growth":
        return f"{t['value']} flagged"
    return _pct(t["value"]) if t["key"].startswith(PERCENT_TARGETS) else _x(t["value"])


def render(res: dict) -> str:
    """The results markdown from the dict :func:`main` builds (see its keys there)."""
    m, side, systems = res["machine"], res["side_by_side"], res["systems"]
    streams = res["streams"]
    L = []
    L.append(f"# CPU decode performance vs llama.cpp's own server — {res['date']}\n")
    L.append(f"Machine: {m['cpu_count']} CPU cores ({m['cpu']}), {m['python']}, torch {m['torch']}; "
             f"model {res['model']} ({res['gguf_name']}). All systems run with {res['threads']} threads. "
             f"1/5/15-min load average before: {'/'.join(f'{x:.2f}' for x in res['load_before'])}, after: "
             f"{'/'.join(f'{x:.2f}' for x in res['load_after'])}; took {res['wall_s']:.0f} s.\n")
    if res.get("note"):
        L.append(res["note"] + "\n")
    L.append(f"Reproduce: `{res['command']}`.\n")
    L.append("Workload (every system gets the identical request list): closed loop; the four ~15-word "
             f"prompts of `perf.PROMPTS` in turn ({'/'.join(str(x) for x in res['prompt_tokens'])} tokens); "
             f"output lengths uniform {res['output_range'][0]}–{res['output_range'][1]} (seed {res['seed']}), "
             "forced with `ignore_eos`; greedy (temperature 0). Requests per point: "
             + ", ".join(f"{n} at {c} stream{'s' if int(c) > 1 else ''}" for c, n in res["requests"].items()) +
             f". Mean decode context {res['mean_ctx']:.0f} tokens. Throughput = forced output tokens of the "
             "completed requests / (last end − first send); the load generator shares the cores.\n")

    # targets
    L.append("## Targets\n")
    L.append("| goodput row | target | measured | goal | |\n|---|---|---|---|---|")
    for row, ts in res["targets"].items():
        for t in ts:
            mark = "–" if t["met"] is None else ("met" if t["met"] else "**missed**")
            L.append(f"| {row} | {t['label']} | {_shown(t)} | {_goal(t)} | {mark} |")
    L.append("")

    # side by side
    L.append("## 1. Side by side: output tokens/s\n")
    head = "| system | weight MB read / decode step | " + " | ".join(f"{c} stream{'s' if c > 1 else ''}"
                                                                      for c in streams) + " |"
    L.append(head + "\n|" + "---|" * (2 + len(streams)))
    for name in side:
        info = systems.get(name, {})
        cells = [_f(side[name].get(c)) for c in streams]
        L.append(f"| {name} | {_mb(info.get('weight_bytes'))} | " + " | ".join(cells) + " |")
    ours_rows = [r for r in side if r.startswith("goodput")]
    others = [r for r in side if not r.startswith("goodput")]
    if ours_rows and others:
        L.append("\nRatios (ours / other):\n")
        L.append("| ours | vs | " + " | ".join(str(c) for c in streams) + " |\n|" + "---|" * (2 + len(streams)))
        for o in ours_rows:
            for other in others:
                L.append(f"| {o} | {other} | " + " | ".join(_x(ratio(side[o].get(c), side[other].get(c)))
                                                            for c in streams) + " |")
    if res.get("side_notes"):
        L.append("\n" + "\n".join(f"- {n}" for n in res["side_notes"]))
    L.append("")

    # bytes
    L.append("### Weight bytes each system reads per decode step\n")
    L.append("Every linear once (q, k, v, o, gate, up, down × layers, and the LM head — tied to the "
             "embedding here, so the whole embedding matrix is read as the head), plus the norms; the "
             "embedding row gather (B rows) is not counted. Ours: formula (`step_bytes.ours_weight_bytes`) "
             "and the bytes of the loaded model's tensors; llama.cpp: the GGUF tensors' stored sizes.\n")
    L.append("| system | storage | formula MB | measured MB | LM head MB |\n|---|---|---|---|---|")
    for name, info in systems.items():
        L.append(f"| {name} | {info.get('storage', '')} | {_mb(info.get('formula_bytes'))} | "
                 f"{_mb(info.get('measured_bytes'))} | {_mb(info.get('lm_head_bytes'))} |")
    L.append("")

    # prefill
    if res.get("prefill"):
        lengths = sorted({n for v in res["prefill"].values() for n in v})
        pk = res["roofline"]["peak_flops"]
        L.append("## Prefill: time to first token of one long prompt\n")
        L.append("One request at a time, alone on its server, one output token; each prompt distinct text "
                 "(no prefix-cache hit). Tokens/s = prompt tokens / TTFT; % of the GEMM bound = the time the "
                 "prompt's FLOPs (every linear, plus attention over the growing context) need at the "
                 f"measured bf16 GEMM peak ({pk / 1e9:.0f} GFLOP/s) / TTFT.\n")
        L.append("| system | " + " | ".join(f"{n} tokens: TTFT s | tok/s | % of bound" for n in lengths)
                 + " |\n|" + "---|" * (1 + 3 * len(lengths)))
        for name, ttft in res["prefill"].items():
            cells = []
            for n in lengths:
                t = ttft.get(n)
                b = prefill_bound_s(res["shape"], n, pk) if res.get("shape") else None
                cells += [_f(t, 2), _f(n / t if t else None, 0), _pct(b / t if (t and b) else None)]
            L.append(f"| {name} | " + " | ".join(cells) + " |")
        if "llama-server" in res["prefill"]:
            for name, ttft in res["prefill"].items():
                if name.startswith("goodput"):
                    L.append(f"\n{name} / llama-server TTFT: " + ", ".join(
                        f"{n} tokens {_x(ratio(ttft.get(n), res['prefill']['llama-server'].get(n)))}"
                        for n in lengths) + " (≤ 1× is the goal)")
        L.append("")

    # resident memory
    if res.get("memory"):
        L.append("### Resident memory (MB, the server process's VmRSS / VmHWM from /proc)\n")
        L.append("Ours: one server for every stream count — after load (before any request), after the "
                 "last point, and the peak. llama-server: a server per stream count (`--parallel N`, its KV "
                 "sized for N), so after load and after its run for each N. HF static: not measured.\n")
        L.append("| system | after load | " + " | ".join(f"after {c} stream{'s' if c > 1 else ''}" for c in streams)
                 + " | peak |\n|" + "---|" * (3 + len(streams)))
        for name, mem in res["memory"].items():
            if name == "llama-server":
                loads = "/".join(_f(mem.get(f"load_c{c}"), 0) for c in streams)
                peak = max((v for k, v in mem.items() if k.startswith("peak") and v), default=None)
                L.append(f"| {name} | {loads} (N = {'/'.join(map(str, streams))}) | "
                         + " | ".join(_f(mem.get(f"after_c{c}"), 0) for c in streams) + f" | {_f(peak, 0)} |")
            else:
                L.append(f"| {name} | {_f(mem.get('after_load'), 0)} | "
                         + " | ".join(_f(mem.get(f"after_c{c}"), 0) for c in streams) + f" | {_f(mem.get('peak'), 0)} |")
        L.append("")

    # roofline
    bw, pk = res["roofline"]["bandwidth"], res["roofline"]["peak_flops"]
    mb = m["bandwidth"]
    L.append("## 2. Roofline\n")
    L.append(f"Measured first, with no server running ({res['threads']} threads): read bandwidth "
             f"{mb['read_gbs']:.1f} GB/s (fp32 sum), {mb.get('gemv_bf16_gbs', float('nan')):.1f} GB/s "
             f"(bf16 GEMV), copy {mb['copy_gbs']:.1f} GB/s; the bound uses **{bw / 1e9:.1f} GB/s**. "
             f"GEMM peak bf16 **{pk / 1e9:.0f} GFLOP/s** (fp32 {m['matmul_gflops']['float32']:.0f}; "
             f"decode-shaped [32 × 4096] bf16 {m['decode_linear_gflops_b32']['bfloat16']:.0f}). Bytes per step = "
             f"weights + B × KV at the mean decode context ({res['mean_ctx']:.0f} tokens; KV "
             f"{res['kv_bytes_per_token']:.0f} B/token in bf16/f16). Server % = closed-loop tok/s at C = B over "
             "the bound's tok/s, over the whole run (its drain runs smaller batches) and while all B streams "
             "were in flight (`perf.full_batch_window`); runner % = bound step / our in-process decode step.\n")
    L.append("| system | B | bytes MB | t_mem ms | t_compute ms | bound tok/s | server tok/s | server % | "
             "all B in flight: tok/s | % | runner step ms | runner % |\n|" + "---|" * 12)
    for r in res["roofline"]["rows"]:
        L.append(f"| {r['system']} | {r['batch']} | {_mb(r['bytes'])} | {_f(r['t_mem_s'] * 1e3)} | "
                 f"{_f(r['t_compute_s'] * 1e3, 2)} | {_f(r['bound_tok_s'], 0)} | {_f(r.get('server_tok_s'))} | "
                 f"{_pct(r.get('server_fraction'))} | {_f(r.get('server_full_tok_s'))} | "
                 f"{_pct(r.get('server_full_fraction'))} | "
                 f"{_f(r['runner_step_s'] * 1e3 if r.get('runner_step_s') else None)} | "
                 f"{_pct(r.get('runner_fraction'))} |")
    L.append("")

    # context growth
    L.append("## 3. How cost grows with context (goodput bf16, in-process decode steps)\n")
    g = res.get("context_growth")
    if not g:
        L.append(res.get("context_note") or "(not run)")
    else:
        L.append(f"Our runner ({g['attention_backend']}, {g['threads']} threads) executes decode steps of B "
                 "sequences whose KV cache already holds the context (random values, distinct blocks per "
                 f"sequence); median (and minimum) of {g['repeats']} steps. KV bytes = 2·L·n_kv·d_head·bytes·T·B "
                 f"= {g['kv_bytes_per_token']:.0f} B × T × B. Bound = (weights + KV) / bandwidth. Extra = minimum "
                 "step − the same batch's minimum step at the shortest context; explained = extra KV bytes / "
                 f"bandwidth (or extra attention FLOPs / peak); flagged when extra > {GROWTH_FLAG_FACTOR:g} × "
                 "explained.\n")
        L.append("| B | context | KV MB / step | step ms (min) | tok/s | bound ms | % of bound | extra ms | "
                 "explained ms | |\n|" + "---|" * 10)
        for r in g["rows"]:
            L.append(f"| {r['batch']} | {r['ctx']} | {_mb(r['kv_bytes'])} | {_f(r['step_s'] * 1e3)} "
                     f"({_f(r.get('step_min_s', r['step_s']) * 1e3)}) | "
                     f"{_f(r['tok_s'])} | {_f(r['bound_s'] * 1e3)} | {_pct(r['of_bound'])} | "
                     f"{_f(r['extra_s'] * 1e3 if r['extra_s'] is not None else None)} | "
                     f"{_f(r['explained_s'] * 1e3 if r['explained_s'] is not None else None)} | "
                     f"{'**slower than its bytes**' if r['flag'] else ''} |")
    L.append("")

    if res.get("profiles"):
        L.append("## 4. Where our decode step's time goes (torch.profiler, in-process)\n")
        L.append("The runner's decode step at the mean decode context, profiled over a few steps: wall time "
                 "per step, the summed self time of all torch ops and of goodput's C++ kernels (`goodput::*`), "
                 "the rest (Python, dispatch gaps and the profiler's own per-op cost), and the ops with the "
                 "most self time.\n")
        for row, profs in res["profiles"].items():
            for pr in profs:
                wall = pr["wall_ms"]
                L.append(f"**{row}, B = {pr['batch']}**: {wall:.1f} ms/step, ops {pr['ops_self_ms']:.1f} ms, "
                         f"outside ops {wall - pr['ops_self_ms']:.1f} ms.\n")
                L.append("| op | ms / step | % of step | calls / step |\n|---|---|---|---|")
                for op in pr["top"][:8]:
                    L.append(f"| `{op['name']}` | {op['self_ms']:.2f} | {op['self_ms'] / wall * 100:.0f}% | "
                             f"{op['calls']:.0f} |")
                L.append("")
    L.append("## Commands\n")
    L.append("```\n" + "\n".join(res["commands"]) + "\n```\n")
    if res.get("llama_server"):
        ls = res["llama_server"]
        L.append(f"llama-server: {ls.get('version') or 'version unknown'}; built by `bench/setup_baselines.sh` "
                 f"({ls.get('build')}). {ls.get('amx_note', '')}\n")
    L.append("No GPU figure exists in this file (CPU only).\n")
    return "\n".join(L)


# ----------------------------------------------------------------------------------------------
# the run

def quantizations_from_help(text: str) -> list[str]:
    """The choices of ``--quantization {a,b,...}`` in an argparse help text; ['none'] without it."""
    m = re.search(r"--quantization \{([a-z0-9_,]+)\}", text)
    return m.group(1).split(",") if m else ["none"]


def worker_quantizations() -> list[str]:
    """Quantizations `goodput-worker serve --help` offers (['none'] when it has no such flag)."""
    from .servers import goodput_worker_cmd
    exe = goodput_worker_cmd(0)[0]
    try:
        out = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ["none"]
    return quantizations_from_help(out)


def _lm_head_scheme(q: str) -> str:
    """The LM head's storage under --quantization q, from the worker's own table when it has one."""
    try:
        from goodput.worker.model import llama
        return getattr(llama, "LM_HEAD_QUANTIZATION", {}).get(q, q)
    except ImportError:
        return q


def _int4_group() -> int:
    """The worker's int4 group size (32, GGUF's block, when it does not say)."""
    try:
        from goodput.worker.model import quant
        return int(getattr(quant, "INT4_GROUP", 32))
    except ImportError:
        return 32


def _portable(arg: str) -> str:
    """Installed files relative to their site-packages, repo paths relative to the repo root,
    other absolute paths by name: no path of this machine in the results."""
    if not os.path.isabs(arg):
        return arg
    head, sep, tail = arg.partition("site-packages" + os.sep)
    if sep:
        return f"<site-packages>/{tail}"
    if arg.startswith(REPO + os.sep):
        return os.path.relpath(arg, REPO)
    return os.path.basename(arg)


def _shown_cmd(cmd: list[str], port: int | None = None) -> str:
    """A command as a reader can reuse it: the executable by name, repo paths relative, the port
    as $PORT."""
    s = " ".join(shlex.quote(os.path.basename(c) if i == 0 else _portable(c)) for i, c in enumerate(cmd))
    return s.replace(str(port), "$PORT") if port else s


class Run:
    def __init__(self, a: argparse.Namespace):
        from .prompts import bundled_model_path, load_gguf_tokenizer
        self.a = a
        self.scale = a.scale * (0.25 if a.quick else 1.0)
        self.name = a.name or f"{a.date}-cpu"
        self.md_path = os.path.join(a.results_dir, f"{self.name}.md")
        self.raw = os.path.join(a.results_dir, "raw", f"{self.name}-perf")
        os.makedirs(self.raw, exist_ok=True)
        self.gguf = bundled_model_path()
        self.tok, _ = load_gguf_tokenizer(self.gguf)
        self.commands: list[str] = []
        self.notes: list[str] = []
        self.profiles: dict[str, list[dict]] = {}
        self.memory: dict[str, dict] = {}  # row -> resident MB (after load, after each stream count, peak)
        self.prefill_ttft: dict[str, dict[int, float | None]] = {}  # row -> {prompt tokens: TTFT s}
        self.amx: dict | None = None

    def log(self, msg: str) -> None:
        print(f"[perf {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def specs(self, c: int, n: int):
        from .workloads import RequestSpec
        lo, hi = (int(x) for x in self.a.output_len.split(":"))
        outs = output_lengths(n, lo, hi, self.a.seed + c)
        return [RequestSpec(PROMPTS[i % len(PROMPTS)], len(self.tok.encode(PROMPTS[i % len(PROMPTS)]).ids), o)
                for i, o in enumerate(outs)]

    def prefill(self, base_url: str, label: str, **cfg) -> dict[int, float | None]:
        """TTFT (s) of one request per prompt length in --prefill, sent alone, one output token;
        each prompt is distinct text (no prefix cache hit), exact token counts from the tokenizer."""
        from .loadgen import LoadConfig, run_load
        from .metrics import OK
        from .prompts import PromptFactory
        from .workloads import RequestSpec
        lengths = [int(x) for x in self.a.prefill.split(",") if x]
        if not lengths:
            return {}
        pf = PromptFactory(seed=self.a.seed + 7)
        out: dict[int, float | None] = {}
        for n in lengths:
            spec = RequestSpec(pf.make(n), n, 1, "prefill")
            recs, _ = asyncio.run(run_load(LoadConfig(base_url=base_url, concurrency=1, progress=False,
                                                      desc=f"{label} prefill {n}", **cfg), [spec]))
            out[n] = recs[0].ttft if recs and recs[0].status == OK else None
            self.log(f"{label} prefill {n} tokens: TTFT {out[n] if out[n] is not None else float('nan'):.2f} s")
        return out

    def load(self, base_url: str, specs, c: int, label: str, **cfg) -> dict:
        """Two unrecorded warm-up requests, then the closed loop; tok/s from forced lengths.
        cfg: extra LoadConfig fields (e.g. min_tokens_equal_max for llama-cpp-python)."""
        from .loadgen import LoadConfig, run_load
        from .metrics import OK, check_consistency, summarize
        from .workloads import RequestSpec
        warm = [RequestSpec(PROMPTS[0], 0, 8)] * 2
        asyncio.run(run_load(LoadConfig(base_url=base_url, concurrency=1, progress=False, **cfg), warm))
        recs, _ = asyncio.run(run_load(LoadConfig(base_url=base_url, concurrency=c, progress=False,
                                                  desc=label, **cfg), specs))
        ok = [r for r in recs if r.status == OK]
        dur = (max(r.end_time for r in ok) - min(r.send_time for r in recs)) if ok else 0.0
        forced = sum(r.max_tokens for r in ok)
        s = summarize(recs)
        bad = sum(1 for r in ok if check_consistency(r))
        full_tokens, full_s = full_batch_window(recs, c)
        res = {"tok_s": forced / dur if dur else None, "ok": len(ok), "sent": len(recs), "duration_s": dur,
               "full_tok_s": full_tokens / full_s if full_s else None, "full_s": full_s,
               "forced_tokens": forced, "reported_tokens": sum(r.n_out for r in ok), "inconsistent": bad,
               "ttft_p50_s": s["ttft_s"]["p50"], "tpot_p50_s": s["tpot_s"]["p50"]}
        with open(os.path.join(self.raw, f"{label.replace(' ', '_')}.json"), "w") as f:
            json.dump({"summary": res, "records": [r.to_dict() for r in recs]}, f, default=float)
        self.log(f"{label}: {len(ok)}/{len(recs)} ok, {res['tok_s'] or 0:.1f} tok/s "
                 f"(forced {forced}, reported {res['reported_tokens']}), TPOT p50 "
                 f"{(res['tpot_p50_s'] or 0) * 1e3:.0f} ms")
        if res["reported_tokens"] != forced and any(r.usage_completion_tokens is not None for r in ok):
            self.notes.append(f"{label}: the server reported {res['reported_tokens']} output tokens for "
                              f"{forced} forced (ignore_eos not honoured?)")
        if len(ok) < len(recs):
            err = next((r.error for r in recs if r.status != OK), "")
            self.notes.append(f"{label}: {len(recs) - len(ok)} of {len(recs)} requests failed ({err[:160]})")
        return res


def _side_by_side(run: Run, a: argparse.Namespace, wanted: list[str], streams: list[int], all_specs: dict,
                  llama_bin: str | None, ctx_per_slot: int, systems: dict) -> tuple[dict, dict]:
    """Every system over the same request lists, one server at a time (each stopped when its
    `with` ends). Returns ({row: {C: tok/s}}, {label: load result})."""
    from .llama_server import choose_flags, llama_server_cmd
    from .servers import Server, free_port, goodput_worker_cmd, llama_cpp_cmd
    side: dict[str, dict[int, float | None]] = {}
    details: dict = {}
    for sysname in wanted:
        try:
            if sysname.startswith("goodput"):
                q = sysname.partition("-")[2] or "none"
                row = OURS_ROWS[q]
                port = free_port()
                flags = {"num_threads": a.threads}
                if q != "none":
                    flags["quantization"] = q
                cmd = goodput_worker_cmd(port, **flags)
                run.commands.append(_shown_cmd(cmd, port))
                with Server(cmd, port, os.path.join(run.raw, f"server-{sysname}.log"), ready_path="/ready",
                            ready_timeout=600) as srv:
                    mem = run.memory.setdefault(row, {})
                    mem["after_load"] = _memory(srv.proc.pid).get("rss_mb")
                    for c in streams:
                        r = run.load(srv.base_url, all_specs[c], c, f"{row} C={c}")
                        side.setdefault(row, {})[c] = r["tok_s"]
                        details[f"{row} C={c}"] = r
                        m = _memory(srv.proc.pid)
                        mem[f"after_c{c}"], mem["peak"] = m.get("rss_mb"), m.get("peak_mb")
                    run.prefill_ttft[row] = run.prefill(srv.base_url, row)
            elif sysname == "llama-server":
                run.log("llama-server: probing llama.cpp's default CPU buffer types (AMX) ...")
                no_repack, why = choose_flags(llama_bin, run.gguf, a.threads,
                                              os.path.join(run.raw, "server-llama-server-defaults-probe.log"))
                run.amx = {"no_repack": no_repack, "why": why}
                run.log(f"llama-server: {'--no-repack' if no_repack else 'defaults'} ({why})")
                for c in streams:
                    port = free_port()
                    cmd = llama_server_cmd(llama_bin, run.gguf, port, c, ctx_per_slot, a.threads, no_repack)
                    run.commands.append(_shown_cmd(cmd, port))
                    with Server(cmd, port, os.path.join(run.raw, f"server-llama-server-np{c}.log"),
                                ready_path="/health", ready_timeout=300) as srv:
                        mem = run.memory.setdefault("llama-server", {})
                        mem[f"load_c{c}"] = _memory(srv.proc.pid).get("rss_mb")
                        r = run.load(srv.base_url, all_specs[c], c, f"llama-server C={c}")
                        m = _memory(srv.proc.pid)
                        mem[f"after_c{c}"], mem[f"peak_c{c}"] = m.get("rss_mb"), m.get("peak_mb")
                        side.setdefault("llama-server", {})[c] = r["tok_s"]
                        details[f"llama-server C={c}"] = r
                lengths = [int(x) for x in a.prefill.split(",") if x]
                if lengths:
                    port = free_port()
                    cmd = llama_server_cmd(llama_bin, run.gguf, port, 1, -(-(max(lengths) + 64) // 64) * 64,
                                           a.threads, no_repack)
                    run.commands.append(_shown_cmd(cmd, port))
                    with Server(cmd, port, os.path.join(run.raw, "server-llama-server-prefill.log"),
                                ready_path="/health", ready_timeout=300) as srv:
                        run.prefill_ttft["llama-server"] = run.prefill(srv.base_url, "llama-server")
            elif sysname == "llama-cpp-python":
                port = free_port()
                cmd = llama_cpp_cmd(port, run.gguf, n_ctx=ctx_per_slot * 2, n_threads=a.threads)
                run.commands.append(_shown_cmd(cmd, port))
                with Server(cmd, port, os.path.join(run.raw, "server-llama-cpp-python.log"),
                            ready_path="/v1/models", ready_timeout=300) as srv:
                    for c in streams:  # it has no ignore_eos: lengths forced with min_tokens
                        r = run.load(srv.base_url, all_specs[c], c, f"llama-cpp-python C={c}",
                                     ignore_eos=False, min_tokens_equal_max=True)
                        side.setdefault("llama-cpp-python (serial)", {})[c] = r["tok_s"]
                        details[f"llama-cpp-python C={c}"] = r
                systems["llama-cpp-python (serial)"] = systems.pop("llama-cpp-python")
            elif sysname == "hf":
                path = os.path.join(run.raw, "hf-specs.json")
                out = os.path.join(run.raw, "hf.json")
                with open(path, "w") as f:
                    json.dump({"jobs": [{"batch": c, "specs": [{"prompt": s.prompt, "max_tokens": s.max_tokens}
                                                               for s in all_specs[c]]} for c in streams]}, f)
                cmd = [sys.executable, "-m", "goodput.bench", "hf-static", "--specs", path, "--dtype", "bfloat16",
                       "--out", out]
                run.commands.append("python " + " ".join(cmd[1:]).replace(run.raw, "bench/results/raw/<name>-perf"))
                run.log("HF static batching ...")
                env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1"}
                p = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
                if p.returncode != 0:
                    run.notes.append(f"HF static failed: {p.stderr[-400:]}")
                    continue
                with open(out) as f:
                    for hp in json.load(f)["points"]:
                        side.setdefault("HF static", {})[hp["batch"]] = hp["output_token_throughput"]
                        run.log(f"HF static C={hp['batch']}: {hp['output_token_throughput']:.1f} tok/s")
        except (RuntimeError, OSError, ValueError) as e:  # one failing system must not lose the others
            run.notes.append(f"{sysname} failed: {type(e).__name__}: {str(e)[-300:]}")
            run.log(f"{sysname} FAILED: {e}")

    return side, details


def _runner_steps(run: Run, a: argparse.Namespace, systems: dict, rbatches: list[int], mean_ctx: float,
                  contexts: list[int], repeats: int, bw: float, shape: dict, peak: float):
    """In-process decode steps per goodput row (roofline batches at the mean context) and the
    context-growth grid for bf16, each in a subprocess. Returns (runner_steps {row: {B: s}},
    growth dict or None, a note when growth failed)."""
    runner_steps: dict[str, dict[int, float]] = {}
    growth = None
    ctx_note = None
    for q, row in OURS_ROWS.items():
        if row not in systems:
            continue
        jobs = [("roof", ",".join(map(str, rbatches)), str(max(1, round(mean_ctx))))]
        profiles = ["--profile-batches", ",".join(map(str, rbatches))]
        if q == "none" and not a.skip_context:
            jobs.append(("growth", a.context_batches, ",".join(map(str, contexts))))
        for kind, batches, ctxs in jobs:
            out = os.path.join(run.raw, f"decode-{q}-{kind}.json")
            cmd = [sys.executable, "-m", "goodput.bench", "decode-steps", "--quantization", q,
                   "--threads", str(a.threads), "--batches", batches, "--contexts", ctxs,
                   "--repeats", str(repeats), "--out", out] + (profiles if kind == "roof" else [])
            run.commands.append("python " + " ".join(cmd[1:]).replace(run.raw, "bench/results/raw/<name>-perf"))
            run.log(f"in-process decode steps: {q} {kind} (batches {batches}, contexts {ctxs}) ...")
            p = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if p.returncode != 0:
                msg = f"decode-steps {q} {kind} failed: {p.stderr.strip()[-400:]}"
                run.notes.append(msg)
                if kind == "growth":
                    ctx_note = msg
                continue
            with open(out) as f:
                d = json.load(f)
            if d.get("weight_bytes"):
                systems[row]["measured_bytes"] = d["weight_bytes"]["total"]
                systems[row]["weight_bytes"] = d["weight_bytes"]["total"]
                if d["weight_bytes"].get("small_batch_blocks"):
                    # a batch of one reads the file's blocks instead (worker's block_linear.py)
                    systems[row]["b1_weight_bytes"] = d["weight_bytes"]["small_batch_blocks"] + d["weight_bytes"]["norms"]
            if kind == "roof":
                runner_steps[row] = {pt["batch"]: pt["step_s_median"] for pt in d["points"]}
                run.profiles[row] = d.get("profiles") or []
            else:
                growth = {"attention_backend": d["attention_backend"], "threads": d["threads"],
                          "repeats": d["repeats"], "kv_bytes_per_token": d["kv_bytes_per_token"],
                          "rows": context_growth(d["points"], systems[row]["weight_bytes"],
                                                 d["kv_bytes_per_token"], bw, shape, peak)}
    return runner_steps, growth, ctx_note


def main(a: argparse.Namespace) -> int:
    import torch

    from . import roofline
    from .llama_server import cpu_has_amx, llama_server_path
    from .llama_server import version as llama_version
    from .servers import LLAMA_VENV_PY

    # SIGTERM -> SystemExit, so each `with Server` stops its server (own process group)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.time()
    load_before = os.getloadavg()
    run = Run(a)
    streams = [int(x) for x in a.streams.split(",") if x]
    nreq = parse_requests(a.requests, streams, run.scale)
    contexts = [256, 1024] if a.quick and a.contexts == "512,2048,8192" else [int(x) for x in a.contexts.split(",")]
    repeats = 3 if a.quick else a.repeats
    rbatches = [int(x) for x in a.roofline_batches.split(",") if x]
    lo, hi = (int(x) for x in a.output_len.split(":"))
    all_specs = {c: run.specs(c, nreq[c]) for c in streams}
    prompt_tokens = [len(run.tok.encode(p).ids) for p in PROMPTS]
    flat = [s for c in streams for s in all_specs[c]]
    mean_ctx = mean_decode_context([s.prompt_tokens for s in flat], [s.max_tokens for s in flat])
    run.log(f"requests per point {nreq} (scale {run.scale:g}); contexts {contexts}; threads {a.threads}; "
            f"mean decode context {mean_ctx:.0f}")

    # which systems
    quants = worker_quantizations()
    llama_bin = llama_server_path()
    available = ["goodput"] + [f"goodput-{q}" for q in ("int8", "int4") if q in quants]
    if llama_bin:
        available.append("llama-server")
    if os.path.exists(LLAMA_VENV_PY):
        available.append("llama-cpp-python")
    available.append("hf")
    wanted = available if a.systems == "auto" else [s for s in a.systems.split(",") if s]
    for s in wanted:
        if s not in available:
            run.notes.append(f"{s}: not available on this machine (skipped)")
    wanted = [s for s in wanted if s in available]
    if "llama-server" not in wanted:
        run.notes.append("llama-server is not built (bash bench/setup_baselines.sh): no llama-server column, "
                         "so the targets against it are not measured")
    run.log(f"systems: {wanted}")

    # 1. roofline peaks first, on a machine with no server running
    torch.set_num_threads(a.threads)
    run.log("measuring bandwidth and GEMM peaks ...")
    machine = roofline.measure_machine(seconds=1.0 if a.quick else 2.0)
    shape = roofline.model_shape(run.gguf)
    bw, peak = roofline.read_bandwidth(machine), machine["matmul_gflops"]["bfloat16"] * 1e9
    run.log(f"bandwidth {bw / 1e9:.1f} GB/s, bf16 peak {peak / 1e9:.0f} GFLOP/s")

    # bytes per step
    from gguf import GGUFReader
    rd = GGUFReader(run.gguf)
    gg = gguf_weight_bytes({t.name: (t.tensor_type.name, int(t.n_bytes)) for t in rd.tensors})
    del rd
    kv_per_tok = kv_bytes_per_step(shape["layers"], shape["kv_heads"], shape["head_dim"], 2, 1)
    systems: dict[str, dict] = {}
    for q, row in OURS_ROWS.items():
        if (q == "none" and "goodput" in wanted) or f"goodput-{q}" in wanted:
            head = _lm_head_scheme(q)
            f = ours_weight_bytes(shape, 2, q, head, group=_int4_group())
            storage = "bf16" if q == "none" else f"{q} (bf16 scales), LM head {head if head != 'none' else 'bf16'}"
            systems[row] = {"storage": storage, "formula_bytes": f["total"], "weight_bytes": f["total"],
                            "lm_head_bytes": f["lm_head"]}
    gguf_types = "/".join(f"{t}" for t in gg["by_type"])
    for name in ("llama-server", "llama-cpp-python"):
        if name in wanted:
            systems[name] = {"storage": f"GGUF as stored ({gguf_types}; head = {gg['lm_head_tensor']})",
                             "formula_bytes": gg["total"], "weight_bytes": gg["total"], "lm_head_bytes": gg["lm_head"]}
    if "hf" in wanted:
        f = ours_weight_bytes(shape, 2, "none")
        systems["HF static"] = {"storage": "bf16 (dequantized from the GGUF)", "formula_bytes": f["total"],
                                "weight_bytes": f["total"], "lm_head_bytes": f["lm_head"]}

    ctx_per_slot = -(-(max(prompt_tokens) + hi + 64) // 64) * 64

    # 2. side by side, then 3. in-process decode steps
    side, details = _side_by_side(run, a, wanted, streams, all_specs, llama_bin, ctx_per_slot, systems)
    runner_steps, growth, ctx_note = _runner_steps(run, a, systems, rbatches, mean_ctx, contexts, repeats, bw,
                                                   shape, peak)
    # roofline rows
    rows, roof = [], {}
    for name, info in systems.items():
        for b in rbatches:
            wb = info.get("b1_weight_bytes", info["weight_bytes"]) if b == 1 else info["weight_bytes"]
            bd = step_bound(wb, kv_per_tok, b, mean_ctx, flops_per_token(shape, mean_ctx), peak, bw)
            st = side.get(name, {}).get(b)
            sf = (details.get(f"{name} C={b}") or {}).get("full_tok_s")
            rs = runner_steps.get(name, {}).get(b)
            r = {"system": name, "batch": b, **bd, "server_tok_s": st,
                 "server_fraction": st / bd["bound_tok_s"] if st else None,
                 "server_full_tok_s": sf, "server_full_fraction": sf / bd["bound_tok_s"] if sf else None,
                 "runner_step_s": rs, "runner_fraction": bd["bound_s"] / rs if rs else None}
            rows.append(r)
            roof.setdefault(name, {})[b] = {"server": r["server_fraction"], "server_full": r["server_full_fraction"],
                                            "runner": r["runner_fraction"]}
    prefill_of_bound = {row: {n: prefill_bound_s(shape, n, peak) / t for n, t in ttft.items() if t}
                        for row, ttft in run.prefill_ttft.items()}
    tg = {row: targets(side, roof, growth["rows"] if growth else None, row, prefill_of_bound.get(row))
          for row in OURS_ROWS.values() if row in side}

    build_s = None
    if llama_bin:
        bs = os.path.join(os.path.dirname(os.path.dirname(llama_bin)), ".build_seconds")
        if os.path.exists(bs):
            with open(bs) as f:
                build_s = f.read().strip()
    res = {
        "date": a.date, "model": "SmolLM2-135M-Instruct", "gguf_name": os.path.basename(run.gguf),
        "threads": a.threads, "streams": streams, "requests": nreq, "seed": a.seed, "output_range": (lo, hi),
        "prompt_tokens": prompt_tokens, "mean_ctx": mean_ctx, "kv_bytes_per_token": kv_per_tok,
        "machine": {**machine, "cpu": _cpu_name(), "python": f"Python {platform.python_version()}",
                    "torch": torch.__version__},
        "side_by_side": side, "systems": systems, "details": details,
        "roofline": {"bandwidth": bw, "peak_flops": peak, "rows": rows},
        "context_growth": growth, "context_note": ctx_note, "targets": tg, "profiles": run.profiles,
        "memory": run.memory, "prefill": run.prefill_ttft, "shape": shape,
        "side_notes": run.notes, "commands": list(dict.fromkeys(run.commands)),
        "command": " ".join(["bash bench/run_perf.sh"]
                            + _shown_args(sys.argv[2:] if sys.argv[1:2] == ["perf"] else [])),
        "load_before": load_before, "load_after": os.getloadavg(), "wall_s": time.time() - t_start,
        "note": a.note if getattr(a, "note", None) else None,
    }
    if llama_bin:
        res["llama_server"] = {
            "version": llama_version(llama_bin),
            "build": "llama.cpp vendored in llama-cpp-python's sdist; cmake Release, target llama-server, "
                     "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
                     + (f"; built in {build_s} s" if build_s else ""),
            "amx_note": amx_note(cpu_has_amx(), run.amx),
        }
    with open(os.path.join(run.raw, "perf.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(run.md_path, "w") as f:
        f.write(render(res))
    print(run.md_path)
    return 0


def amx_note(cpu_amx: bool, choice: dict | None) -> str:
    """The results' sentence on llama-server's AMX path: what the probe saw and what was used."""
    head = "AMX: this CPU has AMX (amx_int8). " if cpu_amx else "AMX: this CPU has no AMX. "
    if choice is None:
        return head + "llama-server did not run."
    if choice["no_repack"]:
        return (head + f"{choice['why'][0].upper() + choice['why'][1:]}, so the runs use its own switch "
                "`--no-repack` (llama.cpp's `no_extra_bufts`): weights stay in the plain CPU buffer with the "
                "AVX-512 Q4_1/Q8_0 kernels; on x86 Q4_1 and Q8_0 have no other repacked layout, so only the "
                "AMX path is off (`llama_server.py`).")
    return head + f"Runs use llama.cpp's default buffer types ({choice['why']})."


def _shown_args(argv: list[str]) -> list[str]:
    """The perf arguments without --results-dir (a path of this machine)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x == "--results-dir":
            skip = True
            continue
        if not x.startswith("--results-dir="):
            out.append(shlex.quote(x))
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return platform.processor()
