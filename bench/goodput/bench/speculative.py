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

``--llama-server`` adds llama.cpp's own n-gram speculation on the same prompt token ids: one
``llama-server`` per mode (:data:`LLAMA_MODES`: off; ``ngram-simple`` with llama.cpp's defaults,
a 12-token lookup proposing up to 48; and ``ngram-simple`` at n = 3, m = 8, the closest to ours:
n-grams of 2 to 4 tokens, 8-token drafts), one slot each, all up at once and taking turns per
prompt. Its decode rate is the server's own ``timings`` (``predicted_n`` / ``predicted_ms``: tokens
sampled after the prompt over the time after the prompt), its acceptance ``draft_n_accepted`` /
``draft_n``. The binary comes from ``bench/setup_baselines.sh``; its weights are the GGUF's own
4- and 8-bit blocks, ours bf16, so the rows compare each system's speed-up over its own "off".
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
    p.add_argument("--llama-server", action="store_true",
                   help="also run llama-server's n-gram speculation on the same prompts (see LLAMA_MODES)")
    p.add_argument("--only-llama-server", action="store_true", help="only the llama-server rows")


#: llama-server's speculation modes compared with ours: (label, extra command-line flags)
LLAMA_MODES = (
    ("off", []),
    ("ngram-simple", ["--spec-type", "ngram-simple"]),
    ("ngram-simple n3 m8", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                            "--spec-ngram-simple-size-m", "8"]),
)


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


def _llama_completion(base_url: str, ids: list[int], a) -> dict:
    """One greedy /completion on llama-server from prompt token ids: its output ids and timings."""
    import httpx
    r = httpx.post(base_url + "/completion", timeout=600, json={
        "prompt": ids, "n_predict": a.max_tokens, "temperature": 0, "cache_prompt": False,
        "return_tokens": True})
    r.raise_for_status()
    body = r.json()
    return {"ids": body.get("tokens", []), **body["timings"]}


def summarize_llama_rounds(rounds: dict[str, list[dict]]) -> dict:
    """Per mode, its median round (by decode rate) against the median rate of "off".

    rounds: {mode: [{"rate": tok/s, "draft_tokens": n, "accepted": n, "ids": [[output ids] per
    prompt]}, ...]}, "off" among the modes. Returns {mode: {decode_tok_s, vs_off, acceptance_rate
    (None without drafts), identical_to_off ("k/n" prompts equal to off's first round), rates}}.
    """
    base = statistics.median(r["rate"] for r in rounds["off"])
    out = {}
    for mode, rs in rounds.items():
        med = sorted(rs, key=lambda r: r["rate"])[len(rs) // 2]
        out[mode] = {
            "decode_tok_s": round(med["rate"], 1), "vs_off": round(med["rate"] / base, 3),
            "acceptance_rate": round(med["accepted"] / med["draft_tokens"], 3) if med["draft_tokens"] else None,
            "identical_to_off": f"{sum(x == y for x, y in zip(med['ids'], rounds['off'][0]['ids']))}/{len(med['ids'])}",
            "rates": [round(r["rate"], 1) for r in rs]}
    return out


def llama_server_rows(workloads: dict[str, list[str]], a) -> dict:
    """llama-server's rows for each workload and :data:`LLAMA_MODES` (median round), shaped as
    :func:`one_stream`'s. RuntimeError when the binary is not built."""
    import contextlib
    import os
    import tempfile

    from goodput.worker.model.gguf_loader import read_metadata
    from goodput.worker.model.tokenizer import GGUFTokenizer

    from .llama_server import llama_server_cmd, llama_server_path
    from .prompts import bundled_model_path
    from .servers import Server, free_port
    binary = llama_server_path()
    if binary is None:
        raise RuntimeError("llama-server is not built: run bench/setup_baselines.sh")
    gguf = bundled_model_path()
    tok = GGUFTokenizer(read_metadata(gguf)[0])  # the engine's own tokenizer: the same prompt ids
    import torch
    threads = a.threads or torch.get_num_threads()  # as many as our engines use
    logs = tempfile.mkdtemp(prefix="spec-llama-")
    with contextlib.ExitStack() as stack:
        servers = {}
        for label, flags in LLAMA_MODES:
            port = free_port()
            cmd = llama_server_cmd(binary, gguf, port, 1, 2048, threads) + flags
            servers[label] = stack.enter_context(Server(cmd, port, os.path.join(logs, label.replace(" ", "-") + ".log"),
                                                        ready_path="/health", ready_timeout=300))
        for srv in servers.values():  # warm-up
            _llama_completion(srv.base_url, tok.encode(workloads["plain"][0]), a)
        out = {}
        for wl, prompts in workloads.items():
            ids = [tok.encode(p) for p in prompts]
            rounds: dict[str, list] = {m: [] for m in servers}
            for _ in range(a.rounds):
                for mode, srv in servers.items():
                    runs = [_llama_completion(srv.base_url, x, a) for x in ids]
                    rounds[mode].append({
                        "rate": sum(r["predicted_n"] for r in runs) / (sum(r["predicted_ms"] for r in runs) / 1000),
                        "draft_tokens": sum(r.get("draft_n", 0) for r in runs),
                        "accepted": sum(r.get("draft_n_accepted", 0) for r in runs),
                        "ids": [r["ids"] for r in runs]})
            out[wl] = summarize_llama_rounds(rounds)
    return out


def main(a) -> dict:
    from goodput.bench.prompts import COPYING_PROMPTS, FIXED_PROMPTS
    workloads = {"copying": COPYING_PROMPTS, "plain": FIXED_PROMPTS[:8]}
    result = {"config": {"dtype": a.dtype, "threads": a.threads, "max_tokens": a.max_tokens, "k": a.k,
                         "rounds": a.rounds}}
    if not a.only_llama_server:
        engines = {m: _engine(m, a) for m in ("off", "on", "adaptive")}
        for eng in engines.values():  # warm-up: first steps pay one-time costs
            _run(eng, FIXED_PROMPTS[:1], a, [None])
        result["one_stream"] = {wl: one_stream(engines, prompts, a) for wl, prompts in workloads.items()}
        if a.batch:
            result["mixed_batch"] = mixed_batch(engines, COPYING_PROMPTS, FIXED_PROMPTS[:8], a)
    if a.llama_server or a.only_llama_server:
        result["llama_server"] = llama_server_rows(workloads, a)
    print(report_md(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def report_md(r: dict) -> str:
    lines = []
    if "one_stream" in r:
        lines += [("| workload | mode | decode tok/s | vs off | acceptance | accepted / draft | tokens / step | "
                   "outputs identical to off (first difference at token) |"),
                  "|---|---|---:|---:|---:|---:|---:|---|"]
    for wl, modes in r.get("one_stream", {}).items():
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
    if "llama_server" in r:
        lines += ["", "| workload | llama-server mode | decode tok/s | vs off | acceptance | outputs identical to off |",
                  "|---|---|---:|---:|---:|---|"]
        for wl, modes in r["llama_server"].items():
            for mode, m in modes.items():
                acc = m["acceptance_rate"] if m["acceptance_rate"] is not None else "-"
                lines.append(f"| {wl} | {mode} | {m['decode_tok_s']} | {m['vs_off']:.2f}x | {acc} | {m['identical_to_off']} |")
    return "\n".join(lines)
