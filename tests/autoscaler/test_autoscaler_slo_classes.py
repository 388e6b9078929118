"""Rule 17 (SLO classes) as table tests: rule 2's TPOT signal from each request's own class, the
growth margins of the strictest class present, rule 5's queue bounded by the strictest class
present; and the per-class counters read from a real worker registry by observe. Every expected
value is computed by hand in the comment beside it; a spec without classes decides bit for bit
as before."""
from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from goodput.api.policy import PolicySpec, SloClass
from goodput.autoscaler import observe
from goodput.autoscaler import policy as P
from goodput.autoscaler.policy import HistogramDelta, Observation, PodObservation, PolicyState, decide
from goodput.worker.metrics import WorkerMetrics

from test_autoscaler_observe import stats
from test_autoscaler_phases import FLEET, SPEC, hist, pod

INF = math.inf
BOUNDS = (0.05, 0.1, 0.2, INF)
# default class: TTFT 1 s, TPOT 100 ms (SPEC); batch: TTFT 5 s, TPOT 400 ms
CSPEC = replace(SPEC, slo_classes=(SloClass("batch", 5.0, 0.4),))


def classed(finished: dict[str, float], tpot_met: dict[str, float], **kw) -> PodObservation:
    return pod(class_finished=finished, class_tpot_met=tpot_met, **kw)


@pytest.mark.parametrize("spec,p,want", [
    # no classes in the spec: the histogram at slo_tpot_s; hist(50, 0.04): all <= 50 ms -> 1.0
    (SPEC, classed({"batch": 50}, {"batch": 0}), 1.0),
    # classes: (27 + 20) / (30 + 20) = 0.94, whatever the histogram says
    (CSPEC, classed({"default": 30, "batch": 20}, {"default": 27, "batch": 20}), 0.94),
    # classes, but the pod has no per-class counters (an older worker): the histogram
    (CSPEC, pod(tpot=hist(50, 0.15)), 0.0),
    # nothing finished in any class: no evidence
    (CSPEC, classed({"default": 0, "batch": 0}, {"default": 0, "batch": 0}), None),
])
def test_tpot_met_is_each_requests_own_class(spec, p, want):
    got = P.tpot_met(p, spec)
    assert got == pytest.approx(want) if want is not None else got is None


def test_batch_requests_slow_for_the_strict_class_do_not_cut_the_batch():
    # 50 batch requests at TPOT in (100, 200] ms on a pod whose cap binds (running 64 = cap 64)
    slow = HistogramDelta(BOUNDS, (0, 0, 50, 50), 50, 50 * 0.15)
    p = pod(running=64, tpot=slow)
    # no classes: fraction <= 100 ms is 0 < 0.9 -> cut to floor(64 * 0.75) = 48
    assert P.tune_cap(p, 64, SPEC) == 48
    # classes: all 50 met their own 400 ms -> no cut; the strictest class present is batch (400 ms):
    # fraction <= 0.5 * 400 = 200 ms is 1.0 -> fast growth ceil(64 * 1.5) = 96 (KV room
    # floor(64 * 0.8 / 0.3) = 170, bound 256)
    only_batch = replace(p, class_finished={"default": 0, "batch": 50}, class_tpot_met={"default": 0, "batch": 50})
    assert P.strictest_tpot(only_batch, CSPEC) == 0.4
    assert P.tune_cap(only_batch, 64, CSPEC) == 96
    assert P.growth_room(only_batch, 64, CSPEC) == 96
    # 10 default requests missing their 100 ms among 40 batch ones: 40 / 50 = 0.8 < 0.9 -> cut to 48
    mixed = replace(p, class_finished={"default": 10, "batch": 40}, class_tpot_met={"default": 0, "batch": 40})
    assert P.tune_cap(mixed, 64, CSPEC) == 48
    assert P.growth_room(mixed, 64, CSPEC) == 64     # a miss: no room either


