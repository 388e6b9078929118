"""Table tests of the goodput autoscaling policy; every expected value is computed by hand in the
comment beside it from the rules in goodput.autoscaler.policy's docstring."""
from __future__ import annotations

import json
import math

import pytest

from goodput.api.policy import PolicySpec
from goodput.autoscaler.policy import (
    HistogramDelta,
    Observation,
    PodObservation,
    PolicyState,
    StartingPod,
    decide,
)

INF = math.inf
BOUNDS = (0.05, 0.1, 0.2, INF)


def hist(le_005: float, le_01: float, le_02: float, total: float, mean: float) -> HistogramDelta:
    return HistogramDelta(BOUNDS, (le_005, le_01, le_02, total), total, mean * total)


def tpot_fast(n: float = 100) -> HistogramDelta:
    """Every TPOT <= 50 ms, mean 40 ms."""
    return hist(n, n, n, n, 0.04)


def pod(name: str = "p0", **kw) -> PodObservation:
    """A pod at a steady 10 req/s: 50 finished per 5 s, all within SLO, 100 tokens each,
    TTFT mean 0.2 s, TPOT mean 0.04 s -> service_s = 0.2 + 99 * 0.04 = 4.16 s."""
    base = dict(name=name, running=20, waiting=0, kv_usage=0.3, max_num_seqs=64, max_waiting=100,
                interval_s=5.0, admitted=50, finished=50, slo_met=50, rejected_429=0, rejected_400=0,
                preempted=0, generation_tokens=5000, ttft=hist(0, 0, 50, 50, 0.2), tpot=tpot_fast(50),
                age_s=600.0)
    base.update(kw)
    return PodObservation(**base)


SPEC = PolicySpec(min_replicas=1, max_replicas=10, slo_ttft_s=1.0, slo_tpot_s=0.1, attainment_target=0.9,
                  scale_up_window_s=0, stabilization_window_s=300, tolerance=0.1,
                  target_utilization=1.0)


# ---------------------------------------------------------------------------- HistogramDelta
@pytest.mark.parametrize("x,expected", [
    (0.05, 0.5),            # counts (5, 8, 9, 10): 5/10 at the first bound
    (0.025, 0.25),          # half-way through [0, 0.05]: 2.5/10
    (0.075, 0.65),          # 5 + 3 * 0.5 = 6.5 -> 0.65
    (0.2, 0.9),
    (5.0, 0.9),             # +Inf bucket: only the count up to the last finite bound (lower bound)
])
def test_fraction_le(x, expected):
    h = HistogramDelta(BOUNDS, (5, 8, 9, 10), 10, 1.0)
    assert h.fraction_le(x) == pytest.approx(expected)


def test_fraction_le_empty_and_bad_shapes():
    assert HistogramDelta(BOUNDS, (0, 0, 0, 0), 0, 0).fraction_le(0.1) is None
    with pytest.raises(ValueError, match="equal length"):
        HistogramDelta(BOUNDS, (1, 2), 2, 0)
    with pytest.raises(ValueError, match="ascending"):
        HistogramDelta((0.1, 0.05, INF), (1, 2, 3), 3, 0)


# --------------------------------------------------------------------------------- state
def test_state_round_trips_through_json():
    st = PolicyState(recommendations=[[1.0, 3.0], [6.0, 4.0]], caps={"a": 48}, service_s=4.2,
                     last_scale_time=6.0, last_direction=1, since=1.0, plan_cap=64, plan_tpot_s=0.07,
                     plan_offered_rps=10.0)
    back = PolicyState.from_dict(json.loads(json.dumps(st.to_dict())))
    assert back == st
    assert PolicyState.from_dict({"caps": "nonsense"}) == PolicyState()
    assert PolicyState.from_dict(None) == PolicyState()


# ----------------------------------------------------------------------------- spec from CRD
def test_spec_from_crd_defaults_and_values():
    s = PolicySpec.from_crd({})
    assert (s.min_replicas, s.max_replicas, s.slo_ttft_s, s.slo_tpot_s) == (1, 4, 1.0, 0.1)
    s = PolicySpec.from_crd({"slo": {"ttftMs": 500, "tpotMs": 50, "attainmentTarget": 0.95},
                             "autoscaling": {"minReplicas": 2, "maxReplicas": 8,
                                             "stabilizationWindowSeconds": 60,
                                             "targets": {"kvCacheUsage": 0.7, "queueDepth": 2}}})
    assert (s.min_replicas, s.max_replicas, s.slo_ttft_s, s.slo_tpot_s, s.attainment_target) == \
        (2, 8, 0.5, 0.05, 0.95)
    assert (s.stabilization_window_s, s.kv_target, s.queue_target) == (60, 0.7, 2)
    with pytest.raises(ValueError, match="min_replicas"):
        PolicySpec.from_crd({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}})


