"""Prefill/decode (P/D) disaggregation in the fleet simulator, against colocated serving.

``python -m goodput.bench.simulate --pd [--trace long-context|chat|all] [--pd-sizes 4,6,8]
[--pd-threshold 512] [--duration S] [--rate R] [--out-dir bench/results/disaggregation]``
(:func:`main`; ``simulate.main`` hands ``--pd`` here).

Disaggregated serving (DistServe, Zhong et al., OSDI 2024; Splitwise, Patel et al., ISCA 2024)
runs prompts on prefill pods and token generation on decode pods, so a long prompt never
stretches the inter-token latency (TPOT) of the requests decoding elsewhere; the price is
shipping the prompt's KV cache from the prefill pod to the decode pod.

What :func:`simulate_pd` runs, on a fixed fleet of ``P`` prefill and ``D`` decode replicas (every
replica the simulator's :class:`~goodput.bench.simulate.Replica`: the engine's real
``Scheduler`` and ``BlockManager`` with the step-time model, chunked prefill as in colocated
serving):

1. an arrival picks a decode replica (least loaded: running + waiting + requests on their way to
   it; ties in turn, as ``--routing least-loaded``) and asks its prefix cache how much of the
   prompt it already holds. When the uncached rest is longer than ``threshold`` tokens the
   request is prefilled remotely (step 2); otherwise the decode replica serves it whole, prompt
   chunks mixed with its decodes (colocated serving on that replica).
2. remote prefill: the least-loaded prefill replica runs the prompt (``max_tokens = 1``: its
   step that completes the prompt samples the first token).
3. the prompt's KV (all its tokens, :func:`kv_bytes`) goes over the prefill replica's link
   (:class:`Link`; transfers out of one prefill replica are sent one at a time, in order; the
   decode side's NIC is not modelled).
4. the decode replica admits the request as a decode: prompt + first token, KV of the prompt
   already in place (:class:`KVImportBlockManager`), ``output - 1`` tokens to generate; it waits
   in the decode replica's queue like any request (max_num_seqs, KV pool). Its first step feeds
   the first token back (attends prompt + 1 tokens) and samples the second.

Latencies (``Request`` definitions). TTFT of a remotely prefilled request = arrival -> the first
token reaches the decode replica, i.e. queueing on the prefill replica + prefill steps + the
wait for its link + the transfer. DistServe counts the first token at the end of the prefill;
we count it where the client gets it, from the decode replica that streams the whole answer
(what a proxy in front of P/D pods, such as vLLM's disaggregated-prefill example, shows a
client), so the transfer is inside TTFT. TPOT = (last token - first token) / (output - 1): the
decode replica's queueing, if any, lands in TPOT (the client waits between tokens 1 and 2).

Not modelled: KV space on the decode replica is taken at admission, not before the transfer
(real systems allocate then pull; here the prefill replica, or host memory, is assumed to hold
the KV until the decode replica admits it); a decode replica's preempted request is recomputed
there (the engine's rule), which then is prefill work on a decode replica (counted in
``PDResult.decode_prefill_tokens``); the KV a decode replica already caches is shipped again.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from goodput.bench.simulate import HARDWARE, Replica, SloRates, StepTime, Trace, make_trace
from goodput.worker.engine.block_manager import BlockManager
from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import RunnerOutput
from goodput.worker.engine.request import Request
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.scheduler import AdmissionError


# ------------------------------------------------------------------------------- KV transfer
@dataclass(frozen=True)
class Link:
    """A prefill -> decode network path: ``seconds(bytes) = bytes / bandwidth + latency``.

    bandwidth_bytes_s: bytes per second; latency_s: seconds per transfer (one message set-up).
    """

    name: str
    bandwidth_bytes_s: float
    latency_s: float

    def seconds(self, nbytes: float) -> float:
        """Transfer time in seconds of ``nbytes`` bytes."""
        return nbytes / self.bandwidth_bytes_s + self.latency_s


# RDMA class: one NVIDIA ConnectX-7 port at 400 Gb/s = 50 GB/s line rate (InfiniBand NDR or
# RoCE), a GPUDirect RDMA write's latency of the order of 10 us. TCP class: a 25 Gb/s Ethernet
# path = 3.125 GB/s line rate, taken as 3 GB/s, ~100 us through the kernel's TCP stack. Both are
# line rates, best cases: a real transfer of many KV blocks gets less.
RDMA = Link("rdma", 50e9, 10e-6)
TCP = Link("tcp", 3e9, 100e-6)
LINKS = {"rdma": RDMA, "tcp": TCP}


def kv_bytes(hw: StepTime, tokens: int) -> int:
    """KV cache bytes of ``tokens`` tokens on ``hw``'s model: ``2 * layers * kv_heads * head_dim
    * bytes_per_elem * tokens`` (K and V), i.e. ``hw.kv_bytes_per_token * tokens``. For
    ``h200_step_time`` (Llama-3-70B: 80 layers, 8 KV heads, head dim 128; its KV cache is bf16,
    2 bytes: the weights are FP8, the cache is not) that is 327,680 B = 320 KiB per token."""
    if hw.kv_bytes_per_token <= 0:
        raise ValueError(f"step time {hw.name!r} does not give its KV bytes per token")
    return hw.kv_bytes_per_token * tokens


def transfer_seconds(hw: StepTime, link: Link, tokens: int) -> float:
    """Seconds to ship the KV of ``tokens`` tokens over ``link``: ``kv_bytes / bandwidth +
    latency`` (e.g. 4,000 tokens on the h200 model: 1.31 GB, 26 ms over RDMA, 437 ms over TCP)."""
    return link.seconds(kv_bytes(hw, tokens))


# ------------------------------------------------------------------------------ KV import
class KVImportBlockManager(BlockManager):
    """A decode replica's block manager: a request whose prompt KV arrived from a prefill replica
    (``expect(request_id, tokens)``) is admitted with those ``tokens`` already computed.

    The scheduler admits a waiting request by asking ``get_computed_blocks`` for its cached prefix
    and then ``allocate_slots`` for the rest; for an expected request the first answers ``tokens``
    and the second reserves blocks for all of them and sets ``num_computed_tokens`` to
    ``tokens``, so the scheduler sees a decode (one token left) and schedules it as one. A
    preempted request loses its imported KV (freed) and is recomputed here like any other."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.expected: dict[str, int] = {}

    def expect(self, request_id: str, tokens: int) -> None:
        self.expected[request_id] = tokens

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        n = self.expected.get(req.request_id)
        if n is not None and not req.block_ids:
            return [], n
        return super().get_computed_blocks(req)

    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks=()) -> bool:
        n = self.expected.get(req.request_id)
        if n is None or req.block_ids or req.num_computed_tokens:
            return super().allocate_slots(req, num_new_tokens, new_computed_blocks)
        if not super().allocate_slots(req, n + num_new_tokens):
            return False
        req.num_computed_tokens = n
        return True

    def free(self, req: Request) -> None:
        self.expected.pop(req.request_id, None)
        super().free(req)


