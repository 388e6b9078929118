"""The autoscaler loop's pure helpers (tables) and its plumbing with an in-memory Kubernetes.

The policy is replaced by a scripted ``decide`` here: these tests check what the loop does with a
decision (scale subresource, limits PUTs, status merge patches, Events, resuming PolicyState), not
the decision itself (tests/autoscaler/test_autoscaler_policy.py). Metrics come from a real worker registry.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

import httpx
import pytest

from goodput.autoscaler import loop, observe, policy
from goodput.worker.metrics import WorkerMetrics
from test_autoscaler_observe import stats as scheduler_stats

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
T = loop.rfc3339


def _pod(name, *, ready=True, ip="10.244.0.7", created=NOW - 100, ready_since=NOW - 40, deleting=False,
         phase="Running"):
    meta = {"name": name, "uid": f"uid-{name}", "creationTimestamp": T(created)}
    if deleting:
        meta["deletionTimestamp"] = T(NOW)
    st = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                          "lastTransitionTime": T(ready_since)}]}
    if ip:
        st["podIP"] = ip
    return {"metadata": meta, "status": st}


def test_classify_pods():
    pods = [_pod("b-ready"), _pod("a-loading", ready=False, created=NOW - 25),
            _pod("c-draining", deleting=True), _pod("d-failed", ready=False, phase="Failed"),
            _pod("e-no-ip", ip=None, created=NOW - 3), _pod("f-future", ready=False, created=NOW + 5)]
    ready, starting = loop.classify_pods(pods, NOW)
    # ready 40 s ago, created 100 s ago: its model load took 60 s
    assert ready == [loop.ReadyPod("b-ready", "uid-b-ready", "10.244.0.7", 40.0, 8000, "/metrics", load_s=60.0)]
    annotated = _pod("g")
    annotated["metadata"]["annotations"] = {"prometheus.io/port": "9100", "prometheus.io/path": "stats"}
    [g], _ = loop.classify_pods([annotated], NOW)
    assert (g.metrics_port, g.metrics_path) == (9100, "/stats")
    assert starting == [policy.StartingPod("a-loading", 25.0), policy.StartingPod("e-no-ip", 3.0),
                        policy.StartingPod("f-future", 0.0)]


MERGE_CASES = {
    "no change": ({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 2}}, {}),
    "scalar changed": ({"a": 1}, {"a": 2}, {"a": 2}),
    "key added": ({"a": 1}, {"a": 1, "n": [1]}, {"n": [1]}),
    "key removed -> null": ({"a": 1, "gone": 3}, {"a": 1}, {"gone": None}),
    "nested removal": ({"s": {"x": 1, "y": 2}}, {"s": {"x": 1}}, {"s": {"y": None}}),
    "list replaced whole": ({"l": [1, 2]}, {"l": [1, 3]}, {"l": [1, 3]}),
    "dict over scalar": ({"s": 1}, {"s": {"x": 1}}, {"s": {"x": 1}}),
}


@pytest.mark.parametrize("case", MERGE_CASES)
def test_merge_diff(case):
    old, new, want = MERGE_CASES[case]
    assert loop.merge_diff(old, new) == want


def _apply_merge_patch(target, patch):  # RFC 7386 reference semantics, to check merge_diff end to end
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _apply_merge_patch(out.get(k), v)
    return out


@pytest.mark.parametrize("case", MERGE_CASES)
def test_merge_diff_applied_gives_new(case):
    old, new, _ = MERGE_CASES[case]
    assert _apply_merge_patch(old, loop.merge_diff(old, new)) == new


def test_conditions_keep_transition_time_while_status_holds():
    prev = [{"type": "MetricsAvailable", "status": "True", "reason": "Scraped", "lastTransitionTime": "old"},
            {"type": "AbleToScale", "status": "True", "reason": "Ready", "lastTransitionTime": "old"}]
    got = loop.conditions_list({"MetricsAvailable": (True, "AllScraped", "3/3 pods"),
                                "ScalingActive": (True, "Active", ""),
                                "AbleToScale": (False, "Cooldown", "2 pods starting")}, prev, "now")
    assert got == [
        {"type": "MetricsAvailable", "status": "True", "reason": "AllScraped", "lastTransitionTime": "old",
         "message": "3/3 pods"},
        {"type": "ScalingActive", "status": "True", "reason": "Active", "lastTransitionTime": "now"},
        {"type": "AbleToScale", "status": "False", "reason": "Cooldown", "lastTransitionTime": "now",
         "message": "2 pods starting"}]


def _decision(replicas, reason="Steady", limits=None, state=None, ok=True, current=1):
    """A policy decision; its message as the policy writes it ("<current> -> <replicas> replicas ...")."""
    return policy.Decision(
        replicas=replicas, limits=limits if limits is not None else {"p1": policy.Limits(8, 4)},
        reason=reason, message=f"{current} -> {replicas} replicas with numbers", state=state or policy.PolicyState(),
        conditions={"MetricsAvailable": (ok, "Scraped" if ok else "PodsUnreachable", ""),
                    "ScalingActive": (True, "Active", ""), "AbleToScale": (True, "Ready", "")})


def test_autoscaler_status_records_only_changes_and_caps_history():
    s = loop.autoscaler_status(None, _decision(2, "ScaleUpGoodput"), current_replicas=1, now=NOW)
    assert s["desiredReplicas"] == 2 and s["lastScaleTime"] == T(NOW)
    assert s["decisions"] == [{"time": T(NOW), "replicas": 2, "reason": "ScaleUpGoodput", "maxNumSeqs": 8,
                               "maxWaiting": 4, "message": "1 -> 2 replicas with numbers"}]
    same = loop.autoscaler_status(s, _decision(2, "ScaleUpGoodput"), current_replicas=2, now=NOW + 5)
    assert same["decisions"] == s["decisions"] and same["lastScaleTime"] == T(NOW)  # nothing new
    cur = s
    for i in range(30):
        cur = loop.autoscaler_status(cur, _decision(2 + i % 2, f"R{i}"), current_replicas=2, now=NOW + i)
    assert len(cur["decisions"]) == 20 and cur["decisions"][-1]["reason"] == "R29"


def test_drop_nulls():
    assert loop.drop_nulls({"a": None, "b": {"c": None, "d": 1}, "l": [None, {"x": None}]}) == \
        {"b": {"d": 1}, "l": [None, {}]}


def test_summarize_limits():
    assert loop.summarize_limits({}) == (None, None)
    assert loop.summarize_limits({"a": policy.Limits(8, 4), "b": policy.Limits(8, 4)}) == (8, 4)
    assert loop.summarize_limits({"a": policy.Limits(8, 2), "b": policy.Limits(6, 4)}) == (6, 2)


# ------------------------------------------------------------------------- loop with fake Kubernetes
class FakeKube:
    def __init__(self, obj, pods):
        self.obj, self.pods = obj, pods
        self.scales, self.patches, self.events, self.annotations = [], [], [], []

    def list_isvcs(self, namespace):
        return [self.obj]

    def list_pods(self, namespace, selector):
        assert selector == "app.kubernetes.io/component=worker,serving.goodput.dev/inferenceservice=svc"
        return self.pods

    def admin_token(self, namespace, name):
        return "tok"

    def scale(self, namespace, name, replicas):
        self.scales.append(replicas)
        self.obj["spec"]["replicas"] = replicas

    def patch_status(self, namespace, name, patch):
        self.patches.append(patch)
        status = self.obj.setdefault("status", {})
        for k, v in patch.items():
            status[k] = _apply_merge_patch(status.get(k), v)

    def event(self, obj, etype, reason, message, series_key=None):
        self.events.append((etype, reason, message))

    def annotate_pod(self, namespace, name, annotations):
        self.annotations.append((name, annotations))


class TextSource:
    """Samples from a real worker registry's text, one pod."""

    def __init__(self, wm):
        self.wm, self.t, self.fail = wm, 0.0, False

    async def samples(self, namespace, pods):
        self.t += 5.0
        if self.fail:
            return {p.name: httpx.ConnectTimeout("timed out") for p in pods}
        return {p.name: observe.parse_sample(self.wm.render().decode(), self.t) for p in pods}