def test_a_strict_class_present_holds_the_growth_margins():
    # 5 default requests at <= 50 ms, 45 batch ones in (100, 200] ms: every request met its own TPOT
    h = HistogramDelta(BOUNDS, (5, 5, 50, 50), 50, 5 * 0.04 + 45 * 0.15)
    p = classed({"default": 5, "batch": 45}, {"default": 5, "batch": 45}, running=64, tpot=h)
    assert P.tpot_met(p, CSPEC) == 1.0
    # the strictest class present is default (100 ms): fraction <= 50 ms = 5 / 50 = 0.1, fraction
    # <= 80 ms = 5 / 50 = 0.1 (nothing in (50, 100]) -> neither growth rule: the cap stays 64
    assert P.strictest_tpot(p, CSPEC) == 0.1
    assert P.tune_cap(p, 64, CSPEC) == 64


@pytest.mark.parametrize("pods,spec,want", [
    ([classed({"default": 0, "batch": 10}, {})], CSPEC, ("batch",)),             # only batch finished
    ([classed({"batch": 10, "default": 3}, {})], CSPEC, ("default", "batch")),    # declaration order
    ([classed({"batch": 10}, {}), classed({"default": 1}, {}, name="b")], CSPEC, ("default", "batch")),
    ([classed({"default": 3, "batch": 10}, {})], SPEC, ()),               # no classes declared
    ([classed({"other": 4}, {})], CSPEC, ()),                             # not a declared class
    ([classed({"batch": 10}, {}, interval_s=0.0)], CSPEC, ()),            # a first scrape: no rates
    ([pod()], CSPEC, ()),                                                 # no per-class counters
])
def test_classes_present(pods, spec, want):
    assert P.classes_present(Observation(tuple(pods), (), (), len(pods)), spec) == want


@pytest.mark.parametrize("present,seen,want", [
    (("batch",), {}, 5.0),                      # only batch: its 5 s
    (("default", "batch"), {}, 1.0),            # the strict class is there: 1 s
    (("batch",), {"default": 800.0}, 1.0),      # default finished 200 s ago (< 300 s window): 1 s
    (("batch",), {"default": 600.0}, 5.0),      # 400 s ago: forgotten, 5 s
    ((), {"batch": 900.0}, 5.0),                # nothing finished now, batch seen 100 s ago
    ((), {}, None),                             # no evidence: rule 5 uses slo_ttft_s
])
def test_queue_ttft_is_the_strictest_class_seen_within_a_window(present, seen, want):
    assert P.queue_ttft(1000.0, present, CSPEC, PolicyState(class_seen=seen)) == want
    assert P.queue_ttft(1000.0, present, SPEC, PolicyState(class_seen=seen)) is None   # no classes


def test_the_classes_seen_are_remembered_one_window():
    # call 1 at t=10: both classes finish; call 2 at t=200: only batch; the state keeps default's 10
    both = classed({"default": 5, "batch": 5}, {"default": 5, "batch": 5})
    d1 = decide(10.0, Observation((both,), (), (), 1), CSPEC, PolicyState())
    assert d1.state.class_seen == {"default": 10.0, "batch": 10.0}
    batch = classed({"default": 0, "batch": 5}, {"default": 0, "batch": 5})
    d2 = decide(200.0, Observation((batch,), (), (), 1), CSPEC, d1.state)
    assert d2.state.class_seen == {"default": 10.0, "batch": 200.0}
    # t=320: default last seen 310 s ago > 300 s: dropped
    d3 = decide(320.0, Observation((batch,), (), (), 1), CSPEC, d2.state)
    assert d3.state.class_seen == {"batch": 320.0}
    assert PolicyState.from_dict(d3.state.to_dict()).class_seen == {"batch": 320.0}


def test_queue_limits_use_the_class_budget():
    # FLEET: live capacity 50, service 4 s -> mu 12.5/s; t_first 0.2 s. Batch only (5 s): budget
    # 4.8 s -> k_ttft floor(4.8 * 12.5) = 60; nothing loading: slack 2 -> 120; router
    # floor(4.8 * 12.5 * 3) = 180. Without it (1 s): k 10, 20, 30 (the phase table's numbers).
    q = P.queue_limits(replace(FLEET, queue_ttft_s=5.0), 3, 0, 0, CSPEC, 4.0)
    assert (q.k_ttft, q.max_waiting, q.router_max_queued) == (60, 120, 180)
    q = P.queue_limits(FLEET, 3, 0, 0, CSPEC, 4.0)
    assert (q.k_ttft, q.max_waiting, q.router_max_queued) == (10, 20, 30)
    # in prompt tokens, the same class budget: 5 s x 2,000 tokens/s x 1.25 = 12,500 (1 s: 2,500)
    assert P.queue_limits(replace(FLEET, queue_ttft_s=5.0), 3, 0, 0, CSPEC, 4.0, 2000.0).max_waiting_tokens == 12500
    assert P.queue_limits(FLEET, 3, 0, 0, CSPEC, 4.0, 2000.0).max_waiting_tokens == 2500