# ----------------------------------------------------------------- rule 3: sizing from demand
def test_steady_fleet_holds():
    # demand = max(in flight 2*20, offered 20 req/s * 4.16 s = 83.2) = 83.2 seqs;
    # capacity per replica = min(cap 64, 20 * 0.8 / 0.3 = 53.3) = 53.3 -> ceil(83.2 / 53.3) = 2
    obs = Observation((pod("a"), pod("b")), (), (), current_replicas=2)
    d = decide(0.0, obs, SPEC, None)
    assert (d.replicas, d.reason) == (2, "Steady")
    assert d.conditions["MetricsAvailable"][0] is True


def test_offered_load_counts_rejections():
    # 25 admitted + 25 rejected per 5 s = 10 req/s offered on one pod; the same pod without the
    # rejections offers 5 req/s. service_s = 4.16 -> demand 41.6 vs 20.8 (in flight 20).
    # kv 0.1 -> capacity min(64, 20 * 0.8 / 0.1 = 160) = 64; attainment 25 / (25 + 25) = 0.5.
    rejecting = pod("a", admitted=25, finished=25, slo_met=25, rejected_429=25, kv_usage=0.1,
                    ttft=hist(0, 0, 25, 25, 0.2), tpot=tpot_fast(25), generation_tokens=2500)
    d = decide(0.0, Observation((rejecting,), (), (), 1), SPEC, None)
    # wanted = ceil(41.6 / 64) = 1 but attainment 0.5 < 0.9 while 429s -> ready + 1 = 2
    assert (d.replicas, d.reason) == (2, "ScaleUpGoodput")
    quiet = pod("a", admitted=25, finished=25, slo_met=25, kv_usage=0.1, ttft=hist(0, 0, 25, 25, 0.2),
                tpot=tpot_fast(25), generation_tokens=2500)
    d = decide(0.0, Observation((quiet,), (), (), 1), SPEC, None)
    assert (d.replicas, d.reason) == (1, "Steady")


def test_scale_up_from_little_law():
    # 40 req/s offered on one pod: demand 40 * 4.16 = 166.4; capacity 53.3 -> ceil(3.12) = 4
    p = pod("a", admitted=200, finished=50)
    d = decide(0.0, Observation((p,), (), (), 1), SPEC, None)
    assert (d.replicas, d.reason) == (4, "ScaleUpGoodput")
    # the message says what was decided, once: no reason (d.reason), no limits (the loop adds the
    # ones in force after the spec's bounds); the AbleToScale condition names the reason once
    assert d.message.startswith("1 -> 4 replicas (1 ready, 0 starting); offered 40.00 req/s")
    assert "ScaleUpGoodput" not in d.message and "max_waiting" not in d.message
    assert d.conditions["AbleToScale"] == (True, "ReadyForNewScale", f"ScaleUpGoodput: {d.message}")


def test_starting_pods_are_capacity_that_is_coming():
    # same demand (4 replicas wanted) while 3 pods load: current_replicas already 4 -> hold
    p = pod("a", admitted=200, finished=50)
    starting = tuple(StartingPod(f"s{i}", 20.0) for i in range(3))
    d = decide(0.0, Observation((p,), starting, (), 4), SPEC, None)
    assert (d.replicas, d.reason) == (4, "HoldStarting")
    # pods created but not yet listed count too (current 4, 1 ready, 0 listed as starting)
    d = decide(0.0, Observation((p,), (), (), 4), SPEC, None)
    assert (d.replicas, d.reason) == (4, "HoldStarting")


def test_missing_metrics_never_scale_down():
    # idle pod a (demand 0) but pod b unreachable: no scale-down from 2
    idle = pod("a", running=0, admitted=0, finished=0, slo_met=0, generation_tokens=0, ttft=None,
               tpot=None, kv_usage=0.0)
    d = decide(0.0, Observation((idle,), (), ("b",), 2), SPEC, None)
    assert (d.replicas, d.reason) == (2, "HoldMissingMetrics")
    assert d.conditions["MetricsAvailable"][:2] == (False, "MetricsMissing")
    # no ready pod with a rate yet (first scrape): hold too
    first = pod("a", interval_s=0.0, running=0)
    d = decide(0.0, Observation((first,), (), (), 3), SPEC, None)
    assert (d.replicas, d.reason) == (3, "HoldMissingMetrics")