@pytest.fixture
def rig(monkeypatch):
    stats = {"s": scheduler_stats(max_num_seqs=8, max_waiting=4)}
    wm = WorkerMetrics("smollm2", lambda: stats["s"])
    obj = {"metadata": {"name": "svc", "namespace": "ns", "uid": "u1"},
           "spec": {"replicas": 1, "autoscaling": {"enabled": True, "maxReplicas": 3}}}
    kube = FakeKube(obj, [_pod("p1")])
    calls, script = [], []

    def decide(now, obs, spec, state):
        calls.append((now, obs, spec, state))
        return script.pop(0)

    monkeypatch.setattr(policy, "decide", decide)
    puts = []

    def handler(request: httpx.Request):
        puts.append((request.url.host, request.headers["authorization"], request.content))
        return httpx.Response(200, json={})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    src = TextSource(wm)
    # the fake pods never turn unready by themselves: a scale-in does not wait for them
    scaler = loop.Autoscaler(kube, src, http, wall_clock=lambda: NOW, drain_unready_wait_s=0.0)
    return dataclasses.make_dataclass("Rig", ["kube", "scaler", "calls", "script", "puts", "src", "stats"])(
        kube, scaler, calls, script, puts, src, stats)


def test_scale_up_goes_through_scale_subresource_with_status_and_event(rig, caplog):
    rig.script.append(_decision(2, "ScaleUpSaturation", state=policy.PolicyState()))
    with caplog.at_level(logging.INFO, logger="goodput.autoscaler"):
        asyncio.run(rig.scaler.tick())
    _, obs, spec, state = rig.calls[0]
    assert state is None and obs.current_replicas == 1 and [p.name for p in obs.ready] == ["p1"]
    assert obs.ready[0].interval_s == 0.0 and obs.unreachable == () and obs.starting == ()
    assert spec.max_replicas == 3
    assert rig.kube.scales == [2]
    [patch] = rig.kube.patches
    assert patch["autoscaler"]["desiredReplicas"] == 2 and patch["autoscaler"]["decisions"][-1]["reason"] == \
        "ScaleUpSaturation"
    assert patch["admission"]["maxNumSeqs"] == 8 and patch["admission"]["maxWaiting"] == 4
    assert [(e[0], e[1]) for e in rig.kube.events] == [("Normal", "ScaleUpSaturation")]
    applied = "1 -> 2 replicas with numbers; limits max_num_seqs 8 max_waiting 4 (1 pod)"
    assert rig.kube.events[0][2] == applied
    # the log line names the reason once, then what was done
    assert "ns/svc: ScaleUpSaturation: " + applied in [r.getMessage() for r in caplog.records]
    assert rig.puts == []  # the pod already has limits 8/4: nothing to PUT