# ------------------------------------------------------------------------------- simulation
@dataclass
class PDResult(SloRates):
    """One fixed fleet on one trace. ``prefill``/``decode``: replica counts (``prefill == 0``:
    colocated). Latencies per finished request in seconds; goodput = SLO-meeting requests per
    second of trace; attainment = SLO-meeting / offered."""

    name: str
    prefill: int
    decode: int
    link: str | None
    threshold: float
    offered: int
    finished: int
    slo_met: int
    rejected: int
    duration: float
    remote: int = 0                      # requests prefilled on a prefill replica
    decode_prefill_tokens: int = 0       # prompt tokens computed by decode replicas
    transfer_s: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)   # requests with output > 1
    finished_ids: list[str] = field(default_factory=list)   # in finishing order

    def summary(self) -> dict:
        return {"prefill": self.prefill, "decode": self.decode, "link": self.link,
                "threshold": None if math.isinf(self.threshold) else self.threshold,
                "goodput_rps": round(self.goodput_rps, 4), "attainment": round(self.attainment, 4),
                "ttft_p90_s": round(pct(self.ttft, 0.9), 4), "tpot_p90_s": round(pct(self.tpot, 0.9), 4),
                "offered": self.offered, "finished": self.finished, "rejected": self.rejected,
                "remote_fraction": round(self.remote / self.offered, 4) if self.offered else 0.0,
                "transfer_mean_s": round(statistics.fmean(self.transfer_s), 4) if self.transfer_s else 0.0,
                "decode_prefill_tokens": self.decode_prefill_tokens}


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``xs``; NaN when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def simulate_pd(trace: Trace, hw: StepTime, prefill: int, decode: int, link: Link = RDMA, *,
                threshold: float = 0.0, max_num_seqs: int = 64, max_waiting: int = 256,
                prefill_max_batched_tokens: int | None = None) -> PDResult:
    """``trace`` on ``prefill`` prefill and ``decode`` decode replicas, all ready at 0 (see the
    module doc); deterministic.

    threshold: a request is prefilled remotely only when its prompt's part not in the chosen
        decode replica's prefix cache is longer than this (tokens; 0: every request, ``inf``:
        none, the decode replicas then serve colocated and the prefill replicas idle).
    prefill_max_batched_tokens: the prefill replicas' step token budget (default the hardware's,
        the colocated replicas' 512); decode replicas keep the hardware's.
    """
    if decode < 1 or prefill < 0:
        raise ValueError("need decode >= 1 and prefill >= 0")
    bs = hw.block_size

    def cfg(budget: int) -> EngineConfig:
        return EngineConfig(num_blocks=hw.num_blocks, max_model_len=hw.max_model_len, block_size=bs,
                            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_waiting=max_waiting, enable_prefix_caching=trace.prefix_caching)

    d_cfg = cfg(hw.max_num_batched_tokens)
    p_cfg = cfg(prefill_max_batched_tokens or hw.max_num_batched_tokens)
    decs = [Replica(f"decode-{i}", 0.0, 0.0, d_cfg, trace.slos, KVImportBlockManager.from_config(d_cfg))
            for i in range(decode)]
    pres = [Replica(f"prefill-{i}", 0.0, 0.0, p_cfg, trace.slos) for i in range(prefill)]
    is_prefill = {id(r): True for r in pres}
    link_free = {id(r): 0.0 for r in pres}
    pending = {id(r): 0 for r in decs}           # remote requests on their way to a decode replica
    turn_d, turn_p = itertools.count(), itertools.count()
    events: list[tuple[float, int, str, object]] = []
    seq = itertools.count()
    res = PDResult(f"pd-{prefill}:{decode}" if prefill else f"colocated-{decode}", prefill, decode,
                   link.name if prefill else None, threshold, len(trace), 0, 0, 0, trace.duration)
    # remote request id -> (trace index, arrival, decode replica, first-token time at the client)
    remote: dict[str, list] = {}

    def least(pods: list[Replica], turn, extra=None) -> Replica:
        start = next(turn) % len(pods)
        order = pods[start:] + pods[:start]
        return min(order, key=lambda p: len(p.sched.running) + len(p.sched.waiting)
                   + (extra[id(p)] if extra else 0))

    def start_step(r: Replica, now: float) -> None:
        r.now = now
        out = r.sched.schedule()
        if not out.chunks:
            r.stepping = False
            return
        attended = 0
        for c in out.chunks:
            attended += c.start_pos + len(c.token_ids)
        if not is_prefill.get(id(r)):   # prompt positions computed here (not imported)
            for c in out.chunks:
                plen = r.sched.requests[c.request_id].num_prompt_tokens - (c.request_id in remote)
                res.decode_prefill_tokens += max(0, min(c.start_pos + len(c.token_ids), plen) - c.start_pos)
        r.stepping = True
        heapq.heappush(events, (now + hw(out.num_batched_tokens, attended), next(seq), "step", (r, out)))

    def record(rid: str, ttft: float, tpot: float | None, cls: int) -> None:
        res.finished += 1
        res.finished_ids.append(rid)
        res.ttft.append(ttft)
        if tpot is not None:
            res.tpot.append(tpot)
        slo_ttft, slo_tpot = trace.slos[cls]
        if ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot):
            res.slo_met += 1

    def admit(r: Replica, req: Request, now: float) -> bool:
        r.now = now
        try:
            r.sched.add_request(req)
        except AdmissionError:
            res.rejected += 1
            return False
        if not r.stepping:
            start_step(r, now)
        return True

    def finish_step(r: Replica, out, now: float) -> None:
        r.now = now
        ro = RunnerOutput(sampled_token_ids={c.request_id: 1 for c in out.chunks if c.sample})
        for o in r.sched.update_from_output(out, ro):
            req = o.request
            rid = req.request_id
            if is_prefill.get(id(r)):          # a remote prefill got its first token: ship the KV
                t0 = max(now, link_free[id(r)])
                dt = transfer_seconds(hw, link, req.num_prompt_tokens)
                link_free[id(r)] = t0 + dt
                res.transfer_s.append(dt)
                heapq.heappush(events, (t0 + dt, next(seq), "kv", rid))
                continue
            if not o.finished:
                continue
            k = int(rid[1:].split(".")[0])
            if rid in remote:                  # the decode half of a remote request
                _, arrival, _, first = remote.pop(rid)
                n_out = trace.output[k]
                record(rid, first - arrival, (req.finished_time - first) / (n_out - 1), trace.cls[k])
            else:
                record(rid, req.ttft, req.tpot, trace.cls[k])
        start_step(r, now)

    def kv_arrived(rid: str, now: float) -> None:
        k, arrival, dst, _ = remote[rid]
        remote[rid][3] = now                   # the first token reaches the client now
        pending[id(dst)] -= 1
        n_out = trace.output[k]
        if n_out <= 1:
            remote.pop(rid)
            record(rid, now - arrival, None, trace.cls[k])
            return
        prompt = tuple(_prompt_ids(trace, k)) + (1,)
        req = Request(rid, prompt, SamplingParams(max_tokens=n_out - 1, ignore_eos=True), arrival_time=now)
        dst.sched.block_manager.expect(rid, len(prompt) - 1)
        if not admit(dst, req, now):
            remote.pop(rid)
            dst.sched.block_manager.expected.pop(rid, None)

    def arrive(k: int, now: float) -> None:
        dst = least(decs, turn_d, pending)
        ids = _prompt_ids(trace, k)
        rid = f"q{k}"
        full = Request(rid, ids, SamplingParams(max_tokens=trace.output[k], ignore_eos=True), arrival_time=now)
        uncached = trace.prompt[k]
        if pres and not math.isinf(threshold) and uncached > threshold and trace.prefix_caching:
            uncached -= _cached_tokens(dst.sched.block_manager, ids)
        if not pres or uncached <= threshold:
            admit(dst, full, now)
            return
        src = least(pres, turn_p)
        remote[rid] = [k, now, dst, None]
        pending[id(dst)] += 1
        res.remote += 1
        pre = Request(rid, ids, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=now)
        if not admit(src, pre, now):
            remote.pop(rid)
            pending[id(dst)] -= 1

    n = len(trace)
    i = 0
    while True:
        t_arr = trace.t[i] if i < n else math.inf
        t_ev = events[0][0] if events else math.inf
        now = min(t_arr, t_ev)
        if now == math.inf:
            break
        if now == t_ev:
            _, _, kind, payload = heapq.heappop(events)
            if kind == "step":
                finish_step(*payload, now)
            else:
                kv_arrived(payload, now)
            continue
        arrive(i, now)
        i += 1
    return res


