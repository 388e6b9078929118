"""Rule 19: the decode pool of a disaggregated service waits for the prefill capacity on its way
(policy.prefill_relief): no scale-up or down while its pods prefill in place of a loading prefill
pool, and rule 2's cuts then are provisional; tables computed by hand."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from goodput.api.policy import PolicySpec
from goodput.autoscaler import policy as P
from goodput.autoscaler.policy import HistogramDelta, Observation, PodObservation, PolicyState

INF = math.inf
SPEC = PolicySpec(min_replicas=1, max_replicas=8, slo_ttft_s=3.0, slo_tpot_s=0.05, attainment_target=0.9,
                  scale_up_window_s=0, stabilization_window_s=300, tolerance=0.1, queue_slack=2.0,
                  max_num_seqs=64)


def tpots(n: float, slow: float) -> HistogramDelta:
    """n TPOTs, the fraction ``slow`` of them over the 50 ms SLO (at 83 ms), the rest at 25 ms."""
    fast = n * (1 - slow)
    return HistogramDelta((0.025, 0.05, 0.1, INF), (fast, fast, n, n), n, fast * 0.025 + (n - fast) * 0.083)


def pod(name: str = "d", **kw) -> PodObservation:
    """A decode pod over 5 s: 14 running, 14 waiting, 13 admitted, 6 finished of which 1 met its
    SLO, 18 refused; TPOT 5 of 6 over the SLO (local 4k-token prefills in its steps)."""
    base = dict(name=name, running=14, waiting=14, kv_usage=0.3, max_num_seqs=64, max_waiting=48,
                interval_s=5.0, admitted=13, finished=6, slo_met=1, rejected_429=18, rejected_400=0,
                preempted=0, generation_tokens=6 * 128, ttft=HistogramDelta((1.0, 3.0, INF), (2, 6, 6), 6, 12.0),
                tpot=tpots(6, 5 / 6), queue=HistogramDelta((1.0, 3.0, INF), (6, 6, 6), 6, 1.0), age_s=600.0)
    base.update(kw)
    return PodObservation(**base)


def obs(*pods: PodObservation, fallback: float = 0.0, coming: int = 0, current: int | None = None) -> Observation:
    return Observation(tuple(pods), (), (), len(pods) if current is None else current,
                       prefill_fallback=fallback, prefill_coming=coming)


@pytest.mark.parametrize("fallback,coming,relief_cap,expected", [
    (0, 0, 0, False),     # nothing prefilled in the prefill pool's place
    (7, 0, 0, False),     # prefilled locally, but nothing coming: the prefill pool is at its max,
                          # the local prefills are the decode pool's work
    (0, 4, 0, False),     # prefill pods loading, none of their work here
    (7, 4, 0, True),      # both: the decode pool waits for the prefill pods
    (0, 4, 64, True),     # a quiet interval while they still load: still waiting
    (3, 0, 64, True),     # they arrived, but this interval still held local prefills
    (0, 0, 64, False),    # arrived and quiet: over
])
def test_prefill_relief_by_hand(fallback, coming, relief_cap, expected):
    st = PolicyState(relief_cap=relief_cap)
    assert P.prefill_relief(obs(pod(), fallback=fallback, coming=coming), st) is expected


def test_cuts_while_the_prefill_pool_loads_are_provisional():
    # learned cap 64; 5 of 6 TPOTs miss -> rule 2 cuts to floor(min(64, 14) * 0.75) = 10 (batch_decrease)
    st = PolicyState(caps={"d": 64})
    caps = P.tune_batch_caps(obs(pod(), fallback=7, coming=4), SPEC, st)
    assert caps.caps["d"] == math.floor(14 * SPEC.batch_decrease)
    assert caps.relief_cap == 64 and caps.sizing["d"] == 64     # sized with the batch before the cut
    # the relief goes on (cap 5 now, 4 running: it does not bind): the cap before the first cut is kept
    st2 = PolicyState(caps={"d": 5}, relief_cap=64)
    caps2 = P.tune_batch_caps(obs(pod(running=4, tpot=tpots(6, 0.0)), fallback=2, coming=4), SPEC, st2)
    assert caps2.relief_cap == 64 and caps2.sizing["d"] == 64 and caps2.caps["d"] == 5
    # the prefill pods arrived and no local prefill: the cap goes back to 64 (then rule 2 on it:
    # 4 running under 64 does not bind, it stays) and the relief is over
    caps3 = P.tune_batch_caps(obs(pod(running=4, tpot=tpots(6, 0.0))), SPEC, st2)
    assert caps3.caps["d"] == 64 and caps3.relief_cap == 0
    # without relief, nothing changes: the cut cap stays
    caps4 = P.tune_batch_caps(obs(pod(running=4, tpot=tpots(6, 0.0))), SPEC, PolicyState(caps={"d": 5}))
    assert caps4.caps["d"] == 5 and caps4.relief_cap == 0 and caps4.sizing["d"] == 5


def _decide(o: Observation, st: PolicyState, now: float = 20.0) -> P.Decision:
    return P.decide(now, o, SPEC, replace(st, last_tick=now - 5.0, since=0.0, caps={"d": 64}))


def test_the_decode_pool_holds_while_it_prefills_for_a_loading_prefill_pool():
    # the same interval (attainment 1/24, 18 refused, 28 in flight) without the fallback: rule 3's
    # evidence scales up at once (saturated and missing)
    free = _decide(obs(pod()), PolicyState())
    assert free.replicas > 1 and free.reason == "ScaleUpGoodput" and free.state.relief_cap == 0
    held = _decide(obs(pod(), fallback=7, coming=4), PolicyState())
    assert (held.replicas, held.reason) == (1, "HoldPrefillStarting")
    assert held.state.relief_cap == 64 and held.state.relief_until is None
    assert held.conditions["AbleToScale"][:2] == (False, "HoldPrefillStarting")
    # the prefill pods arrive at 70, the interval still held local prefills: held, relief goes on
    d70 = _decide(obs(pod(), fallback=2), held.state, 70.0)
    assert (d70.replicas, d70.reason, d70.state.relief_cap) == (1, "HoldPrefillStarting", 64)
    # 75: quiet; over, caps back to 64; held until 75 + 5 + 2 x 3 s = 86 (what the pods admitted
    # meanwhile finishes)
    d75 = _decide(obs(pod()), d70.state, 75.0)
    assert (d75.replicas, d75.reason, d75.state.relief_cap) == (1, "HoldPrefillStarting", 0)
    assert d75.state.relief_until == pytest.approx(86.0) and d75.limits["d"].max_num_seqs >= 10
    d80 = _decide(obs(pod()), d75.state, 80.0)
    assert (d80.replicas, d80.reason) == (1, "HoldPrefillStarting") and d80.state.relief_until == pytest.approx(86.0)
    # 90: settled; the same evidence now scales up
    d90 = _decide(obs(pod()), d80.state, 90.0)
    assert d90.replicas > 1 and d90.reason == "ScaleUpGoodput" and d90.state.relief_until is None


def test_the_hold_keeps_the_replica_bounds():
    # below min_replicas (2) the pool is raised regardless
    d = P.decide(20.0, obs(pod(), fallback=7, coming=4), replace(SPEC, min_replicas=2),
                 PolicyState(last_tick=15.0, since=0.0))
    assert (d.replicas, d.reason) == (2, "ScaleUpMinReplicas")


def test_relief_state_round_trips():
    st = PolicyState(relief_cap=64, relief_until=86.0)
    assert PolicyState.from_dict(st.to_dict()) == st
    assert PolicyState.from_dict({"relief_cap": 12}).relief_until is None
