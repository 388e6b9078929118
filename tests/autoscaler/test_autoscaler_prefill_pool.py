"""Rule 18: a disaggregated service's prefill pool is sized by prompt tokens (policy.prefill_size)
and its queue bounded by its prefill time; tables computed by hand."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from goodput.api.policy import PolicySpec
from goodput.autoscaler import policy as P
from goodput.autoscaler.policy import HistogramDelta, Observation, PodObservation, PolicyState

INF = math.inf
SPEC = PolicySpec(min_replicas=1, max_replicas=10, slo_ttft_s=1.0, slo_tpot_s=0.1, attainment_target=0.9,
                  scale_up_window_s=0, stabilization_window_s=300, tolerance=0.1, target_utilization=1.0,
                  token_utilization=0.8, queue_slack=2.0, prefill_pool=True)


def seconds(n: float, mean: float) -> HistogramDelta:
    return HistogramDelta((0.1, 2.0, INF), (0.0, n, n), n, mean * n)


def prompts(n: float, mean: float) -> HistogramDelta:
    return HistogramDelta((1000.0, 2000.0, INF), (0.0, n, n), n, mean * n)


def pod(name: str = "a", **kw) -> PodObservation:
    """A prefill pod over 5 s: 10 remote prefills of 1000-token prompts, one token each; TTFT
    0.375 s of which 0.125 s queued -> prefill 0.25 s; no TPOT; ready for 600 s."""
    base = dict(name=name, running=1, waiting=0, kv_usage=0.1, max_num_seqs=64, max_waiting=100,
                interval_s=5.0, admitted=10, finished=10, slo_met=10, rejected_429=0, rejected_400=0,
                preempted=0, generation_tokens=10, ttft=seconds(10, 0.375), tpot=None,
                queue=seconds(10, 0.125), prompt_tokens=10000.0, prompt_len=prompts(10, 1000.0), age_s=600.0)
    base.update(kw)
    return PodObservation(**base)


def obs(*pods: PodObservation) -> Observation:
    return Observation(tuple(pods), (), (), len(pods))


def cap(tokens: float, scale: float = 1.0) -> P.Capacity:
    return P.Capacity(None, tokens, 0.0, 60.0, scale, 0.0, tokens > 0, 0.0, 0.0, None)


def sized(o: Observation, spec: PolicySpec = SPEC, st: PolicyState | None = None):
    st = st or PolicyState()
    caps = P.tune_batch_caps(o, spec, st)
    fleet = P.aggregate(0.0, o, caps, spec, st)
    return fleet, P.size(fleet, caps, len(o.ready), spec, st), st


@pytest.mark.parametrize("p,tokens,scale,level,service,demand,rec", [
    # prefill 0.25 s; 1000 / 3200 = 0.3125 s: the shorter, 0.25; 8 req/s -> 2 busy -> ceil(2 / 0.8) = 3
    (pod(), 3200.0, 1.0, 8.0, 0.25, 2.0, 3),
    # 1000 / 5000 = 0.2 s is shorter: 1.6 busy -> ceil(1.6 / 0.8) = 2
    (pod(), 5000.0, 1.0, 8.0, 0.2, 1.6, 2),
    # no capacity estimate yet: the prefill time alone
    (pod(), 0.0, 1.0, 8.0, 0.25, 2.0, 3),
    # an undone scale-down halved the estimate: 1000 / 2000 = 0.5 s; 0.25 s stays the shorter
    (pod(), 4000.0, 0.5, 8.0, 0.25, 2.0, 3),
    # no prefill time (no TTFT histogram): 1000 / 3200 = 0.3125 s -> 2.5 busy -> ceil(3.125) = 4
    (pod(ttft=None), 3200.0, 1.0, 8.0, 0.3125, 2.5, 4),
    # 40 req/s of 0.25 s = 10 busy -> 12.5 replicas -> max_replicas 10
    (pod(), 0.0, 1.0, 40.0, 0.25, 10.0, 10),
    # idle: min_replicas
    (pod(), 3200.0, 1.0, 0.0, 0.25, 0.0, 1),
])
def test_prefill_pool_is_sized_by_prompt_tokens(p, tokens, scale, level, service, demand, rec):
    o = obs(p)
    fleet, sz, st = sized(o)
    got = P.prefill_size(o, fleet, sz, cap(tokens, scale), level, SPEC, st)
    assert (got.service_s, got.demand, got.per_replica, got.rec) == \
        (pytest.approx(service), pytest.approx(demand), 0.8, rec)


def test_prefill_size_falls_back_to_rules_3_and_4_without_a_service_time():
    o = obs(pod(ttft=None))
    fleet, sz, st = sized(o)
    assert P.prefill_size(o, fleet, sz, cap(0.0), 8.0, SPEC, st) is sz
    # no prompt-length histogram: the smoothed prompt level (1600 tokens) over 3200 tokens/s = 0.5 s
    o = obs(pod(ttft=None, prompt_len=None))
    fleet, sz, st = sized(o, st=PolicyState(prompt_level=1600.0))
    assert P.prefill_size(o, fleet, sz, cap(3200.0), 2.0, SPEC, st).service_s == pytest.approx(0.5)


def test_prefill_evidence_adds_one_replica_and_waits_for_arrived_capacity():
    # 2 of 10 within the SLO and three 429s (6 of 26 refused, more than 0.1 of them): missing
    # while saturated, nothing coming
    missing = dict(slo_met=2, rejected_429=3)
    o = obs(pod("a", **missing), pod("b", **missing))
    fleet, sz, st = sized(o)
    assert sz.evidence and sz.rec == 8          # HPA's step: ceil(2 * 0.9 / 0.25) = 8
    # rule 18: 1 req/s x 0.25 s -> ceil(0.3125) = 1, the evidence adds one: 2 ready + 1 = 3
    got = P.prefill_size(o, fleet, sz, cap(3200.0), 1.0, SPEC, st)
    assert (got.evidence, got.rec) == (True, 3)
    # misses count once every ready pod is older than the interval + queue_slack TTFT SLOs (5 + 2 x 1 = 7 s):
    # pod b ready 14 s ago: evidence; 6.9 s ago: its misses may have queued before it arrived
    for age, evidence, rec in ((14.0, True, 3), (6.9, False, 1)):
        o = obs(pod("a", **missing), pod("b", age_s=age, **missing))
        fleet, sz, st = sized(o)
        got = P.prefill_size(o, fleet, sz, cap(3200.0), 1.0, SPEC, st)
        assert (got.evidence, got.rec) == (evidence, rec)


def test_decide_bounds_the_prefill_queue_by_the_prefill_time():
    # mu = 1 / 0.25 s = 4 prefills/s; TTFT budget 1 - 0.25 = 0.75 s -> k = 3; nothing loading:
    # slack queue_slack = 2 -> max_waiting 6. 2 req/s offered x 0.25 s = 0.5 busy -> 1 replica
    d = P.decide(0.0, obs(pod()), SPEC, None)
    assert d.replicas == 1 and d.limits["a"].max_waiting == 6
    # the same pod in a pool that is not a prefill pool: no TPOT, no service time -> max_waiting
    d = P.decide(0.0, obs(pod()), replace(SPEC, prefill_pool=False), None)
    assert d.limits["a"].max_waiting == SPEC.max_waiting