def _prompt_ids(trace: Trace, k: int) -> Sequence[int]:
    """Request ``k``'s prompt token ids (as ``simulate`` builds them)."""
    return trace.tokens[k] if trace.tokens is not None else range(1, trace.prompt[k] + 1)


def _cached_tokens(bm: BlockManager, ids: Sequence[int]) -> int:
    """Tokens of a prompt ``ids`` that ``bm``'s prefix cache holds now (no side effect on it)."""
    probe = Request("probe", ids, SamplingParams(max_tokens=1))
    return BlockManager.get_computed_blocks(bm, probe)[1]



# ------------------------------------------------------------------------------------ report
PD_TRACES = ("long-context", "chat")
# total replicas compared per trace at its default rate: from overloaded to comfortable (colocated,
# least-loaded: long-context 3 req/s needs ~6 replicas, chat 1 session/s ~3)
PD_SIZES = {"long-context": "4,6,8", "chat": "2,3,4"}


@dataclass
class Comparison:
    """One trace: for each total N, colocated serving on N replicas and every split P:D (P + D
    = N, P >= 1) per link and threshold."""

    trace: Trace
    hw: StepTime
    colocated: dict[int, PDResult]
    splits: dict[int, list[PDResult]]

    def best(self, n: int, link: str, threshold: float) -> PDResult | None:
        """The split of ``n`` replicas with the highest goodput on ``link`` at ``threshold``
        (ties: fewer prefill replicas)."""
        rows = [r for r in self.splits[n] if r.link == link and r.threshold == threshold]
        return max(rows, key=lambda r: (r.goodput_rps, -r.prefill), default=None)


