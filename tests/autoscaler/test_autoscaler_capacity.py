"""Table tests of the capacity rules (policy rules 14-16, and the calm fleet's batch room of rule
3): the capacity estimate from given histograms, the survivor-load scale-down at N = 2 -> 1 and
4 -> 3, what an undone scale-down teaches, the spike headroom from a given arrival series, and
infeasible requests. Every expected value is computed by hand in the comment beside it."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from goodput.autoscaler import policy as P
from goodput.api.policy import PolicySpec
from goodput.autoscaler.policy import HistogramDelta, Observation, PodObservation, PolicyState

INF = math.inf
SPEC = PolicySpec(min_replicas=1, max_replicas=10, slo_ttft_s=1.0, slo_tpot_s=0.1, attainment_target=0.9,
                  scale_up_window_s=0, stabilization_window_s=300, tolerance=0.1, target_utilization=1.0,
                  token_utilization=0.8, capacity_margin_sd=2.0, length_alpha=0.05)


def seconds(n: float, mean: float) -> HistogramDelta:
    """n observations with the given mean (seconds), all in the bucket (0.1, 2]."""
    return HistogramDelta((0.1, 2.0, INF), (0.0, n, n), n, mean * n)


def pod(name: str = "a", **kw) -> PodObservation:
    """Over 5 s: 10 admitted, 6000 prompt tokens (600 each), 1000 generated; TTFT 0.35 s of which
    0.15 s queued -> prefill 0.2 s."""
    base = dict(name=name, running=20, waiting=0, kv_usage=0.3, max_num_seqs=64, max_waiting=100,
                interval_s=5.0, admitted=10, finished=10, slo_met=10, rejected_429=0, rejected_400=0,
                preempted=0, generation_tokens=1000, ttft=seconds(10, 0.35), tpot=seconds(10, 0.04),
                queue=seconds(10, 0.15), prompt_tokens=6000.0)
    base.update(kw)
    return PodObservation(**base)


def obs(*pods: PodObservation, current: int | None = None, unreachable=()) -> Observation:
    return Observation(tuple(pods), (), tuple(unreachable), len(pods) if current is None else current)


# ------------------------------------------------------------------ rule 14: capacity estimate
@pytest.mark.parametrize("kw,expected", [
    ({}, 3200.0),                                       # 600 / (0.35 - 0.15) + 1000 / 5 = 3000 + 200
    ({"ttft": seconds(10, 0.55)}, 1700.0),              # 600 / 0.4 + 200
    ({"generation_tokens": 0}, 3000.0),                 # no decodes in the interval
    ({"admitted": 0}, None),                            # no prefill measured
    ({"queue": None}, None),                            # no queue histogram: prefill unknown
    ({"prompt_tokens": None}, None),
    ({"ttft": seconds(10, 0.15)}, None),                # TTFT not above the queue time
    ({"interval_s": 0.0}, None),                        # first scrape
])
def test_pod_token_rate_from_histograms(kw, expected):
    got = P.pod_token_rate(pod(**kw))
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_capacity_smooths_with_its_variance_and_waits_a_model_load():
    # first measurement: the mean of the pods (3200 and 1700) = 2450, no variance yet, 5 s seen
    c1 = P.capacity(obs(pod("a"), pod("b", ttft=seconds(10, 0.55))), 5.0, 60.0, SPEC, PolicyState())
    assert (c1.sample, c1.tokens, c1.var, c1.seen_s, c1.ready) == (2450.0, 2450.0, 0.0, 5.0, False)
    assert (c1.usable, c1.p_max) == (0.0, None)
    # 60 s seen, estimate 3000; this call measures 3200 over 5 s: g = 0.05, d = 200,
    # tokens = 3000 + 0.05 * 200 = 3010, var = 0.95 * (0 + 0.05 * 200^2) = 1900
    st = PolicyState(cap_tokens=3000.0, cap_var=0.0, cap_seen_s=60.0)
    c = P.capacity(obs(pod()), 5.0, 60.0, SPEC, st)
    assert (c.tokens, c.var, c.seen_s, c.ready) == (pytest.approx(3010.0), pytest.approx(1900.0), 65.0, True)
    # sd of the smoothed mean = sqrt(1900 * 0.05 / 1.95) = 6.980; margin = 2 * 6.980 / 3010 = 0.004638
    sd = math.sqrt(1900 * 0.05 / 1.95)
    assert c.sd == pytest.approx(sd)
    assert c.margin == pytest.approx(2 * sd / 3010)
    # usable = 0.8 * 3010 * 1 * (1 - 0.004638) = 2396.83; p_max = 1.0 s * 3010 * 1.004638 = 3023.96
    assert c.usable == pytest.approx(0.8 * 3010 * (1 - 2 * sd / 3010))
    assert c.p_max == pytest.approx(3010 * (1 + 2 * sd / 3010))
    # a learned scale of 0.5 halves what a scale-down may plan for (not the idle prefill speed)
    half = P.capacity(obs(pod()), 5.0, 60.0, SPEC, replace(st, cap_scale=0.5))
    assert half.usable == pytest.approx(c.usable / 2) and half.p_max == pytest.approx(c.p_max)
    # an unreachable pod: the state is carried unchanged
    u = P.capacity(obs(pod(), unreachable=["b"]), 5.0, 60.0, SPEC, st)
    assert (u.sample, u.tokens, u.var, u.seen_s) == (None, 3000.0, 0.0, 60.0)


# ------------------------------------------------------------- rule 14: survivor-load check
# A fleet whose Little's law never binds (200 seqs per replica, 40 in flight, 10 req/s * 4 s)
FLEET = P.Fleet(rated=2, offered_rps=10.0, admitted_rps=10.0, finished=50, slo_met=50, rejected=0,
                preempted=0, in_flight=40, waiting=0, kv_hot=False, attainment=1.0, service_s=4.0,
                sizing_service_s=4.0, tpot_mean=0.04, capacity=200.0, live_capacity=200.0, t_first=0.2,
                prompt_mean=600.0, output_mean=100.0)
CAPS = P.BatchCaps({"a": 200}, {"a": 200}, 0, 0)


def cap(usable: float) -> P.Capacity:
    return P.Capacity(None, 5000.0, 0.0, 600.0, 1.0, 0.0, True, 0.0, usable, 5000.0)


def fc(work: float) -> P.Forecast:
    # 10 req/s, 0.0 trend; work_fc (tokens/s at the forecast) is what survivors carry
    return P.Forecast(10.0, 0.0, 600.0, 100.0, 60.0, 10.0, work, 1, 60.0, work)


@pytest.mark.parametrize("n,work,usable,expected", [
    # N = 2 -> 1: survivors carry 2/1 x (3000 per replica now) = 6000 tokens/s
    (2, 6000.0, 6000.0, True),       # 6000 <= 6000
    (2, 6000.0, 5999.0, False),      # 6000 > 5999
    # N = 4 -> 3: survivors carry 4/3 x (3000 per replica now) = 4000 tokens/s each
    (4, 12000.0, 4000.0, True),
    (4, 12000.0, 3999.0, False),
])
def test_survivor_load_scale_down(n, work, usable, expected):
    st = PolicyState()
    spec = replace(SPEC, idle_utilization=0.0)   # no idle shortcut: the survivor check decides
    sz = P.size(FLEET, CAPS, n, spec, st)
    assert P.carries(n - 1, 0.0, FLEET, sz, fc(work), spec, st, cap(usable), None) is expected


def test_survivor_check_needs_a_ready_estimate_and_proof_tightens_it():
    spec = replace(SPEC, idle_utilization=0.0)
    st = PolicyState()
    sz = P.size(FLEET, CAPS, 2, spec, st)
    not_ready = replace(cap(1e9), ready=False)
    assert P.carries(1, 0.0, FLEET, sz, fc(6000.0), spec, st, not_ready, None) is False
    # the estimate says 5000, but the fleet has proven 6000 per replica within the SLO: it carries.
    # (explore_ratio 1.0 isolates the survivor check from rule 7's proven-work step)
    spec1 = replace(spec, explore_ratio=1.0)
    assert P.carries(1, 6000.0, FLEET, sz, fc(6000.0), spec1, st, cap(5000.0), None) is True
    assert P.carries(1, 5999.0, FLEET, sz, fc(6000.0), spec1, st, cap(5000.0), None) is False
    # below a learned floor: 6000 >= 0.75 * 7000 = 5250 failed before -> no, however high the estimate
    floor = PolicyState(floor=2, fail_work=7000.0)
    assert P.carries(1, 0.0, FLEET, sz, fc(6000.0), spec, floor, cap(1e9), None) is False


def test_survivor_check_uses_the_headroom_once_it_covers_a_horizon():
    spec = replace(SPEC, idle_utilization=0.0)
    st = PolicyState()
    sz = P.size(FLEET, CAPS, 2, spec, st)
    # spike work 1.5 x 4000 = 6000 > usable 5000 at 1 replica, though the forecast's 4000 fits
    head = P.Headroom(1.5, 4000.0, 10.0, (), covered=True)
    assert P.carries(1, 0.0, FLEET, sz, fc(4000.0), spec, st, cap(5000.0), head) is False
    assert P.carries(1, 0.0, FLEET, sz, fc(4000.0), spec, st, cap(6000.0), head) is True
    # a history shorter than a horizon: the forecast's work decides (4000 <= 5000)
    assert P.carries(1, 0.0, FLEET, sz, fc(4000.0), spec, st, cap(5000.0), replace(head, covered=False)) is True
    # Little's law at the spike: 1.5 x 10 req/s x 4 s = 60 seqs > 50 per replica -> no
    small = replace(FLEET, capacity=50.0, live_capacity=50.0, room=50.0)
    sz_small = P.size(small, CAPS, 2, spec, st)
    assert sz_small.per_replica == 50.0
    assert P.carries(1, 0.0, small, sz_small, fc(4000.0), spec, st, cap(1e9), head) is False
    assert P.carries(1, 0.0, small, sz_small, fc(4000.0), spec, st, cap(1e9), replace(head, ratio=1.2)) is True


def test_a_lull_between_spikes_is_not_idle():
    # Little's law: max(40 in flight, 10 req/s x 4 s, the spike's 1.5 x 10 x 4 = 60) = 60 seqs
    # <= 1.0 x 1 x 200: the idle shortcut (idle_utilization 1.0) would let 1 replica carry it.
    # The spike's work 1.5 x 4000 = 6000 tokens/s must still fit: not within usable 5000 ...
    spec = replace(SPEC, idle_utilization=1.0)
    st = PolicyState()
    sz = P.size(FLEET, CAPS, 2, spec, st)
    head = P.Headroom(1.5, 4000.0, 10.0, (), covered=True)
    assert P.carries(1, 0.0, FLEET, sz, fc(4000.0), spec, st, cap(5000.0), head) is False
    # ... within 6000 (or within 6000 proven) it is
    assert P.carries(1, 0.0, FLEET, sz, fc(4000.0), spec, st, cap(6000.0), head) is True
    assert P.carries(1, 6000.0, FLEET, sz, fc(4000.0), spec, st, cap(5000.0), head) is True
    # no spike in the window (ratio 1): the idle shortcut decides as before
    assert P.carries(1, 0.0, FLEET, sz, fc(4000.0), spec, st, cap(1.0), replace(head, ratio=1.0)) is True


def test_undone_scale_down_teaches_the_estimate():
    # 1 ready pod after a scale-down 100 s ago; this call scales up to 2. Work now 4500 tokens/s per
    # replica, usable was 5000: scale = 1 * min(1, 4500 * 0.9 / 5000) = 0.81, floor 2
    o = obs(pod(), current=1)
    st = PolicyState(last_down_time=-100.0, proven_work=9000.0)
    caps = P.tune_batch_caps(o, SPEC, st)
    fleet = P.aggregate(0.0, o, caps, SPEC, st)
    sz = P.size(fleet, caps, 1, SPEC, st)
    f = replace(fc(4500.0), work=4500.0)
    win = P.windows(0.0, 1, sz, f, 2, True, SPEC, st)
    proof = P.Proof(9000.0, ())
    ns = P.next_state(0.0, o, fleet, caps, sz, f, win, proof, P.Replicas(2, "ScaleUpGoodput"), True, SPEC, st,
                      cap(5000.0), None)
    assert (ns.floor, ns.fail_work) == (2, 4500.0)
    assert ns.cap_scale == pytest.approx(0.81)
    assert ns.proven_work == pytest.approx(4500.0 * 0.9)      # rule 7: below what failed
    # the floor decays to min_replicas after floor_quiet_s without failure: the scale returns to 1
    later = P.next_state(2000.0, o, fleet, caps, sz, f, win, proof, P.Replicas(1, "Steady"), True, SPEC,
                         ns, replace(cap(5000.0), scale=0.81), None)
    assert (later.floor, later.cap_scale) == (0, 1.0)


# ---------------------------------------------------------------------- rule 15: headroom
def test_peak_to_mean_from_a_given_arrival_series():
    # 12 calls of 5 s at 10 req/s and 1000 tokens/s, then 12 at 40 req/s and 4000 tokens/s:
    # mean work (12 * 5000 + 12 * 20000) / 120 s = 2500 tokens/s, mean rate 25 req/s.
    # Horizon 60 s: the last 12 calls: m = 4000, 2400 requests, noise sqrt(2 / 2400) = 0.02887:
    # (4000 - 2.5 * 4000 * 0.02887) / 2500 = 3711.3 / 2500 = 1.48453
    hist = [(5.0 * (i + 1), 5.0, 5000.0, 50.0) for i in range(12)] + \
           [(60.0 + 5.0 * (i + 1), 5.0, 20000.0, 200.0) for i in range(12)]
    ratio, mean_w, mean_n = P.peak_to_mean(hist, 60.0)
    assert (mean_w, mean_n) == (2500.0, 25.0)
    assert ratio == pytest.approx((4000 - 2.5 * 4000 * math.sqrt(2 / 2400)) / 2500)
    # steady: every horizon at the mean; less its noise it is below the mean -> 1
    steady = [(5.0 * (i + 1), 5.0, 5000.0, 50.0) for i in range(24)]
    assert P.peak_to_mean(steady, 60.0) == (1.0, 1000.0, 10.0)
    # shorter than one horizon: nothing to measure -> 1
    assert P.peak_to_mean(hist[:11], 60.0)[0] == 1.0
    assert P.peak_to_mean([], 60.0) == (1.0, 0.0, 0.0)


def test_headroom_records_the_offered_work_and_forgets_the_window():
    # history kept max(headroom 100 s, stabilization 100 s) = 100 s
    spec = replace(SPEC, headroom_window_s=100.0, stabilization_window_s=100.0)
    st = PolicyState(work_history=[[-150.0, 5.0, 1.0, 1.0], [-50.0, 5.0, 7000.0, 10.0]])
    fleet = replace(FLEET, offered_rps=2.0, prompt_mean=None)
    f = fc(0.0)     # smoothed prompt 600, output 100
    h = P.headroom(0.0, 5.0, fleet, f, True, spec, st)
    # the call at -150 is older than the window; this call adds 2 req/s * 5 s * (600 + 100) tokens
    assert h.history == ((-50.0, 5.0, 7000.0, 10.0), (0.0, 5.0, 7000.0, 10.0))
    # 14000 tokens and 20 requests over 10 s; 10 s < the 60 s horizon: not covered
    assert (h.mean_work, h.mean_rps, h.covered, h.recent_work) == (1400.0, 2.0, False, 1400.0)
    # without metrics nothing is added
    assert P.headroom(0.0, 5.0, fleet, f, False, spec, st).history == ((-50.0, 5.0, 7000.0, 10.0),)


def test_headroom_off_keeps_the_stabilization_window_for_the_means():
    # headroom off (0 s): ratio 1, but the history of the stabilization window (300 s) is kept:
    # 12 calls of 5 s at 1000 tokens/s, then 12 at 4000 tokens/s (the spike of the test above)
    spec = replace(SPEC, headroom_window_s=0.0, stabilization_window_s=300.0)
    hist = [[-115.0 + 5.0 * i, 5.0, 5000.0, 50.0] for i in range(12)] + \
           [[-55.0 + 5.0 * i, 5.0, 20000.0, 200.0] for i in range(11)]
    h = P.headroom(0.0, 5.0, replace(FLEET, offered_rps=40.0, prompt_mean=400.0), fc(0.0), True, spec,
                   PolicyState(work_history=hist))
    # this call: 40 req/s * 5 s = 200 requests of 400 + 100 tokens = 100000 tokens
    assert h.history[-1] == (0.0, 5.0, 100000.0, 200.0)
    assert h.ratio == 1.0 and h.covered
    # mean over 120 s: (12 * 5000 + 11 * 20000 + 100000) / 120 = 3166.67 tokens/s
    assert h.mean_work == pytest.approx((12 * 5000 + 11 * 20000 + 100000) / 120)
    # the last horizon (60 s): the newest 12 calls: (11 * 20000 + 100000) / 60 = 5333.33
    assert h.recent_work == pytest.approx((11 * 20000 + 100000) / 60)


# --------------------------------------------------------------------- rule 16: infeasible
def test_infeasible_requests_are_counted_and_left_out_of_the_attainment():
    # prompt lengths of 20 finished requests: 10 <= 1000, 6 in (1000, 2000], 4 in (2000, 5000]
    lens = HistogramDelta((1000.0, 2000.0, 5000.0, INF), (10.0, 16.0, 20.0, 20.0), 20.0, 30000.0)
    p = pod(prompt_len=lens, finished=20, slo_met=14)
    # p_max 3500: (3500 - 2000) / 3000 = half of the (2000, 5000] bucket -> 18 of 20 feasible -> 2
    assert P.infeasible(p, 3500.0) == pytest.approx(2.0)
    assert P.infeasible(p, 1500.0) == pytest.approx(7.0)   # 13 <= 1500: 20 - 13
    assert P.infeasible(p, None) == 0.0 and P.infeasible(replace(p, prompt_len=None), 3500.0) == 0.0
    st = PolicyState()
    caps = P.tune_batch_caps(obs(p), SPEC, st)
    f = P.aggregate(0.0, obs(p), caps, SPEC, st, 3500.0)
    # attainment 14 / (20 - 2) instead of 14 / 20
    assert (f.infeasible, f.attainment) == (pytest.approx(2.0), pytest.approx(14 / 18))
    assert P.aggregate(0.0, obs(p), caps, SPEC, st).attainment == pytest.approx(14 / 20)


def test_prompts_between_the_last_1_2_5_bound_and_max_model_len_are_feasible():
    # the worker's prompt-length buckets for max_model_len 8192 end with 8192 itself, so prompts
    # of 5001..8192 tokens land in a finite bucket, not in +Inf
    from goodput.api.worker_metrics import count_buckets
    bounds = tuple(float(b) for b in count_buckets(8192)) + (INF,)
    assert bounds[-4:] == (2000.0, 5000.0, 8192.0, INF)
    # 10 prompts: 4 of <= 2000 tokens, 6 of 6000 tokens (all in (5000, 8192])
    cum = tuple(0.0 if b < 2000 else 4.0 if b < 8192 else 10.0 for b in bounds)
    lens = HistogramDelta(bounds, cum, 10.0, 4 * 1500.0 + 6 * 6000.0)
    p = pod(prompt_len=lens, finished=10, slo_met=10)
    # p_max 8192 (an idle replica prefills max_model_len in time): nothing is infeasible
    assert P.infeasible(p, 8192.0) == 0.0
    # p_max 6596: (6596 - 5000) / (8192 - 5000) = 1/2 of the 6 in (5000, 8192] are feasible -> 3
    assert P.infeasible(p, 6596.0) == pytest.approx(3.0)
    # the old buckets (..., 2000, 5000, +Inf) counted all 6 as infeasible for any p_max > 5000
    old = HistogramDelta((2000.0, 5000.0, INF), (4.0, 4.0, 10.0), 10.0, lens.sum)
    assert P.infeasible(replace(p, prompt_len=old), 8192.0) == pytest.approx(6.0)


def test_decision_reports_infeasible_requests():
    lens = HistogramDelta((1000.0, 2000.0, 5000.0, INF), (10.0, 16.0, 20.0, 20.0), 20.0, 30000.0)
    p = pod(prompt_len=lens, finished=20, slo_met=14)
    # a ready estimate of 2000 tokens/s, no variance: p_max = 1 s * 2000 -> 20 - 16 = 4 infeasible
    st = PolicyState(cap_tokens=2000.0, cap_seen_s=600.0, since=-1000.0)
    spec = replace(SPEC, length_alpha=1e-9)      # keep the estimate at 2000 on this call
    d = P.decide(0.0, obs(p), spec, st)
    assert d.infeasible == pytest.approx(4.0)
    assert d.capacity_tokens == pytest.approx(2000.0, rel=1e-6)
    assert "infeasible 4" in d.message


# ------------------------------------------------------------ rule 3: a calm fleet's batch room
@pytest.mark.parametrize("kw,expected", [
    ({"tpot": HistogramDelta((0.05, 0.08, 0.1, INF), (10.0, 10.0, 10.0, 10.0), 10.0, 0.4)}, 96),  # fast: 64 * 1.5
    ({"tpot": HistogramDelta((0.05, 0.08, 0.1, INF), (0.0, 10.0, 10.0, 10.0), 10.0, 0.7)}, 72),   # margin: 64 + 8
    ({"tpot": HistogramDelta((0.05, 0.08, 0.1, INF), (0.0, 0.0, 10.0, 10.0), 10.0, 0.9)}, 64),    # near the SLO
    ({"tpot": HistogramDelta((0.05, 0.08, 0.1, INF), (0.0, 0.0, 5.0, 10.0), 10.0, 1.2)}, 64),     # missing it
    ({"preempted": 1}, 64),
    ({"kv_usage": 0.2}, 80),     # fast, but KV: floor(20 * 0.8 / 0.2) = 80 < 96
])
def test_growth_room(kw, expected):
    base = {"tpot": HistogramDelta((0.05, 0.08, 0.1, INF), (10.0, 10.0, 10.0, 10.0), 10.0, 0.4)}
    base.update(kw)
    assert P.growth_room(pod(**{"kv_usage": 0.1, **base}), 64, SPEC) == expected


# A history of 5 s calls: base 1000 tokens/s (5000 tokens, 50 requests per call), spike 4000 tokens/s
# (20000 tokens, 200 requests per call)
def calls(*runs: tuple[int, bool], start: float = 0.0) -> list[tuple[float, float, float, float]]:
    out, t = [], start
    for n, spike in runs:
        for _ in range(n):
            t += 5.0
            out.append((t, 5.0, 20000.0, 200.0) if spike else (t, 5.0, 5000.0, 50.0))
    return out


def test_short_spikes_from_a_given_series():
    # 60 s base, a 60 s spike, 120 s base: mean work (36 * 5000 + 12 * 20000) / 240 = 1750.
    # r1: the spike's horizon, (4000 - 2.5 * 4000 * sqrt(2 / 2400)) / 1750 = 3711.325 / 1750 = 2.12076;
    # r2: 120 s holding the spike and 60 s of base: 300000 / 120 = 2500 tokens/s over 3000 requests,
    # (2500 - 2.5 * 2500 * sqrt(2 / 3000)) / 1750 = 2338.63 / 1750 = 1.33636.
    # 0.33636 <= 0.5 * 1.12076 = 0.56038: short
    short = calls((12, False), (12, True), (24, False))
    assert P.peak_to_mean(short, 60.0)[0] == pytest.approx(1.0 + 1.12076, abs=1e-5)
    assert P.peak_to_mean(short, 120.0)[0] == pytest.approx(1.33636, abs=1e-5)
    assert P.short_spikes(short, 60.0) is True
    # a 120 s spike: mean (24 * 5000 + 24 * 20000) / 240 = 2500; r1 = 3711.325 / 2500 = 1.48453;
    # r2 = (4000 - 2.5 * 4000 * sqrt(2 / 4800)) / 2500 = 3795.876 / 2500 = 1.51835;
    # 0.51835 > 0.5 * 0.48453 = 0.24227: not short (a rise that outlasts a model load)
    long = calls((12, False), (24, True), (12, False))
    assert P.peak_to_mean(long, 120.0)[0] == pytest.approx(1.51835, abs=1e-5)
    assert P.short_spikes(long, 60.0) is False
    # steady (r1 = 1) and shorter than two horizons (115 s < 118.8 s): nothing to judge
    assert P.short_spikes(calls((48, False)), 60.0) is False
    assert P.short_spikes(short[:23], 60.0) is False


def test_short_spikes_up_to_a_load_plus_one_call():
    # Capacity ordered on the first call that sees a spike is ready up to one call interval P
    # after the spike began plus the load H, so a spike of d <= H + P = 65 s (5 s calls, 60 s
    # load) is short: threshold fraction 0.5 + 5 / 120 = 0.541667 (0.5 before the call interval
    # counted). 1800 s of 5 s calls at 1000 tokens/s with one 4000 tokens/s spike; 10^12 requests
    # per call make the arrival noise vanish (2.5 * sqrt(2 / 1.2e13) ~ 1e-6).
    def hist(spike_calls: int) -> list[tuple[float, float, float, float]]:
        return [(5.0 * (i + 1), 5.0, 20000.0 if 100 <= i < 100 + spike_calls else 5000.0, 1e12)
                for i in range(360)]
    # 65 s spike (13 calls): mean (347 * 5000 + 13 * 20000) / 1800 = 1995000 / 1800 = 1108.333;
    # r1 = 4000 / 1108.333 = 3.609023; r2: 120 s holding the spike, (13 * 20000 + 11 * 5000) / 120
    # = 2625, 2625 / 1108.333 = 2.368421; 1.368421 <= 0.541667 * 2.609023 = 1.413221: short
    # (with 0.5: 1.304511 < 1.368421, it was not)
    h65 = hist(13)
    assert P.peak_to_mean(h65, 60.0)[0] == pytest.approx(3.609023, abs=1e-4)
    assert P.peak_to_mean(h65, 120.0)[0] == pytest.approx(2.368421, abs=1e-4)
    assert P.short_spikes(h65, 60.0) is True
    # 70 s spike (14 calls): mean (346 * 5000 + 14 * 20000) / 1800 = 1116.667; r1 = 3.582090;
    # r2 = (14 * 20000 + 10 * 5000) / 120 / 1116.667 = 2750 / 1116.667 = 2.462687;
    # 1.462687 > 0.541667 * 2.582090 = 1.398632: not short (capacity ordered 5 s in is ready 5 s
    # before it ends)
    h70 = hist(14)
    assert P.peak_to_mean(h70, 60.0)[0] == pytest.approx(3.582090, abs=1e-4)
    assert P.peak_to_mean(h70, 120.0)[0] == pytest.approx(2.462687, abs=1e-4)
    assert P.short_spikes(h70, 60.0) is False
    # 10 s calls: P / 2H = 10 / 120, threshold 0.583333: the 70 s spike (7 calls of 10 s) is
    # short, 1.462687 <= 0.583333 * 2.582090 = 1.506219
    h70_10 = [(10.0 * (i + 1), 10.0, 40000.0 if 50 <= i < 57 else 10000.0, 1e12) for i in range(180)]
    assert P.short_spikes(h70_10, 60.0) is True


def test_headroom_judges_the_spikes_before_the_last_horizon():
    spec = replace(SPEC, headroom_window_s=1800.0, stabilization_window_s=300.0)
    # the short-spike history above (ending at t = 240), then a new spike: 11 calls in the state and
    # this call's 40 req/s * 5 s * (400 + 100) = 100000 tokens (20000 tokens/s); the last horizon is
    # those 12 calls, the 240 s before it are the short-spike history: short
    hist = calls((12, False), (12, True), (24, False), start=-300.0) + calls((11, True), start=-60.0)
    f = fc(0.0)
    fleet = replace(FLEET, offered_rps=40.0, prompt_mean=400.0)
    h = P.headroom(0.0, 5.0, fleet, f, True, spec, PolicyState(work_history=[list(e) for e in hist]))
    assert len(h.history) == 60 and h.short is True
    # the last horizon: (11 * 20000 + 100000) / 60 = 5333.33 tokens/s
    assert h.recent_work == pytest.approx(320000 / 60)
    # the history before it held a 120 s spike instead: not short
    long = calls((12, False), (24, True), (12, False), start=-300.0) + calls((11, True), start=-60.0)
    assert P.headroom(0.0, 5.0, fleet, f, True, spec, PolicyState(work_history=[list(e) for e in long])).short \
        is False
    # the headroom off: never short
    off = replace(spec, headroom_window_s=0.0)
    assert P.headroom(0.0, 5.0, fleet, f, True, off, PolicyState(work_history=[list(e) for e in hist])).short \
        is False


@pytest.mark.parametrize("current,work,scale,short,ready,expected", [
    (6, 18000.0, 1.0, True, True, 6),      # ceil(18000 / 5000) = 4 < 6 ready: hold 6
    (2, 18000.0, 1.0, True, True, 4),      # up to 4, no further
    (2, 20000.0, 1.0, True, True, 4),      # exactly 4 x 5000
    (2, 18000.0, 0.5, True, True, 8),      # an undone scale-down halved it: ceil(18000 / 2500) = 8
    (2, 18000.0, 1.0, False, True, None),  # no short spike before this one: the scale-up rules decide
    (2, 18000.0, 1.0, True, False, None),  # no capacity estimate yet
])
def test_short_spike_limit(current, work, scale, short, ready, expected):
    head = P.Headroom(work / 1000.0, 1000.0, 10.0, (), covered=True, short=short)
    c = replace(cap(4000.0), scale=scale, ready=ready)     # full-step capacity 5000 x scale
    assert P.short_spike_limit(current, head, c) == expected


def test_choose_replicas_during_a_short_spike():
    # 2 ready, the windows want 8; the window's spikes were short and need ceil(18000 / 5000) = 4
    o = obs(pod("a"), pod("b"))
    st = PolicyState()
    caps = P.tune_batch_caps(o, SPEC, st)
    fleet = P.aggregate(0.0, o, caps, SPEC, st)
    sz = replace(P.size(fleet, caps, 2, SPEC, st), rec=8)
    win = P.Windows((), 8, 8, 600.0, -600.0)
    head = P.Headroom(18.0, 1000.0, 10.0, (), covered=True, short=True)
    f = replace(fc(0.0), rec=1)
    out = P.choose_replicas(0.0, o, fleet, caps, sz, f, win, 0.0, True, SPEC, st, cap(4000.0), head)
    assert (out.replicas, out.reason) == (4, "ScaleUpGoodput")
    # 6 ready already carry the spikes: hold, with its own reason
    o6 = obs(*[pod(n) for n in "abcdef"])
    out6 = P.choose_replicas(0.0, o6, fleet, caps, sz, f, win, 0.0, True, SPEC, st, cap(4000.0), head)
    assert (out6.replicas, out6.reason) == (6, "HoldShortSpike")
    # without short spikes before (the first spike): the windows decide, 2 + max(4, 2) = 6
    first = P.choose_replicas(0.0, o, fleet, caps, sz, f, win, 0.0, True, SPEC, st, cap(4000.0),
                              replace(head, short=False))
    assert (first.replicas, first.reason) == (6, "ScaleUpGoodput")


# ------------------------------------------------- rule 2 during short spikes (rule 15)
def tpot_hist(k: float) -> HistogramDelta:
    """10 finished requests: k with TPOT in (50, 100] ms, 10 - k in (100, 200] ms. At the 100 ms
    SLO the fraction met is k / 10; at tpot_margin 0.8 (80 ms), 0.6 k / 10 (interpolated: (80 - 50)
    / 50 of the bucket); at tpot_fast_margin 0.5 (50 ms), 0."""
    return HistogramDelta((0.05, 0.1, 0.2, INF), (0.0, k, 10.0, 10.0), 10.0, 0.08 * k + 0.15 * (10 - k))


@pytest.mark.parametrize("k,short,kw,spec_kw,expected", [
    (8, False, {}, {}, 48),        # 0.8 < 0.9: cut to floor(min(64, 64) * 0.75) = 48
    (8, True, {}, {}, 64),         # short spikes: 0.8 >= min(0.9, 0.75) = 0.75, no cut; no growth
                                   # either (at 80 ms 0.48 < 0.9, at 50 ms 0): 64
    (7, True, {}, {}, 48),         # 0.7 < 0.75: a cut can pay, floor(64 * 0.75) = 48
    (7, True, {"running": 40}, {}, 30),     # the batch that missed: floor(min(64, 40) * 0.75) = 30
    (8, True, {"preempted": 1}, {}, 48),    # a preemption always cuts
    (10, True, {}, {}, 64),        # 1.0 met, but 0.6 at 80 ms: no growth
    (8, True, {}, {"batch_decrease": 0.95}, 60),   # min(0.9, 0.95) = 0.9: 0.8 cuts, floor(64 * 0.95) = 60
])
def test_cut_during_short_spikes(k, short, kw, spec_kw, expected):
    p = pod(**{"running": 64, "tpot": tpot_hist(k), **kw})
    assert P.tune_cap(p, 64, replace(SPEC, **spec_kw), short) == expected


def test_spikes_were_short_reads_the_state_history():
    # the previous calls: the short-spike history (60 s base, 60 s spike, 120 s base, ending at
    # -60) and then 60 s of spike: the last horizon (60 s: the newest 12 calls) is left out, the
    # 240 s before it hold a spike of one horizon: r2 - 1 = 0.33636 <= 0.541667 * 1.12076 (see
    # test_short_spikes_from_a_given_series with 5 s calls): short
    short = calls((12, False), (12, True), (24, False), start=-300.0) + calls((12, True), start=-60.0)
    st = PolicyState(work_history=[list(e) for e in short])
    assert P.last_horizon(short, 60.0) == (12, 60.0, 240000.0)
    assert P.spikes_were_short(st, SPEC) is True
    # a 120 s spike before the last horizon: not short
    long = calls((12, False), (24, True), (12, False), start=-300.0) + calls((12, True), start=-60.0)
    assert P.spikes_were_short(PolicyState(work_history=[list(e) for e in long]), SPEC) is False
    # a measured load of 120 s: the last horizon is 24 calls, the 180 s before it are under two
    # horizons (237.6 s): nothing to judge
    assert P.spikes_were_short(replace(st, load_s=120.0), SPEC) is False
    # the headroom off, or no history: never short
    assert P.spikes_were_short(st, replace(SPEC, headroom_window_s=0.0)) is False
    assert P.spikes_were_short(PolicyState(), SPEC) is False
    # tune_batch_caps reads it: a pod at 0.8 TPOT attainment holds 64 after short spikes, else 48
    o = obs(pod(running=64, tpot=tpot_hist(8)))
    assert P.tune_batch_caps(o, SPEC, replace(st, caps={"a": 64})).caps == {"a": 64}
    assert P.tune_batch_caps(o, SPEC, PolicyState(caps={"a": 64}, work_history=[list(e) for e in long])).caps \
        == {"a": 48}
