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
from dataclasses import dataclass, field
from typing import Sequence

from goodput.bench.simulate import HARDWARE, Replica, StepTime, Trace, make_trace, static_result
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
class PDResult:
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

    @property
    def goodput_rps(self) -> float:
        return self.slo_met / self.duration

    @property
    def attainment(self) -> float:
        return self.slo_met / self.offered if self.offered else 1.0

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

    def record(ttft: float, tpot: float | None, cls: int) -> None:
        res.finished += 1
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
                k, _, dst, _ = remote[rid]
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
                record(first - arrival, (req.finished_time - first) / (n_out - 1), trace.cls[k])
            else:
                record(req.ttft, req.tpot, trace.cls[k])
        start_step(r, now)

    def kv_arrived(rid: str, now: float) -> None:
        k, arrival, dst, _ = remote[rid]
        remote[rid][3] = now                   # the first token reaches the client now
        pending[id(dst)] -= 1
        n_out = trace.output[k]
        if n_out <= 1:
            remote.pop(rid)
            record(now - arrival, None, trace.cls[k])
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

