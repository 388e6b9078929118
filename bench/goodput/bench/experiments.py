"""The seven benchmark experiments, run back to back by one command:

    python -m goodput.bench experiments [--only 1,2,...] [--quick] [--date YYYY-MM-DD]

Writes bench/results/<date>-cpu.md (tables, the exact commands, notes), PNGs and a small
summary JSON under bench/results/<date>-cpu/, and every request's timeline under
bench/results/raw/<date>/ (not committed). Each server under test runs as a subprocess on a free
127.0.0.1 port; only one server runs at a time (2 shared cores), and each is stopped before the
next starts. Durations and sweep points are scaled by --quick / --scale so the whole set fits
the time one has on a shared CPU; the results say which scale was used.

1 frontier     closed-loop concurrency sweep, varying lengths: throughput vs TTFT/ITL p50/p99
2 HOL          8 short streams + one ~2k-token prompt; short ITL p99 during the injection,
               chunked prefill (token budget 512 < prompt) vs whole-prompt budget (4096)
3 prefix       1k-token shared system prompt; TTFT with prefix caching on vs off
4 static       continuous vs static batching (a cohort at a time), same max batch
5 side-by-side ours vs llama-cpp-python's server vs HF transformers static batching at C=1,8,32
6 trace        Azure code-completion trace at 0.5x/1x/2x the knee rate
7 roofline     machine peaks and the decode-step lower bound vs our measured step at B=1,8,32
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import re
import shlex
import subprocess
import sys
import time

from . import report, workloads
from .loadgen import LoadConfig, run_load
from .metrics import OK, check_consistency, mean_active, percentile, summarize, window_itls
from .prompts import PromptFactory, bundled_model_path
from .servers import Server, free_port, goodput_worker_cmd, llama_cpp_available, llama_cpp_cmd

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), *[".."] * 3))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default="1,2,3,4,5,6,7", help="comma list of experiment numbers")
    p.add_argument("--quick", action="store_true", help="smallest scale (a few minutes in all)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply durations and request counts")
    p.add_argument("--date", default=_dt.date.today().isoformat())
    p.add_argument("--results-dir", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=250.0)
    p.add_argument("--worker-flags", default="", help="extra flags for every goodput-worker (e.g. '--dtype bfloat16')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-min", type=float, default=None,
                   help="start no new experiment after this many minutes (the rest are listed as skipped)")
    p.add_argument("--side-by-side-conc", default="1,8,32", help="experiment 5's concurrency points")



_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _portable(arg: str) -> str:
    """A command argument as a reader can reuse it: repo paths relative to the repo root, installed
    files relative to their site-packages, no path of this machine."""
    if not os.path.isabs(arg):
        return arg
    if arg.startswith(_REPO + os.sep):
        return os.path.relpath(arg, _REPO)
    head, sep, tail = arg.partition("site-packages" + os.sep)
    return f"<site-packages>/{tail}" if sep else os.path.basename(arg)

class Ctx:
    """Run-wide state: output paths, the one live server, the markdown sections, summaries."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.scale = (0.5 if a.quick else 1.0) * a.scale
        self.name = f"{a.date}-cpu"
        self.md_path = os.path.join(a.results_dir, f"{self.name}.md")
        self.fig_dir = os.path.join(a.results_dir, self.name)
        self.raw_dir = os.path.join(a.results_dir, "raw", a.date)
        os.makedirs(self.fig_dir, exist_ok=True)
        os.makedirs(self.raw_dir, exist_ok=True)
        self.pf = PromptFactory("smollm2", seed=a.seed)
        self.server: Server | None = None
        self.server_key: tuple | None = None
        self.sections: dict[int, str] = {}
        self.summary: dict = {}
        self.commands: list[str] = []
        self.started = time.time()
        self.slo = (a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3)
        argv = sys.argv[sys.argv.index("experiments") + 1:] if "experiments" in sys.argv else []
        shown, skip = [], False
        for x in argv:  # the results dir is machine-specific: leave it out of the shown command
            if skip or x.startswith("--results-dir"):
                skip = x == "--results-dir"
                continue
            shown.append(shlex.quote(x))
        self.argv = " ".join(shown)

    # -- servers -----------------------------------------------------------------------------
    def ours(self, **flags) -> Server:
        """Our worker with these flags (reused when the flags match the live one)."""
        key = ("ours",) + tuple(sorted(flags.items()))
        if self.server_key == key and self.server is not None:
            return self.server
        self.stop()
        port = free_port()
        cmd = goodput_worker_cmd(port, **flags) + shlex.split(self.a.worker_flags)
        return self._start(key, cmd, port, "/ready")

    def llama(self) -> Server:
        self.stop()
        port = free_port()
        return self._start(("llama",), llama_cpp_cmd(port, bundled_model_path()), port, "/v1/models")

    def _start(self, key, cmd, port, ready) -> Server:
        tag = "-".join(str(x) for x in key).replace("/", "_")[:80]
        log = os.path.join(self.raw_dir, f"server-{tag}.log")
        t = time.time()
        s = Server(cmd, port, log, ready_path=ready, ready_timeout=600)
        s.__enter__()
        self.server, self.server_key = s, key
        shown = [os.path.basename(cmd[0]) if os.path.isabs(cmd[0]) else cmd[0]] + [_portable(c) for c in cmd[1:]]
        self.commands.append(" ".join(shlex.quote(c) for c in shown).replace(str(port), "$PORT"))
        print(f"[server up in {time.time() - t:.1f}s] {' '.join(cmd)}", file=sys.stderr)
        return s

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server, self.server_key = None, None

    # -- load ---------------------------------------------------------------------------------
    def load(self, server: Server, specs, *, label: str, mode: str = "closed", concurrency: int = 1,
             duration: float | None = None, drain: float = 120.0, warmup: int = 2, **cfg_kw) -> dict:
        """Warm up, run, summarize, check consistency, save the raw records; returns a result dict."""
        if warmup:
            wpf = PromptFactory("smollm2", seed=999)
            asyncio.run(run_load(LoadConfig(base_url=server.base_url, concurrency=1, progress=False, **cfg_kw),
                                 workloads.fixed(wpf, warmup, 16, 4, cls="warmup")))
        cfg = LoadConfig(base_url=server.base_url, mode=mode, concurrency=concurrency, duration_s=duration,
                         drain_timeout_s=drain, desc=label, **cfg_kw)
        recs, info = asyncio.run(run_load(cfg, specs))
        s = summarize(recs, slo_ttft_s=self.slo[0], slo_tpot_s=self.slo[1])
        bad = {r.request_id: e for r in recs if (e := check_consistency(r))}
        s["inconsistent"] = len(bad)
        report.save_json(os.path.join(self.raw_dir, f"{label.replace(' ', '_').replace('/', '_')}.json"),
                         {"label": label, "summary": s, "inconsistent": bad, "t_start": info["t_start"],
                          "records": [r.to_dict() for r in recs]})
        print(f"  {label}: ok={s['counts']['ok']}/{s['counts']['sent']} out tok/s={s['output_token_throughput']:.1f} "
              f"TTFT p50={_ms(s['ttft_s']['p50'])} ITL p50={_ms(s['itl_s']['p50'])} inconsistent={len(bad)}",
              file=sys.stderr)
        return {"summary": s, "records": recs, "t_start": info["t_start"]}

    def n(self, x: float, lo: int = 1) -> int:
        return max(lo, int(round(x * self.scale)))

    def d(self, x: float) -> float:
        return x * self.scale

    def write(self) -> None:
        parts = [f"# goodput benchmarks on this machine — {self.a.date} (CPU)\n",
                 _machine_blurb(), "",
                 f"Scale: {self.scale:g} (durations and request counts are scaled to fit a 2-core machine; "
                 f"bigger scales give tighter percentiles). SLOs for goodput: TTFT <= {self.a.slo_ttft_ms:g} ms, "
                 f"TPOT <= {self.a.slo_tpot_ms:g} ms. Reproduce: `bash bench/run_all.sh {self.argv}` "
                 f"(= `python -m goodput.bench experiments {self.argv}`).\n",
                 "The load generator runs on the same 2 cores as the server under test, so every "
                 "figure includes the client's own CPU use.\n"]
        parts.append(targets_section(self.summary))
        for k in sorted(self.sections):
            parts.append(self.sections[k])
        parts.append("## Exact server commands\n\n```\n" + "\n".join(dict.fromkeys(self.commands)) + "\n```\n")
        with open(self.md_path, "w") as f:
            f.write("\n".join(parts))
        report.save_json(os.path.join(self.fig_dir, "summary.json"), self.summary)