# ----------------------------------------------------------------- rule 2: the best batch
def _cap_after(**kw) -> int:
    d = decide(0.0, Observation((pod("a", **kw),), (), (), 1), SPEC, None)
    return d.limits["a"].max_num_seqs


@pytest.mark.parametrize("kw,expected", [
    # binding (running == cap 64), all TPOT <= 50 ms = half the SLO, kv 0.3:
    # fast growth ceil(64 * 1.5) = 96; KV room floor(64 * 0.8 / 0.3) = 170
    (dict(running=64, kv_usage=0.3), 96),
    # KV room binds: floor(64 * 0.8 / 0.7) = 73 < 96
    (dict(running=64, kv_usage=0.7), 73),
    # 80 % of TPOTs <= 50 ms, all <= 100 ms: fraction_le(0.05) = 0.8 < 0.9 (no fast growth);
    # fraction_le(0.08) = 0.8 + 0.2 * 0.6 = 0.92 >= 0.9 -> 64 + ceil(64 * 0.125) = 72
    (dict(running=64, tpot=hist(40, 50, 50, 50, 0.05)), 72),
    # KV over target: no growth even though TPOT is fine
    (dict(running=64, kv_usage=0.85), 64),
    # the cap does not bind (40 < 64): no evidence to grow
    (dict(running=40), 64),
    # a preemption: floor(min(64, 64) * 0.75) = 48
    (dict(running=64, preempted=1), 48),
    # TPOT attainment 0.5 < 0.9 with 30 running: floor(30 * 0.75) = 22
    (dict(running=30, tpot=hist(10, 25, 50, 50, 0.12)), 22),
    # first scrape: nothing to learn from
    (dict(running=64, interval_s=0.0), 64),
])
def test_best_batch_table(kw, expected):
    assert _cap_after(**kw) == expected


def test_learned_cap_carries_over_and_to_new_pods():
    d = decide(0.0, Observation((pod("a", running=64),), (), (), 2), SPEC, None)
    assert d.limits["a"].max_num_seqs == 96
    # next tick: pod a keeps its 96 (not binding now), new pod b starts at the fleet median 96
    d2 = decide(5.0, Observation((pod("a"), pod("b", max_num_seqs=64)), (), (), 2), SPEC, d.state)
    assert (d2.limits["a"].max_num_seqs, d2.limits["b"].max_num_seqs) == (96, 96)


# --------------------------------------------------------- rule 5: the waiting-queue limit
def test_queue_limit_tightens_while_capacity_loads():
    # capacity per replica min(64, 20 * 0.8 / 0.3) = 53.33; service 4.16 s -> mu = 12.82 req/s;
    # k_ttft = floor(1.0 s * 12.82) = 12. Nothing loading: 12 * queue_slack 2 = 24.
    d = decide(0.0, Observation((pod("a"), pod("b")), (), (), 2), SPEC, None)
    assert {lim.max_waiting for lim in d.limits.values()} == {24}
    # 2 ready + 2 starting: floor(12 * (1 + 1 * 2 / 4)) = 18
    starting = (StartingPod("s0", 5.0), StartingPod("s1", 5.0))
    d = decide(0.0, Observation((pod("a"), pod("b")), starting, (), 4), SPEC, None)
    assert {lim.max_waiting for lim in d.limits.values()} == {18}
    # 1 ready + 3 loading (2 starting, 1 not created yet): floor(12 * (1 + 1/4)) = 15
    d = decide(0.0, Observation((pod("a"),), starting, (), 4), SPEC, None)
    assert d.limits["a"].max_waiting == 15