def compare(trace: Trace, hw: StepTime, sizes: Sequence[int], links: Sequence[Link] = (RDMA, TCP),
            thresholds: Sequence[float] = (0.0,), progress: bool = False, **kw) -> Comparison:
    """Colocated serving on N replicas (``simulate_pd`` with no prefill replica: each replica
    serves whole requests with chunked prefill, arrivals least-loaded; the same numbers as
    ``simulate.static_result(trace, N, hw, 0, routing="least-loaded")``) against every split
    P:D of N, for each N in ``sizes``, link and threshold (tokens)."""
    colo, splits = {}, {}
    for n in sizes:
        colo[n] = simulate_pd(trace, hw, 0, n, threshold=math.inf, **kw)
        splits[n] = []
        for p in range(1, n):
            for link in links:
                for th in thresholds:
                    r = simulate_pd(trace, hw, p, n - p, link, threshold=th, **kw)
                    splits[n].append(r)
                    if progress:
                        print(f"  {trace.name} N={n} {p}:{n - p} {link.name} threshold {th:g}: "
                              f"goodput {r.goodput_rps:.2f}", file=sys.stderr)
    return Comparison(trace, hw, colo, splits)


def _fmt_th(th: float) -> str:
    return "-" if math.isinf(th) else f"{th:g}"


