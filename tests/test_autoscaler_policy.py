"""Table tests of the goodput autoscaling policy; every expected value is computed by hand in the
comment beside it from the rules in goodput.autoscaler.policy's docstring."""
from __future__ import annotations

import json
import math

import pytest

from goodput.autoscaler.policy import (
    HistogramDelta,
    Observation,
    PodObservation,
    PolicySpec,
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
                     last_scale_time=6.0, last_direction=1)
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