def test_queue_limit_leaves_the_prefill_its_part_of_ttft():
    # as above (mu = 53.33 / 4.16 = 12.82/s), now with the queue-time histogram: TTFT mean 0.2 s,
    # queue time mean 0.05 s -> t_first = 0.15 s after the queue; a position k request meets TTFT
    # when k / 12.82 + 0.15 <= 1.0 -> k_ttft = floor(0.85 * 12.82) = floor(10.9) = 10.
    # Nothing loading: 10 * 2 = 20 (24 without the histogram: those past 20 wait their whole budget)
    q = hist(50, 50, 50, 50, 0.05)
    pods = (pod("a", queue=q), pod("b", queue=q))
    d = decide(0.0, Observation(pods, (), (), 2), SPEC, None)
    assert {lim.max_waiting for lim in d.limits.values()} == {20}
    # 2 ready + 2 starting: floor(10 * (1 + 2/4)) = 15
    d = decide(0.0, Observation(pods, (StartingPod("s0", 5.0), StartingPod("s1", 5.0)), (), 4), SPEC, None)
    assert {lim.max_waiting for lim in d.limits.values()} == {15}
    # first tokens take 1.2 s after the queue (TTFT mean 1.25, queue 0.05): no queue position
    # meets a 1 s TTFT -> budget 0, k_ttft 0 -> min_waiting 1
    slow = tuple(pod(n, queue=q, ttft=hist(0, 0, 0, 50, 1.25)) for n in "ab")
    d = decide(0.0, Observation(slow, (), (), 2), SPEC, None)
    assert {lim.max_waiting for lim in d.limits.values()} == {1}


# ------------------------------------------------------- rule 6: preemption is saturation
def test_preemptions_scale_up_as_saturation():
    # 5 preemptions, attainment 30 / 50 = 0.6: cap -> floor(20 * 0.75) = 15, capacity
    # min(15, 53.3) = 15, demand 41.6 -> ceil(41.6 / 15) = 3
    d = decide(0.0, Observation((pod("a", preempted=5, slo_met=30),), (), (), 1), SPEC, None)
    assert (d.replicas, d.reason, d.limits["a"].max_num_seqs) == (3, "ScaleUpSaturation", 15)


# ------------------------------------------- rules 7-9: windows, tolerance, bounded steps
def _quiet(name: str, rps: float = 5.0) -> PodObservation:
    n = rps * 5
    return pod(name, admitted=n, finished=n, slo_met=n, generation_tokens=100 * n,
               ttft=hist(0, 0, n, n, 0.2), tpot=tpot_fast(n))


def test_scale_down_after_the_window_and_one_step_at_a_time():
    # 3 pods at 5 req/s: demand 15 * 4.16 = 62.4, capacity 53.33 -> rec 2
    obs = Observation(tuple(_quiet(n) for n in "abc"), (), (), 3)
    # 400 s of history, and the fleet has proven it serves 500 output tokens/s per replica (5 req/s
    # x 100 tokens; no prompt counter): at 2 replicas each gets 15 * 100 / 2 = 750 <= 1.75 * 500
    old = PolicyState(since=-400.0, proven_work=500.0)
    d = decide(0.0, obs, SPEC, old)
    assert (d.replicas, d.reason) == (2, "ScaleDown")
    # no history (fresh or lost state): a whole window must pass first
    assert decide(0.0, obs, SPEC, None).reason == "HoldStabilizing"
    assert decide(299.0, obs, SPEC, PolicyState(since=0.0)).reason == "HoldStabilizing"
    # a recommendation of 3 from 200 s ago is inside the 300 s window: hold
    st = PolicyState(recommendations=[[-200.0, 3.0]], since=-400.0)
    assert decide(0.0, obs, SPEC, st).reason == "HoldStabilizing"
    # ... from 400 s ago it is not
    st = PolicyState(recommendations=[[-400.0, 3.0]], since=-400.0, proven_work=500.0)
    assert decide(0.0, obs, SPEC, st).replicas == 2
    # nothing proven yet: 750 per replica is not within 1.75x of 0, and demand 62.4 is above the
    # idle 0.3 * 2 * 53.33 = 32: the fleet that carries it is the current 3 -> hold
    assert decide(0.0, obs, SPEC, PolicyState(since=-400.0)).reason == "HoldStabilizing"
    # proven 428 < 750 / 1.75 = 428.57: hold; 429: go
    assert decide(0.0, obs, SPEC, PolicyState(since=-400.0, proven_work=428.0)).replicas == 3
    assert decide(0.0, obs, SPEC, PolicyState(since=-400.0, proven_work=429.0)).replicas == 2
    # idle fleet of 4: rec = min_replicas 1, but at most max_scale_down_step = 1 per decision
    idle = tuple(pod(n, running=0, admitted=0, finished=0, slo_met=0, generation_tokens=0, ttft=None,
                     tpot=None, kv_usage=0.0) for n in "abcd")
    d = decide(0.0, Observation(idle, (), (), 4), SPEC, old)
    assert (d.replicas, d.reason) == (3, "ScaleDownIdle")