def targets_section(summary: dict) -> str:
    """The targets as measured ratios (printed, never asserted)."""
    rows = []

    def add(name, value, target, fmt):
        if value is None:
            rows.append(f"| {name} | not measured | {target:g}{'x' if fmt == 'x' else '%'} | – |")
            return
        shown = _x(value) if fmt == "x" else _pct(value)
        goal = target if fmt == "x" else target / 100
        rows.append(f"| {name} | {shown} | >= {target:g}{'x' if fmt == 'x' else '%'} | "
                    f"{'met' if value >= goal else '**missed**'} |")

    sbs = summary.get("side_by_side") or {}
    var = next((v for k, v in sbs.items() if k.startswith("varying")), {})
    eq = next((v for k, v in sbs.items() if k.startswith("equal")), {})

    def ratio(d, c, other):
        p = d.get(str(c)) or d.get(c) or {}
        return p["ours"] / p[other] if p.get("ours") and p.get(other) else None

    add("C=32 ours / llama.cpp (varying lengths)", ratio(var, 32, "llama.cpp"), 2, "x")
    add("C=32 ours / HF static (varying lengths)", ratio(var, 32, "HF static"), 1.5, "x")
    add("C=32 ours / HF static (equal lengths)", ratio(eq, 32, "HF static"), 1.5, "x")
    add("C=1 ours / llama.cpp", ratio(var, 1, "llama.cpp"), 0.5, "x")
    roof = summary.get("roofline", {}).get("rows") or []
    r32 = next((r["achieved_fraction"] for r in roof if r["dtype"] == "bfloat16" and r["batch"] == 32), None)
    add("achieved fraction of the bf16 roofline bound, B=32", r32, 50, "%")
    add("HOL: short p99 ITL during injection, chunking off / on", (summary.get("hol") or {}).get("ratio_off_over_on"), 5, "x")
    add("prefix cache: TTFT p50 off / on", (summary.get("prefix") or {}).get("ratio_off_over_on"), 5, "x")
    add("continuous / static batching throughput (no target; > 1 expected)", (summary.get("static") or {}).get("ratio_cont_over_static"), 1, "x")
    return ("## Targets (measured ratios; no timed asserts)\n\n| target | measured | goal | |\n|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


def _ms(x) -> str:
    return "–" if x is None else f"{x * 1e3:.1f} ms"


def _machine_blurb() -> str:
    import platform
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return (f"Machine: {os.cpu_count()} CPU cores ({cpu or platform.processor()}), Python "
            f"{platform.python_version()}; model SmolLM2-135M-Instruct (bundled GGUF, Q4_1).")


def _rel(ctx: Ctx, path: str) -> str:
    return os.path.relpath(path, os.path.dirname(ctx.md_path))


# ---------------------------------------------------------------------------------------------
def exp1_frontier(ctx: Ctx) -> None:
    conc = [1, 4, 16, 32] if ctx.a.quick else [1, 2, 4, 8, 16, 32, 64]
    srv = ctx.ours()
    points = []
    for c in conc:
        specs = workloads.uniform(ctx.pf, 3 * c + 4, (64, 512), (16, 256), seed=ctx.a.seed + c)
        r = ctx.load(srv, specs, label=f"frontier C={c}", concurrency=c, duration=ctx.d(30), drain=90)
        points.append((f"C={c}", r["summary"]))
    png = os.path.join(ctx.fig_dir, "1-frontier.png")
    report.plot_frontier(points, png, "Frontier: ours (default flags), uniform 64-512 in / 16-256 out")
    ctx.summary["frontier"] = {lab: _small(s) for lab, s in points}
    ctx.sections[1] = (
        "## 1. Throughput–latency frontier (ours, default flags)\n\n"
        f"Closed loop, concurrency {conc}; prompts uniform 64–512 tokens, outputs uniform 16–256 "
        f"(ignore_eos); each point sends for {ctx.d(30):.0f} s then drains.\n\n"
        + report.markdown_table(points, per_class=False) + f"\n\n![frontier]({_rel(ctx, png)})\n")


def exp2_hol(ctx: Ctx) -> None:
    short_in, short_out, long_in, inject = 32, 256, 2000, ctx.d(6)
    dur = inject + ctx.d(10)
    rows, series, res = [], {}, {}
    configs = [("chunked prefill (budget 128)", {"max_num_batched_tokens": 128}),
               ("no chunking (budget 4096)", {"max_num_batched_tokens": 4096})]
    if not ctx.a.quick:  # the default budget too: the chunk size trades ITL against prefill speed
        configs.insert(1, ("chunked prefill (budget 512, default)", {"max_num_batched_tokens": 512}))
    for name, flags in configs:
        srv = ctx.ours(**flags)
        specs = workloads.long_inject(ctx.pf, 40, short_in, short_out, long_in, 1, inject)
        r = ctx.load(srv, specs, label=f"hol {name}", concurrency=8, duration=dur, drain=60)
        recs = r["records"]
        long = next((x for x in recs if x.cls == "long"), None)
        if long is None or long.status != OK:
            rows.append(f"| {name} | long prompt failed: {long.error if long else 'not sent'} | | | |")
            continue
        lo, hi = long.send_time, long.end_time
        during = window_itls(recs, lo, hi + 0.05, cls="short")
        before = window_itls(recs, r["t_start"] + 1.0, lo, cls="short")
        p99d, p99b = percentile(during, 99), percentile(before, 99)
        res[name] = {"p99_during_s": p99d, "max_during_s": max(during) if during else None,
                     "p99_before_s": p99b, "long_ttft_s": long.ttft, "n_gaps_during": len(during)}
        rows.append(f"| {name} | {_ms(p99b)} | {_ms(p99d)} | {_ms(res[name]['max_during_s'])} | "
                    f"{len(during)} | {_ms(long.ttft)} |")
        series[name] = (recs, r["t_start"], (lo, hi))
    png = os.path.join(ctx.fig_dir, "2-hol-itl.png")
    if series:
        report.plot_itl_timeline(series, png, f"Short requests' ITL; one {long_in}-token prompt injected at {inject:.0f}s")
    on, off = configs[0][0], configs[-1][0]
    ratio = (res[off]["p99_during_s"] / res[on]["p99_during_s"]
             if on in res and off in res and res[on]["p99_during_s"] else None)
    ctx.summary["hol"] = {**res, "ratio_off_over_on": ratio}
    ctx.sections[2] = (
        "## 2. Head-of-line blocking: chunked prefill on vs off\n\n"
        "On = a step token budget (--max-num-batched-tokens) smaller than the prompt, so the prompt is "
        "prefilled in chunks between decode steps; off = a budget that holds the whole prompt in one step. "
        f"8 short streams (closed loop, {short_in}-token prompts, {short_out} output tokens); one "
        f"{long_in}-token prompt (1 output token) sent at t={inject:.0f} s. 'During' = ITL gaps of the short "
        "requests whose later token arrived while the long prompt was in flight (send .. its first token).\n\n"
        "| config | short ITL p99 before | short ITL p99 during | max during | gaps during | long TTFT |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) +
        f"\n\n**p99 ITL during injection, off (4096) / on (128) = {_x(ratio)}** (target >= 5x)\n\n![hol]({_rel(ctx, png)})\n")


def exp3_prefix(ctx: Ctx) -> None:
    n = ctx.n(10, 4)
    res = {}
    for name, flags in (("prefix cache off", {"enable_prefix_caching": False}), ("prefix cache on", {})):
        srv = ctx.ours(**flags)
        specs = workloads.shared_prefix(ctx.pf, n, 1024, 32, 4)
        r = ctx.load(srv, specs, label=f"prefix {name}", concurrency=1)
        recs = r["records"]
        ttfts = [x.ttft for x in recs if x.ttft is not None]
        res[name] = {"ttft_p50_s": percentile(ttfts, 50), "ttft_first_s": ttfts[0] if ttfts else None,
                     "ttft_p50_after_first_s": percentile(ttfts[1:], 50), "n": len(ttfts)}
    on, off = res.get("prefix cache on", {}), res.get("prefix cache off", {})
    ratio = (off["ttft_p50_s"] / on["ttft_p50_s"]) if on.get("ttft_p50_s") and off.get("ttft_p50_s") else None
    ctx.summary["prefix"] = {**res, "ratio_off_over_on": ratio}
    rows = "\n".join(f"| {k} | {v['n']} | {_ms(v['ttft_first_s'])} | {_ms(v['ttft_p50_s'])} | "
                     f"{_ms(v['ttft_p50_after_first_s'])} |" for k, v in res.items())
    ctx.sections[3] = (
        "## 3. Prefix caching: 1k-token shared system prompt\n\n"
        f"{n} requests one at a time, each = the same 1024-token system prompt + a distinct 32-token suffix, "
        "4 output tokens. The first request fills the cache.\n\n"
        "| config | n | TTFT first | TTFT p50 | TTFT p50 (2nd..) |\n|---|---|---|---|---|\n" + rows +
        f"\n\n**TTFT p50 off / on = {_x(ratio)}** (target >= 5x)\n")


def exp4_static(ctx: Ctx) -> None:
    c = 32
    res, points = {}, []
    for name, flags in (("continuous", {}), ("static", {"scheduling_policy": "static"})):
        srv = ctx.ours(**flags)
        specs = workloads.uniform(ctx.pf, ctx.n(64, 32), (64, 256), (16, 256), seed=ctx.a.seed + 4)
        r = ctx.load(srv, specs, label=f"batching {name}", concurrency=c, duration=ctx.d(40), drain=120)
        recs, s = r["records"], r["summary"]
        ok = [x for x in recs if x.status == OK]
        if not ok:
            raise RuntimeError(f"{name}: no request succeeded: {recs[0].error if recs else 'none sent'}")
        t0, t1 = min(x.send_time for x in ok), max(x.end_time for x in ok)
        util = mean_active(recs, t0, t1) / c
        res[name] = {"output_token_throughput": s["output_token_throughput"], "slot_utilization": util,
                     "ttft_p50_s": s["ttft_s"]["p50"], "e2e_p50_s": s["e2e_s"]["p50"]}
        points.append((name, s))
    ratio = (res["continuous"]["output_token_throughput"] / res["static"]["output_token_throughput"]
             if len(res) == 2 and res["static"]["output_token_throughput"] else None)
    ctx.summary["static"] = {**res, "ratio_cont_over_static": ratio}
    rows = "\n".join(f"| {k} | {v['output_token_throughput']:.1f} | {v['slot_utilization'] * 100:.0f}% | "
                     f"{_ms(v['ttft_p50_s'])} | {v['e2e_p50_s']:.2f} s |" for k, v in res.items())
    ctx.sections[4] = (
        "## 4. Continuous vs static batching (same engine, same max batch 32)\n\n"
        "Closed loop at 32 streams, prompts 64–256, outputs 16–256 tokens. Static = the engine admits a new "
        "cohort only when the whole running batch has finished. Slot utilization = time-average number of "
        "requests between first token and end / 32.\n\n"
        "| policy | out tok/s | slot utilization | TTFT p50 | E2E p50 |\n|---|---|---|---|---|\n" + rows +
        f"\n\n**continuous / static throughput = {_x(ratio)}**\n\n" + report.markdown_table(points, per_class=False)
        + "\n")


def exp5_side_by_side(ctx: Ctx) -> None:
    conc = [int(x) for x in ctx.a.side_by_side_conc.split(",")]
    loads = {"varying (in 32-256, out 16-256)": ((32, 256), (16, 256)), "equal (in 128, out 128)": ((128, 128), (128, 128))}
    n_for = {c: ctx.n(4, 2) if c == 1 else ctx.n(2 * c, c) for c in conc}
    # identical prompts for every system: build once per (workload, C)
    specs_for = {(w, c): workloads.uniform(PromptFactory("smollm2", seed=ctx.a.seed + 50), n_for[c], *lens,
                                           seed=ctx.a.seed + 50 + c)
                 for w, lens in loads.items() for c in conc}
    table: dict = {w: {c: {} for c in conc} for w in loads}
    ours_step: dict = {}

    # ours, default flags
    srv = ctx.ours()
    for w in loads:
        for c in conc:
            r = ctx.load(srv, specs_for[(w, c)], label=f"ours {w[:7]} C={c}", concurrency=c)
            table[w][c]["ours"] = r["summary"]["output_token_throughput"]
            table[w][c]["ours_itl_p50"] = r["summary"]["itl_s"]["p50"]
            if w.startswith("equal"):  # TPOT p50: the mean step per request, robust to coalesced events
                ours_step[c] = r["summary"]["tpot_s"]["p50"]
    ctx.summary["ours_equal_tpot_p50"] = ours_step
    # profile our server at 32 streams (where the step time goes), then stop it
    prof = profile_server(ctx, srv, specs_for[(list(loads)[1], conc[-1])], conc[-1])
    ctx.stop()

    # llama.cpp (llama-cpp-python server)
    llama_note = ""
    if llama_cpp_available():
        lsrv = ctx.llama()
        for w in loads:
            for c in conc:
                r = ctx.load(lsrv, specs_for[(w, c)], label=f"llama.cpp {w[:7]} C={c}", concurrency=c,
                             ignore_eos=False, min_tokens_equal_max=True)
                recs = r["records"]
                # llama-cpp-python sends no usage in streams: count forced lengths from the specs
                forced = sum(x.max_tokens for x in recs if x.status == OK)
                dur = r["summary"]["duration_s"]
                table[w][c]["llama.cpp"] = forced / dur if dur else None
                table[w][c]["llama.cpp_events_per_token"] = (
                    sum(len(x.token_times) for x in recs if x.status == OK) / forced if forced else None)
        ctx.stop()
    else:
        llama_note = "llama-cpp-python is not built (run bench/setup_baselines.sh): no llama.cpp column.\n"

    # HF transformers static batching, in one subprocess per workload (same prompts, bf16 like ours)
    hf_note = ""
    for wi, w in enumerate(loads):
        path = os.path.join(ctx.raw_dir, f"hf-specs-{wi}.json")
        out = os.path.join(ctx.raw_dir, f"hf-{wi}.json")
        with open(path, "w") as f:
            json.dump({"jobs": [{"batch": c, "specs": [{"prompt": s.prompt, "max_tokens": s.max_tokens}
                                                       for s in specs_for[(w, c)]]} for c in conc]}, f)
        cmd = [sys.executable, "-m", "goodput.bench", "hf-static", "--specs", path, "--dtype", "bfloat16",
               "--out", out]
        ctx.commands.append("python " + " ".join(cmd[1:]).replace(ctx.raw_dir, "bench/results/raw/<date>"))
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            hf_note += f"HF run ({w}) failed: {p.stderr[-500:]}\n"
            continue
        with open(out) as f:
            hpoints = json.load(f)["points"]
        for hp in hpoints:
            c = hp["batch"]
            table[w][c]["HF static"] = hp["output_token_throughput"]
            table[w][c]["HF slot util"] = hp["slot_utilization"]
            print(f"  HF {w[:7]} C={c}: {hp['output_token_throughput']:.1f} tok/s", file=sys.stderr)

    ctx.summary["side_by_side"] = {w: {str(c): v for c, v in d.items()} for w, d in table.items()}
    from .roofline import model_shape
    shape = model_shape(bundled_model_path())
    bf16_mb = (shape["matmul_params"] + shape["norm_params"]) * 2 / 1e6
    q4_mb = shape["gguf_tensor_bytes"] / 1e6
    lines = ["| workload | C | ours tok/s | llama.cpp tok/s | HF static tok/s | ours/llama.cpp | ours/HF | HF slot util |",
             "|---|---|---|---|---|---|---|---|"]
    groups = {}
    for w in loads:
        for c in conc:
            d = table[w][c]
            o, l, h = d.get("ours"), d.get("llama.cpp"), d.get("HF static")
            lines.append(f"| {w} | {c} | {_f(o)} | {_f(l)} | {_f(h)} | {_x(o / l if o and l else None)} | "
                         f"{_x(o / h if o and h else None)} | {_pct(d.get('HF slot util'))} |")
            groups[f"{w[:5]} C={c}"] = {k: v for k, v in (("ours", o), ("llama.cpp", l), ("HF static", h)) if v}
    png = os.path.join(ctx.fig_dir, "5-side-by-side.png")
    report.plot_bars(groups, png, "Output tokens/s, same prompts and lengths", "output tok/s")
    ctx.sections[5] = (
        "## 5. Side by side: ours vs llama.cpp (llama-cpp-python server) vs HF transformers static batching\n\n"
        "Same machine, same GGUF file, identical prompts and forced output lengths, run back to back. "
        "Ours: default flags (bf16). HF: `generate` with left padding, cohorts of C, greedy, bf16 weights "
        "dequantized from the same GGUF (same dtype as ours). llama.cpp: llama-cpp-python's OpenAI server "
        "on the Q4_1 GGUF; lengths forced with min_tokens. **llama-cpp-python's server has no parallel slots**: "
        "one global lock serializes requests, so 'parallel slots = concurrency' is not available there and "
        "its C=8/32 figures are its serial throughput under a queue. Bytes each reads per decode step "
        f"(weights): ours bf16 ~{bf16_mb:.0f} MB, HF bf16 ~{bf16_mb:.0f} MB, llama.cpp Q4_1 ~{q4_mb:.0f} MB "
        f"({bf16_mb / q4_mb:.1f}x fewer) — the main reason llama.cpp leads at one stream on a "
        "bandwidth-bound CPU.\n\n" + llama_note + hf_note + "\n".join(lines) +
        "\n\nTargets: C=32 ours >= 2x llama.cpp and >= 1.5x HF (varying lengths); C=1 ours >= 0.5x llama.cpp.\n\n"
        f"![side by side]({_rel(ctx, png)})\n\n" + prof)


def profile_server(ctx: Ctx, srv: Server, specs, c: int) -> str:
    """py-spy the server process for a few seconds under load; returns a markdown section."""
    import shutil
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy) or srv.proc is None:
        return "(py-spy not installed: no profile)\n"
    out = os.path.join(ctx.raw_dir, f"pyspy-ours-c{c}.txt")
    secs = max(6, int(ctx.d(12)))
    p = subprocess.Popen([spy, "record", "--pid", str(srv.proc.pid), "--duration", str(secs), "--rate", "50",
                          "--format", "raw", "--output", out, "--nonblocking"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ctx.load(srv, specs, label=f"profiled ours C={c}", concurrency=c, duration=secs + 2, drain=30,
                 warmup=0)
    finally:
        try:
            p.wait(secs + 30)
        except subprocess.TimeoutExpired:
            p.kill()
    if not os.path.exists(out):
        return "(py-spy produced no profile)\n"
    return f"### Profile of our server at {c} streams (py-spy, Python frames)\n\n" + summarize_pyspy(out) + "\n"


def summarize_pyspy(path: str, top: int = 15) -> str:
    """Collapsed stacks ('f1;f2;f3 count') -> markdown tables of the top self and inclusive frames."""
    self_c, incl_c, total = {}, {}, 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not stack or not n.isdigit():
                continue
            n = int(n)
            frames = stack.split(";")
            total += n
            self_c[frames[-1]] = self_c.get(frames[-1], 0) + n
            for fr in {re.sub(r":\d+\)$", ")", fr) for fr in frames}:  # per function, not per line
                incl_c[fr] = incl_c.get(fr, 0) + n
    if not total:
        return "(empty profile)"
    rows = ["| self % | frame |", "|---|---|"]
    rows += [f"| {v / total * 100:.1f} | `{k[:120]}` |" for k, v in sorted(self_c.items(), key=lambda x: -x[1])[:top]]
    rows += ["", "| inclusive % | function (goodput code) |", "|---|---|"]
    ours = [(k, v) for k, v in incl_c.items() if "goodput" in k or "worker/" in k]
    rows += [f"| {v / total * 100:.1f} | `{k[:120]}` |" for k, v in sorted(ours, key=lambda x: -x[1])[:top]]
    return f"{total} samples (all threads, idle included).\n\n" + "\n".join(rows)


def exp6_trace(ctx: Ctx) -> None:
    rows_all = workloads.read_azure_trace(_trace_path())
    token_scale, max_prompt, max_out = 0.25, 1024, 128
    srv = ctx.ours()
    # the knee: saturated request throughput of this length mix (closed loop, 16 streams)
    probe = workloads.trace_workload(ctx.pf, rows_all[:400], token_scale=token_scale, max_prompt=max_prompt,
                                     max_output=max_out, output_scale=1.0)
    for s in probe:
        s.at = None
    r = ctx.load(srv, probe[: ctx.n(48, 16)], label="trace knee probe C=16", concurrency=16, duration=ctx.d(30))
    knee = r["summary"]["request_throughput_rps"]
    if not knee or knee != knee:
        raise RuntimeError(f"knee probe completed no request: {r['records'][0].error if r['records'] else ''}")
    window = ctx.d(40)  # wall seconds per rate point
    res, points = {}, []
    for mult in (0.5, 1.0, 2.0):
        rate = knee * mult
        # pick a trace window with ~rate * window requests, compress/stretch its time to that rate
        n_req = max(4, int(rate * window))
        sub = rows_all[:n_req]
        span = (sub[-1].t - sub[0].t) or 1.0
        rate_scale = rate * span / n_req  # trace's own rate n_req/span -> the target rate
        specs = workloads.trace_workload(ctx.pf, sub, rate_scale=rate_scale, token_scale=token_scale,
                                         max_prompt=max_prompt, max_output=max_out, output_scale=1.0)
        rr = ctx.load(srv, specs, label=f"trace {mult}x knee", mode="open", drain=60)
        s = rr["summary"]
        res[f"{mult}x"] = {"rate_rps": rate, "time_scale": rate_scale, **_small(s)}
        points.append((f"{mult}x knee ({rate:.2f} req/s)", s))
    ctx.summary["trace"] = {"knee_rps": knee, "token_scale": token_scale, **res}
    ctx.sections[6] = (
        "## 6. Azure LLM inference trace (code completion), replayed\n\n"
        f"`{os.path.relpath(_trace_path(), REPO)}`: arrivals and token counts of the first N requests, "
        f"prompt lengths x{token_scale}, output lengths as recorded (clipped to {max_prompt} prompt / {max_out} "
        "output tokens: a 135M model "
        "on 2 cores cannot prefill 1.5k-token prompts at the trace's 2.6 req/s), arrival times rescaled so "
        f"the mean rate is 0.5x/1x/2x the knee. Knee = saturated throughput of this length mix, closed "
        f"loop at 16 streams: **{knee:.2f} req/s**. Each point replays ~{window:.0f} s.\n\n"
        + report.markdown_table(points, per_class=False) + "\n")


def _trace_path() -> str:
    from .workloads import AZURE_CODE_TRACE
    return AZURE_CODE_TRACE


def exp7_roofline(ctx: Ctx) -> None:
    from .roofline import measure_machine, model_shape, table
    ctx.stop()
    shape = model_shape(bundled_model_path())
    machine = measure_machine(seconds=min(3.0, max(0.3, 3.0 * ctx.scale)))
    steps = ctx.summary.get("ours_equal_tpot_p50")
    if not steps:
        srv = ctx.ours()
        steps = {}
        for c in (1, 8, 32):
            specs = workloads.fixed(PromptFactory("smollm2", seed=70 + c), ctx.n(c, c), 128, 128)
            steps[c] = ctx.load(srv, specs, label=f"roofline ours C={c}", concurrency=c)["summary"]["tpot_s"]["p50"]
        ctx.stop()
    measured = {("bfloat16", int(c)): v for c, v in steps.items() if v}
    md, rows = table(machine, shape, [1, 8, 32], 128 + 64, measured)
    ctx.summary["roofline"] = {"machine": machine, "shape": shape, "rows": rows}
    ach32 = next((r["achieved_fraction"] for r in rows if r["dtype"] == "bfloat16" and r["batch"] == 32), None)
    ctx.sections[7] = (
        "## 7. The limit: roofline of one decode step\n\n"
        f"Measured here with torch ({machine['threads']} threads): matmul peak fp32 "
        f"{machine['matmul_gflops']['float32']:.0f} GFLOP/s, bf16 {machine['matmul_gflops']['bfloat16']:.0f} GFLOP/s "
        f"(decode-shaped [32 x 4096] @ [4096 x 4096]: fp32 {machine['decode_linear_gflops_b32']['float32']:.0f}, "
        f"bf16 {machine['decode_linear_gflops_b32']['bfloat16']:.0f}); memory bandwidth {machine['bandwidth']['read_gbs']:.1f} GB/s "
        f"read (sum), {machine['bandwidth'].get('gemv_bf16_gbs', float('nan')):.1f} GB/s bf16 GEMV, "
        f"{machine['bandwidth']['copy_gbs']:.1f} GB/s copy (the bound uses the best read rate). Model from GGUF metadata: {shape['layers']} layers, "
        f"d={shape['d_model']}, {shape['heads']}/{shape['kv_heads']} heads, {shape['matmul_params'] / 1e6:.1f}M matmul "
        "params (tied lm_head read every step). Context per sequence 192 tokens (128-token prompt, middle of 128 "
        "outputs). Measured step = our TPOT p50 at C=B with equal lengths (experiment 5: all B streams "
        "decode together), which includes the server, sampling and the client on the same cores.\n\n" + md +
        f"\n\n**Achieved fraction of the bf16 bound at B=32: {_pct(ach32)}** (target >= 50%)\n")


EXPERIMENTS = {1: exp1_frontier, 2: exp2_hol, 3: exp3_prefix, 4: exp4_static, 5: exp5_side_by_side,
               6: exp6_trace, 7: exp7_roofline}


def _small(s: dict) -> dict:
    keep = ("counts", "rates", "duration_s", "offered_rps", "request_throughput_rps", "output_token_throughput",
            "goodput_rps", "slo_attainment", "ttft_s", "itl_s", "tpot_s", "e2e_s", "inconsistent")
    return {k: s[k] for k in keep if k in s}


_f, _x, _pct = report.fmt, report.fmt_ratio, report.fmt_pct


def main(a: argparse.Namespace) -> None:
    import signal
    # SIGTERM -> SystemExit, so the finally below stops the server under test (its own session)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ctx = Ctx(a)
    only = [int(x) for x in a.only.split(",") if x]
    try:
        for k in only:
            t = time.time()
            if a.budget_min is not None and t - ctx.started > a.budget_min * 60:
                ctx.sections[k] = (f"## {k}. {EXPERIMENTS[k].__name__}: skipped (time budget of "
                                   f"{a.budget_min:g} min spent; run `--only {k}`)\n")
                continue
            print(f"== experiment {k}: {EXPERIMENTS[k].__name__}", file=sys.stderr)
            load, started = os.getloadavg(), time.strftime("%H:%M:%S %Z")
            try:
                EXPERIMENTS[k](ctx)
                ctx.sections[k] += (f"\n_Started {started}, took {time.time() - t:.0f} s; "
                                    f"1/5/15-min load average at start: {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} "
                                    f"on {os.cpu_count()} cores._\n")
            except Exception as e:  # one failing experiment must not lose the others' results
                import traceback
                traceback.print_exc()
                ctx.sections[k] = f"## {k}. {EXPERIMENTS[k].__name__}: FAILED\n\n```\n{type(e).__name__}: {e}\n```\n"
            print(f"== experiment {k} done in {time.time() - t:.0f}s", file=sys.stderr)
            ctx.write()
    finally:
        ctx.stop()
        ctx.write()
    print(ctx.md_path)
