"""The autoscaler's plan (pure): what one decision writes — scale target, drains, limit pushes,
status patch, Events — as tables with hand-written expectations.

Each case: the status stored before, the spec's engine limits, the pods as observed (scraped limits
and in-flight work), the decision; expected: what ``loop.make_plan`` returns.
"""
from __future__ import annotations

import pytest

from goodput.autoscaler import loop, observe, policy
from goodput.api import crd as api

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
TS = "2027-01-15T08:00:00Z"
OK = {"MetricsAvailable": (True, "MetricsScraped", "2 ready pod(s) scraped"),
      "ScalingActive": (True, "ValidMetricFound", "replicas between 1 and 4"),
      "AbleToScale": (True, "ReadyForNewScale", "m")}
STORED_OK = [{"type": t, "status": "True", "reason": r, "lastTransitionTime": "old"} for t, (_, r, _) in OK.items()]


def pod(name, ip):
    return loop.ReadyPod(name, f"uid-{name}", ip, 100.0)


def sample(running=0, waiting=0, seqs=8, mw=16):
    return observe.PodSample(time=0.0, gauges={"running": running, "waiting": waiting, "kv_usage": 0.1,
                                               "max_num_seqs": seqs, "max_waiting": mw},
                             counters={}, histograms={})


def seen(samples, hits=None, starting=0, draining=()):
    ready = tuple(pod(n, f"10.244.0.{i + 1}") for i, n in enumerate(samples))
    unreachable = tuple(n for n, s in samples.items() if not isinstance(s, observe.PodSample))
    obs = policy.Observation(ready=(), starting=tuple(policy.StartingPod(f"s{i}", 1.0) for i in range(starting)),
                             unreachable=unreachable, current_replicas=0)
    return loop.Observed(ready, obs.starting, tuple(draining), samples, obs, hits or {})


def decision(replicas, limits, reason="Steady", conditions=OK, current=None):
    """A policy decision; its message as the policy writes it ("<current> -> <replicas> replicas ...")."""
    msg = f"{replicas if current is None else current} -> {replicas} replicas because"
    return policy.Decision(replicas=replicas, limits=limits, reason=reason, message=msg,
                           conditions=dict(conditions), state=policy.PolicyState())


def spec(replicas, **engine):
    return api.InferenceServiceSpec.model_validate({"model": {"name": "m"}, "replicas": replicas, "engine": engine})


L = policy.Limits


def test_steady_with_limits_in_force_writes_nothing_but_the_first_record():
    stored = {"autoscaler": {"conditions": STORED_OK, "decisions": [
        {"time": "old", "replicas": 2, "reason": "Steady", "maxNumSeqs": 8, "maxWaiting": 16,
         "message": "2 -> 2 replicas because; limits max_num_seqs 8 max_waiting 16 (2 pods)"}],
        "desiredReplicas": 2, "policyState": {},
        "lastDecisionTime": "old"}, "admission": {"maxNumSeqs": 8, "maxWaiting": 16}}
    stored["autoscaler"]["policyState"] = loop.drop_nulls(policy.PolicyState().to_dict())
    for c in stored["autoscaler"]["conditions"]:
        c["message"] = OK[c["type"]][2]
    p = loop.make_plan(stored, spec(2), seen({"a": sample(), "b": sample()}),
                       decision(2, {"a": L(8, 16), "b": L(8, 16)}), NOW)
    assert p == loop.Plan(scale_to=None, drain=(), undrain=(), pushes=(), status_patch={}, events=(),
                          limits={"a": L(8, 16), "b": L(8, 16)},
                          message="2 -> 2 replicas because; limits max_num_seqs 8 max_waiting 16 (2 pods)")


def test_scale_up_pushes_changed_limits_and_posts_one_event():
    p = loop.make_plan({}, spec(1), seen({"a": sample(seqs=8, mw=16)}),
                       decision(3, {"a": L(12, 16)}, "ScaleUpGoodput", current=1), NOW)
    assert p.scale_to == 3 and p.drain == ()
    assert p.pushes == (loop.LimitPush(pod("a", "10.244.0.1"), L(12, 16)),)
    assert p.status_patch["admission"] == {"maxNumSeqs": 12, "maxWaiting": 16, "updatedAt": TS}
    a = p.status_patch["autoscaler"]
    assert (a["desiredReplicas"], a["lastScaleTime"], a["decisions"][-1]["replicas"]) == (3, TS, 3)
    # the first decision: no condition existed before, so none flips; no earlier limits to change from
    # the message says the transition and the limits once; the reason is the Event's reason, not repeated
    assert p.events == (loop.EventSpec("Normal", "ScaleUpGoodput", "1 -> 3 replicas because; limits max_num_seqs 12 "
                                                                   "max_waiting 16 (1 pod)"),)