def test_steady_writes_nothing_new_and_limits_change_is_put_with_the_token(rig):
    rig.script += [_decision(1, "Steady"), _decision(1, "Steady"), _decision(1, "Steady", {"p1": policy.Limits(5, 2)})]
    asyncio.run(rig.scaler.tick())
    n_patches, n_events = len(rig.kube.patches), len(rig.kube.events)
    asyncio.run(rig.scaler.tick())
    assert rig.kube.scales == [] and len(rig.kube.events) == n_events
    assert len(rig.kube.patches) == n_patches  # identical decision: no status write
    assert rig.calls[1][1].ready[0].interval_s == 5.0  # second scrape: a real interval
    asyncio.run(rig.scaler.tick())
    assert rig.puts == [("10.244.0.7", "Bearer tok", b'{"max_num_seqs":5,"max_waiting":2,"max_waiting_tokens":0}')]
    assert rig.kube.events[-1][1] == "AdmissionLimits" and "maxNumSeqs=5 maxWaiting=2" in rig.kube.events[-1][2]


def test_policy_state_resumes_from_status(rig):
    st = policy.PolicyState()
    rig.script += [_decision(1, "Steady", state=st), _decision(1, "Steady", state=st)]
    asyncio.run(rig.scaler.tick())
    stored = rig.kube.obj["status"]["autoscaler"]["policyState"]
    assert stored == loop.drop_nulls(st.to_dict()) and None not in stored.values()
    # a new autoscaler process (no memory) reads the state back from status
    fresh = loop.Autoscaler(rig.kube, rig.src, rig.scaler.http, wall_clock=lambda: NOW + 5)
    asyncio.run(fresh.tick())
    assert rig.calls[1][3] == policy.PolicyState.from_dict(stored)


def test_unreachable_pod_is_reported_not_observed(rig):
    rig.src.fail = True
    rig.script.append(_decision(1, "HoldMissingMetrics", ok=False))
    asyncio.run(rig.scaler.tick())
    obs = rig.calls[0][1]
    assert obs.ready == () and obs.unreachable == ("p1",)
    assert rig.kube.events[-1][0] == "Warning"
    assert rig.kube.obj["status"]["autoscaler"]["conditions"][0]["status"] == "False"


