"""The autoscaler loop's pure helpers (tables) and its plumbing with an in-memory Kubernetes.

The policy is replaced by a scripted ``decide`` here: these tests check what the loop does with a
decision (scale subresource, limits PUTs, status merge patches, Events, resuming PolicyState), not
the decision itself (tests/autoscaler/test_autoscaler_policy.py). Metrics come from a real worker registry.
"""
from __future__ import annotations

import asyncio
import dataclasses

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
    assert ready == [loop.ReadyPod("b-ready", "uid-b-ready", "10.244.0.7", 40.0, 8000, "/metrics")]
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


def _decision(replicas, reason="Steady", limits=None, state=None, ok=True):
    return policy.Decision(
        replicas=replicas, limits=limits if limits is not None else {"p1": policy.Limits(8, 4)},
        reason=reason, message=f"{reason} with numbers", state=state or policy.PolicyState(),
        conditions={"MetricsAvailable": (ok, "Scraped" if ok else "PodsUnreachable", ""),
                    "ScalingActive": (True, "Active", ""), "AbleToScale": (True, "Ready", "")})


def test_autoscaler_status_records_only_changes_and_caps_history():
    s = loop.autoscaler_status(None, _decision(2, "ScaleUpGoodput"), current_replicas=1, now=NOW)
    assert s["desiredReplicas"] == 2 and s["lastScaleTime"] == T(NOW)
    assert s["decisions"] == [{"time": T(NOW), "replicas": 2, "reason": "ScaleUpGoodput", "maxNumSeqs": 8,
                               "maxWaiting": 4, "message": "ScaleUpGoodput with numbers"}]
    same = loop.autoscaler_status(s, _decision(2, "ScaleUpGoodput"), current_replicas=2, now=NOW + 5)
    assert same["decisions"] == s["decisions"] and same["lastScaleTime"] == T(NOW)  # nothing new
    assert not loop.changed(s, _decision(2, "ScaleUpGoodput"), 2)
    assert not loop.changed(s, _decision(2, "Steady"), 2)  # a new reason alone: status only, no Event
    assert loop.changed(s, _decision(3, "ScaleUpGoodput"), 2)  # replicas
    assert loop.changed(s, _decision(2, "ScaleUpGoodput", {"p1": policy.Limits(6, 4)}), 2)  # limits
    assert loop.changed(s, _decision(2, "HoldMissingMetrics", ok=False), 2)  # MetricsAvailable flips
    assert loop.changed(None, _decision(2, "Steady"), 2)  # the first decision
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
        self.scales, self.patches, self.events = [], [], []

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

    def event(self, obj, etype, reason, message):
        self.events.append((etype, reason, message))


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
    scaler = loop.Autoscaler(kube, src, http, wall_clock=lambda: NOW)
    return dataclasses.make_dataclass("Rig", ["kube", "scaler", "calls", "script", "puts", "src", "stats"])(
        kube, scaler, calls, script, puts, src, stats)


def test_scale_up_goes_through_scale_subresource_with_status_and_event(rig):
    rig.script.append(_decision(2, "ScaleUpSaturation", state=policy.PolicyState()))
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
    assert "replicas 1 -> 2" in rig.kube.events[0][2]
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
    assert rig.puts == [("10.244.0.7", "Bearer tok", b'{"max_num_seqs":5,"max_waiting":2}')]
    assert rig.kube.events[-1][1] == "Steady" and "maxNumSeqs=5 maxWaiting=2" in rig.kube.events[-1][2]


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
