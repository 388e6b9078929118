"""The goodput autoscaling policy: replicas and per-replica admission limits (pure, stdlib only).

``decide(now, obs, spec, state) -> Decision`` is called once per period with one observation of
the fleet. It does no I/O and keeps everything it remembers in ``PolicyState`` (JSON-safe, so a
restarted autoscaler resumes with the same history and does not flap).

Terms: TTFT (time to first token), TPOT (time per output token after the first), a request
*meets the SLO* when TTFT <= ``slo_ttft_s`` and TPOT <= ``slo_tpot_s``; *goodput* is the rate of
such requests (DistServe, Zhong et al., OSDI 2024). *Attainment* is SLO-meeting requests over
OFFERED requests.

How each rule follows from the ideas it rests on:

1. Offered demand, not admitted demand. A fleet can look fast by refusing work, so demand is
   ``admitted + rejected_429`` per second, and attainment is
   ``slo_met / (finished + rejected_429)``: a 429 is a missed request. (400s, never_fits and
   invalid, are client errors that no replica count can fix; they are reported, not counted.)

2. The best batch is the largest that still meets the latency contract. Each replica's
   ``max_num_seqs`` is tuned AIMD-style from its own signals over the interval: TPOT attainment
   (``tpot.fraction_le(slo_tpot_s)``) below ``attainment_target`` or any preemption (the batch
   outgrew the KV pool) cuts it multiplicatively to ``floor(min(cap, running) * batch_decrease)``;
   when the cap binds (``running >= cap``), KV usage is below ``kv_target`` and nothing was
   preempted, it grows: by ``batch_fast_increase`` times while TPOT attainment holds at half the
   SLO (``fraction_le(slo_tpot_s * tpot_fast_margin) >= attainment_target``: far from the
   contract, step time grows only linearly with the batch), by ``max(1, ceil(cap *
   batch_increase))`` while it holds at ``tpot_margin`` of it, never past the batch whose KV,
   extrapolated from the KV per running request, reaches ``kv_target``. Otherwise it stays (too
   little evidence moves nothing). A new replica starts at the fleet's
   median learned cap (or at the batch it was ordered with, if larger: rule 4), so what one
   replica learned is not re-learned.

3. Size from demand in flight (Little's law). The concurrency the fleet must carry is
   ``L = max(running + waiting now, offered_rps * service_s)`` with
   ``service_s = min(mean TTFT, slo_ttft_s) + (mean output tokens - 1) * mean TPOT``; one replica
   carries ``c = min(cap, running * kv_target / kv_usage)`` (the batch or, when KV binds first,
   what the KV pool holds at ``kv_target``) at ``target_utilization``. Wanted replicas
   ``w = ceil(L / (c_mean * target_utilization))``. When attainment is below target while the
   fleet is saturated (waiting, 429s or preemptions) and nothing is loading (misses while pods
   load are the expected cost of rule 4, not new evidence), ``w >= max(ready + 1, ceil(ready *
   attainment_target / attainment))`` (HPA's proportional formula applied to goodput; attainment
   floored at 0.25) (reason ScaleUpGoodput; ScaleUpSaturation when preemptions or KV over target
   are the signal). Little's law counts sequences, so it underrates prefill-heavy load (long
   prompts, short outputs); the attainment term is what sees that.

4. Starting pods are capacity that is coming. ``w`` is compared with ``current_replicas``, which
   counts pods that are loading or not yet created, never with the ready pods alone: demand that
   the loading pods will serve never adds replicas again (no pile-up while a model loads;
   reason HoldStarting). Coming capacity is counted with the batch and the TPOT it will have:
   those the scale-up that ordered it was sized with (``PolicyState.plan_cap``, the median
   learned cap, and ``plan_tpot_s``, the mean TPOT, of that decision; pods found loading without
   a plan get the caps in force before the tick and the TPOT of the tick). While anything is
   coming, every replica is sized with ``max(its cap, plan_cap)`` and service_s with
   ``min(mean TPOT, plan_tpot_s)``; a pod that becomes ready starts at ``max(plan_cap, median
   learned cap)``. Why: a TPOT miss during the load happens on the replicas that carry the
   overload the coming pods are ordered to absorb. It cuts their batch (rule 2), which protects
   the TPOT of the requests they admit now, and it stretches the measured service time; neither
   says that replicas at their planned load will need a smaller batch or serve slower, so
   neither may by itself order another replica (sized against the cut, one 64 -> 48 cut turns
   104 seqs from 2 replicas into 3). The offered rate is sized with ``min(offered, max(
   plan_offered_rps, admitted rate))``: while capacity loads the admission limits are tight on
   purpose (rule 5, and the cuts), and a client that retries a 429 offers the same request
   again, so 429s beyond the offered rate the plan was sized for are not new demand until the
   capacity has arrived (then they count in full). While pods load only a rise in demand (seqs
   in flight, admitted or planned req/s) adds replicas. For the same reason the cuts are provisional: on the tick the
   last coming pod is ready, every replica's cap is raised back to at least ``plan_cap`` (the
   load per replica is back to the planned one; if the batch still misses there, rule 2 cuts it
   again after one interval), and the plan is dropped. A cut or a slow TPOT that then persists
   counts in full, and its scale-up must still pass the scale-up window (rule 8) or be proven by
   missed SLOs on a saturated fleet (rule 3).

5. While capacity loads, admit only what can still meet TTFT. A waiting request at queue position
   k leaves the queue after about k / mu seconds, mu = c / service_s completions per second per
   replica, and then still needs ``t_first`` until its first token (its prefill, sharing each
   step's token budget with the batch): ``t_first`` = mean TTFT - mean queue time over the
   interval (the worker's queue-time histogram: arrival -> first scheduled). It meets TTFT when
   ``k / mu + t_first <= slo_ttft_s``, so ``k_ttft = floor((slo_ttft_s - t_first) * mu)``.
   (Spending the whole TTFT budget on the queue admits requests that wait their full budget and
   then miss by their prefill.) While pods are starting and the ready ones are saturated,
   the overload lasts the whole load time, so any request queued past k_ttft misses TTFT and
   only steals capacity: ``max_waiting = k_ttft`` (a fast 429 instead). With nothing loading a
   queue is transient noise that drains, so the limit loosens to ``k_ttft * queue_slack`` in
   proportion to the fraction of wanted capacity that is ready.

6. Preemptions are a saturation signal (they waste the recomputed prefill and stall TPOT): they
   cut the batch (rule 2) and block any scale-down.

7. Scale down only after the stabilization window and only when the rest holds the SLO. The
   scale-down target is the LARGEST recommendation of the last ``stabilization_window_s``
   (Kubernetes HPA's scale-down stabilization), over a history at least that long (a fresh or
   lost state waits a window); it applies only when there were no 429s and no
   preemptions in the interval, attainment met the target, nothing is starting, and the
   remaining replicas carry L at no more than ``target_utilization`` of their capacity.
   Successive scale-downs are at least ``model_load_s`` apart: undoing a wrong one costs a model
   load, so the smaller fleet is watched that long before the next replica goes.

8. Scale up on evidence. The scale-up target is the SMALLEST recommendation of the last
   ``scale_up_window_s`` (a spike shorter than the window moves nothing), except that a
   recommendation of at least ``panic_ratio`` times the current replicas (Knative's panic mode),
   or one made while SLOs are being missed on a saturated fleet (the evidence is in), acts at
   once.

9. Bounded steps and a tolerance band. One decision adds at most ``max(max_scale_up_step,
   current)`` replicas and removes at most ``max_scale_down_step``; ``|w / current - 1| <=
   tolerance`` moves nothing (HPA's 10 % band). Limits move only by at least one unit.

10. Missing or stale metrics never cause a scale-down. If any ready pod is unreachable, or no ready
   pod has a rate yet (first scrape), ``MetricsAvailable`` is False and only a scale-up that the
   available pods prove is allowed (reason HoldMissingMetrics otherwise). Such a tick records
   ``max(w, current)`` in the windows (the pods that did not answer are assumed busy, as HPA
   assumes missing pods at 100 % of target on a scale-down): the stabilization window after the
   metrics come back then holds a whole window of complete metrics before any scale-down, where
   recording nothing would leave it empty after a gap longer than the window and let a single
   sample act. ``current_replicas`` below ``min_replicas`` is raised regardless
   (ScaleUpMinReplicas).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# ----------------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class HistogramDelta:
    """Increase of a Prometheus histogram over one interval.

    bounds: bucket upper bounds in seconds, ascending, the last one ``math.inf``.
    counts: cumulative counts per bound (same length; ``counts[-1]`` is the +Inf bucket).
    count, sum: the ``_count`` and ``_sum`` increases (observations, seconds).
    Raises ValueError when bounds and counts differ in length or bounds are not ascending.
    """

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    count: float
    sum: float

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.counts) or not self.bounds:
            raise ValueError(f"bounds ({len(self.bounds)}) and counts ({len(self.counts)}) must be "
                             "non-empty and of equal length")
        if any(b <= a for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"bounds must be strictly ascending, got {self.bounds}")

    def fraction_le(self, x: float) -> float | None:
        """Fraction of the interval's observations <= ``x`` seconds; None when there were none.

        Linear interpolation inside the bucket holding ``x`` (as Prometheus'
        ``histogram_quantile`` assumes; the first bucket starts at 0). Beyond the last finite
        bound nothing can be interpolated, so the count up to that bound is used (a lower bound).
        """
        total = self.counts[-1] if self.counts[-1] > 0 else self.count
        if total <= 0:
            return None
        prev_bound, prev_count = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.counts):
            if x <= bound:
                if math.isinf(bound):
                    frac = prev_count
                else:
                    width = bound - prev_bound
                    part = (x - prev_bound) / width if width > 0 else 1.0
                    frac = prev_count + (cum - prev_count) * max(0.0, part)
                return min(1.0, max(0.0, frac / total))
            prev_bound, prev_count = bound, cum
        return min(1.0, prev_count / total)

    @property
    def mean(self) -> float | None:
        """Mean observation in seconds (sum / count); None when count is 0."""
        return self.sum / self.count if self.count > 0 else None


@dataclass(frozen=True)
class PodObservation:
    """One READY pod, from one scrape and the deltas to the previous scrape.

    running, waiting: requests now (gauges). kv_usage: KV blocks in use, 0..1.
    max_num_seqs, max_waiting: admission limits in force on the pod.
    interval_s: seconds between the two scrapes the deltas come from (0 = first scrape: the
        deltas are meaningless and ignored).
    admitted, finished, slo_met, rejected_429 (queue_full), rejected_400 (never_fits + invalid),
        preempted, generation_tokens: counter increases over the interval.
    ttft, tpot: histogram increases over the interval (None when not scraped).
    age_s: seconds since the pod became ready.
    queue: histogram increase of the queue time (arrival -> first scheduled, seconds) over the
        interval (None when not scraped; rule 5 then assumes no time after the queue).
    """

    name: str
    running: int
    waiting: int
    kv_usage: float
    max_num_seqs: int
    max_waiting: int
    interval_s: float
    admitted: float
    finished: float
    slo_met: float
    rejected_429: float
    rejected_400: float
    preempted: float
    generation_tokens: float
    ttft: HistogramDelta | None
    tpot: HistogramDelta | None
    age_s: float = 0.0
    queue: HistogramDelta | None = None


@dataclass(frozen=True)
class StartingPod:
    """A pod created but not ready yet (model loading); ``age_s`` since it was created."""

    name: str
    age_s: float


@dataclass(frozen=True)
class Observation:
    """The fleet at one instant.

    ready: scraped ready pods. starting: pods not ready yet. unreachable: names of ready pods whose
    scrape failed, timed out or is stale. current_replicas: ``spec.replicas`` as the API server
    has it now (it also counts pods not created yet).
    """

    ready: tuple[PodObservation, ...]
    starting: tuple[StartingPod, ...]
    unreachable: tuple[str, ...]
    current_replicas: int


# ------------------------------------------------------------------------------------------ spec


@dataclass(frozen=True)
class PolicySpec:
    """What the policy holds the fleet to. Times in seconds, ratios in 0..1.

    min_replicas, max_replicas: bounds on the replicas decided.
    slo_ttft_s, slo_tpot_s, attainment_target: the SLO (``spec.slo``).
    scale_up_window_s: scale-up uses the smallest recommendation of this window (rule 8).
    stabilization_window_s: scale-down uses the largest recommendation of this window (rule 7).
    kv_target: KV usage a replica is held below. queue_target: waiting requests per replica above
        which a replica counts as saturated (rule 3).
    tolerance: relative band within which replicas do not move (rule 9).
    max_scale_up_step, max_scale_down_step: replicas one decision may add (at least; up to
        doubling) / remove.
    target_utilization: fraction of a replica's batch capacity the sizing plans to fill.
    panic_ratio: a recommendation this many times the current replicas skips the scale-up window.
    model_load_s: expected seconds from pod creation to ready; also the least time between two
        scale-downs (rule 7).
    min_num_seqs, max_num_seqs: bounds on the ``max_num_seqs`` limit set on replicas.
    min_waiting, max_waiting: bounds on the ``max_waiting`` limit set on replicas.
    queue_slack: how far past the TTFT-bound queue the limit loosens when nothing loads (rule 5).
    batch_increase, batch_fast_increase, batch_decrease, tpot_margin, tpot_fast_margin: the
        AIMD factors of rule 2.
    """

    min_replicas: int = 1
    max_replicas: int = 4
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.1
    attainment_target: float = 0.9
    scale_up_window_s: float = 30.0
    stabilization_window_s: float = 300.0
    kv_target: float = 0.8
    queue_target: int = 4
    tolerance: float = 0.1
    max_scale_up_step: int = 4
    max_scale_down_step: int = 1
    target_utilization: float = 0.85
    panic_ratio: float = 2.0
    model_load_s: float = 60.0
    min_num_seqs: int = 1
    max_num_seqs: int = 256
    min_waiting: int = 1
    max_waiting: int = 1024
    queue_slack: float = 2.0
    batch_increase: float = 0.125
    batch_fast_increase: float = 1.5
    batch_decrease: float = 0.75
    tpot_margin: float = 0.8
    tpot_fast_margin: float = 0.5

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{self.min_replicas}..{self.max_replicas}")
        for name in ("slo_ttft_s", "slo_tpot_s", "target_utilization", "panic_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("attainment_target", "kv_target", "tolerance"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if not 1 <= self.min_num_seqs <= self.max_num_seqs:
            raise ValueError(f"need 1 <= min_num_seqs <= max_num_seqs, got "
                             f"{self.min_num_seqs}..{self.max_num_seqs}")
        if not 0 <= self.min_waiting <= self.max_waiting:
            raise ValueError(f"need 0 <= min_waiting <= max_waiting, got "
                             f"{self.min_waiting}..{self.max_waiting}")
        if self.max_scale_up_step < 1 or self.max_scale_down_step < 1:
            raise ValueError("max_scale_up_step and max_scale_down_step must be >= 1")

    @classmethod
    def from_crd(cls, spec: dict[str, Any]) -> "PolicySpec":
        """Build from an InferenceService ``.spec`` (camelCase dict as the API server returns it;
        absent fields take the CRD defaults). Raises ValueError on inconsistent values."""
        a = spec.get("autoscaling") or {}
        slo = spec.get("slo") or {}
        targets = a.get("targets") or {}
        engine = spec.get("engine") or {}
        kw: dict[str, Any] = {
            "min_replicas": int(a.get("minReplicas", 1)),
            "max_replicas": int(a.get("maxReplicas", 4)),
            "slo_ttft_s": float(slo.get("ttftMs", 1000.0)) / 1000.0,
            "slo_tpot_s": float(slo.get("tpotMs", 100.0)) / 1000.0,
            "attainment_target": float(slo.get("attainmentTarget", 0.9)),
            "scale_up_window_s": float(a.get("scaleUpWindowSeconds", 30)),
            "stabilization_window_s": float(a.get("stabilizationWindowSeconds", 300)),
            "kv_target": float(targets.get("kvCacheUsage", 0.8)),
            "queue_target": int(targets.get("queueDepth", 4)),
        }
        # the other PolicySpec fields keep their defaults (the CRD does not expose them)
        if engine.get("maxNumSeqs"):
            kw["max_num_seqs"] = max(int(engine["maxNumSeqs"]), cls.max_num_seqs)
        return cls(**kw)


# ----------------------------------------------------------------------------------------- state


@dataclass
class PolicyState:
    """What ``decide`` remembers between calls (JSON-safe through ``to_dict``/``from_dict``).

    recommendations: ``[time, replicas]`` pairs, newest last, kept for the longest window.
    caps: pod name -> learned ``max_num_seqs`` (the best batch, rule 2).
    service_s: last estimate of the service time of one request (seconds; 0 = unknown).
    last_scale_time: when replicas last changed (None = never). last_direction: +1, -1 or 0.
    plan_cap, plan_tpot_s, plan_offered_rps: the batch (``max_num_seqs``) per replica, the mean
        TPOT (seconds) and the offered load (req/s) that the capacity now coming was sized with
        (rule 4); 0 when nothing is coming.
    since: when this history started (the first call with metrics); no scale-down before a whole
        stabilization window of history exists, so an autoscaler that lost its state waits
        instead of acting on one sample.
    """

    recommendations: list[list[float]] = field(default_factory=list)
    caps: dict[str, int] = field(default_factory=dict)
    service_s: float = 0.0
    last_scale_time: float | None = None
    last_direction: int = 0
    since: float | None = None
    plan_cap: int = 0
    plan_tpot_s: float = 0.0
    plan_offered_rps: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (lists, dicts, numbers, None)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "PolicyState":
        """Inverse of ``to_dict``; unknown keys are ignored, a missing or malformed dict gives a
        fresh state (a corrupt status must not crash the loop)."""
        if not isinstance(d, dict):
            return cls()
        try:
            return cls(
                recommendations=[[float(t), float(r)] for t, r in d.get("recommendations", [])],
                caps={str(k): int(v) for k, v in (d.get("caps") or {}).items()},
                service_s=float(d.get("service_s", 0.0)),
                last_scale_time=None if d.get("last_scale_time") is None else float(d["last_scale_time"]),
                last_direction=int(d.get("last_direction", 0)),
                since=None if d.get("since") is None else float(d["since"]),
                plan_cap=int(d.get("plan_cap", 0)),
                plan_tpot_s=float(d.get("plan_tpot_s", 0.0)),
                plan_offered_rps=float(d.get("plan_offered_rps", 0.0)),
            )
        except (TypeError, ValueError, AttributeError):
            return cls()


@dataclass(frozen=True)
class Limits:
    """Admission limits for one replica (``PUT /admin/limits``)."""

    max_num_seqs: int
    max_waiting: int


@dataclass(frozen=True)
class Decision:
    """What ``decide`` returns.

    replicas: the ``spec.replicas`` to set (unchanged = current).
    limits: pod name -> limits for every ready pod.
    reason: CamelCase (ScaleUpGoodput, ScaleUpSaturation, ScaleUpMinReplicas, ScaleDownMaxReplicas,
        HoldStarting, ScaleDownIdle, ScaleDown, HoldStabilizing, HoldMissingMetrics, Steady).
    message: one sentence with the numbers behind the decision.
    conditions: type -> (status, reason, message) for MetricsAvailable, ScalingActive, AbleToScale.
    state: the state to pass to the next call.
    """

    replicas: int
    limits: dict[str, Limits]
    reason: str
    message: str
    conditions: dict[str, tuple[bool, str, str]]
    state: PolicyState


# -------------------------------------------------------------------------------------- decision


@dataclass
class _Fleet:
    """Aggregates of one observation (internal)."""

    rated: int = 0                  # ready pods with interval_s > 0
    offered_rps: float = 0.0
    admitted_rps: float = 0.0
    finished_rps: float = 0.0
    rejected_429: float = 0.0
    finished: float = 0.0
    slo_met: float = 0.0
    preempted: float = 0.0
    in_flight: int = 0              # running + waiting now
    waiting: int = 0
    kv_hot: bool = False
    attainment: float | None = None
    service_s: float = 0.0


def _pod_service_s(p: PodObservation, slo_ttft_s: float, tpot_ceiling_s: float = math.inf
                   ) -> float | None:
    if p.interval_s <= 0 or p.finished <= 0 or p.tpot is None or p.tpot.mean is None:
        return None
    ttft = p.ttft.mean if p.ttft is not None and p.ttft.mean is not None else 0.0
    out = max(1.0, p.generation_tokens / p.finished)
    return min(ttft, slo_ttft_s) + (out - 1.0) * min(p.tpot.mean, tpot_ceiling_s)


def _tune_cap(p: PodObservation, cap: int, spec: PolicySpec) -> int:
    """Rule 2 (AIMD on the best batch) for one pod."""
    if p.interval_s <= 0 or p.tpot is None:
        return cap
    tpot_ok = p.tpot.fraction_le(spec.slo_tpot_s)
    if p.preempted > 0 or (tpot_ok is not None and tpot_ok < spec.attainment_target):
        base = min(cap, max(p.running, spec.min_num_seqs))
        return max(spec.min_num_seqs, min(cap - 1, math.floor(base * spec.batch_decrease)))
    if p.running < cap or p.kv_usage >= spec.kv_target:
        return cap          # the cap does not bind, or KV binds first: no evidence to grow
    # KV at the new cap, extrapolated from KV per running request now, must stay <= kv_target
    kv_room = math.floor(p.running * spec.kv_target / p.kv_usage) if p.kv_usage > 0 else spec.max_num_seqs
    fast = p.tpot.fraction_le(spec.slo_tpot_s * spec.tpot_fast_margin)
    margin = p.tpot.fraction_le(spec.slo_tpot_s * spec.tpot_margin)
    if fast is not None and fast >= spec.attainment_target:
        grown = math.ceil(cap * spec.batch_fast_increase)
    elif margin is not None and margin >= spec.attainment_target:
        grown = cap + max(1, math.ceil(cap * spec.batch_increase))
    else:
        return cap
    return max(cap, min(spec.max_num_seqs, grown, kv_room))


def _replica_capacity(p: PodObservation, cap: int, spec: PolicySpec) -> float:
    """Rule 3: concurrency one replica carries within the contract (batch or KV at kv_target)."""
    c = float(cap)
    if p.kv_usage > 0 and p.running > 0:
        c = min(c, p.running * spec.kv_target / p.kv_usage)
    return max(float(spec.min_num_seqs), c)


def _median(xs: list[int]) -> int:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0


def decide(now: float, obs: Observation, spec: PolicySpec, state: PolicyState | None) -> Decision:
    """One autoscaling decision; see the module docstring for the rules and their sources.

    now: the caller's clock in seconds (monotonic or wall; only differences are used).
    Returns a Decision whose ``state`` must be passed to the next call. Never raises on odd
    observations (negative deltas are treated as 0 by the caller's counter-reset handling).
    """
    st = PolicyState.from_dict(state.to_dict()) if state is not None else PolicyState()
    current = obs.current_replicas
    ready_names = [p.name for p in obs.ready]
    n_ready = len(obs.ready)

    # pods loading or not yet created (rule 4)
    coming = len(obs.starting) + max(0, current - n_ready - len(obs.unreachable) - len(obs.starting))
    if coming > 0 and not st.plan_cap:
        # loading found without a plan of ours (created elsewhere, or state lost): the batch in
        # force before this tick's cuts is the one it will have
        st.plan_cap = _median([st.caps.get(p.name) or p.max_num_seqs for p in obs.ready])

    # --- rule 2: best batch per pod (caps of vanished pods are forgotten) ---
    fleet_cap = max(st.plan_cap, _median(list(st.caps.values()))) or None
    # the capacity the plan waited for has arrived: cuts made meanwhile were provisional (rule 4)
    arrived = coming == 0 and st.plan_cap > 0
    caps: dict[str, int] = {}
    for p in obs.ready:
        start = st.caps.get(p.name) or fleet_cap or p.max_num_seqs
        if arrived:
            start = max(start, st.plan_cap)
        start = max(spec.min_num_seqs, min(spec.max_num_seqs, start))
        caps[p.name] = _tune_cap(p, start, spec)
    for name in obs.unreachable:
        if name in st.caps:
            caps[name] = st.caps[name]
    st.caps = caps
    # the batch each replica is sized with: a cut while capacity is coming does not shrink it
    sizing_caps = {n: max(c, st.plan_cap) if coming > 0 else c for n, c in caps.items()}

    # --- rule 1 and 3: demand and capacity ---
    f = _Fleet()
    services: list[tuple[float, float]] = []     # (live service_s, finished) per pod
    sized: list[tuple[float, float]] = []        # with TPOT at most the plan's (rule 4)
    tpot_sum = tpot_n = 0.0
    tpot_ceiling = st.plan_tpot_s if coming > 0 and st.plan_tpot_s > 0 else math.inf
    capacities: list[float] = []        # sized with sizing_caps (rule 4)
    live: list[float] = []              # with the caps in force now (rule 5: how fast queues drain)
    for p in obs.ready:
        f.in_flight += p.running + p.waiting
        f.waiting += p.waiting
        f.kv_hot = f.kv_hot or p.kv_usage > spec.kv_target
        capacities.append(_replica_capacity(p, sizing_caps[p.name], spec))
        live.append(_replica_capacity(p, caps[p.name], spec))
        if p.interval_s <= 0:
            continue
        f.rated += 1
        f.offered_rps += (p.admitted + p.rejected_429) / p.interval_s
        f.admitted_rps += p.admitted / p.interval_s
        f.finished_rps += p.finished / p.interval_s
        f.rejected_429 += p.rejected_429
        f.finished += p.finished
        f.slo_met += p.slo_met
        f.preempted += p.preempted
        s = _pod_service_s(p, spec.slo_ttft_s)
        if s is not None:
            services.append((s, p.finished))
            sized.append((_pod_service_s(p, spec.slo_ttft_s, tpot_ceiling) or s, p.finished))
        if p.tpot is not None and p.tpot.count > 0:
            tpot_sum, tpot_n = tpot_sum + p.tpot.sum, tpot_n + p.tpot.count
    sizing_service_s = st.service_s
    if services:
        w = sum(n for _, n in services)
        st.service_s = sum(s * n for s, n in services) / w
        sizing_service_s = sum(s * n for s, n in sized) / w
    f.service_s = st.service_s       # how fast queues drain now (rule 5)
    tpot_mean = tpot_sum / tpot_n if tpot_n > 0 else 0.0
    if coming > 0 and not st.plan_tpot_s:
        st.plan_tpot_s = tpot_mean
    if coming > 0 and not st.plan_offered_rps:
        st.plan_offered_rps = f.offered_rps
    sizing_offered_rps = f.offered_rps
    if coming > 0:      # retried 429s while capacity loads are not new demand (rule 4)
        sizing_offered_rps = min(f.offered_rps, max(st.plan_offered_rps, f.admitted_rps))
    offered = f.finished + f.rejected_429
    f.attainment = f.slo_met / offered if offered > 0 else None
    cap_mean = sum(capacities) / len(capacities) if capacities else float(
        _median(list(sizing_caps.values())) or spec.max_num_seqs)
    per_replica = max(1e-9, cap_mean * spec.target_utilization)
    demand = max(float(f.in_flight), sizing_offered_rps * sizing_service_s)
    wanted = math.ceil(demand / per_replica - 1e-9) if demand > 0 else 0

    saturated = f.waiting > spec.queue_target * max(1, n_ready) or f.rejected_429 > 0 \
        or f.preempted > 0 or f.kv_hot
    missing_attainment = (f.attainment is not None
                          and f.attainment < spec.attainment_target * (1 - spec.tolerance / 2))
    up_reason = "ScaleUpSaturation" if (f.preempted > 0 or f.kv_hot) else "ScaleUpGoodput"
    # misses while pods load are expected (rule 4): only a fleet with nothing coming is evidence
    evidence = missing_attainment and saturated and coming == 0
    if evidence:
        # goodput-proportional (HPA's formula on attainment): the replicas that would bring the
        # attainment back to target if misses scale with load per replica; at least one more
        att = max(f.attainment or 0.0, 0.25)
        wanted = max(wanted, n_ready + 1, math.ceil(n_ready * spec.attainment_target / att - 1e-9))
    rec = max(spec.min_replicas, min(spec.max_replicas, wanted))

    # --- metrics health (rule 10) ---
    metrics_ok = not obs.unreachable and f.rated > 0
    if obs.unreachable:
        metrics_msg = f"{len(obs.unreachable)} ready pod(s) not scraped: {', '.join(obs.unreachable)}"
    elif n_ready == 0:
        metrics_msg = "no ready pod to scrape"
    elif f.rated == 0:
        metrics_msg = "first scrape of every ready pod; rates need a second one"
    else:
        metrics_msg = f"{f.rated} ready pod(s) scraped"

    # --- windows (rules 7, 8) ---
    if metrics_ok:
        st.recommendations.append([now, float(rec)])
        if st.since is None:
            st.since = now
    else:   # the silent pods are assumed busy: nothing here argues for fewer replicas
        st.recommendations.append([now, float(max(rec, current))])
    history_s = now - st.since if st.since is not None else 0.0
    horizon = max(spec.stabilization_window_s, spec.scale_up_window_s)
    st.recommendations = [r for r in st.recommendations if now - r[0] <= horizon]
    up_window = [r for t, r in st.recommendations if now - t <= spec.scale_up_window_s] or [rec]
    down_window = [r for t, r in st.recommendations if now - t <= spec.stabilization_window_s] or [rec]
    up_target = int(min(up_window))
    if rec >= spec.panic_ratio * max(1, current) or evidence:
        up_target = rec   # panic, or SLOs already missed while saturated: no more evidence needed
    if not metrics_ok:
        up_target = rec  # only pods that answered speak; a scale-up they prove is still taken
    down_target = int(max(down_window))

    in_band = current > 0 and abs(rec / current - 1.0) <= spec.tolerance + 1e-9
    replicas, reason = current, "Steady"
    if current < spec.min_replicas:
        replicas, reason = spec.min_replicas, "ScaleUpMinReplicas"
    elif current > spec.max_replicas:
        replicas, reason = spec.max_replicas, "ScaleDownMaxReplicas"
    elif up_target > current and not in_band:
        step = max(spec.max_scale_up_step, current)
        replicas, reason = min(up_target, current + step), up_reason
    elif rec > current and not in_band:
        reason = "HoldStabilizing"   # the scale-up window has not confirmed it yet
    elif rec < current and not metrics_ok:
        reason = "HoldMissingMetrics"
    elif rec < current and coming > 0:
        reason = "HoldStarting"
    elif rec < current and not in_band:
        holds = (f.rejected_429 == 0 and f.preempted == 0
                 and (f.attainment is None or f.attainment >= spec.attainment_target)
                 and demand <= down_target * per_replica)
        spaced = (st.last_direction >= 0 or st.last_scale_time is None
                  or now - st.last_scale_time >= spec.model_load_s)
        if down_target < current and holds and history_s >= spec.stabilization_window_s and spaced:
            replicas = max(down_target, current - spec.max_scale_down_step, spec.min_replicas)
            reason = "ScaleDownIdle" if demand == 0 else "ScaleDown"
        else:
            reason = "HoldStabilizing"
    elif coming > 0:
        reason = "HoldStarting"

    if replicas != current:
        st.last_direction = 1 if replicas > current else -1
        st.last_scale_time = now
    if replicas > current:      # what this scale-up was sized with (rule 4)
        st.plan_cap = _median(list(sizing_caps.values())) or st.plan_cap
        st.plan_tpot_s = min(tpot_mean, st.plan_tpot_s or math.inf) if tpot_mean else st.plan_tpot_s
        st.plan_offered_rps = max(sizing_offered_rps, st.plan_offered_rps if coming else 0.0)
    elif coming == 0:
        st.plan_cap, st.plan_tpot_s, st.plan_offered_rps = 0, 0.0, 0.0

    # --- rule 5: waiting-queue limit ---
    live_mean = sum(live) / len(live) if live else cap_mean
    mu = (live_mean / f.service_s) if f.service_s > 0 else 0.0
    ttfts = [p.ttft for p in obs.ready if p.interval_s > 0 and p.ttft is not None and p.ttft.count > 0]
    queues = [p.queue for p in obs.ready if p.interval_s > 0 and p.queue is not None and p.queue.count > 0]
    t_first = 0.0
    if ttfts and queues:   # time after the queue until the first token (prefill)
        t_first = max(0.0, sum(h.sum for h in ttfts) / sum(h.count for h in ttfts)
                      - sum(h.sum for h in queues) / sum(h.count for h in queues))
    budget = max(0.0, spec.slo_ttft_s - t_first)
    k_ttft = math.floor(budget * mu) if mu > 0 else spec.max_waiting
    loading = coming + max(0, replicas - current)
    ready_frac = n_ready / max(1, n_ready + loading) if loading else 1.0
    slack = 1.0 + (spec.queue_slack - 1.0) * ready_frac
    max_waiting = max(spec.min_waiting, min(spec.max_waiting, math.floor(k_ttft * slack)))
    limits = {p.name: Limits(max_num_seqs=caps[p.name], max_waiting=max_waiting) for p in obs.ready}

    att = "n/a" if f.attainment is None else f"{f.attainment:.3f}"
    message = (f"{reason}: {current} -> {replicas} replicas ({n_ready} ready, {coming} starting); "
               f"offered {f.offered_rps:.2f} req/s, in flight {f.in_flight}, demand {demand:.1f} seqs, "
               f"{per_replica:.1f} seqs per replica, attainment {att} (target "
               f"{spec.attainment_target}), 429s {f.rejected_429:.0f}, preemptions {f.preempted:.0f}; "
               f"limits max_num_seqs median {_median(list(caps.values())) or '-'} "
               f"max_waiting {max_waiting}")
    conditions = {
        "MetricsAvailable": (metrics_ok, "MetricsScraped" if metrics_ok else "MetricsMissing",
                             metrics_msg),
        "ScalingActive": (spec.min_replicas != spec.max_replicas,
                          "ValidMetricFound" if spec.min_replicas != spec.max_replicas
                          else "ScalingDisabled",
                          f"replicas between {spec.min_replicas} and {spec.max_replicas}"),
        "AbleToScale": (reason not in ("HoldStarting", "HoldStabilizing", "HoldMissingMetrics"),
                        "ReadyForNewScale" if reason not in (
                            "HoldStarting", "HoldStabilizing", "HoldMissingMetrics") else reason,
                        message),
    }
    return Decision(replicas=replicas, limits=limits, reason=reason, message=message,
                    conditions=conditions, state=st)


__all__ = ["HistogramDelta", "PodObservation", "StartingPod", "Observation", "PolicySpec",
           "PolicyState", "Limits", "Decision", "decide"]