def test_failed_scale_is_able_to_scale_false(rig):
    def refuse(*a):
        raise RuntimeError("403 forbidden")
    rig.kube.scale = refuse
    rig.script.append(_decision(3, "ScaleUpGoodput"))
    asyncio.run(rig.scaler.tick())
    cond = {c["type"]: c for c in rig.kube.obj["status"]["autoscaler"]["conditions"]}
    assert cond["AbleToScale"]["status"] == "False" and cond["AbleToScale"]["reason"] == "FailedUpdateScale"
    assert rig.kube.events[-1][:2] == ("Warning", "FailedUpdateScale")
    assert rig.kube.obj["spec"]["replicas"] == 1


def test_disabled_or_invalid_services_are_left_alone(rig):
    rig.kube.obj["spec"]["autoscaling"]["enabled"] = False
    assert asyncio.run(rig.scaler.tick()) == {}
    rig.kube.obj["spec"]["autoscaling"]["enabled"] = True
    rig.kube.obj["spec"]["replicas"] = -3  # not a valid spec
    assert asyncio.run(rig.scaler.tick()) == {}
    rig.kube.obj["spec"]["replicas"] = 1
    rig.kube.obj["spec"]["autoscaling"].update(minReplicas=3, maxReplicas=2)  # the policy refuses it
    assert asyncio.run(rig.scaler.tick()) == {}
    assert rig.calls == [] and rig.kube.patches == []


def test_dry_run_decides_and_writes_nothing(rig):
    rig.scaler.dry_run = True
    rig.script.append(_decision(3, "ScaleUpGoodput", {"p1": policy.Limits(2, 1)}))
    decisions = asyncio.run(rig.scaler.tick())
    assert decisions[("ns", "svc")].replicas == 3
    assert (rig.kube.scales, rig.kube.patches, rig.kube.events, rig.puts) == ([], [], [], [])


# ------------------------------------------------------------------ engine bounds, Events, scale-in
def test_spec_engine_limits_bound_the_pushed_limits(rig):
    # crds/examples/local.yaml sets maxWaiting 8: the autoscaler tunes below it, never above
    rig.kube.obj["spec"]["engine"] = {"maxNumSeqs": 4, "maxWaiting": 8}
    rig.script.append(_decision(1, "Steady", {"p1": policy.Limits(64, 1024)}))
    decided = asyncio.run(rig.scaler.tick())
    assert rig.puts == [("10.244.0.7", "Bearer tok", b'{"max_num_seqs":4,"max_waiting":8,"max_waiting_tokens":0}')]
    adm = rig.kube.obj["status"]["admission"]
    assert (adm["maxNumSeqs"], adm["maxWaiting"]) == (4, 8)
    # every message (status record, --once output) says the limits in force, not the policy's 64/1024
    applied = "1 -> 1 replicas with numbers; limits max_num_seqs 4 max_waiting 8 (1 pod)"
    assert rig.kube.obj["status"]["autoscaler"]["decisions"][-1]["message"] == applied
    assert decided[("ns", "svc")].message == applied


def test_spec_token_limit_bounds_the_policy_token_limit_and_stands_in_when_it_has_none(rig):
    rig.kube.obj["spec"]["engine"] = {"maxWaitingTokens": 6000}
    rig.script.append(_decision(1, "Steady", {"p1": policy.Limits(64, 1024, 9000)}))
    asyncio.run(rig.scaler.tick())
    assert rig.puts[-1][2] == b'{"max_num_seqs":64,"max_waiting":1024,"max_waiting_tokens":6000}'
    assert loop.bound_limits({"p": policy.Limits(8, 4, 0)}, policy.Limits(9, 9, 6000))["p"] == \
        policy.Limits(8, 4, 6000)     # the policy sets no token bound: the user's stands
    assert loop.bound_limits({"p": policy.Limits(8, 4, 5000)}, policy.Limits(9, 9, 0))["p"] == \
        policy.Limits(8, 4, 5000)     # the user set none: the policy's
    assert rig.kube.obj["status"]["autoscaler"]["decisions"][-1]["message"].endswith(
        "limits max_num_seqs 64 max_waiting 1024 max_waiting_tokens 6000 (1 pod)")