# (limits decided, spec engine limits, limits expected on the pod and in status.admission)
BOUND_CASES = {
    "no engine limits: the decision": ((64, 1024), {}, (64, 1024)),
    "maxWaiting 8 (crds/examples/local.yaml) bounds the queue": ((4, 1024), {"maxWaiting": 8}, (4, 8)),
    "maxNumSeqs 4 bounds the batch": ((64, 20), {"maxNumSeqs": 4}, (4, 20)),
    "both, decision below both": ((2, 5), {"maxNumSeqs": 4, "maxWaiting": 8}, (2, 5)),
    "both bound": ((64, 1024), {"maxNumSeqs": 4, "maxWaiting": 8}, (4, 8)),
}


@pytest.mark.parametrize("case", BOUND_CASES)
def test_spec_engine_limits_are_upper_bounds(case):
    decided, engine, want = BOUND_CASES[case]
    p = loop.make_plan({}, spec(1, **engine), seen({"a": sample(seqs=1, mw=1)}), decision(1, {"a": L(*decided)}), NOW)
    assert p.limits == {"a": L(*want)}
    assert [(u.pod.name, u.limits) for u in p.pushes] == [("a", L(*want))]
    assert (p.status_patch["admission"]["maxNumSeqs"], p.status_patch["admission"]["maxWaiting"]) == want
    assert (p.status_patch["autoscaler"]["decisions"][-1]["maxNumSeqs"],
            p.status_patch["autoscaler"]["decisions"][-1]["maxWaiting"]) == want
    # the message reports the limits in force (after the bounds), not the policy's
    applied = f"1 -> 1 replicas because; limits max_num_seqs {want[0]} max_waiting {want[1]} (1 pod)"
    assert p.message == applied and p.status_patch["autoscaler"]["decisions"][-1]["message"] == applied


def test_decision_message_states_the_limits_in_force():
    assert loop.decision_message("2 -> 2 replicas", {"a": L(4, 6), "b": L(8, 4)}) == \
        "2 -> 2 replicas; limits max_num_seqs 4..8 max_waiting 4..6 (2 pods)"
    assert loop.decision_message("1 -> 0 replicas", {}) == "1 -> 0 replicas; no ready pod to limit"


# (candidates (name, in_flight, prefix hits), k, expected names)
DRAIN_CASES = {
    "least in flight": ([("a", 5, 0), ("b", 1, 0), ("c", 3, 0)], 1, ["b"]),
    "two least": ([("a", 5, 0), ("b", 1, 0), ("c", 3, 0)], 2, ["b", "c"]),
    "tie: least prefix hits": ([("a", 2, 900.0), ("b", 2, 10.0), ("c", 4, 0.0)], 1, ["b"]),
    "tie on both: by name": ([("b", 0, 0.0), ("a", 0, 0.0)], 1, ["a"]),
    "unscraped last": ([("a", None, 0.0), ("b", 40, 0.0)], 1, ["b"]),
    "k beyond the pods": ([("a", 1, 0.0)], 3, ["a"]),
    "k 0": ([("a", 1, 0.0)], 0, []),
}


@pytest.mark.parametrize("case", DRAIN_CASES)
def test_pick_drain(case):
    cands, k, want = DRAIN_CASES[case]
    assert loop.pick_drain([loop.DrainCandidate(*c) for c in cands], k) == want


def test_scale_in_drains_the_least_loaded_ready_pod():
    s = seen({"a": sample(running=3, waiting=1), "b": sample(running=1), "c": sample(running=1)},
             hits={"a": 0.0, "b": 500.0, "c": 20.0})
    p = loop.make_plan({}, spec(3), s, decision(2, {n: L(8, 16) for n in "abc"}, "ScaleDown"), NOW)
    assert p.scale_to == 2 and [d.name for d in p.drain] == ["c"]    # b and c carry 1; c hit the cache less


