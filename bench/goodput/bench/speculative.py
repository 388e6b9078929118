"""n-gram speculative decoding, in-process: output tokens/s with it off, on and adaptive, on a
workload whose output copies its prompt and on one whose output does not, plus its cost to the
other requests of a batch.

    python -m goodput.bench speculative --out bench/results/speculative.json

One engine per mode (the worker's own ``build_engine``: model, C++ kernels, scheduler); the modes
take turns within each round (``--rounds``) so a slow spell of a shared machine hits all of them,
and the median round is reported. Workloads (``goodput.bench.prompts``): ``copying`` =
COPYING_PROMPTS (a repeat, code edits, a list with a pattern), ``plain`` = FIXED_PROMPTS[:8]
(facts, stories, code starts). Greedy, ``--max-tokens`` each, EOS ends a request early.

Reported per (workload, mode): decode tokens/s at one stream (generated tokens after the first /
time after the first token, summed over the prompts), its ratio to "off", the acceptance rate
(accepted / draft tokens), the mean accepted length per draft, tokens per forward pass, and
whether every output equals "off"'s token for token. ``--batch`` adds a mixed batch: the plain
prompts decoding together with the copying ones, speculation on for the copying ones only
(the request's ``speculative`` field); the plain requests' time per output token, against the same
batch with speculation off, is the cost speculation puts on its neighbours (their extra positions
in the step).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=8, help="--num-speculative-tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the mixed batch")
    p.add_argument("--out", default=None, help="JSON result path")


def _engine(mode: str, a):
    from goodput.worker.engine.config import EngineArgs
    from goodput.worker.engine_args import build_engine
    # no prefix caching: a repeated prompt would hit the cache, and a prefill from cached blocks
    # rounds differently from a cold one in bf16, so rounds would not decode the same text
    return build_engine(EngineArgs(dtype=a.dtype, device="cpu", speculative_mode=mode, enable_prefix_caching=False,
                                   num_speculative_tokens=a.k, num_threads=a.threads, max_model_len=2048))


def _run(engine, prompts: list[str], a, speculative: list[bool | None]) -> dict:
    """Decode ``prompts`` together (one engine step loop); per request: ids, first/last token time."""
    from goodput.worker.engine.sampling_params import SamplingParams
    tok = engine.tokenizer
    reqs = {}
    for i, (p, spec) in enumerate(zip(prompts, speculative)):
        rid = f"b{time.monotonic_ns()}-{i}"
        reqs[rid] = engine.add_request(rid, tok.encode(p), SamplingParams(
            temperature=0, max_tokens=a.max_tokens, speculative=spec))
    s0 = engine.scheduler.stats()
    steps0 = engine.num_steps
    while engine.has_unfinished():
        engine.step()
    s1 = engine.scheduler.stats()
    return {"requests": [(list(r.output_token_ids), r.token_times) for r in reqs.values()],
            "drafts": s1.spec_decode_drafts_total - s0.spec_decode_drafts_total,
            "draft_tokens": s1.spec_decode_draft_tokens_total - s0.spec_decode_draft_tokens_total,
            "accepted": s1.spec_decode_accepted_tokens_total - s0.spec_decode_accepted_tokens_total,
            "steps": engine.num_steps - steps0}


def _decode_rate(requests) -> float:
    """Generated tokens after the first / seconds after the first token, summed over requests."""
    toks = sum(len(ids) - 1 for ids, _ in requests)
    secs = sum(times[-1] - times[0] for _, times in requests if len(times) > 1)
    return toks / secs if secs > 0 else float("nan")


def _tpot(requests) -> float:
    """Mean time per output token after the first, seconds (the requests given)."""
    per = [(t[-1] - t[0]) / (len(t) - 1) for _, t in requests if len(t) > 1]
    return statistics.mean(per)


def _first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first output token where two greedy outputs differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def one_stream(engines: dict, prompts: list[str], a) -> dict:
    """Each prompt alone (one stream); modes take turns within a round."""
    rounds: dict[str, list] = {m: [] for m in engines}
    for _ in range(a.rounds):
        for mode, eng in engines.items():
            runs = [_run(eng, [p], a, [None]) for p in prompts]
            reqs = [r["requests"][0] for r in runs]
            rounds[mode].append({"rate": _decode_rate(reqs), "ids": [ids for ids, _ in reqs],
                                 **{k: sum(r[k] for r in runs) for k in ("drafts", "draft_tokens", "accepted", "steps")},
                                 "tokens": sum(len(ids) for ids, _ in reqs)})
    out = {}
    base = statistics.median(r["rate"] for r in rounds["off"])
    for mode, rs in rounds.items():
        med = sorted(rs, key=lambda r: r["rate"])[len(rs) // 2]
        out[mode] = {
            "decode_tok_s": round(med["rate"], 1), "vs_off": round(med["rate"] / base, 3),
            "acceptance_rate": round(med["accepted"] / med["draft_tokens"], 3) if med["draft_tokens"] else None,
            "mean_accepted_per_draft": round(med["accepted"] / med["drafts"], 2) if med["drafts"] else None,
            "tokens_per_step": round(med["tokens"] / med["steps"], 2),
            "identical_to_off": f"{sum(x == y for x, y in zip(med['ids'], rounds['off'][0]['ids']))}/{len(prompts)}",
            "first_difference_at": [_first_difference(x, y) for x, y in zip(med["ids"], rounds["off"][0]["ids"])
                                    if x != y],
            "rates": [round(r["rate"], 1) for r in rs],
        }
    return out


def mixed_batch(engines: dict, copying: list[str], plain: list[str], a) -> dict:
    """Plain and copying prompts in one batch; the copying ones speculate (or, in the baseline,
    nothing does): the plain requests' TPOT is what speculation costs its neighbours."""
    eng = engines["off"]
    prompts = plain + copying
    res = {"off": [], "copying_speculate": []}
    for _ in range(a.rounds):
        for name, spec in (("off", False), ("copying_speculate", True)):
            r = _run(eng, prompts, a, [False] * len(plain) + [spec] * len(copying))
            res[name].append({"plain_tpot_ms": 1000 * _tpot(r["requests"][:len(plain)]),
                              "copying_tpot_ms": 1000 * _tpot(r["requests"][len(plain):]),
                              "steps": r["steps"],
                              "accepted": r["accepted"], "draft_tokens": r["draft_tokens"]})
    out = {}
    for name, rs in res.items():
        out[name] = {k: round(statistics.median(x[k] for x in rs), 2)
                     for k in ("plain_tpot_ms", "copying_tpot_ms", "steps")}
        out[name]["acceptance_rate"] = round(sum(x["accepted"] for x in rs) / max(1, sum(x["draft_tokens"] for x in rs)), 3)
    out["plain_tpot_ratio"] = round(out["copying_speculate"]["plain_tpot_ms"] / out["off"]["plain_tpot_ms"], 3)
    out["copying_tpot_ratio"] = round(out["copying_speculate"]["copying_tpot_ms"] / out["off"]["copying_tpot_ms"], 3)
    return out