@pytest.mark.parametrize("scraped, want, in_force", [
    ((8, 4, 9000), (8, 4, 9000), True),
    ((8, 4, 9500), (8, 4, 9000), True),      # within 10 % of 9000: not pushed again
    ((8, 4, 10000), (8, 4, 9000), False),    # 1000 > 900
    ((8, 4, 0), (8, 4, 9000), False),        # no bound where one is wanted
    ((8, 4, 9000), (8, 4, 0), False),        # a bound where none is wanted
    ((8, 5, 9000), (8, 4, 9000), False),
    ((8, 4, None), (8, 4, 0), True),         # a worker that exports no token limit has none
])
def test_limits_in_force(scraped, want, in_force):
    gauges = {"max_num_seqs": scraped[0], "max_waiting": scraped[1]}
    if scraped[2] is not None:
        gauges["max_waiting_tokens"] = scraped[2]
    sample = observe.PodSample(0.0, gauges, {}, {})
    assert loop.limits_in_force(sample, policy.Limits(*want)) is in_force


class FakeEvents:
    """The core/v1 Event resource as the API server behaves for these calls: create (409 on a
    taken name), get, merge patch."""

    def __init__(self):
        self.items, self.n = {}, 0

    def create(self, namespace, body):
        from kubernetes.client.exceptions import ApiException
        body = dict(body, metadata=dict(body["metadata"]))
        if "name" not in body["metadata"]:
            self.n += 1
            body["metadata"]["name"] = body["metadata"].pop("generateName") + str(self.n)
        if body["metadata"]["name"] in self.items:
            raise ApiException(status=409, reason="AlreadyExists")
        self.items[body["metadata"]["name"]] = body

    def get(self, name, namespace):
        item = self.items[name]
        return type("R", (), {"to_dict": lambda self: item})()

    def patch(self, name, namespace, body, content_type):
        self.items[name].update(body)


def test_limit_changes_are_one_event_series_and_the_first_scrape_warns_nothing(rig):
    from goodput import kube as kube_mod
    events = FakeEvents()
    recorder = kube_mod.EventRecorder(events, loop.COMPONENT, clock=lambda: NOW)
    rig.kube.event = lambda obj, etype, reason, message, series_key=None: recorder.record(
        {"apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService", "metadata": obj["metadata"]},
        etype, reason, message, series_key)
    # a new service: the first pass has no rates yet (MetricsAvailable False, nothing unreachable)
    first = _decision(1, "HoldMissingMetrics", ok=False)
    # then max_waiting follows the load: 11 changes (the reported churn: 11 Events in 75 s)
    rig.script += [first] + [_decision(1, "Steady", {"p1": policy.Limits(8, 4 + i)}) for i in range(1, 12)]
    for _ in range(12):
        asyncio.run(rig.scaler.tick())
    assert [e["type"] for e in events.items.values()].count("Warning") == 0
    limits = [e for e in events.items.values() if e["reason"] == "AdmissionLimits"]
    assert len(limits) == 1 and limits[0]["count"] == 11
    assert limits[0]["message"] == "limits maxNumSeqs=8 maxWaiting=15"
    # MetricsAvailable False -> True after the first scrape is not news either (no Event at all)
    assert len(events.items) == 1


def test_a_restarted_recorder_continues_the_series():
    from goodput import kube as kube_mod
    events = FakeEvents()
    obj = {"apiVersion": "v1", "kind": "X", "metadata": {"name": "svc", "namespace": "ns", "uid": "u"}}
    kube_mod.EventRecorder(events, "c", clock=lambda: NOW).record(obj, "Normal", "R", "one", "k")
    kube_mod.EventRecorder(events, "c", clock=lambda: NOW + 60).record(obj, "Normal", "R", "two", "k")
    [e] = events.items.values()
    assert (e["count"], e["message"], e["firstTimestamp"], e["lastTimestamp"]) == (
        2, "two", T(NOW), T(NOW + 60))


