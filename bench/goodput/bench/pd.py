"""Prefill/decode (P/D) disaggregation in the fleet simulator, against colocated serving.

``python -m goodput.bench.simulate --pd [--trace long-context|chat|all] [--pd-sizes 4,6,8]
[--pd-threshold 512] [--duration S] [--rate R] [--out-dir bench/results/disaggregation]``
(:func:`main`; ``simulate.main`` hands ``--pd`` here). ``--auto``: both pools autoscaled by the
autoscaler's own code (:class:`PDAutoscale`) against every fixed split up to ``--pd-max-n``
replicas (:func:`compare_auto`); ``--capacity R1,R2,...``: colocated and every split of each N at
each rate, and the highest rate each sustains at ``--target`` attainment (:func:`capacity_sweep`;
``--capacity-tol W``: each crossing then bisected to a bracket at most W req/s wide,
:func:`refine_sweep`).

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
   step that completes the prompt samples the first token). When it refuses the prompt (its
   queue is full), the router's rule applies (``goodput.router.disagg.defer_when_full``): with
   prefill replicas ordered and not ready yet (autoscaled fleets) the request is refused (429,
   ``prefill_deferred``); otherwise the decode replica serves it whole (``prefill_failed``).
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
from dataclasses import dataclass, field, replace

from goodput.api.policy import PolicySpec
from goodput.autoscaler.policy import Limits
from goodput.router.disagg import defer_when_full
from goodput.bench.simulate import (HARDWARE, GoodputPolicy, Replica, SloRates, StepTime, Trace, make_trace,
                                    pool_observation, scale_in, set_limits)
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
    """One fleet on one trace. ``prefill``/``decode``: replica counts (``prefill == 0``:
    colocated; autoscaled: the counts it started with). Latencies per finished request in seconds;
    goodput = SLO-meeting requests per second of trace; attainment = SLO-meeting / offered.
    ``prefill_hours``/``decode_hours``: each pool's replica-hours over the trace's duration (a pod
    costs from its creation, model load included, until it is gone after a drain); ``timeline``
    (autoscaled only): ``(t, prefill replicas set, prefill ready, decode replicas set, decode
    ready)`` at every decision; ``reasons``: pool -> decision reason -> count."""

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
    deferred: int = 0                    # refused by the router: prefill pool full and growing
    decode_prefill_tokens: int = 0       # prompt tokens computed by decode replicas
    transfer_s: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)   # requests with output > 1
    finished_ids: list[str] = field(default_factory=list)   # in finishing order
    prefill_hours: float = 0.0
    decode_hours: float = 0.0
    timeline: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    reasons: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def replica_hours(self) -> float:
        return self.prefill_hours + self.decode_hours

    def summary(self) -> dict:
        return {"prefill": self.prefill, "decode": self.decode, "link": self.link,
                "threshold": None if math.isinf(self.threshold) else self.threshold,
                "goodput_rps": round(self.goodput_rps, 4), "attainment": round(self.attainment, 4),
                "deferred": self.deferred,
                "replica_hours": round(self.replica_hours, 4),
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


@dataclass(frozen=True)
class PDAutoscale:
    """Both pools of :func:`simulate_pd` sized by the autoscaler, as ``goodput.autoscaler.loop``
    sizes a disaggregated service: every ``period_s`` each pool is decided by ``policy.decide``
    on its own pods' observation (:func:`~goodput.bench.simulate.pool_observation`, the loop's),
    with its own state and :class:`~goodput.autoscaler.policy.PolicySpec` (``prefill_spec``,
    ``decode_spec``: ``loop.pool_policy``'s), its limits capped by the pool's engine settings
    (``loop.bound_limits`` with ``prefill_bound``/``decode_bound``); the decode pool (the
    workers) first, then the prefill pool, as the loop does. ``initial``: (prefill, decode)
    replicas ready at 0; a new replica is ready ``load_time_s`` after it is ordered; a removed one
    drains (:func:`~goodput.bench.simulate.scale_in`). Build it with :func:`pd_autoscale`."""

    prefill_spec: PolicySpec
    decode_spec: PolicySpec
    prefill_bound: Limits | None = None
    decode_bound: Limits | None = None
    initial: tuple[int, int] = (1, 1)
    load_time_s: float = 60.0
    period_s: float = 5.0


def pd_autoscale(trace: Trace, *, prefill_replicas: tuple[int, int] = (1, 8),
                 decode_replicas: tuple[int, int] = (1, 8), initial: tuple[int, int] = (1, 1),
                 max_num_seqs: int = 64, max_waiting: int = 256, load_time_s: float = 60.0,
                 period_s: float = 5.0) -> PDAutoscale:
    """The two pools' policies exactly as the loop derives them from an InferenceService with
    ``spec.disaggregation`` on: ``spec.slo`` the trace's (one class), ``spec.engine`` the
    simulated replicas' ``max_num_seqs``/``max_waiting``, ``spec.autoscaling.min/maxReplicas``
    = ``decode_replicas`` (the workers), ``spec.disaggregation.prefill.min/maxReplicas`` =
    ``prefill_replicas``; then ``PolicySpec.from_crd``, ``loop.pools``, ``loop.pool_policy`` and
    ``loop.engine_bounds``."""
    from goodput.api import crd
    from goodput.autoscaler import loop

    if trace.class_names:
        raise ValueError("pd_autoscale: traces with SLO classes are not supported")
    (ttft, tpot), = trace.slos
    raw = {"replicas": initial[1], "engine": {"maxNumSeqs": max_num_seqs, "maxWaiting": max_waiting},
           "slo": {"ttftMs": ttft * 1000.0, "tpotMs": tpot * 1000.0},
           "autoscaling": {"enabled": True, "minReplicas": decode_replicas[0], "maxReplicas": decode_replicas[1]},
           "disaggregation": {"enabled": True, "prefill": {
               "replicas": initial[0], "minReplicas": prefill_replicas[0], "maxReplicas": prefill_replicas[1]}}}
    spec = crd.InferenceServiceSpec.model_validate(raw)
    pspec = PolicySpec.from_crd(spec.model_dump(by_alias=True))
    workers, prefill = loop.pools("sim", spec)
    return PDAutoscale(loop.pool_policy(pspec, spec, prefill), loop.pool_policy(pspec, spec, workers),
                       loop.engine_bounds(spec, loop.PREFILL), loop.engine_bounds(spec, loop.WORKERS),
                       initial, load_time_s, period_s)


class _Pool:
    """One pool of :func:`simulate_pd`: its replicas (all ever made), the replicas its spec asks
    for, and its autoscaler (None: fixed)."""

    def __init__(self, name: str, cfg: EngineConfig, spec: PolicySpec | None, bound: Limits | None,
                 period_s: float) -> None:
        self.name, self.cfg, self.bound = name, cfg, bound
        self.pods: list[Replica] = []
        self.replicas = 0
        self.policy = GoodputPolicy(spec, period_s) if spec is not None else None

    def live(self) -> list[Replica]:
        return [p for p in self.pods if not p.draining and p.gone_at is None]

    def ready(self, now: float) -> list[Replica]:
        return [p for p in self.live() if p.ready_at <= now]

    def hours(self, end: float) -> float:
        return sum(min(p.gone_at if p.gone_at is not None else end, end) - min(p.created, end)
                   for p in self.pods) / 3600.0


def simulate_pd(trace: Trace, hw: StepTime, prefill: int, decode: int, link: Link = RDMA, *,
                threshold: float = 0.0, max_num_seqs: int = 64, max_waiting: int = 256,
                prefill_max_batched_tokens: int | None = None,
                autoscale: PDAutoscale | None = None, defer_full: bool = True) -> PDResult:
    """``trace`` on ``prefill`` prefill and ``decode`` decode replicas, all ready at 0 (see the
    module doc); deterministic.

    threshold: a request is prefilled remotely only when its prompt's part not in the chosen
        decode replica's prefix cache is longer than this (tokens; 0: every request, ``inf``:
        none, the decode replicas then serve colocated and the prefill replicas idle).
    prefill_max_batched_tokens: the prefill replicas' step token budget (default the hardware's,
        the colocated replicas' 512); decode replicas keep the hardware's.
    autoscale: both pools sized by the autoscaler (:class:`PDAutoscale`; ``prefill``/``decode``
        are then ignored for its ``initial``). With no ready prefill replica a request is
        prefilled where it decodes (the router's ``no_prefill_pod``).
    defer_full: the router's rule when the prefill replica picked refuses a prompt (its queue is
        full): with prefill replicas ordered and not ready (autoscaled only), the request is
        refused (``goodput.router.disagg.defer_when_full``: ``prefill_deferred``, counted in
        ``rejected`` and ``deferred``); otherwise, or with ``defer_full=False``, the decode
        replica prefills it (``prefill_failed``).
    """
    if autoscale is not None:
        prefill, decode = autoscale.initial
    if decode < 1 or prefill < 0:
        raise ValueError("need decode >= 1 and prefill >= 0")
    bs = hw.block_size

    def cfg(budget: int) -> EngineConfig:
        return EngineConfig(num_blocks=hw.num_blocks, max_model_len=hw.max_model_len, block_size=bs,
                            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_waiting=max_waiting, enable_prefix_caching=trace.prefix_caching)

    auto = autoscale
    period = auto.period_s if auto else 0.0
    dpool = _Pool("decode", cfg(hw.max_num_batched_tokens), auto and auto.decode_spec,
                  auto and auto.decode_bound, period)
    ppool = _Pool("prefill", cfg(prefill_max_batched_tokens or hw.max_num_batched_tokens),
                  auto and auto.prefill_spec, auto and auto.prefill_bound, period)
    is_prefill: dict[int, bool] = {}
    link_free: dict[int, float] = {}
    pending: dict[int, int] = {}                 # remote requests on their way to a decode replica
    # requests the decode pods prefilled because no prefill pod was ready or it refused (the
    # router's no_prefill_pod and prefill_failed): [total, total at the last tick]
    fallback = [0, 0]

    def new_pod(pool: _Pool, now: float, ready: bool) -> Replica:
        i = len(pool.pods)
        if pool is dpool:
            r = Replica(f"decode-{i}", now, now if ready else now + auto.load_time_s, pool.cfg, trace.slos,
                        KVImportBlockManager.from_config(pool.cfg))
            pending[id(r)] = 0
        else:
            r = Replica(f"prefill-{i}", now, now if ready else now + auto.load_time_s, pool.cfg, trace.slos)
            is_prefill[id(r)] = True
            link_free[id(r)] = 0.0
        pool.pods.append(r)
        return r

    for _ in range(decode):
        new_pod(dpool, 0.0, True)
    for _ in range(prefill):
        new_pod(ppool, 0.0, True)
    dpool.replicas, ppool.replicas = decode, prefill
    turn_d, turn_p = itertools.count(), itertools.count()
    events: list[tuple[float, int, str, object]] = []
    seq = itertools.count()
    name = "pd-auto" if auto else f"pd-{prefill}:{decode}" if prefill else f"colocated-{decode}"
    res = PDResult(name, prefill, decode, link.name if prefill or auto else None, threshold, len(trace), 0, 0, 0,
                   trace.duration)
    # remote request id -> (trace index, arrival, decode replica, first-token time at the client)
    remote: dict[str, list] = {}

    def least(pods: list[Replica], turn, extra=None) -> Replica:
        start = next(turn) % len(pods)
        order = pods[start:] + pods[:start]
        return min(order, key=lambda p: len(p.sched.running) + len(p.sched.waiting)
                   + (extra[id(p)] if extra else 0))

    def maybe_gone(r: Replica, now: float) -> None:
        """A draining replica is gone once it holds nothing: no request, no import on its way, no
        KV still leaving over its link."""
        if r.draining and r.gone_at is None and not r.sched.has_unfinished() and not pending.get(id(r)):
            r.gone_at = max(now, link_free.get(id(r), 0.0))

    def start_step(r: Replica, now: float) -> None:
        r.now = now
        out = r.sched.schedule()
        if not out.chunks:
            r.stepping = False
            maybe_gone(r, now)
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
            r.account(o)                       # the pod's own metrics, as its worker exports them
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
            maybe_gone(dst, now)
            return
        prompt = tuple(_prompt_ids(trace, k)) + (1,)
        req = Request(rid, prompt, SamplingParams(max_tokens=n_out - 1, ignore_eos=True), arrival_time=now)
        dst.sched.block_manager.expect(rid, len(prompt) - 1)
        if not admit(dst, req, now):
            remote.pop(rid)
            dst.sched.block_manager.expected.pop(rid, None)
            maybe_gone(dst, now)

    def arrive(k: int, now: float) -> None:
        decs = dpool.ready(now)
        if not decs:                           # no decode replica to stream the answer: refused
            res.rejected += 1
            return
        dst = least(decs, turn_d, pending)
        pres = ppool.ready(now)
        ids = _prompt_ids(trace, k)
        rid = f"q{k}"
        full = Request(rid, ids, SamplingParams(max_tokens=trace.output[k], ignore_eos=True), arrival_time=now)
        uncached = trace.prompt[k]
        if not math.isinf(threshold) and uncached > threshold and trace.prefix_caching:
            uncached -= _cached_tokens(dst.sched.block_manager, ids)
        if not pres or uncached <= threshold:
            if uncached > threshold:           # the router's no_prefill_pod
                fallback[0] += 1
            admit(dst, full, now)
            return
        src = least(pres, turn_p)
        remote[rid] = [k, now, dst, None]
        pending[id(dst)] += 1
        res.remote += 1
        pre = Request(rid, ids, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=now)
        if not admit(src, pre, now):           # the prefill pod refused it (429)
            remote.pop(rid)
            pending[id(dst)] -= 1
            res.remote -= 1
            if defer_full and defer_when_full(len(pres), max(0, ppool.replicas - len(pres))):
                res.deferred += 1              # the router's prefill_deferred: refused (429), counted
                return                         # in res.rejected by the failed admission
            res.rejected -= 1                  # the router's prefill_failed: the decode pod prefills
            fallback[0] += 1                   # it itself
            admit(dst, full, now)

    def scale(pool: _Pool, desired: int, now: float) -> None:
        live = pool.live()
        if desired > len(live):
            for _ in range(desired - len(live)):
                new_pod(pool, now, False)
        elif desired < len(live):
            for p in scale_in(live, now, len(live) - desired):
                if p.ready_at > now:
                    p.gone_at = now
                else:
                    maybe_gone(p, now)
        pool.replicas = desired

    def tick(now: float) -> None:
        for pool in (dpool, ppool):            # the loop's order: the workers, then the prefill pool
            obs = pool_observation(pool.pods, now, pool.replicas)
            if pool is dpool:                  # policy rule 19: what the router did in the prefill pool's place
                obs = replace(obs, prefill_fallback=float(fallback[0] - fallback[1]),
                              prefill_coming=max(0, ppool.replicas - len(ppool.ready(now))))
                fallback[1] = fallback[0]
            desired, limits = pool.policy.tick(now, obs)
            set_limits(pool.ready(now), bound_limits(limits, pool.bound), now, start_step)
            if desired != pool.replicas:
                scale(pool, desired, now)
        res.timeline.append((now, ppool.replicas, len(ppool.ready(now)), dpool.replicas, len(dpool.ready(now))))

    n = len(trace)
    i = 0
    end = trace.duration
    next_tick = period if auto else math.inf
    if auto:
        res.timeline.append((0.0, prefill, prefill, decode, decode))
    while True:
        t_arr = trace.t[i] if i < n else math.inf
        t_ev = events[0][0] if events else math.inf
        t_tick = next_tick if next_tick <= end else math.inf
        now = min(t_arr, t_ev, t_tick)
        if now == math.inf:
            break
        if now == t_ev:
            _, _, kind, payload = heapq.heappop(events)
            if kind == "step":
                finish_step(*payload, now)
            else:
                kv_arrived(payload, now)
            continue
        if now == t_tick:
            tick(now)
            next_tick += period
            continue
        arrive(i, now)
        i += 1
    res.prefill_hours, res.decode_hours = ppool.hours(end), dpool.hours(end)
    if auto:
        res.reasons = {pool.name: dict(pool.policy.reasons) for pool in (ppool, dpool)}
    return res


def bound_limits(limits: dict | None, bound: Limits | None) -> dict:
    """``loop.bound_limits``: each pod's limits capped by its pool's engine settings."""
    from goodput.autoscaler import loop

    return loop.bound_limits(limits or {}, bound)


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


# ------------------------------------------------------------------- autoscaled P/D (hindsight)
def splits_upto(n_max: int) -> list[tuple[int, int]]:
    """Every split P:D with P >= 1, D >= 1 and P + D <= ``n_max``, by N then P (4 -> (1, 1),
    (1, 2), (2, 1), (1, 3), (2, 2), (3, 1))."""
    return [(p, n - p) for n in range(2, n_max + 1) for p in range(1, n)]


def best_split(fixed: Sequence[PDResult]) -> PDResult:
    """The hindsight-best fixed split: the highest goodput; among equal goodputs (the same count
    of SLO-meeting requests), the fewest replica-hours, then the fewest prefill replicas."""
    return max(fixed, key=lambda r: (r.slo_met, -round(r.replica_hours, 9), -r.prefill))


def frontier_split(fixed: Sequence[PDResult], hours: float) -> PDResult | None:
    """What the same money buys in hindsight: the best fixed split (:func:`best_split`'s order)
    among those whose replica-hours are at most ``hours``; None when every split costs more."""
    within = [r for r in fixed if r.replica_hours <= hours + 1e-9]
    return best_split(within) if within else None


def cheapest_split(fixed: Sequence[PDResult], slo_met: int) -> PDResult | None:
    """The fixed split with the fewest replica-hours (then the most goodput) whose SLO-meeting
    requests reach ``slo_met``; None when none does."""
    ok = [r for r in fixed if r.slo_met >= slo_met]
    return min(ok, key=lambda r: (round(r.replica_hours, 9), -r.slo_met, r.prefill)) if ok else None


@dataclass
class AutoComparison:
    """The autoscaled P/D fleet against every fixed split up to ``n_max`` replicas on one trace.

    target: the claim, ``auto.goodput >= target * best.goodput`` and ``auto.replica_hours <=
    best.replica_hours`` with ``best`` = :func:`best_split` (the hindsight-best split)."""

    trace: Trace
    hw: StepTime
    auto: PDResult
    fixed: list[PDResult]
    spec: PDAutoscale
    target: float = 0.9

    @property
    def best(self) -> PDResult:
        return best_split(self.fixed)

    def verdict(self) -> dict:
        """The claim's two ratios and whether it holds; the equal-cost frontier split and the
        cheapest split with the autoscaler's goodput (where it loses)."""
        a, b = self.auto, self.best
        g = a.goodput_rps / b.goodput_rps if b.goodput_rps else math.inf
        h = a.replica_hours / b.replica_hours
        f = frontier_split(self.fixed, a.replica_hours)
        c = cheapest_split(self.fixed, a.slo_met)
        return {"goodput_ratio": round(g, 4), "hours_ratio": round(h, 4),
                "met": g >= self.target - 1e-9 and h <= 1 + 1e-9,
                "frontier": None if f is None else f"{f.prefill}:{f.decode}",
                "frontier_goodput_ratio": None if f is None or not f.goodput_rps else round(a.goodput_rps / f.goodput_rps, 4),
                "cheapest_same_goodput": None if c is None else f"{c.prefill}:{c.decode}",
                "cheapest_hours_ratio": None if c is None else round(a.replica_hours / c.replica_hours, 4)}


def compare_auto(trace: Trace, hw: StepTime, spec: PDAutoscale, n_max: int = 8, link: Link = RDMA,
                 threshold: float = 0.0, progress: bool = False, target: float = 0.9,
                 defer_full: bool = True) -> AutoComparison:
    """The autoscaled run (``spec``; ``defer_full``: :func:`simulate_pd`'s) and every fixed split of
    at most ``n_max`` replicas."""
    auto = simulate_pd(trace, hw, 0, 1, link, threshold=threshold, autoscale=spec, defer_full=defer_full)
    fixed = []
    for p, d in splits_upto(n_max):
        fixed.append(simulate_pd(trace, hw, p, d, link, threshold=threshold))
        if progress:
            print(f"  {trace.name} {p}:{d}: goodput {fixed[-1].goodput_rps:.3f}", file=sys.stderr)
    return AutoComparison(trace, hw, auto, fixed, spec, target)


def _changes(xs: Sequence[int]) -> str:
    """The successive distinct values of ``xs`` ("1 -> 4 -> 8 -> 7")."""
    out: list[int] = []
    for x in xs:
        if not out or out[-1] != x:
            out.append(x)
    return " -> ".join(map(str, out))


def auto_table(c: AutoComparison) -> str:
    """Markdown: the autoscaled run, the hindsight-best split, the verdict, the pools over time,
    every fixed split."""
    tr, a, b, v = c.trace, c.auto, c.best, c.verdict()
    sp = c.spec
    lines = [f"### {tr.name}: autoscaled P/D against fixed splits ({len(tr)} requests over {tr.duration:.0f} s; "
             f"{tr.note}; {c.hw.name}; link {a.link}, threshold {_fmt_th(a.threshold)}; model load "
             f"{sp.load_time_s:.0f} s; decisions every {sp.period_s:.0f} s)", "",
             f"Autoscaled: starts at {sp.initial[0]}:{sp.initial[1]} (prefill:decode), prefill pool bounds "
             f"{sp.prefill_spec.min_replicas}..{sp.prefill_spec.max_replicas}, decode pool (the workers) "
             f"{sp.decode_spec.min_replicas}..{sp.decode_spec.max_replicas}.", "",
             "| fleet | goodput (req/s) | attainment | replica-hours (prefill + decode) | TTFT p90 (s) "
             "| TPOT p90 (ms) | rejected |", "|---|---:|---:|---:|---:|---:|---:|"]

    def row(label: str, r: PDResult) -> str:
        return (f"| {label} | {r.goodput_rps:.3f} | {r.attainment:.3f} | {r.replica_hours:.3f} "
                f"({r.prefill_hours:.3f} + {r.decode_hours:.3f}) | {pct(r.ttft, 0.9):.2f} "
                f"| {pct(r.tpot, 0.9) * 1000:.1f} | {r.rejected}"
                + (f" ({r.deferred} deferred)" if r.deferred else "") + " |")

    lines.append(row("autoscaled", a))
    lines.append(row(f"hindsight-best split {b.prefill}:{b.decode}", b))
    f = frontier_split(c.fixed, a.replica_hours)
    if f is not None:
        lines.append(row(f"best split within the autoscaler's replica-hours, {f.prefill}:{f.decode}", f))
    ch = cheapest_split(c.fixed, a.slo_met)
    if ch is not None:
        lines.append(row(f"cheapest split with at least the autoscaler's goodput, {ch.prefill}:{ch.decode}", ch))
    lines += ["", f"- claim (goodput >= {c.target}x the hindsight-best split's at <= its replica-hours): goodput "
                  f"{v['goodput_ratio']:.3f}x, replica-hours {v['hours_ratio']:.3f}x -> "
                  f"{'met' if v['met'] else 'NOT met'}",
              f"- prefill pool: {_changes([e[1] for e in a.timeline])} replicas; decode pool: "
              f"{_changes([e[3] for e in a.timeline])}",
              "- decisions: " + "; ".join(f"{pool} " + ", ".join(f"{k} {n}" for k, n in sorted(rs.items()))
                                          for pool, rs in sorted(a.reasons.items())), "",
              "Every fixed split (all replicas ready at 0):", "",
              "| P:D | goodput (req/s) | attainment | replica-hours | TTFT p90 (s) | TPOT p90 (ms) |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in c.fixed:
        lines.append(f"| {r.prefill}:{r.decode} | {r.goodput_rps:.3f} | {r.attainment:.3f} | {r.replica_hours:.3f} "
                     f"| {pct(r.ttft, 0.9):.2f} | {pct(r.tpot, 0.9) * 1000:.1f} |")
    lines.append("\nhindsight-best split: the fixed split (P + D <= "
                 f"{max(r.prefill + r.decode for r in c.fixed)}) with the highest goodput, the fewest "
                 "replica-hours among equal goodputs. Replica-hours of the autoscaled fleet count each pod from "
                 "its creation (model load included) until it is gone after its drain.")
    return "\n".join(lines) + "\n"


def auto_json(c: AutoComparison) -> dict:
    a = c.auto
    return {"trace": c.trace.name, "note": c.trace.note, "requests": len(c.trace), "duration_s": c.trace.duration,
            "hardware": c.hw.name, "link": a.link, "threshold": a.threshold,
            "load_time_s": c.spec.load_time_s, "period_s": c.spec.period_s, "initial": list(c.spec.initial),
            "prefill_bounds": [c.spec.prefill_spec.min_replicas, c.spec.prefill_spec.max_replicas],
            "decode_bounds": [c.spec.decode_spec.min_replicas, c.spec.decode_spec.max_replicas],
            "autoscaled": {**a.summary(), "prefill_hours": round(a.prefill_hours, 4),
                           "decode_hours": round(a.decode_hours, 4), "reasons": a.reasons,
                           "timeline": [list(e) for e in a.timeline]},
            "hindsight_best": c.best.summary(), "verdict": c.verdict(),
            "fixed": [r.summary() for r in c.fixed]}


# ---------------------------------------------------------------------------- capacity (rate sweep)
def capacity_rate(points: Sequence[tuple[float, float]], target: float) -> tuple[float | None, bool]:
    """The highest arrival rate a fleet sustains at ``target`` attainment, from a sweep: ``points``
    are ``(rate, attainment)``, ascending by rate. Walking up, the rate is sustained while every
    attainment so far is >= ``target``; at the first miss the crossing is interpolated linearly
    between that point and the one before. Returns ``(rate, exact)``: ``(None, True)`` when the
    lowest rate already misses, ``(highest rate, False)`` (a lower bound) when none misses.
    E.g. [(2, 1.0), (3, 0.95), (4, 0.75)] at 0.9 -> 3 + (0.95 - 0.9) / (0.95 - 0.75) = 3.25."""
    i = first_miss([att for _, att in points], target)
    if i is None:
        return (points[-1][0] if points else None), not points
    if i == 0:
        return None, True
    (r0, a0), (rate, att) = points[i - 1], points[i]
    return r0 + (rate - r0) * (a0 - target) / (a0 - att), True


def first_miss(attainments: Sequence[float], target: float) -> int | None:
    """Index of the first attainment below ``target`` (a sweep's crossing), None when none is."""
    return next((i for i, att in enumerate(attainments) if att < target), None)


@dataclass(frozen=True)
class Budgets:
    """Step token budgets (``max_num_batched_tokens``) per kind of replica; None: the hardware's
    (512 on h200). ``colocated``: every replica of a colocated fleet (``spec.engine``);
    ``prefill``: a P/D fleet's prefill pool (``spec.disaggregation.prefill.engine``). A P/D
    fleet's decode replicas keep the hardware's (``spec.disaggregation.decode.engine`` unset)."""

    colocated: int | None = None
    prefill: int | None = None

    def label(self) -> str:
        """"" when both are the hardware's, else e.g. "-colocated2048-prefill4096"."""
        return "".join(f"-{k}{v}" for k, v in (("colocated", self.colocated), ("prefill", self.prefill)) if v)


def measured(rates: Sequence[float], runs: Sequence[PDResult | None]) -> list[tuple[float, PDResult]]:
    """(rate, run) for the rates a fleet was run at (``capacity_sweep``'s ``stop_at_miss`` leaves
    None after its first miss)."""
    return [(x, r) for x, r in zip(rates, runs) if r is not None]


@dataclass
class CapacitySweep:
    """For one total N: colocated serving and every split P:D of N at each arrival rate."""

    name: str
    n: int
    rates: list[float]
    colocated: list[PDResult]
    splits: dict[tuple[int, int], list[PDResult]]
    target: float = 0.9
    # fleet ("colocated", "P:D") -> the bisected crossing (:func:`refine_capacity`): (highest rate
    # measured at or above the target, lowest rate above it measured below) and the runs made
    refined: dict[str, tuple[float, float]] = field(default_factory=dict)
    refine_runs: dict[str, list[tuple[float, PDResult]]] = field(default_factory=dict)
    budgets: Budgets = Budgets()

    def capacities(self) -> dict[str, tuple[float | None, bool]]:
        """``colocated`` and ``P:D`` -> :func:`capacity_rate` of its sweep (rates not run, None
        after a miss with ``stop_at_miss``, left out)."""
        out = {"colocated": capacity_rate([(x, r.attainment) for x, r in measured(self.rates, self.colocated)],
                                          self.target)}
        for (p, d), rs in self.splits.items():
            out[f"{p}:{d}"] = capacity_rate([(x, r.attainment) for x, r in measured(self.rates, rs)], self.target)
        return out

    def best(self) -> tuple[str, float | None, bool]:
        """The split with the highest capacity (the interpolated one)."""
        caps = {k: v for k, v in self.capacities().items() if k != "colocated"}
        k = max(caps, key=lambda s: caps[s][0] if caps[s][0] is not None else -1.0)
        return (k, *caps[k])

    def fleet(self, key: str) -> tuple[int, int]:
        """``(prefill, decode)`` replicas of ``key`` ("colocated": ``(0, n)``)."""
        if key == "colocated":
            return 0, self.n
        p, d = key.split(":")
        return int(p), int(d)

    def bracket(self, key: str) -> tuple[float, float] | None:
        """The sweep's step that holds ``key``'s crossing: (the last rate at or above the target,
        the first below it), walking up as :func:`capacity_rate` does; None when there is none
        (the lowest rate already misses, or no rate misses)."""
        runs = self.colocated if key == "colocated" else self.splits[self.fleet(key)]
        i = first_miss([r.attainment for _, r in measured(self.rates, runs)], self.target)
        return None if not i else (self.rates[i - 1], self.rates[i])


def run_fleet(tr: Trace, hw: StepTime, prefill: int, decode: int, link: Link, threshold: float,
              budgets: Budgets = Budgets()) -> PDResult:
    """One fleet on ``tr``: ``prefill == 0`` is colocated serving on ``decode`` replicas (no prompt
    leaves them; each replica's step budget ``budgets.colocated``), else ``prefill:decode`` with
    remote prefill above ``threshold`` uncached tokens (the prefill replicas' budget
    ``budgets.prefill``)."""
    if prefill == 0:
        if budgets.colocated:
            hw = replace(hw, max_num_batched_tokens=budgets.colocated)
        return simulate_pd(tr, hw, 0, decode, threshold=math.inf)
    return simulate_pd(tr, hw, prefill, decode, link, threshold=threshold,
                       prefill_max_batched_tokens=budgets.prefill)


def capacity_sweep(trace_name: str, hw: StepTime, n: int, rates: Sequence[float], *, seed: int = 0,
                   duration: float | None = None, link: Link = RDMA, threshold: float = 0.0,
                   target: float = 0.9, progress: bool = False, budgets: Budgets = Budgets(),
                   stop_at_miss: bool = False) -> CapacitySweep:
    """Colocated serving on ``n`` replicas and every split of ``n`` on the trace at each rate.

    stop_at_miss: a fleet that missed ``target`` at some rate is not run at the higher ones (its
    entries there are None): its capacity (:func:`capacity_rate`) and its bisection bracket use
    only the rates up to its first miss, so the sweep's answer is the same, on fewer runs."""
    colo: list[PDResult | None] = []
    splits: dict[tuple[int, int], list[PDResult | None]] = {(p, n - p): [] for p in range(1, n)}

    def run(runs: list[PDResult | None], tr: Trace, p: int, d: int) -> None:
        missed = bool(runs) and (runs[-1] is None or runs[-1].attainment < target)   # None only after a miss
        if stop_at_miss and missed:
            runs.append(None)
        else:
            runs.append(run_fleet(tr, hw, p, d, link, threshold, budgets))

    for rate in rates:
        tr = make_trace(trace_name, seed, "h200", duration, rate)
        run(colo, tr, 0, n)
        for p, d in splits:
            run(splits[(p, d)], tr, p, d)
        if progress:
            print(f"  {trace_name} N={n} {rate:g} req/s: "
                  + ", ".join(f"{k} {'-' if rs[-1] is None else f'{rs[-1].attainment:.3f}'}"
                              for k, rs in [("colocated", colo), *((f"{p}:{d}", rs) for (p, d), rs in splits.items())]),
                  file=sys.stderr)
    return CapacitySweep(trace_name, n, list(rates), colo, splits, target, budgets=budgets)


def refine_capacity(trace_name: str, hw: StepTime, prefill: int, decode: int, lo: float, hi: float, *,
                    tol: float = 0.05, seed: int = 0, duration: float | None = None, link: Link = RDMA,
                    threshold: float = 0.0, target: float = 0.9,
                    budgets: Budgets = Budgets()) -> tuple[float, float, list[tuple[float, PDResult]]]:
    """Bisect a fleet's capacity inside one step of a sweep: ``lo`` sustains ``target`` attainment,
    ``hi`` misses it; the trace is made at the midpoint (the same generator and seed as the sweep)
    and the fleet run on it (``prefill == 0``: colocated serving on ``decode`` replicas, as
    :func:`capacity_sweep`), the half that holds the crossing kept, until ``hi - lo <= tol``.
    Returns ``(lo, hi, runs)``: the highest rate measured at or above the target, the lowest rate
    above it measured below, and each run as ``(rate, result)``. Measured, not interpolated: the
    capacity lies in ``[lo, hi]``."""
    runs: list[tuple[float, PDResult]] = []
    while hi - lo > tol + 1e-9:
        mid = round((lo + hi) / 2, 6)
        tr = make_trace(trace_name, seed, "h200", duration, mid)
        r = run_fleet(tr, hw, prefill, decode, link, threshold, budgets)
        runs.append((mid, r))
        if r.attainment >= target:
            lo = mid
        else:
            hi = mid
    return lo, hi, runs


def refine_sweep(c: CapacitySweep, hw: StepTime, *, tol: float = 0.05, seed: int = 0,
                 duration: float | None = None, link: Link = RDMA, threshold: float = 0.0,
                 progress: bool = False, top: int | None = None) -> CapacitySweep:
    """:func:`refine_capacity` for every fleet of ``c`` whose crossing lies inside the sweep
    (``CapacitySweep.bracket``); fills ``c.refined`` and ``c.refine_runs`` and returns ``c``.
    top: only colocated serving and the ``top`` splits with the highest interpolated capacity
    (None: every split)."""
    caps = c.capacities()
    keys = sorted((f"{p}:{d}" for p, d in c.splits), key=lambda k: -(caps[k][0] or 0.0))
    for key in ["colocated"] + (keys if top is None else keys[:top]):
        br = c.bracket(key)
        if br is None:
            continue
        p, d = c.fleet(key)
        lo, hi, runs = refine_capacity(c.name, hw, p, d, *br, tol=tol, seed=seed, duration=duration, link=link,
                                       threshold=threshold, target=c.target, budgets=c.budgets)
        c.refined[key] = (lo, hi)
        c.refine_runs[key] = runs
        if progress:
            print(f"  {c.name} N={c.n} {key}: capacity in [{lo:g}, {hi:g}] ("
                  + ", ".join(f"{x:g} {r.attainment:.3f}" for x, r in runs) + ")", file=sys.stderr)
    return c


def capacity_table(sweeps: Sequence[CapacitySweep], hw: StepTime, link: Link, duration: float) -> str:
    """Markdown: per N, goodput and attainment of each fleet at each rate, then the capacities."""
    lines = []
    for c in sweeps:
        keys = ["colocated"] + [f"{p}:{d}" for p, d in c.splits]
        runs = [c.colocated] + list(c.splits.values())
        b = c.budgets
        lines += [f"### {c.name}, N = {c.n}: goodput (req/s) / attainment by arrival rate ({hw.name}; "
                  f"{duration:.0f} s per rate; P/D over {link.name}, threshold 0; step token budget: colocated "
                  f"{b.colocated or hw.max_num_batched_tokens}, prefill pool {b.prefill or hw.max_num_batched_tokens}, "
                  f"decode pool {hw.max_num_batched_tokens})", "",
                  "| rate (req/s) | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
        for i, rate in enumerate(c.rates):
            lines.append(f"| {rate:g} | " + " | ".join("-" if rs[i] is None else
                                                      f"{rs[i].goodput_rps:.3f} / {rs[i].attainment:.3f}"
                                                      for rs in runs) + " |")
        caps = c.capacities()
        bk, bv, bexact = c.best()
        cv, cexact = caps["colocated"]
        ratio = bv / cv if bv is not None and cv else math.nan

        def fmt(v, exact):
            return "below the sweep" if v is None else f"{v:.2f}" + ("" if exact else " (at least: no miss in the sweep)")

        lines += ["", f"Capacity at attainment {c.target} (highest rate sustained, interpolated): "
                  + ", ".join(f"{k} {fmt(*caps[k])}" for k in keys) + ".",
                  f"Best split {bk}: {fmt(bv, bexact)} req/s against colocated {fmt(cv, cexact)} req/s: "
                  f"**{ratio:.2f}x**.", ""]
        if c.refined:
            lines += [f"Bisected (each step a run at the midpoint, until the bracket is at most "
                      f"{max(h - l for l, h in c.refined.values()):.3g} req/s wide; the capacity lies in it):", "",
                      "| fleet | sustains (attainment) | misses (attainment) | runs (rate: goodput / attainment) |",
                      "|---|---:|---:|---|"]
            for key, (lo, hi) in c.refined.items():
                runs = c.refine_runs[key]
                att = {x: r.attainment for x, r in runs}
                base = c.colocated if key == "colocated" else c.splits[c.fleet(key)]
                att.update({x: r.attainment for x, r in measured(c.rates, base) if x not in att})
                lines.append(f"| {key} | {lo:g} ({att[lo]:.4f}) | {hi:g} ({att[hi]:.4f}) | "
                             + ", ".join(f"{x:g}: {r.goodput_rps:.3f} / {r.attainment:.4f}" for x, r in runs) + " |")
            rb = max((k for k in c.refined if k != "colocated"), key=lambda k: c.refined[k][0], default=None)
            if rb is not None and "colocated" in c.refined:
                (bl, bh), (cl, ch) = c.refined[rb], c.refined["colocated"]
                lines += ["", f"Bisected: best split {rb} sustains {bl:g} req/s (misses at {bh:g}) against colocated "
                          f"{cl:g} (misses at {ch:g}): **{bl / cl:.2f}x** (bounds {bl / ch:.2f}x to {bh / cl:.2f}x).", ""]
    return "\n".join(lines) + "\n"


def capacity_json(sweeps: Sequence[CapacitySweep]) -> dict:
    out = {}
    for c in sweeps:
        caps = c.capacities()
        bk, bv, _ = c.best()
        cv = caps["colocated"][0]
        out[str(c.n)] = {"rates": c.rates, "target": c.target,
                         "budgets": {"colocated": c.budgets.colocated, "prefill": c.budgets.prefill},
                         "capacity": {k: {"rate": None if v is None else round(v, 4), "exact": e}
                                      for k, (v, e) in caps.items()},
                         "best_split": bk, "ratio": round(bv / cv, 4) if bv is not None and cv else None,
                         "refined": {k: {"sustains": lo, "misses": hi,
                                         "runs": [{"rate": x, **r.summary()} for x, r in c.refine_runs[k]]}
                                     for k, (lo, hi) in c.refined.items()},
                         "runs": {"colocated": [r and r.summary() for r in c.colocated],
                                  **{f"{p}:{d}": [r and r.summary() for r in rs] for (p, d), rs in c.splits.items()}}}
    return out


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
    ap.add_argument("--colocated-budget", type=int, default=None,
                    help="--capacity: the colocated replicas' step token budget (default the hardware's, 512)")
    ap.add_argument("--capacity-top", type=int, default=None,
                    help="--capacity-tol: bisect colocated and only this many splits, those with the highest "
                         "interpolated capacity (default every split)")
    ap.add_argument("--capacity-stop", action="store_true",
                    help="--capacity: a fleet that missed the target is not run at higher rates (same capacities)")
    ap.add_argument("--out-dir", default=None, help="write pd-<trace>-<hardware>.md and .json here")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--auto", action="store_true",
                    help="both pools autoscaled (policy.decide per pool, as the loop) against every fixed "
                         "split up to --pd-max-n replicas: pd-auto-<trace>-<hardware>[-seed<N>].md/.json")
    ap.add_argument("--pd-max-n", type=int, default=8, help="--auto: the largest fixed fleet compared")
    ap.add_argument("--auto-initial", default="1:1", help="--auto: prefill:decode replicas at 0")
    ap.add_argument("--auto-bounds", default="1:8,1:8",
                    help="--auto: prefill pool min:max, decode pool min:max replicas")
    ap.add_argument("--load-time", type=float, default=60.0, help="--auto: model load seconds")
    ap.add_argument("--no-defer", action="store_true",
                    help="--auto: the router never defers (429) a prompt the full prefill pool refuses while "
                         "prefill pods load; the decode pod prefills it (goodput.router.disagg.defer_when_full)")
    ap.add_argument("--capacity", metavar="R1,R2,...",
                    help="rate sweep at each N of --pd-sizes: colocated and every split, the highest rate "
                         "each sustains at --target attainment: pd-capacity-<trace>-<hardware>.md/.json")
    ap.add_argument("--capacity-tol", type=float, default=0.0,
                    help="--capacity: bisect each fleet's crossing inside the sweep until its bracket is at most "
                         "this wide (req/s; 0: off, the crossing is interpolated only)")
    ap.add_argument("--target", type=float, default=0.9, help="--capacity: attainment sustained; --auto: "
                                                                "the goodput ratio claimed")
    args = ap.parse_args(argv)
    if args.auto or args.capacity:
        return _main_auto_capacity(args, argv)
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
        _write(args.out_dir, f"pd-{tname}-{args.hardware}", argv, table, comparison_json(c))
    return 0


def _write(out_dir: str | None, stem: str, argv: list[str] | None, table: str, data: dict) -> None:
    """``<out_dir>/<stem>.md`` (the command, then ``table``) and ``<stem>.json`` (``data``); nothing
    without ``out_dir``."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem)
    cmd = " ".join(sys.argv[1:] if argv is None else ["--pd", *argv] if "--pd" not in argv else argv)
    with open(path + ".md", "w") as f:
        f.write(f"`python -m goodput.bench.simulate {cmd}`\n\n" + table)
    with open(path + ".json", "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def _main_auto_capacity(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--auto`` and ``--capacity`` (RDMA only: the first of ``--pd-links``)."""
    hw = HARDWARE[args.hardware]()
    link = LINKS[args.pd_links.split(",")[0].strip()]
    th = float(args.pd_thresholds.split(",")[0])
    tname = "long-context" if args.trace == "all" else args.trace
    if args.auto:
        trace = make_trace(tname, args.seed, args.hardware, args.duration, args.rate)
        (p_lo, p_hi), (d_lo, d_hi) = (tuple(int(x) for x in b.split(":")) for b in args.auto_bounds.split(","))
        initial = tuple(int(x) for x in args.auto_initial.split(":"))
        spec = pd_autoscale(trace, prefill_replicas=(p_lo, p_hi), decode_replicas=(d_lo, d_hi),
                            initial=initial, load_time_s=args.load_time)
        c = compare_auto(trace, hw, spec, args.pd_max_n, link, th, args.progress, args.target,
                         defer_full=not args.no_defer)
        table = auto_table(c)
        print(table)
        seed = f"-seed{args.seed}" if args.seed else ""     # seed 0 keeps the name it always had
        _write(args.out_dir, f"pd-auto-{tname}-{args.hardware}{seed}", argv, table, auto_json(c))
    if args.capacity:
        rates = [float(x) for x in args.capacity.split(",") if x.strip()]
        sizes = [int(x) for x in (args.pd_sizes or "4").split(",") if x.strip()]
        budgets = Budgets(args.colocated_budget, args.prefill_budget)
        sweeps = [capacity_sweep(tname, hw, n, rates, seed=args.seed, duration=args.duration, link=link,
                                 threshold=th, target=args.target, progress=args.progress, budgets=budgets,
                                 stop_at_miss=args.capacity_stop) for n in sizes]
        if args.capacity_tol > 0:
            for c in sweeps:
                refine_sweep(c, hw, tol=args.capacity_tol, seed=args.seed, duration=args.duration, link=link,
                             threshold=th, progress=args.progress, top=args.capacity_top)
        duration = make_trace(tname, args.seed, args.hardware, args.duration, rates[0]).duration
        table = capacity_table(sweeps, hw, link, duration)
        print(table)
        _write(args.out_dir, f"pd-capacity-{tname}-{args.hardware}{'' if link is RDMA else '-' + link.name}"
                             f"{budgets.label()}", argv, table,
               {"trace": tname, "hardware": hw.name, "link": link.name, "threshold": th, "duration_s": duration,
                "sizes": capacity_json(sweeps)})
    return 0