def test_no_scale_down_while_starting_or_rejecting():
    obs = Observation(tuple(_quiet(n) for n in "abc"), (StartingPod("s", 1.0),), (), 4)
    assert decide(0.0, obs, SPEC, None).reason == "HoldStarting"
    # 429s on one pod (attainment 72 / 75 = 0.96 >= 0.9, rec still 2): remaining may not hold
    pods = (_quiet("a"), _quiet("b"), pod("c", admitted=25, finished=25, slo_met=22, rejected_429=3,
                                          ttft=hist(0, 0, 25, 25, 0.2), tpot=tpot_fast(25),
                                          generation_tokens=2500))
    d = decide(0.0, Observation(pods, (), (), 3), SPEC, PolicyState(since=-400.0))
    assert (d.replicas, d.reason) == (3, "HoldStabilizing")


def test_tolerance_band_and_bounded_scale_up():
    # 10 pods at 13 req/s: demand 130 * 4.16 = 540.8 / 53.33 = 10.14 -> 11; 11/10 - 1 = 0.1: in band
    obs = Observation(tuple(pod(f"p{i}", admitted=65) for i in range(10)), (), (), 10)
    assert (decide(0.0, obs, SPEC, None).replicas, decide(0.0, obs, SPEC, None).reason) == (10, "Steady")
    # 1 pod offered 200 req/s: 832 / 53.33 -> 16, clamped to max 10, step max(4, 1) -> 5
    d = decide(0.0, Observation((pod("a", admitted=1000),), (), (), 1), SPEC, None)
    assert d.replicas == 5


def test_scale_up_window_needs_evidence_unless_panic():
    spec = PolicySpec(**{**SPEC.__dict__, "scale_up_window_s": 30.0})
    # rec 4 (40 req/s, see test_scale_up_from_little_law) with current 3: a rec of 3 from 10 s ago
    # is the window's minimum -> no scale-up yet
    pods = (pod("a", admitted=200, finished=50), pod("b", running=0, admitted=0, finished=0, slo_met=0,
                                                     generation_tokens=0, ttft=None, tpot=None,
                                                     kv_usage=0.0), pod("c", running=0, admitted=0,
                                                                         finished=0, slo_met=0,
                                                                         generation_tokens=0,
                                                                         ttft=None, tpot=None,
                                                                         kv_usage=0.0))
    st = PolicyState(recommendations=[[-10.0, 3.0]])
    # demand = max(in flight 20, 40 * 4.16 = 166.4); capacity mean (53.33 + 64 + 64) / 3 = 60.4
    # -> ceil(166.4 / 60.4) = 3: equal to current, so steady
    d = decide(0.0, Observation(pods, (), (), 3), spec, st)
    assert (d.replicas, d.reason) == (3, "Steady")
    one = Observation((pod("a", admitted=200, finished=50),), (), (), 1)
    # rec 4 >= panic_ratio 2 * current 1: immediate despite a rec of 1 five seconds ago
    d = decide(0.0, one, spec, PolicyState(recommendations=[[-5.0, 1.0]]))
    assert d.replicas == 4
    # 40 + 5 + 5 req/s on 3 pods: demand 50 * 4.16 = 208 / 53.33 = 3.9 -> rec 4 < panic 2 * 3;
    # window minimum min(3, 4) = 3 -> HoldStabilizing
    three = Observation((pod("a", admitted=200, finished=50), _quiet("b"), _quiet("c")), (), (), 3)
    d = decide(0.0, three, spec, PolicyState(recommendations=[[-10.0, 3.0]]))
    assert (d.replicas, d.reason) == (3, "HoldStabilizing")


def test_restart_from_saved_state_does_not_flap():
    # scale up to 4 at t=0, then light load (4 pods at 2 req/s: 33.3 / 53.33 -> rec 1): at t=30
    # the state holds (the 4 is in the window), and so does a state restored from its JSON
    up = decide(0.0, Observation((pod("a", admitted=200, finished=50),), (), (), 1), SPEC, None)
    assert up.replicas == 4
    light = Observation(tuple(_quiet(n, rps=2.0) for n in "abcd"), (), (), 4)
    kept = decide(30.0, light, SPEC, up.state)
    restored = decide(30.0, light, SPEC, PolicyState.from_dict(json.loads(json.dumps(up.state.to_dict()))))
    assert (kept.replicas, kept.reason) == (4, "HoldStabilizing")
    assert (restored.replicas, restored.reason) == (kept.replicas, kept.reason)
    # at t=331 the 4s (and the t=30 call, when nothing was proven yet, so 4 replicas were the
    # fewest known to carry the load) have left the window; 331 s of history exist and the good
    # calls at 30 and 331 (more than a model load apart) prove 2 * 100 = 200 tokens/s per
    # replica: 3 replicas get 800 / 3 = 267 <= 1.75 * 200 = 350 (2 would get 400 > 350): one
    # step down, restored or not; a fresh state (history lost) holds another whole window
    later = decide(331.0, light, SPEC, PolicyState.from_dict(json.loads(json.dumps(kept.state.to_dict()))))
    assert (later.replicas, later.reason) == (3, "ScaleDown")
    assert later.state.proven_work == pytest.approx(200.0)
    assert decide(331.0, light, SPEC, None).reason == "HoldStabilizing"