def test_scale_in_annotates_and_drains_the_pod_before_lowering_replicas(rig):
    order = []
    rig.kube.pods = [_pod("p1", ip="10.244.0.7"), _pod("p2", ip="10.244.0.8")]
    rig.kube.obj["spec"]["replicas"] = 2
    rig.kube.annotate_pod = lambda ns, name, ann: order.append(("annotate", name, ann))
    scale = rig.kube.scale
    rig.kube.scale = lambda ns, name, n: (order.append(("scale", n)), scale(ns, name, n))

    def handler(request: httpx.Request):
        order.append((request.method, request.url.host, request.url.path, request.headers["authorization"]))
        return httpx.Response(200, json={})
    rig.scaler.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    # p1 and p2 serve the same text (one registry): the tie goes by name
    rig.script.append(_decision(1, "ScaleDown", {"p1": policy.Limits(8, 4), "p2": policy.Limits(8, 4)}))
    asyncio.run(rig.scaler.tick())
    assert order == [
        ("annotate", "p1", {"serving.goodput.dev/draining": "true",
                            "controller.kubernetes.io/pod-deletion-cost": "-1000"}),
        ("POST", "10.244.0.7", "/admin/drain", "Bearer tok"),
        ("scale", 1)]


def test_scale_in_lowers_replicas_only_once_the_drained_pod_is_unready(rig):
    """The ReplicaSet deletes unready pods first (Kubernetes < 1.22 has no pod-deletion-cost): the
    replicas go down only after the API reports the drained pod unready (here: 2 lists later)."""
    order = []
    rig.kube.pods = [_pod("p1", ip="10.244.0.7"), _pod("p2", ip="10.244.0.8")]
    rig.kube.obj["spec"]["replicas"] = 2
    rig.kube.annotate_pod = lambda ns, name, ann: order.append(("annotate", name))
    lists = {"n": 0}
    list_pods = rig.kube.list_pods

    def listed(ns, selector):
        if ("POST", "/admin/drain") in order:
            lists["n"] += 1
            if lists["n"] == 2:  # the kubelet's readiness probe saw /ready 503
                rig.kube.pods[0] = _pod("p1", ready=False, ip="10.244.0.7")
        return list_pods(ns, selector)
    rig.kube.list_pods = listed
    scale = rig.kube.scale
    rig.kube.scale = lambda ns, name, n: (order.append(("scale", n, rig.kube.pods[0]["status"]["conditions"][0]
                                                         ["status"])), scale(ns, name, n))

    def handler(request: httpx.Request):
        order.append((request.method, request.url.path))
        return httpx.Response(200, json={})
    rig.scaler.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    rig.scaler.drain_unready_wait_s = 60.0
    rig.script.append(_decision(1, "ScaleDown", {"p1": policy.Limits(8, 4), "p2": policy.Limits(8, 4)}))
    asyncio.run(rig.scaler.tick())
    assert order == [("annotate", "p1"), ("POST", "/admin/drain"), ("scale", 1, "False")]
    assert lists["n"] == 2


def test_refused_scale_in_undoes_the_drain(rig):
    order = []
    rig.kube.pods = [_pod("p1", ip="10.244.0.7"), _pod("p2", ip="10.244.0.8")]
    rig.kube.obj["spec"]["replicas"] = 2
    rig.kube.annotate_pod = lambda ns, name, ann: order.append(("annotate", name, tuple(ann.values())))

    def refuse(*a):
        raise RuntimeError("403 forbidden")
    rig.kube.scale = refuse

    def handler(request: httpx.Request):
        order.append((request.method, request.url.path))
        return httpx.Response(200, json={})
    rig.scaler.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    rig.script.append(_decision(1, "ScaleDown", {"p1": policy.Limits(8, 4), "p2": policy.Limits(8, 4)}))
    asyncio.run(rig.scaler.tick())
    assert order == [("annotate", "p1", ("true", "-1000")), ("POST", "/admin/drain"),
                     ("annotate", "p1", (None, None)), ("DELETE", "/admin/drain")]
    assert rig.kube.events[-1][:2] == ("Warning", "FailedUpdateScale")


def test_a_standby_decides_and_writes_nothing_until_it_leads(rig):
    rig.scaler.period_s = 0.001
    stop, calls = asyncio.Event(), []

    def leading():
        calls.append(1)
        if len(calls) == 4:
            stop.set()
        return len(calls) == 3      # standby for two passes, leader for one, standby again
    rig.script.append(_decision(1, "Steady"))
    asyncio.run(rig.scaler.run(stop, leading=leading))
    assert len(rig.calls) == 1 and rig.kube.patches    # one pass as leader: decided and wrote