def main(a) -> dict:
    from goodput.bench.prompts import COPYING_PROMPTS, FIXED_PROMPTS
    engines = {m: _engine(m, a) for m in ("off", "on", "adaptive")}
    for eng in engines.values():  # warm-up: first steps pay one-time costs
        _run(eng, FIXED_PROMPTS[:1], a, [None])
    result = {"config": {"dtype": a.dtype, "threads": a.threads, "max_tokens": a.max_tokens, "k": a.k,
                         "rounds": a.rounds},
              "one_stream": {"copying": one_stream(engines, COPYING_PROMPTS, a),
                             "plain": one_stream(engines, FIXED_PROMPTS[:8], a)}}
    if a.batch:
        result["mixed_batch"] = mixed_batch(engines, COPYING_PROMPTS, FIXED_PROMPTS[:8], a)
    print(report_md(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def report_md(r: dict) -> str:
    lines = ["| workload | mode | decode tok/s | vs off | acceptance | accepted / draft | tokens / step | "
             "outputs identical to off (first difference at token) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for wl, modes in r["one_stream"].items():
        for mode, m in modes.items():
            lines.append(f"| {wl} | {mode} | {m['decode_tok_s']} | {m['vs_off']:.2f}x | "
                         f"{m['acceptance_rate'] if m['acceptance_rate'] is not None else '-'} | "
                         f"{m['mean_accepted_per_draft'] if m['mean_accepted_per_draft'] is not None else '-'} | "
                         f"{m['tokens_per_step']} | {m['identical_to_off']}"
                         f"{' (' + ', '.join(map(str, m['first_difference_at'])) + ')' if m['first_difference_at'] else ''} |")
    if "mixed_batch" in r:
        mb = r["mixed_batch"]
        lines += ["", "| mixed batch (8 plain + 4 copying) | plain TPOT ms | copying TPOT ms | steps |",
                  "|---|---:|---:|---:|"]
        for name in ("off", "copying_speculate"):
            x = mb[name]
            lines.append(f"| {name} | {x['plain_tpot_ms']} | {x['copying_tpot_ms']} | {x['steps']} |")
        lines.append(f"\nplain requests' TPOT x{mb['plain_tpot_ratio']}, copying requests' x{mb['copying_tpot_ratio']} "
                     "with speculation on for the copying ones")
    return "\n".join(lines)
