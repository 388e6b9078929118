"""goodput-bench: load generator and benchmark experiments.

  goodput-bench run --base-url http://127.0.0.1:8000 --workload uniform --input-len 64:512 \
      --output-len 16:256 --concurrency 1,2,4,8 --num-requests 32 --seed 0 --out bench/results/raw/x
  goodput-bench run ... --arrival poisson --rate 0.5,1,2 [--cv 2 for gamma]
  goodput-bench run ... --workload trace --trace PATH --rate-scale 0.1
  goodput-bench roofline [--batches 1,8,32]
  goodput-bench experiments [--only 1,2,...] [--quick]    (see bench/README.md)
  goodput-bench perf [--scale 0.5]          (vs llama-server; bench/run_perf.sh)
  goodput-bench decode-steps --batches 1,16 --contexts 512,2048,8192
  goodput-bench speculative [--out x.json]  (n-gram speculative decoding: off / on / adaptive)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from . import report, workloads
from .loadgen import LoadConfig, run_load
from .metrics import check_consistency, summarize
from .prompts import PromptFactory

DEFAULT_TRACE = workloads.AZURE_CODE_TRACE


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help='"model" field (default: first id of GET /v1/models)')
    p.add_argument("--tokenizer-model", default="smollm2", help="GGUF whose tokenizer sizes the prompts")
    p.add_argument("--workload", choices=["fixed", "uniform", "shared-prefix", "long-inject", "trace"],
                   default="fixed")
    p.add_argument("--input-len", default="128", help="N or LO:HI (uniform)")
    p.add_argument("--output-len", default="64", help="N or LO:HI (uniform)")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    p.add_argument("--long-input-len", type=int, default=2048, help="long-inject: the long prompt")
    p.add_argument("--long-output-len", type=int, default=1)
    p.add_argument("--inject-at", type=float, default=5.0, help="long-inject: seconds after start")
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--trace-start", type=float, default=0.0, help="trace seconds to skip")
    p.add_argument("--trace-window", type=float, default=None, help="trace seconds to replay")
    p.add_argument("--rate-scale", type=float, default=1.0, help="trace: time compression (>1 faster)")
    p.add_argument("--token-scale", type=float, default=1.0, help="trace: multiply token counts")
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--arrival", choices=["closed", "poisson", "gamma", "trace"], default="closed")
    p.add_argument("--concurrency", default="1", help="closed loop: one value or a sweep 1,2,4")
    p.add_argument("--rate", default="1", help="open loop req/s: one value or a sweep 0.5,1,2")
    p.add_argument("--cv", type=float, default=2.0, help="gamma: coefficient of variation")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many s")
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--warmup", type=int, default=2, help="unrecorded requests before each point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--min-tokens-equal-max", action="store_true",
                   help="also send min_tokens = max_tokens (servers without ignore_eos, e.g. llama-cpp-python)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--out", default=None, help="directory for <tag>.json / .md / .png")
    p.add_argument("--tag", default="run")
    p.add_argument("--no-progress", action="store_true")


def build_specs(a: argparse.Namespace, pf: PromptFactory, seed: int) -> list[workloads.RequestSpec]:
    n = a.num_requests
    if a.workload == "fixed":
        return workloads.fixed(pf, n, workloads.parse_range(a.input_len)[0], workloads.parse_range(a.output_len)[0])
    if a.workload == "uniform":
        return workloads.uniform(pf, n, workloads.parse_range(a.input_len), workloads.parse_range(a.output_len),
                                 seed=seed)
    if a.workload == "shared-prefix":
        return workloads.shared_prefix(pf, n, a.prefix_len, workloads.parse_range(a.input_len)[0],
                                       workloads.parse_range(a.output_len)[0])
    if a.workload == "long-inject":
        return workloads.long_inject(pf, n, workloads.parse_range(a.input_len)[0],
                                     workloads.parse_range(a.output_len)[0], a.long_input_len,
                                     a.long_output_len, a.inject_at)
    rows = workloads.read_azure_trace(a.trace)
    return workloads.trace_workload(pf, rows, rate_scale=a.rate_scale, token_scale=a.token_scale,
                                    max_prompt=a.max_prompt, max_output=a.max_output, start=a.trace_start,
                                    duration=a.trace_window)[: a.num_requests]


def run_point(a: argparse.Namespace, specs, *, mode: str, concurrency: int, label: str) -> dict:
    """Warm up, run one load point, summarize; returns {label, config, summary, records}."""
    cfg = LoadConfig(base_url=a.base_url.rstrip("/"), model=a.model, mode=mode, concurrency=concurrency,
                     duration_s=a.duration, drain_timeout_s=a.drain_timeout, ignore_eos=a.ignore_eos,
                     extra_body=json.loads(a.extra_body), progress=not a.no_progress, desc=label,
                     min_tokens_equal_max=a.min_tokens_equal_max)
    if a.warmup:
        pf = PromptFactory(a.tokenizer_model, seed=10_000 + a.seed)
        wcfg = LoadConfig(**{**cfg.__dict__, "mode": "closed", "concurrency": 1, "duration_s": None,
                             "progress": False})
        asyncio.run(run_load(wcfg, workloads.fixed(pf, a.warmup, 16, 4, cls="warmup")))
    records, info = asyncio.run(run_load(cfg, specs))
    slo_ttft = a.slo_ttft_ms / 1e3 if a.slo_ttft_ms is not None else None
    slo_tpot = a.slo_tpot_ms / 1e3 if a.slo_tpot_ms is not None else None
    summ = summarize(records, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot)
    bad = {r.request_id: check_consistency(r) for r in records}
    bad = {k: v for k, v in bad.items() if v}
    cfg_d = {k: v for k, v in cfg.__dict__.items()}
    cfg_d.update(workload=a.workload, seed=a.seed, arrival=a.arrival, model=info["model"])
    return {"label": label, "config": cfg_d, "summary": summ, "inconsistent": bad,
            "t_start": info["t_start"], "records": [r.to_dict() for r in records],
            "specs": [s.to_dict() for s in specs]}


def cmd_run(a: argparse.Namespace) -> list[dict]:
    pf = PromptFactory(a.tokenizer_model, seed=a.seed)
    results = []
    if a.arrival == "closed":
        points = [("closed", c, f"C={c}", None) for c in _ints(a.concurrency)]
    elif a.arrival == "trace":
        points = [("open", 0, f"trace x{a.rate_scale:g}", None)]
    else:
        points = [("open", 0, f"{a.arrival} {r:g}/s", r) for r in _floats(a.rate)]
    for mode, c, label, rate in points:
        specs = build_specs(a, pf, a.seed)
        if rate is not None:
            cv = 1.0 if a.arrival == "poisson" else a.cv
            specs = workloads.with_arrivals(specs, workloads.gamma_times(len(specs), rate, cv, a.seed))
        res = run_point(a, specs, mode=mode, concurrency=c, label=label)
        res["config"]["rate"] = rate
        results.append(res)
        s = res["summary"]
        print(f"{label}: {s['counts']} out tok/s={s['output_token_throughput']:.1f} "
              f"TTFT p50={s['ttft_s']['p50']} ITL p50={s['itl_s']['p50']} "
              f"inconsistent={len(res['inconsistent'])}", file=sys.stderr)
    table = report.markdown_table([(r["label"], r["summary"]) for r in results])
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        report.save_json(os.path.join(a.out, f"{a.tag}.json"), {"argv": sys.argv, "time": time.time(),
                                                                 "points": results})
        with open(os.path.join(a.out, f"{a.tag}.md"), "w") as f:
            f.write(f"`{' '.join(sys.argv)}`\n\n{table}\n")
        if len(results) > 1:
            report.plot_frontier([(r["label"], r["summary"]) for r in results],
                                 os.path.join(a.out, f"{a.tag}.png"), a.tag)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="goodput-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_run_args(sub.add_parser("run", help="drive a server with a workload and arrival process"))
    rp = sub.add_parser("roofline", help="peak matmul GFLOP/s, memory bandwidth, decode-step bounds")
    rp.add_argument("--batches", default="1,8,32")
    rp.add_argument("--context", type=int, default=256, help="tokens of KV per sequence")
    rp.add_argument("--out", default=None)
    ep = sub.add_parser("experiments", help="run the seven experiments (bench/README.md)")
    from .experiments import add_args as add_exp_args
    add_exp_args(ep)
    hp = sub.add_parser("hf-static", help="HF transformers static batching baseline (in-process)")
    from .hf_static import add_args as add_hf_args
    add_hf_args(hp)
    dp = sub.add_parser("decode-steps", help="time our decode steps in-process at given batch x context")
    from .decode_steps import add_args as add_ds_args
    add_ds_args(dp)
    sp = sub.add_parser("speculative", help="n-gram speculative decoding off/on/adaptive, in-process")
    from .speculative import add_args as add_sp_args
    add_sp_args(sp)
    pp = sub.add_parser("perf", help="side by side vs llama-server and HF, roofline, context growth")
    from .perf import add_args as add_perf_args
    add_perf_args(pp)
    a = ap.parse_args(argv)
    if a.cmd == "run":
        cmd_run(a)
    elif a.cmd == "roofline":
        from .roofline import main as roofline_main
        roofline_main(a)
    elif a.cmd == "experiments":
        from .experiments import main as exp_main
        exp_main(a)
    elif a.cmd == "decode-steps":
        from .decode_steps import main as ds_main
        ds_main(a)
    elif a.cmd == "speculative":
        from .speculative import main as sp_main
        sp_main(a)
    elif a.cmd == "perf":
        from .perf import main as perf_main
        return perf_main(a)
    elif a.cmd == "hf-static":
        from .hf_static import main as hf_main
        hf_main(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