def test_missed_slos_scale_up_in_proportion_and_at_once():
    # 3 pods, 20 waiting each (60 > queue_target 4 * 3: saturated), attainment 90 / 150 = 0.6.
    # Little's law: max(in flight 120, 30 req/s * 4.16 = 124.8) / 53.33 -> 3 (no change), but
    # ceil(3 * 0.9 / 0.6) = ceil(4.5) = 5 < panic 2 * 3, and the missed SLOs skip the 30 s
    # scale-up window whose minimum (3, ten seconds ago) would otherwise hold it
    spec = PolicySpec(**{**SPEC.__dict__, "scale_up_window_s": 30.0})
    pods = tuple(pod(n, waiting=20, slo_met=30) for n in "abc")
    d = decide(0.0, Observation(pods, (), (), 3), spec, PolicyState(recommendations=[[-10.0, 3.0]]))
    assert (d.replicas, d.reason) == (5, "ScaleUpGoodput")
    # the same misses without saturation (no queue): not a capacity problem, nothing moves
    calm = tuple(pod(n, slo_met=30) for n in "abc")
    d = decide(0.0, Observation(calm, (), (), 3), spec, PolicyState(recommendations=[[-10.0, 3.0]]))
    assert d.replicas == 3
    # the same misses while 2 pods load (current 5): they are capacity that is coming -> hold
    d = decide(0.0, Observation(pods, (StartingPod("s0", 9.0), StartingPod("s1", 9.0)), (), 5), spec,
               PolicyState(recommendations=[[-10.0, 3.0]]))
    assert (d.replicas, d.reason) == (5, "HoldStarting")


def test_successive_scale_downs_are_a_model_load_apart():
    # rec 2 from 3 (see test_scale_down_after_the_window...); the last scale-down was 30 s ago:
    # undoing a wrong one would cost a 60 s model load, so wait; 70 s ago: go
    obs = Observation(tuple(_quiet(n) for n in "abc"), (), (), 3)
    recent = PolicyState(since=-400.0, last_down_time=-30.0, proven_work=500.0)
    assert decide(0.0, obs, SPEC, recent).reason == "HoldStabilizing"
    older = PolicyState(since=-400.0, last_down_time=-70.0, proven_work=500.0)
    assert decide(0.0, obs, SPEC, older).replicas == 2
    # no scale-down within a model load of a scale-UP either (its new pods are watched that
    # long), nor of the last call that saw a pod loading
    assert decide(0.0, obs, SPEC, PolicyState(since=-400.0, proven_work=500.0, last_up_time=-30.0)).reason == "HoldStabilizing"
    assert decide(0.0, obs, SPEC, PolicyState(since=-400.0, proven_work=500.0, last_loading_time=-59.0)).reason == "HoldStabilizing"
    assert decide(0.0, obs, SPEC, PolicyState(since=-400.0, proven_work=500.0, last_up_time=-61.0)).replicas == 2
    # a measured model load of 145 s (state) replaces the 60 s prior: 70 s after a scale-up waits
    assert decide(0.0, obs, SPEC, PolicyState(since=-400.0, proven_work=500.0, last_up_time=-70.0, load_s=145.0)
                  ).reason == "HoldStabilizing"


