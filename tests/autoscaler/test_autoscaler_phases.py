"""Table tests of decide's phases, one by one, and of the rules that span calls (restart, metrics
outage, zero traffic, router inputs, the learned floor). Every expected value is computed by hand
in the comment beside it from goodput.autoscaler.policy's docstring."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from goodput.autoscaler import policy as P
from goodput.api.policy import PolicySpec
from goodput.autoscaler.policy import (
    HistogramDelta,
    Observation,
    PodObservation,
    PolicyState,
    RouterObservation,
    StartingPod,
    decide,
)

INF = math.inf
BOUNDS = (0.05, 0.1, 0.2, INF)
SPEC = PolicySpec(min_replicas=1, max_replicas=10, slo_ttft_s=1.0, slo_tpot_s=0.1, attainment_target=0.9,
                  scale_up_window_s=0, stabilization_window_s=300, tolerance=0.1, target_utilization=1.0)


def hist(n: float, mean: float) -> HistogramDelta:
    """n observations, all <= 50 ms when mean <= 0.05, else all in (0.1, 0.2]."""
    counts = (n, n, n, n) if mean <= 0.05 else (0, 0, n, n)
    return HistogramDelta(BOUNDS, counts, n, mean * n)


def pod(name: str = "a", **kw) -> PodObservation:
    """10 req/s over 5 s, all within SLO, 100 output tokens each: TTFT 0.2 s, TPOT 0.04 s ->
    service 0.2 + 99 * 0.04 = 4.16 s."""
    base = dict(name=name, running=20, waiting=0, kv_usage=0.3, max_num_seqs=64, max_waiting=100,
                interval_s=5.0, admitted=50, finished=50, slo_met=50, rejected_429=0, rejected_400=0,
                preempted=0, generation_tokens=5000, ttft=hist(50, 0.2), tpot=hist(50, 0.04), age_s=600.0)
    base.update(kw)
    return PodObservation(**base)


def idle(name: str = "a", **kw) -> PodObservation:
    return pod(name, running=0, admitted=0, finished=0, slo_met=0, generation_tokens=0, ttft=None, tpot=None,
               kv_usage=0.0, **kw)


def obs(*pods: PodObservation, current: int | None = None, starting=(), unreachable=(), router=None):
    return Observation(tuple(pods), tuple(starting), tuple(unreachable),
                       len(pods) if current is None else current, router)


# ------------------------------------------------------------------- phase 1: tune_batch_caps
def test_batch_caps_new_pod_coming_pods_and_unreachable():
    c = P.tune_batch_caps(obs(pod()), SPEC, PolicyState())
    # running 20 < cap 64: the cap does not bind, nothing to learn
    assert (dict(c.caps), dict(c.sizing), c.coming, c.plan_cap) == ({"a": 64}, {"a": 64}, 0, 0)
    # spec.replicas 3, 1 ready, 1 starting: coming = 1 starting + (3 - 1 - 0 - 1) not created = 2,
    # and without a plan the batch in force (64) is the plan
    c = P.tune_batch_caps(obs(pod(), current=3, starting=[StartingPod("s", 9.0)]), SPEC, PolicyState())
    assert (c.coming, c.plan_cap) == (2, 64)
    # an unreachable pod keeps what it learned; a new ready pod starts at the fleet's median (32)
    c = P.tune_batch_caps(obs(pod("n"), current=2, unreachable=["b"]), SPEC, PolicyState(caps={"b": 32}))
    assert dict(c.caps) == {"n": 32, "b": 32}


# ------------------------------------------------------------------------- phase 2: aggregate
def test_aggregate_counts_router_refusals_and_in_flight():
    p = pod(waiting=5, admitted=50, rejected_429=10, finished=40, slo_met=30, generation_tokens=4000,
            prompt_tokens=25000, ttft=hist(40, 0.2), tpot=hist(40, 0.04))
    router = RouterObservation(held=3, queued=4, refused=20)
    st = PolicyState(last_tick=90.0)
    f = P.aggregate(100.0, obs(p, router=router), P.tune_batch_caps(obs(p), SPEC, st), SPEC, st)
    # offered (50 + 10) / 5 + 20 refused over the 10 s since the last call = 12 + 2 = 14 req/s
    assert f.offered_rps == pytest.approx(14.0)
    assert f.rejected == 30                                   # 10 + 20
    assert f.attainment == pytest.approx(30 / (40 + 30))      # slo_met / (finished + rejected)
    assert f.in_flight == 20 + 5 + 3 + 4                      # running + waiting + held + queued
    assert (f.prompt_mean, f.output_mean) == (500.0, 100.0)   # 25000 / 50, 4000 / 40
    assert f.service_s == pytest.approx(0.2 + 99 * 0.04)


def test_aggregate_of_exactly_zero_traffic_has_no_nan():
    st = PolicyState()
    o = obs(idle("a"), idle("b"))
    f = P.aggregate(0.0, o, P.tune_batch_caps(o, SPEC, st), SPEC, st)
    assert (f.offered_rps, f.in_flight, f.attainment, f.service_s, f.prompt_mean, f.output_mean) == \
        (0.0, 0, None, None, None, None)
    assert P.attainment(0, 0, 0) is None and P.attainment(9, 8, 2) == 0.9


# ------------------------------------------------------------------------------ phase 3: size
FLEET = P.Fleet(rated=2, offered_rps=20.0, admitted_rps=20.0, finished=100, slo_met=100, rejected=0,
                preempted=0, in_flight=40, waiting=0, kv_hot=False, attainment=1.0, service_s=4.0,
                sizing_service_s=4.0, tpot_mean=0.04, capacity=50.0, live_capacity=50.0, t_first=0.2,
                prompt_mean=500.0, output_mean=100.0)
CAPS = P.BatchCaps({"a": 50, "b": 50}, {"a": 50, "b": 50}, 0, 0)


@pytest.mark.parametrize("change,wanted,reason,evidence", [
    ({}, 2, "ScaleUpGoodput", False),                        # max(40, 20 * 4 = 80) / 50 -> 2
    ({"offered_rps": 40.0}, 4, "ScaleUpGoodput", False),     # 160 / 50 -> 4
    ({"in_flight": 170}, 4, "ScaleUpGoodput", False),        # in flight 170 > 80 -> 4
    # attainment 0.5 with 20 waiting (> 4 * 2): max(2, 2 + 1, ceil(2 * 0.9 / 0.5) = 4) = 4
    ({"attainment": 0.5, "waiting": 20}, 4, "ScaleUpGoodput", True),
    ({"attainment": 0.5}, 2, "ScaleUpGoodput", False),       # misses without saturation: no evidence
    ({"attainment": 0.5, "preempted": 3}, 4, "ScaleUpSaturation", True),
    ({"offered_rps": 0.0, "in_flight": 0}, 0, "ScaleUpGoodput", False),   # rec still min 1
])
def test_size_table(change, wanted, reason, evidence):
    s = P.size(replace(FLEET, **change), CAPS, 2, SPEC, PolicyState())
    assert (s.wanted, s.up_reason, s.evidence, s.rec) == (wanted, reason, evidence, max(1, wanted))


# -------------------------------------------------------------------------- phase 4: forecast
def _fc(now, rps, st, ready=(), ok=True, coming=0):
    f = replace(FLEET, offered_rps=rps, admitted_rps=rps)
    caps = replace(CAPS, coming=coming)
    s = P.size(f, caps, 2, SPEC, st)
    return P.forecast(now, obs(*ready) if ready else obs(pod("a"), pod("b")), f, caps, s, ok, SPEC, st)


def test_holt_forecast_table():
    st = PolicyState(level_rps=10.0, trend_rps=0.0, last_tick=0.0, caps={"a": 50, "b": 50})
    fc = _fc(5.0, 20.0, st)
    # level 0.3 * 20 + 0.7 * 10 = 13; trend 0.1 * (13 - 10) / 5 = 0.06 req/s per s; horizon 60 s
    # (no load measured: model_load_s) -> 13 + 0.06 * 60 = 16.6 req/s; Little: 16.6 * 4 / 50 -> 2
    assert (fc.level_rps, fc.trend_rps, fc.horizon_s) == (pytest.approx(13.0), pytest.approx(0.06), 60.0)
    assert (fc.rps, fc.rec) == (pytest.approx(16.6), 2)
    # the work at the level 13 (not the forecast: its trend is noise to a scale-down's comparison)
    # with 500 + 100 tokens per request (the first lengths seen)
    assert fc.work == pytest.approx(13.0 * 600)
    # a single spike of 100 req/s from a steady 10: level 0.3 * 100 + 7 = 37, trend
    # 0.1 * 27 / 5 = 0.54, forecast 37 + 0.54 * 60 = 69.4 (under the cap 2 x 37 = 74): Little
    # 69.4 * 4 / 50 -> 6 replicas. It is a recommendation like any other: the scale-up window's
    # minimum (the 2 of 10 s ago) holds it, and a forecast never triggers panic mode
    spike = _fc(5.0, 100.0, st)
    assert (spike.level_rps, spike.rps, spike.rec) == (pytest.approx(37.0), pytest.approx(69.4), 6)
    sz = P.size(FLEET, CAPS, 2, SPEC, st)        # now: rec 2
    w = P.windows(5.0, 2, sz, spike, 2, True, replace(SPEC, scale_up_window_s=30.0),
                  PolicyState(recommendations=[[-5.0, 2.0]]))
    assert w.up_target == 2
    # capacity coming: the forecast recommends nothing (the coming pods were ordered for it)
    assert _fc(5.0, 40.0, st, coming=1).rec == 1
    # a metrics outage carries the state unchanged (not zero traffic)
    out = _fc(5.0, 0.0, st, ok=False)
    assert (out.level_rps, out.trend_rps) == (10.0, 0.0)
    # exactly zero traffic: level 7, trend -0.06 -> 7 - 3.6 = 3.4; never below 0, never NaN
    zero = _fc(5.0, 0.0, st)
    assert (zero.level_rps, zero.rps) == (pytest.approx(7.0), pytest.approx(3.4))
    low = _fc(5.0, 0.0, PolicyState(level_rps=0.1, trend_rps=-0.5, last_tick=0.0))
    assert low.rps == 0.0 and low.rec == 1 and not math.isnan(low.work)


def test_model_load_time_is_learned_from_new_pods():
    # pods seen ready for the first time carry creation -> Ready: the first replaces the 60 s
    # prior, the next ones average in (0.5 * 145 + 0.5 * 45 = 95)
    st = PolicyState(caps={"a": 50})
    fc = _fc(5.0, 10.0, st, ready=(pod("a", load_s=999.0), pod("n", load_s=145.0)))
    assert (fc.load_s, fc.horizon_s) == (145.0, 145.0)       # "a" is not new: its time is ignored
    fc = _fc(5.0, 10.0, replace(st, load_s=145.0), ready=(pod("a"), pod("m", load_s=45.0)))
    assert fc.load_s == 95.0


# --------------------------------------------------------------------------- phase 5: windows
def test_windows_table():
    sz = P.size(FLEET, CAPS, 2, SPEC, PolicyState())           # rec 2
    fc = replace(_fc(5.0, 20.0, PolicyState()), rec=1)
    st = PolicyState(recommendations=[[-400.0, 9.0], [-100.0, 3.0, 4.0], [-50.0, 2.0]], since=-500.0)
    w = P.windows(0.0, 3, sz, fc, 2, True, SPEC, st)
    # -400 is past both windows; down = max over [-100, 0] of max(rec, keep) = max(4, 2, 2) = 4;
    # scale-up window 0 s: only this call's 2
    assert (w.up_target, w.down_target, w.history_s) == (2, 4, 500.0)
    assert [e[0] for e in w.recommendations] == [-100.0, -50.0, 0.0]
    # metrics missing: the call records max(rec, current) and keep = current (assumed busy)
    w = P.windows(0.0, 5, sz, fc, 2, False, SPEC, PolicyState())
    assert w.recommendations[-1] == (0.0, 5.0, 5.0) and w.since is None


@pytest.mark.parametrize("current,rec,expected", [
    # scale-up window 30 s whose other recommendation (10 s ago) was the current fleet: only panic
    # (rec >= max(2 x current, current + 2)) acts before the window confirms
    (1, 2, 1),      # 2 = 2 x 1 but only one more replica: no panic (one noisy tick at 1 replica)
    (1, 3, 3),      # 3 >= max(2, 3): panic
    (2, 4, 4),      # 4 >= max(4, 4): panic, as before
    (2, 3, 2),      # 3 < 4: the window holds
    (4, 8, 8),
    (4, 7, 4),
])
def test_panic_needs_two_replicas_more(current, rec, expected):
    sz = replace(P.size(FLEET, CAPS, current, SPEC, PolicyState()), rec=rec, evidence=False)
    fc = replace(_fc(5.0, 20.0, PolicyState()), rec=1)
    st = PolicyState(recommendations=[[-10.0, float(current)]])
    w = P.windows(0.0, current, sz, fc, current, True, replace(SPEC, scale_up_window_s=30.0), st)
    assert w.up_target == expected


# ---------------------------------------------------------------------- phase 6: carrying load
@pytest.mark.parametrize("m,proven,st,expected", [
    # work 12000 tokens/s; Little demand 80 seqs (20 req/s * 4 s) vs 50 per replica
    (1, 1e9, PolicyState(), False),            # 80 > 50: Little's law says no
    (2, 6000, PolicyState(), True),            # 12000 / 2 = 6000 <= 1.75 * 6000
    (2, 3428, PolicyState(), False),           # 6000 > 1.75 * 3428 = 5999
    (2, 3429, PolicyState(), True),            # 1.75 * 3429 = 6000.75
    (6, 0, PolicyState(), True),               # 80 <= 0.3 * 6 * 50 = 90: nearly idle, no proof needed
    # a floor of 3 learned where 2 replicas failed at 6500 per replica: 6000 >= 0.75 * 6500 -> no
    (2, 6000, PolicyState(floor=3, fail_work=6500.0), False),
    (2, 6000, PolicyState(floor=3, fail_work=8100.0), True),   # 6000 < 0.75 * 8100 = 6075
])
def test_carries_table(m, proven, st, expected):
    sz = P.size(FLEET, CAPS, 2, SPEC, st)
    fc = replace(_fc(5.0, 20.0, PolicyState()), rps=20.0, work=12000.0)
    assert P.carries(m, proven, FLEET, sz, fc, SPEC, st) is expected


def test_proof_needs_a_whole_model_load_of_good_calls():
    st = PolicyState(proof=[[-70.0, 900.0], [-65.0, 800.0], [-30.0, 700.0]], proven_work=100.0)
    sz = P.size(FLEET, CAPS, 2, SPEC, st)
    fc = replace(_fc(0.0, 20.0, st), work=1200.0, horizon_s=60.0)
    pr = P.proven_work(0.0, FLEET, CAPS, sz, fc, 2, True, SPEC, st)
    # samples from the newest one at least 60 s old (-65) on: min(800, 700, 1200 / 2) = 600
    assert (pr.proven, [t for t, _ in pr.samples]) == (600.0, [-65.0, -30.0, 0.0])
    # a call that is not good (saturated) proves nothing and restarts the run
    bad = P.proven_work(0.0, replace(FLEET, rejected=12), CAPS, P.size(replace(FLEET, rejected=12), CAPS, 2,
                                                                          SPEC, st), fc, 2, True, SPEC, st)
    assert (bad.proven, bad.samples) == (100.0, ())


# ---------------------------------------------------------- phase 6: from and to zero (router)
def test_scale_from_zero_at_once_when_the_router_holds_requests():
    spec = replace(SPEC, min_replicas=0, scale_up_window_s=30.0)
    d = decide(0.0, obs(current=0, router=RouterObservation(held=2, queued=0, refused=0)), spec, None)
    assert (d.replicas, d.reason, d.limits, d.router_max_queued) == (1, "ScaleFromZero", {}, None)
    d = decide(0.0, obs(current=0, router=RouterObservation(held=0, queued=0, refused=0)), spec, None)
    assert (d.replicas, d.reason) == (0, "Steady")
    d = decide(0.0, obs(current=0), SPEC, None)          # min_replicas 1
    assert (d.replicas, d.reason) == (1, "ScaleUpMinReplicas")


def test_scale_to_zero_after_the_idle_time_only_with_a_router():
    spec = replace(SPEC, min_replicas=0, scale_to_zero_idle_s=600.0)
    router = RouterObservation(held=0, queued=0, refused=0)
    st = PolicyState(since=-1000.0, last_busy=-599.0, proven_work=1.0)
    d = decide(0.0, obs(idle(), router=router), spec, st)
    assert (d.replicas, d.reason) != (0, "ScaleToZeroIdle")        # 599 s idle
    d = decide(1.0, obs(idle(), router=router), spec, d.state)
    assert (d.replicas, d.reason) == (0, "ScaleToZeroIdle")         # 600 s idle
    # no router: nothing could wake it up again -> stays at 1
    assert decide(1.0, obs(idle()), spec, st).replicas == 1
    # a held or queued request, or a refusal, is activity: the idle clock restarts
    busy = decide(1.0, obs(idle(), router=RouterObservation(0, 1, 0)), spec, st)
    assert busy.replicas == 1 and busy.state.last_busy == 1.0


def test_router_queue_counts_as_demand_and_refusals_as_offered():
    # 1 pod, 20 running at KV 0.3: it carries min(64, 20 * 0.8 / 0.3) = 53.33 seqs. The router
    # queues 40 (every pod at its limits): in flight 60 / 53.33 -> 2
    d = decide(0.0, obs(pod(), router=RouterObservation(held=0, queued=40, refused=0)), SPEC, None)
    assert d.replicas == 2
    # 100 refusals over the pod's 5 s interval (no previous call): +20 req/s -> 30 * 4.16 = 124.8
    # seqs -> ceil(124.8 / 53.33) = 3; attainment 50 / (50 + 100) = 0.33 while saturated -> at
    # once, max(3, 1 + 1, ceil(0.9 / 0.333) = 3) = 3
    d = decide(0.0, obs(pod(), router=RouterObservation(held=0, queued=0, refused=100)), SPEC, None)
    assert (d.replicas, d.reason) == (3, "ScaleUpGoodput")


@pytest.mark.parametrize("rejected, saturated", [
    (0, False), (11, False),   # 11 of 111 requests refused: not more than tolerance (0.1) of them
    (12, True),                # 12 > 0.1 x 112 = 11.2: the fleet is refusing
])
def test_refusals_saturate_only_past_the_tolerance(rejected, saturated):
    # FLEET: 100 finished, nothing waiting, preempted or queued
    assert P.size(replace(FLEET, rejected=rejected), CAPS, 2, SPEC, PolicyState()).saturated is saturated


# ----------------------------------------------------------------------- phase 7: queue limits
def test_queue_limits_and_router_bound():
    # mu = 50 / 4 = 12.5 completions/s per replica; budget 1 - 0.2 = 0.8 s -> k_ttft = 10;
    # nothing loading: slack 2 -> max_waiting 20; router: floor(0.8 * 12.5 * 3) = 30
    q = P.queue_limits(FLEET, 3, 0, 0, SPEC, 4.0)
    assert (q.k_ttft, q.max_waiting, q.router_max_queued) == (10, 20, 30)
    # 1 of 2 wanted replicas loading: slack 1 + (2 - 1) * 3 / 4 = 1.75 -> floor(17.5) = 17
    assert P.queue_limits(FLEET, 3, 1, 0, SPEC, 4.0).max_waiting == 17
    # no service rate yet: the spec's bound, no router bound
    q = P.queue_limits(FLEET, 0, 0, 0, SPEC, 0.0)
    assert (q.max_waiting, q.router_max_queued) == (1024, None)


@pytest.mark.parametrize("token_rate, loading, scale, tokens", [
    (4600.5, 0, 1.25, 5750),   # TTFT 1 s x 4,600.5 tokens/s at a full step x 1.25 = 5,750.6
    (4600.5, 1, 1.25, 5750),   # no slack, loading or not: the prefill rate is no noisy count
    (4600.5, 0, 1.0, 4600),
    (0.4, 0, 1.25, 1),         # at least one token
    (0.0, 0, 1.25, 0),         # no capacity estimate yet: no token bound
    (4600.5, 0, 0.0, 0),       # tokenQueueScale 0: the token bound is off
])
def test_queue_limits_in_prompt_tokens(token_rate, loading, scale, tokens):
    q = P.queue_limits(FLEET, 3, loading, 0, replace(SPEC, token_queue_scale=scale), 4.0, token_rate)
    assert q.max_waiting_tokens == tokens
    assert q.max_waiting == (20 if not loading else 17)    # the count bound as before


def test_decision_carries_router_max_queued():
    # pod(): live capacity min(64, 20 * 0.8 / 0.3) = 53.33, service 4.16 s -> mu 12.82/s; no
    # queue histogram: t_first 0 -> floor(1.0 * 12.82 * 1) = 12
    assert decide(0.0, obs(pod()), SPEC, None).router_max_queued == 12


# ------------------------------------------------------------------------- phase 8: conditions
def test_conditions_table():
    f = FLEET
    c = P.conditions(obs(pod()), f, True, "Steady", "m", SPEC)
    assert c["MetricsAvailable"][:2] == (True, "MetricsScraped")
    assert c["AbleToScale"][:2] == (True, "ReadyForNewScale")
    c = P.conditions(obs(pod(), unreachable=["b"]), f, False, "HoldMissingMetrics", "m", SPEC)
    assert c["MetricsAvailable"][:2] == (False, "MetricsMissing") and "b" in c["MetricsAvailable"][2]
    assert c["AbleToScale"][:2] == (False, "HoldMissingMetrics")
    assert P.conditions(obs(pod()), f, True, "Steady", "m", replace(SPEC, min_replicas=3, max_replicas=3)
                        )["ScalingActive"][:2] == (False, "ScalingDisabled")


# ------------------------------------------------------------------- rules across calls
def test_an_undone_scale_down_leaves_a_floor_that_decays():
    # scaled 2 -> 1 100 s ago; now 1 pod misses its SLO while saturated (20 waiting, attainment
    # 0.5): scale-up at once, and the work per replica that failed is remembered with floor 2
    spec = replace(SPEC, floor_quiet_s=1000.0)
    failing = pod(waiting=20, slo_met=25)
    st = PolicyState(since=-1000.0, last_down_time=-100.0, level_rps=10.0, last_tick=-5.0,
                     output_level=100.0, proven_work=600.0)
    up = decide(0.0, obs(failing), spec, st)
    # level 0.3 * 10 + 0.7 * 10 = 10 req/s x 100 tokens on 1 replica = 1000 tokens/s failed
    assert (up.replicas, up.reason) == (2, "ScaleUpGoodput")
    assert (up.state.floor, up.state.fail_work, up.state.floor_time) == (2, pytest.approx(1000.0), 0.0)
    assert up.state.proven_work == 600.0       # min(600, 0.9 * 1000)
    # floor 2: back at 1 replica the work would be 1000 >= 0.75 * 1000: 2 is the fewest that carry
    # (Little: 10 * 4.16 = 41.6 seqs fits one 64-batch, and 1000 <= 1.75 * 600 would allow it)
    two = obs(pod("a", admitted=25, finished=25, slo_met=25, generation_tokens=2500, ttft=hist(25, 0.2),
                  tpot=hist(25, 0.04)), pod("b", admitted=25, finished=25, slo_met=25, generation_tokens=2500,
                                            ttft=hist(25, 0.2), tpot=hist(25, 0.04)))
    st2 = replace(up.state, recommendations=[], since=-1000.0, last_up_time=None, last_down_time=None,
                  last_loading_time=None, level_rps=10.0, last_tick=395.0)
    assert decide(400.0, two, spec, st2).replicas == 2
    # after floor_quiet_s without a new failure the floor drops one replica (to 1: cleared)
    later = decide(1000.0, two, spec, replace(st2, last_tick=995.0))
    assert (later.state.floor, later.state.fail_work) == (0, 0.0)


def test_restart_from_status_resumes_every_phase():
    # a state after some calls, through JSON (as status stores it), gives the same decision
    st = None
    o = obs(pod("a"), pod("b", admitted=60), current=2)
    for t in (0.0, 5.0, 10.0):
        d = decide(t, o, SPEC, st)
        st = d.state
    again = decide(15.0, o, SPEC, PolicyState.from_dict(json.loads(json.dumps(st.to_dict()))))
    direct = decide(15.0, o, SPEC, st)
    assert (again.replicas, again.reason, again.limits, again.router_max_queued, again.state) == \
        (direct.replicas, direct.reason, direct.limits, direct.router_max_queued, direct.state)
    # a state from before these fields (only the old keys) still loads; a corrupt one starts fresh
    old = {"recommendations": [[1.0, 2.0]], "caps": {"a": 48}, "service_s": 4.0}
    assert PolicyState.from_dict(old).caps == {"a": 48} and PolicyState.from_dict(old).proof == []
    assert PolicyState.from_dict({"level_rps": "NaN"}) == PolicyState()


def test_zero_traffic_decisions_are_finite_and_json_safe():
    st = None
    o = obs(idle("a"), idle("b"))
    for t in (0.0, 5.0, 400.0):
        d = decide(t, o, SPEC, st)
        st = d.state
        json.dumps(st.to_dict(), allow_nan=False)      # raises on NaN or inf
        assert "nan" not in d.message.lower()
    assert d.reason in ("ScaleDownIdle", "HoldStabilizing")