def test_scale_in_with_pods_starting_drains_only_the_ready_excess():
    # replicas 4 -> 3 with 2 ready and 2 starting: the ReplicaSet removes a starting pod first
    s = seen({"a": sample(), "b": sample()}, starting=2)
    assert loop.make_plan({}, spec(4), s, decision(3, {}, "ScaleDown"), NOW).drain == ()
    # 3 -> 1 with 3 ready: two go
    s = seen({"a": sample(running=1), "b": sample(running=2), "c": sample()})
    assert [d.name for d in loop.make_plan({}, spec(3), s, decision(1, {}, "ScaleDown"), NOW).drain] == ["c", "a"]


def test_draining_pod_is_undrained_when_no_scale_in_will_remove_it():
    # one drained pod left over (replicas went 2 -> 1 -> 2 before the ReplicaSet removed it)
    s = seen({"a": sample()}, draining=(("b", "10.244.0.9"),))
    assert loop.make_plan({}, spec(2), s, decision(2, {}), NOW).undrain == (("b", "10.244.0.9"),)
    # still on its way out (2 pods for 1 replica): left alone
    assert loop.make_plan({}, spec(1), s, decision(1, {}), NOW).undrain == ()


def test_refused_scale_is_planned_as_able_to_scale_false_without_drains():
    s = seen({"a": sample(), "b": sample()})
    p = loop.make_plan({"autoscaler": {"conditions": STORED_OK}}, spec(2), s,
                       decision(1, {"a": L(8, 16), "b": L(8, 16)}, "ScaleDown"), NOW, scale_error="403 forbidden")
    assert (p.scale_to, p.drain) == (None, ())
    cond = {c["type"]: c for c in p.status_patch["autoscaler"]["conditions"]}
    assert (cond["AbleToScale"]["status"], cond["AbleToScale"]["reason"]) == ("False", "FailedUpdateScale")
    assert "lastScaleTime" not in p.status_patch["autoscaler"]
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "FailedUpdateScale")]


def test_first_scrape_is_awaiting_rates_in_status_not_missing_metrics():
    d = decision(1, {"a": L(8, 16)}, "HoldMissingMetrics",
                 dict(OK, MetricsAvailable=(False, "MetricsMissing", "first scrape of every ready pod")))
    p = loop.make_plan({}, spec(1), seen({"a": sample()}), d, NOW)
    [c] = [c for c in p.status_patch["autoscaler"]["conditions"] if c["type"] == "MetricsAvailable"]
    assert (c["status"], c["reason"]) == ("False", "AwaitingRates") and p.events == ()
    p = loop.make_plan({}, spec(1), seen({"a": RuntimeError("reset")}), d, NOW)
    [c] = [c for c in p.status_patch["autoscaler"]["conditions"] if c["type"] == "MetricsAvailable"]
    assert (c["status"], c["reason"]) == ("False", "MetricsMissing")
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "MetricsMissing")]


def test_router_max_queued_goes_to_status_admission():
    d = decision(1, {"a": L(8, 16)})
    object.__setattr__(d, "router_max_queued", 40)
    p = loop.make_plan({"admission": {"maxNumSeqs": 8, "maxWaiting": 16}}, spec(1), seen({"a": sample()}), d, NOW)
    assert p.status_patch["admission"] == {"routerMaxQueued": 40, "updatedAt": TS}


@pytest.mark.parametrize("old, tokens, written", [
    ({}, (0, 0), None),                              # none before, none now: nothing to write
    ({}, (9000, 9400), 9000),                        # the smallest of the pods' limits
    ({"maxWaitingTokens": 9000}, (9800, 9800), None),    # 800 <= 10 % of 9,800: not rewritten
    ({"maxWaitingTokens": 9000}, (10100, 10200), 10100),  # 1,100 > 10 % of 10,100
    ({"maxWaitingTokens": 9000}, (0, 0), 0),         # the bound is gone
])
def test_status_admission_token_limit(old, tokens, written):
    limits = {"a": L(8, 16, tokens[0]), "b": L(8, 16, tokens[1])}
    adm = loop.admission_patch({"maxNumSeqs": 8, "maxWaiting": 16, **old}, limits, None)
    assert adm.get("maxWaitingTokens") == written and ("maxWaitingTokens" in adm) == (written is not None)


# ---------------------------------------------------------------------------------------- Events
def _cond(metrics_ok, able_ok=True, able_reason="ReadyForNewScale", missing="MetricsMissing"):
    return {"MetricsAvailable": (metrics_ok, "MetricsScraped" if metrics_ok else missing, "x"),
            "ScalingActive": (True, "ValidMetricFound", "y"),
            "AbleToScale": (able_ok, able_reason, "z")}