# ------------------------------- rule 4: a batch cut while capacity loads adds no replica
def test_batch_cut_while_a_pod_loads_does_not_pile_up():
    # One pod, 64 running + 40 waiting, kv 0.2, every TPOT in (50, 100] ms (mean 70 ms):
    # fraction_le(0.1) = 1.0 (no cut), fraction_le(0.08) = 0.6 (no growth) -> cap stays 64.
    # service_s = 0.2 + 99 * 0.07 = 7.13 s; demand = max(in flight 104, 10 req/s * 7.13 = 71.3)
    # = 104; capacity min(64, 64 * 0.8 / 0.2 = 256) = 64 -> ceil(104 / 64) = 2: scale 1 -> 2.
    t0 = pod("a", running=64, waiting=40, kv_usage=0.2, tpot=hist(0, 50, 50, 50, 0.07))
    up = decide(0.0, Observation((t0,), (), (), 1), SPEC, None)
    assert (up.replicas, up.reason, up.limits["a"].max_num_seqs) == (2, "ScaleUpGoodput", 64)
    # 5 s later the new pod s1 is loading and pod a misses TPOT (40 of 50 <= 100 ms: 0.8 < 0.9):
    # its cap is cut to floor(64 * 0.75) = 48, which is the limit it gets. Demand is unchanged
    # (104). Sized against the cut batch, ceil(104 / 48) = 3 would order a third replica while
    # the second still loads (the pile-up). Replicas that count: a (ready) and s1 (coming), each
    # with the batch the scale-up was sized with, 64 -> ceil(104 / 64) = 2 = current: hold.
    t5 = pod("a", running=64, waiting=40, kv_usage=0.2, tpot=hist(20, 40, 50, 50, 0.07))
    d = decide(5.0, Observation((t5,), (StartingPod("s1", 5.0),), (), 2), SPEC, up.state)
    assert (d.replicas, d.reason, d.limits["a"].max_num_seqs) == (2, "HoldStarting", 48)
    # pods ordered but not yet created count the same way (current 2, nothing listed yet)
    d_unlisted = decide(5.0, Observation((t5,), (), (), 2), SPEC, up.state)
    assert (d_unlisted.replicas, d_unlisted.reason) == (2, "HoldStarting")
    # a real rise in demand while s1 loads still scales up: 200 in flight (a: 64 + 136 waiting)
    # -> ceil(200 / 64) = 4 (against the cut batch it would be ceil(200 / 48) = 5)
    surge = pod("a", running=64, waiting=136, kv_usage=0.2, tpot=hist(20, 40, 50, 50, 0.07))
    d_surge = decide(5.0, Observation((surge,), (StartingPod("s1", 5.0),), (), 2), SPEC, up.state)
    assert (d_surge.replicas, d_surge.reason) == (4, "ScaleUpGoodput")
    # at 10 s s1 is ready (first scrape) and the load is split: s1 starts with the batch it was
    # counted with, 64, not the fleet median after the cut (48), and a's provisional cut is
    # undone: max(48, 64) = 64 (40 running, TPOT within the SLO: no new cut, no growth)
    a10 = pod("a", running=40, waiting=0, kv_usage=0.125, tpot=hist(0, 50, 50, 50, 0.07))
    s1 = pod("s1", running=40, interval_s=0.0, max_num_seqs=64, kv_usage=0.125)
    d10 = decide(10.0, Observation((a10, s1), (), (), 2), SPEC, d.state)
    assert (d10.limits["a"].max_num_seqs, d10.limits["s1"].max_num_seqs) == (64, 64)
    # demand max(in flight 80, 10 req/s * 7.13 = 71.3) = 80 -> ceil(80 / 64) = 2: steady, and the
    # plan is dropped (nothing coming): the next cut counts in full
    assert (d10.replicas, d10.reason, d10.state.plan_cap) == (2, "Steady", 0)
    # ... a TPOT miss at the planned load cuts again: floor(min(64, 40) * 0.75) = 30
    a15 = pod("a", running=40, waiting=0, kv_usage=0.125, tpot=hist(20, 40, 50, 50, 0.07))
    d15 = decide(15.0, Observation((a15, pod("s1", running=40, kv_usage=0.125)), (), (), 2), SPEC,
                 d10.state)
    assert d15.limits["a"].max_num_seqs == 30