def test_a_spec_without_classes_decides_as_before():
    # the same pods with and without per-class counters, a spec without classes: the same decision
    slow = HistogramDelta(BOUNDS, (0, 0, 50, 50), 50, 50 * 0.15)
    plain = [pod("a", running=64, tpot=slow), pod("b")]
    with_counts = [replace(p, class_finished={"default": 50}, class_tpot_met={"default": 50}) for p in plain]
    d1 = decide(10.0, Observation(tuple(plain), (), (), 2), SPEC, PolicyState())
    d2 = decide(10.0, Observation(tuple(with_counts), (), (), 2), SPEC, PolicyState())
    assert (d1.replicas, d1.limits, d1.reason, d1.message, d1.router_max_queued) == \
        (d2.replicas, d2.limits, d2.reason, d2.message, d2.router_max_queued)
    assert d1.limits["a"].max_num_seqs == 48      # the strict-TPOT cut, as before
    # with classes, pod a's requests (default class, counters say met) are not cut
    d3 = decide(10.0, Observation(tuple(with_counts), (), (), 2), replace(SPEC, slo_classes=CSPEC.slo_classes),
                PolicyState())
    assert d3.limits["a"].max_num_seqs == 64


def test_policy_spec_reads_the_classes_from_the_crd():
    spec = PolicySpec.from_crd({"slo": {"ttftMs": 500, "tpotMs": 50, "classes": [
        {"name": "batch", "ttftMs": 5000, "tpotMs": 200}]}})
    assert spec.slo_classes == (SloClass("batch", 5.0, 0.2),)
    assert spec.class_slos() == {"default": (0.5, 0.05), "batch": (5.0, 0.2)}


# ---------------------------------------------------------------------------- observe (per class)
def _request(rid: str, ttft: float, tpot: float) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, ttft=ttft, tpot=tpot, e2e=ttft + 1.0, arrival_time=0.0,
                           prefill_time=ttft, decode_time=1.0, inference_time=ttft + 1.0, num_prompt_tokens=5,
                           num_output_tokens=10, sampling_params=SimpleNamespace(max_tokens=16))


def test_observe_reads_the_per_class_counters_of_a_real_worker():
    wm = WorkerMetrics("m", lambda: stats(), slo_ttft_s=0.5, slo_tpot_s=0.05,
                       slo_classes=(SloClass("batch", 5.0, 0.2),))
    s0 = observe.parse_sample(wm.render().decode(), 0.0)
    wm.assign_class(["b1", "b2"], "batch")
    wm.observe_finished("stop", _request("b1", 1.0, 0.1))     # batch: TPOT 100 <= 200 ms
    wm.observe_finished("stop", _request("b2", 1.0, 0.3))     # batch: TPOT 300 > 200 ms
    wm.observe_finished("stop", _request("d1", 0.1, 0.04))    # default: TPOT 40 <= 50 ms
    s1 = observe.parse_sample(wm.render().decode(), 5.0)
    p = observe.observation("pod", s0, s1)
    assert p.class_finished == {"default": 1.0, "batch": 2.0}
    assert p.class_tpot_met == {"default": 1.0, "batch": 1.0}
    first = observe.observation("pod", None, s0)          # a first scrape: no increases
    assert first.class_finished == {"default": 0.0, "batch": 0.0}
    assert "goodput_requests_tpot_met_by_class_total" in observe.needed_series()


def test_observe_without_per_class_counters_gives_none():
    wm = WorkerMetrics("m", lambda: stats(), slo_ttft_s=0.5, slo_tpot_s=0.05)
    lines = [ln for ln in wm.render().decode().splitlines() if "_by_class" not in ln]
    s0 = observe.parse_sample("\n".join(lines) + "\n", 0.0)      # an older worker: still parses
    s1 = observe.parse_sample("\n".join(lines) + "\n", 5.0)
    p = observe.observation("pod", s0, s1)
    assert p.class_finished is None and p.class_tpot_met is None
