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


# ------------------------------------------------- rule 18: the first rate of a cold prefill pool
def cold(name: str = "a", **kw) -> PodObservation:
    """A cold prefill pod: ready 10 s ago (its first scrape, 5 s in, gave no delta), over the last
    5 s 18 arrivals (3.6 req/s) and 5 prefills of 4000-token prompts (TTFT 3.0 s, of which 2.0 s
    queued: prefill 1.0 s, 4000 tokens/s), 1 running and 17 waiting now."""
    base = dict(running=1, waiting=17, admitted=18, finished=5, slo_met=1, generation_tokens=0,
                ttft=seconds(5, 3.0), queue=seconds(5, 2.0), prompt_tokens=20000.0,
                prompt_len=prompts(5, 4000.0), age_s=10.0)
    base.update(kw)
    return pod(name, **base)


@pytest.mark.parametrize("pods,coming,st,expected", [
    # (1 + 17) / 10 s + 5 / 5 s = 1.8 + 1.0 = 2.8 req/s over the pod's 10 s (the interval: 3.6)
    ((cold(),), 0, PolicyState(), 2.8),
    # two pods: (1 + 3) / 8 + 4 / 5 = 0.5 + 0.8 = 1.3; (2 + 6) / 10 + 3 / 5 = 0.8 + 0.6 = 1.4 -> 2.7
    ((cold("a", waiting=3, age_s=8.0, ttft=seconds(4, 3.0)),
      cold("b", running=2, waiting=6, ttft=seconds(3, 3.0))), 0, PolicyState(), 2.7),
    # ready exactly two intervals ago still qualifies: (1 + 17) / 10 + 5 / 5
    ((cold(age_s=10.0),), 0, PolicyState(), 2.8),
    # Holt's level is set: not the first rate, the interval's count goes to the smoothing
    ((cold(),), 0, PolicyState(level_rps=3.0), None),
    # a pod older than two intervals (its unseen part is longer than the interval): None
    ((cold(age_s=10.5),), 0, PolicyState(), None),
    # no older than the interval: its counters' whole life is the interval already
    ((cold(age_s=5.0),), 0, PolicyState(), None),
    # nothing waiting: the queue does not hold what arrived before the interval
    ((cold(waiting=0),), 0, PolicyState(), None),
    # a refusal left the queue
    ((cold(rejected_429=1),), 0, PolicyState(), None),
    # one of two pods does not qualify
    ((cold("a"), cold("b", waiting=0)), 0, PolicyState(), None),
    # no TTFT histogram: what it served is unknown
    ((cold(ttft=None),), 0, PolicyState(), None),
    # capacity coming: rule 4 sizes the rate
    ((cold(),), 2, PolicyState(), None),
])
def test_backlog_rate_by_hand(pods, coming, st, expected):
    o = Observation(tuple(pods), (), (), len(pods) + coming)
    fleet, _, _ = sized(o, st=st)
    got = P.backlog_rate(o, fleet, coming, st)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_a_cold_prefill_pool_orders_for_the_rate_over_its_pods_life():
    # prefill 1.0 s (TTFT 3.0 - queue 2.0; 4000-token prompts over the first capacity sample,
    # 4000 / 1.0 = 4000 tokens/s: also 1.0 s). The rate over the pod's 10 s, 2.8 req/s: 2.8
    # busy -> ceil(2.8 / 0.8) = ceil(3.5) = 4, ordered at once (4 >= 2 x 1 and 1 + 2)
    d = P.decide(10.0, obs(cold()), SPEC, None)
    assert (d.replicas, d.state.level_rps, d.state.plan_offered_rps) == \
        (4, pytest.approx(2.8), pytest.approx(2.8))
    # ready 11 s ago (first scraped 6 s in): the interval's 18 arrivals, 3.6 req/s -> 3.6 busy ->
    # ceil(4.5) = 5
    d = P.decide(10.0, obs(cold(age_s=11.0)), SPEC, None)
    assert (d.replicas, d.state.level_rps) == (5, pytest.approx(3.6))


def test_the_prefill_pools_capacity_reads_the_prompts_it_prefilled():
    # the cold pod: 20000 prompt tokens started over 18 arrivals = 1111 per prompt over the 1.0 s
    # prefill -> 1111 tokens/s; the 5 prompts it prefilled (its prompt-length histogram, one per
    # finished request: a prefill pod's request finishes with its first token) average 4000 -> 4000
    p = cold()
    assert P.pod_token_rate(p) == pytest.approx(20000 / 18)
    assert P.pod_token_rate(p, prefill_pool=True) == pytest.approx(4000.0)
    # + generated tokens per second, as for any pod: 5 first tokens over 5 s -> 4001
    assert P.pod_token_rate(replace(p, generation_tokens=5), prefill_pool=True) == pytest.approx(4001.0)
    # no prompt-length histogram (or none finished): the prompt counter over the admissions
    assert P.pod_token_rate(replace(p, prompt_len=None), prefill_pool=True) == pytest.approx(20000 / 18)
    none_finished = replace(p, prompt_len=prompts(0, 0.0))
    assert P.pod_token_rate(none_finished, prefill_pool=True) == pytest.approx(20000 / 18)
    # in decide: the prefill pool's first capacity sample is 4000; the same pods elsewhere 1111
    assert P.decide(10.0, obs(cold()), SPEC, None).state.cap_tokens == pytest.approx(4000.0)
    assert P.decide(10.0, obs(cold()), replace(SPEC, prefill_pool=False), None).state.cap_tokens == \
        pytest.approx(20000 / 18)