def _stored(metrics="True", able="True", limits=(8, 16), reason="MetricsScraped"):
    return {"conditions": [{"type": "MetricsAvailable", "status": metrics, "reason": reason}, {"type": "ScalingActive", "status": "True"},
                           {"type": "AbleToScale", "status": able}],
            "decisions": [{"replicas": 2, "maxNumSeqs": limits[0], "maxWaiting": limits[1]}]}


E = loop.EventSpec
# (stored status.autoscaler, decided replicas, conditions, limits, unreachable pods, expected events)
EVENT_CASES = {
    "nothing new": (_stored(), 2, _cond(True), (8, 16), (), []),
    "first decision, first scrape: nothing (no warning)": ({}, 2, _cond(False, missing="AwaitingRates"),
                                                            (8, 16), (), []),
    "restart/new leader, first scrape: nothing": (_stored(), 2, _cond(False, missing="AwaitingRates"), (8, 16),
                                                  (), []),
    "rates arrive after the first scrape: nothing": (_stored("False", reason="AwaitingRates"), 2, _cond(True),
                                                     (8, 16), (), []),
    "first decision, a pod cannot be scraped: warning": (
        {}, 2, _cond(False), (8, 16), ("p",), [E("Warning", "MetricsMissing", "MetricsAvailable False: x",
                                                 "MetricsAvailable=False")]),
    "scrape fails later: warning": (
        _stored(), 2, _cond(False), (8, 16), ("p",), [E("Warning", "MetricsMissing", "MetricsAvailable False: x",
                                                        "MetricsAvailable=False")]),
    "still failing: nothing more": (_stored(metrics="False", reason="MetricsMissing"), 2, _cond(False), (8, 16), ("p",), []),
    "metrics back: normal": (_stored(metrics="False", reason="MetricsMissing"), 2, _cond(True), (8, 16), (),
                             [E("Normal", "MetricsScraped", "MetricsAvailable True: x", "MetricsAvailable=True")]),
    "replicas change": (_stored(), 3, _cond(True), (8, 16), (),
                        [E("Normal", "Steady", "2 -> 3 replicas because")]),
    "limits change: one series": (_stored(), 2, _cond(True), (8, 12), (),
                                  [E("Normal", "AdmissionLimits", "limits maxNumSeqs=8 maxWaiting=12",
                                     "AdmissionLimits")]),
    "holding flips AbleToScale: series per status": (
        _stored(), 2, _cond(True, False, "HoldStabilizing"), (8, 16), (),
        [E("Normal", "HoldStabilizing", "AbleToScale False: z", "AbleToScale=False")]),
}


@pytest.mark.parametrize("case", EVENT_CASES)
def test_plan_events(case):
    stored, replicas, conds, limits, unreachable, want = EVENT_CASES[case]
    d = decision(replicas, {"a": L(*limits)}, "Steady", conds, current=2)
    assert loop.plan_events(stored, d, 2, d.limits, unreachable) == want


def test_infeasible_requests_post_one_warning_series_and_count_in_the_metric():
    from dataclasses import replace as _replace

    from goodput.autoscaler.metrics import AutoscalerMetrics
    from goodput.autoscaler import metric_names as names
    d = _replace(decision(2, {"a": L(8, 16)}, "Steady", _cond(True), current=2), infeasible=3.4,
                 capacity_tokens=4800.0)
    ev = loop.plan_events(_stored(), d, 2, d.limits, ())
    # round(3.4) = 3 requests, one Warning in the InfeasibleRequests series
    assert ev == [E("Warning", "InfeasibleRequests",
                    "3 request(s) over the last interval had prompts longer than one idle replica prefills "
                    "within the TTFT SLO (4800 tokens/s per replica); counted as infeasible and left out of "
                    "the sizing", "InfeasibleRequests")]
    assert loop.plan_events(_stored(), _replace(d, infeasible=0.0), 2, d.limits, ()) == []
    m = AutoscalerMetrics()
    m.record("ns", "svc", d, 2, 2, 0)
    m.record("ns", "svc", d, 2, 2, 0)
    labels = {"namespace": "ns", "inferenceservice": "svc"}
    assert m.registry.get_sample_value(names.INFEASIBLE_REQUESTS + "_total", labels) == pytest.approx(6.8)
    assert m.registry.get_sample_value(names.REPLICA_CAPACITY_TOKENS, labels) == 4800.0