def comparison_table(c: Comparison) -> str:
    """Markdown: every run, then the best split per N, link and threshold against colocated."""
    tr = c.trace
    lines = [f"### {tr.name} ({len(tr)} requests over {tr.duration:.0f} s; {tr.note}; {c.hw.name})", "",
             "| N | serving | P:D | link | threshold (tokens) | goodput (req/s) | attainment | TTFT p90 (s) "
             "| TPOT p90 (ms) | remote prefill | mean transfer (ms) |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def row(n: int, r: PDResult) -> str:
        s = r.summary()
        kind = "P/D" if r.prefill else "colocated"
        split = f"{r.prefill}:{r.decode}" if r.prefill else "-"
        return (f"| {n} | {kind} | {split} | {r.link or '-'} | {_fmt_th(r.threshold) if r.prefill else '-'} "
                f"| {s['goodput_rps']:.3f} | {s['attainment']:.3f} | {s['ttft_p90_s']:.2f} "
                f"| {s['tpot_p90_s'] * 1000:.1f} | {s['remote_fraction']:.0%} | {s['transfer_mean_s'] * 1000:.0f} |")

    for n in sorted(c.colocated):
        lines.append(row(n, c.colocated[n]))
        lines.extend(row(n, r) for r in c.splits[n])
    lines += ["", "Best split per N (highest goodput) against colocated serving on the same N replicas:", "",
              "| N | link | threshold | best P:D | goodput (req/s) | colocated goodput | ratio | attainment "
              "| colocated attainment | TPOT p90 (ms) | colocated TPOT p90 (ms) |",
              "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted(c.colocated):
        co = c.colocated[n]
        keys = sorted({(r.link, r.threshold) for r in c.splits[n]})
        for link, th in keys:
            b = c.best(n, link, th)
            ratio = b.goodput_rps / co.goodput_rps if co.goodput_rps else math.inf
            lines.append(f"| {n} | {link} | {_fmt_th(th)} | {b.prefill}:{b.decode} | {b.goodput_rps:.3f} "
                         f"| {co.goodput_rps:.3f} | {ratio:.2f}x | {b.attainment:.3f} | {co.attainment:.3f} "
                         f"| {pct(b.tpot, 0.9) * 1000:.1f} | {pct(co.tpot, 0.9) * 1000:.1f} |")
    lines.append("\ngoodput: requests meeting both the TTFT and the TPOT SLO per second of trace; "
                 "attainment: those / offered. TTFT of a P/D request includes the KV transfer (the "
                 "first token is counted when it reaches the decode replica that streams the answer). "
                 "Colocated: N replicas each serving whole requests (chunked prefill, 512-token budget), "
                 "arrivals to the least-loaded replica; P/D: P prefill + D decode replicas, "
                 "least-loaded each (goodput.bench.pd).")
    return "\n".join(lines) + "\n"


def comparison_json(c: Comparison) -> dict:
    return {"trace": c.trace.name, "note": c.trace.note, "requests": len(c.trace),
            "duration_s": c.trace.duration, "hardware": c.hw.name,
            "kv_bytes_per_token": c.hw.kv_bytes_per_token,
            "links": {k: {"bandwidth_bytes_s": v.bandwidth_bytes_s, "latency_s": v.latency_s}
                      for k, v in LINKS.items()},
            "sizes": {str(n): {"colocated": c.colocated[n].summary(),
                               "splits": [r.summary() for r in c.splits[n]],
                               "best": {f"{link}/{_fmt_th(th)}": c.best(n, link, th).summary()
                                        for link, th in sorted({(r.link, r.threshold) for r in c.splits[n]})}}
                      for n in sorted(c.colocated)}}


def main(argv: list[str] | None = None) -> int:
    """``python -m goodput.bench.simulate --pd ...``: see the module doc."""
    ap = argparse.ArgumentParser(prog="python -m goodput.bench.simulate --pd",
                                 description="P/D disaggregation vs colocated serving (goodput.bench.pd).")
    ap.add_argument("--pd", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace", default="all", choices=PD_TRACES + ("all",))
    ap.add_argument("--hardware", default="h200", choices=("h200",))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, help="trace length in seconds (quick runs)")
    ap.add_argument("--rate", type=float, help="req/s (long-context) or sessions/s (chat)")
    ap.add_argument("--pd-sizes", default=None,
                    help="total replica counts N (comma-separated; default per trace: "
                         + ", ".join(f"{k} {v}" for k, v in PD_SIZES.items()) + ")")
    ap.add_argument("--pd-thresholds", default="0,512",
                    help="remote prefill only when the uncached prompt is longer (tokens; comma-separated)")
    ap.add_argument("--pd-links", default="rdma,tcp", help="comma-separated subset of " + ",".join(LINKS))
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="the prefill replicas' step token budget (default the hardware's, 512)")
    ap.add_argument("--out-dir", default=None, help="write pd-<trace>-<hardware>.md and .json here")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    if args.pd_sizes and any(int(x) < 2 for x in args.pd_sizes.split(",") if x.strip()):
        ap.error("--pd-sizes: every N must be >= 2 (one prefill and one decode replica)")
    ths = [float(x) for x in args.pd_thresholds.split(",") if x.strip()]
    links = [LINKS[x.strip()] for x in args.pd_links.split(",") if x.strip()]
    hw = HARDWARE[args.hardware]()
    for tname in PD_TRACES if args.trace == "all" else (args.trace,):
        trace = make_trace(tname, args.seed, args.hardware, args.duration, args.rate)
        sizes = [int(x) for x in (args.pd_sizes or PD_SIZES[tname]).split(",") if x.strip()]
        c = compare(trace, hw, sizes, links, ths, progress=args.progress,
                    prefill_max_batched_tokens=args.prefill_budget)
        table = comparison_table(c)
        print(table)
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            stem = os.path.join(args.out_dir, f"pd-{tname}-{args.hardware}")
            with open(stem + ".md", "w") as f:
                cmd = " ".join(sys.argv[1:] if argv is None else ["--pd", *argv] if "--pd" not in argv else argv)
                f.write(f"`python -m goodput.bench.simulate {cmd}`\n\n" + table)
            with open(stem + ".json", "w") as f:
                json.dump(comparison_json(c), f, indent=1)
                f.write("\n")
    return 0