def test_slow_tpot_while_pods_load_does_not_stretch_demand():
    # One pod at 20 req/s (100 finished per 5 s, 100 tokens each), 40 running, kv 0.2, TPOT mean
    # 70 ms all within the SLO: service_s = 0.2 + 99 * 0.07 = 7.13 s, demand max(40, 20 * 7.13 =
    # 142.6) = 142.6; capacity min(64, 40 * 0.8 / 0.2 = 160) = 64 -> ceil(2.23) = 3: scale 1 -> 3.
    def busy(tpot: HistogramDelta) -> PodObservation:
        return pod("a", running=40, kv_usage=0.2, admitted=100, finished=100, slo_met=100,
                   generation_tokens=10000, ttft=hist(0, 0, 100, 100, 0.2), tpot=tpot)
    up = decide(0.0, Observation((busy(hist(0, 100, 100, 100, 0.07)),), (), (), 1), SPEC, None)
    assert (up.replicas, up.reason) == (3, "ScaleUpGoodput")
    # while 2 pods load, pod a's TPOT stretches to a mean of 100 ms (90 % within the SLO: no
    # cut). Measured service_s 0.2 + 99 * 0.1 = 10.1 s -> demand 202 -> ceil(202 / 64) = 4 would
    # order a 4th replica; with the TPOT the plan was sized with (70 ms) demand stays 142.6 -> 3
    loading = Observation((busy(hist(0, 90, 100, 100, 0.1)),), (StartingPod("s1", 5.0),
                                                                 StartingPod("s2", 5.0)), (), 3)
    d = decide(5.0, loading, SPEC, up.state)
    assert (d.replicas, d.reason, d.limits["a"].max_num_seqs) == (3, "HoldStarting", 64)
    # the queue limit still uses the service time measured now (how fast the queue drains):
    # mu = 64 / 10.1 = 6.34/s -> k_ttft = floor(1.0 * 6.34) = 6; 1 of 3 ready -> floor(6 * 4/3) = 8
    assert d.limits["a"].max_waiting == 8
    # with nothing coming (no plan) the same stretched TPOT is measured service time: 202 / 64 -> 4
    d = decide(5.0, Observation(loading.ready, (), (), 1), SPEC, None)
    assert (d.replicas, d.reason) == (4, "ScaleUpGoodput")


def test_metrics_back_after_a_long_gap_wait_a_whole_window():
    # pods a, b, c at 5 req/s: rec 2 from 3 (see test_scale_down_after_the_window...). Pod c's
    # metrics are missing from t=0 to t=400 (longer than the 300 s window): every such tick holds
    # (HoldMissingMetrics) and records max(rec, current) = 3
    quiet = Observation(tuple(_quiet(n) for n in "abc"), (), (), 3)
    gap = Observation((_quiet("a"), _quiet("b")), (), ("c",), 3)
    st = PolicyState(since=-400.0, proven_work=500.0)
    for t in (0.0, 100.0, 200.0, 300.0, 400.0):
        d = decide(t, gap, SPEC, st)
        assert (d.replicas, d.reason) == (3, "HoldMissingMetrics")
        st = d.state
    # metrics back at t=450: the window [150, 450] holds the gap's 3s -> no scale-down on one
    # sample (recording nothing during the gap would leave only this tick's 2 and scale down)
    d = decide(450.0, quiet, SPEC, st)
    assert (d.replicas, d.reason) == (3, "HoldStabilizing")
    # t=701: the window [401, 701] holds only complete-metrics 2s (450, 701): one step down
    d = decide(701.0, quiet, SPEC, d.state)
    assert (d.replicas, d.reason) == (2, "ScaleDown")


def test_retried_429s_while_pods_load_are_not_new_demand():
    # scale 1 -> 2 at t=0 as in test_batch_cut_while_a_pod_loads...: 104 in flight, offered
    # 10 req/s (plan_offered_rps 10), service_s 7.13 s
    t0 = pod("a", running=64, waiting=40, kv_usage=0.2, tpot=hist(0, 50, 50, 50, 0.07))
    up = decide(0.0, Observation((t0,), (), (), 1), SPEC, None)
    assert (up.replicas, up.state.plan_offered_rps) == (2, 10.0)
    # while s1 loads, the tightened queue answers 429 and the clients retry: 40 admitted and 160
    # rejections per 5 s -> offered 40 req/s, 40 * 7.13 = 285.2 seqs -> ceil(285.2 / 64) = 5
    # would order 3 more. Sized with min(40, max(plan 10, admitted 8)) = 10 req/s -> 71.3; in
    # flight 104 -> ceil(104 / 64) = 2 = current: hold (attainment 40 / 200 = 0.2 is not
    # evidence while pods load, rule 3)
    retried = pod("a", running=64, waiting=40, kv_usage=0.2, admitted=40, finished=40, slo_met=40,
                  rejected_429=160, generation_tokens=4000, ttft=hist(0, 0, 40, 40, 0.2),
                  tpot=hist(0, 40, 40, 40, 0.07))
    d = decide(5.0, Observation((retried,), (StartingPod("s1", 5.0),), (), 2), SPEC, up.state)
    assert (d.replicas, d.reason) == (2, "HoldStarting")
    # with nothing coming the same 429s are offered demand in full: 285.2 / 64 -> 5
    d = decide(5.0, Observation((retried,), (), (), 1), SPEC, None)
    assert d.replicas == 5
