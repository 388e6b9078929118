"""A disaggregated service's two pools, each sized on its own measurements (docs/disaggregation.md):
the workers (decode pool) through the scale subresource, the prefill pool through
spec.disaggregation.prefill.replicas; each with its own policy state, record and Events.

As in test_autoscaler_loop.py the policy is a scripted ``decide``: these tests check what the loop
does with each pool's decision, with an in-memory Kubernetes and a real worker registry's metrics."""
from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from goodput.api import crd
from goodput.api.policy import PolicySpec
from goodput.autoscaler import loop, policy
from goodput.worker.metrics import WorkerMetrics
from test_autoscaler_loop import NOW, TextSource, _apply_merge_patch, _decision, _pod
from test_autoscaler_observe import stats as scheduler_stats

WORKERS_SELECTOR = "app.kubernetes.io/component=worker,serving.goodput.dev/inferenceservice=svc"
PREFILL_SELECTOR = "app.kubernetes.io/component=prefill-worker,serving.goodput.dev/inferenceservice=svc"
SPEC = {"replicas": 2, "engine": {"maxNumSeqs": 16},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6},
        "disaggregation": {"enabled": True, "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3,
                                                        "engine": {"maxNumSeqs": 4}}}}


def _spec(raw=SPEC):
    return crd.InferenceServiceSpec.model_validate(raw)


def test_pools_of_a_colocated_and_a_disaggregated_service():
    assert loop.pools("svc", _spec({"replicas": 3})) == [loop.Pool(loop.WORKERS, WORKERS_SELECTOR, 3)]
    assert loop.pools("svc", _spec()) == [loop.Pool(loop.WORKERS, WORKERS_SELECTOR, 2),
                                          loop.Pool(loop.PREFILL, PREFILL_SELECTOR, 1)]


def test_each_pool_keeps_its_own_bounds_and_the_services_slo():
    spec = _spec()
    pspec = PolicySpec.from_crd(spec.model_dump(by_alias=True))
    workers, prefill = loop.pools("svc", spec)
    assert loop.pool_policy(pspec, spec, workers) is pspec
    p = loop.pool_policy(pspec, spec, prefill)
    assert (p.min_replicas, p.max_replicas) == (1, 3)
    assert (p.slo_ttft_s, p.slo_tpot_s) == (pspec.slo_ttft_s, pspec.slo_tpot_s)
    assert p.prefill_pool and not pspec.prefill_pool     # rule 18 sizes the prefill pool by tokens
    # the limits each pool's pods may be given: its own maxNumSeqs over spec.engine's
    assert loop.engine_bounds(spec, loop.WORKERS).max_num_seqs == 16
    assert loop.engine_bounds(spec, loop.PREFILL).max_num_seqs == 4


def test_records_are_kept_apart():
    status = {"autoscaler": {"desiredReplicas": 2, "prefill": {"desiredReplicas": 1}}}
    workers, prefill = loop.pools("svc", _spec())
    assert loop.pool_record(status, workers) == {"desiredReplicas": 2}
    assert loop.pool_record(status, prefill) == {"desiredReplicas": 1}
    assert loop.pool_record({}, prefill) == {}


class PoolKube:
    """In-memory Kubernetes with a workers pod and a prefill pod."""

    def __init__(self, obj):
        self.obj = obj
        self.pods = {WORKERS_SELECTOR: [_pod("w1", ip="10.244.0.7")], PREFILL_SELECTOR: [_pod("p1", ip="10.244.0.8")]}
        self.scales, self.prefill_scales, self.patches, self.events, self.annotations = [], [], [], [], []

    def list_isvcs(self, namespace):
        return [self.obj]

    def list_pods(self, namespace, selector):
        return self.pods[selector]

    def admin_token(self, namespace, name):
        return "tok"

    def scale(self, namespace, name, replicas):
        self.scales.append(replicas)
        self.obj["spec"]["replicas"] = replicas

    def scale_prefill(self, namespace, name, replicas):
        self.prefill_scales.append(replicas)
        self.obj["spec"]["disaggregation"]["prefill"]["replicas"] = replicas

    def patch_status(self, namespace, name, patch):
        self.patches.append(patch)
        self.obj["status"] = _apply_merge_patch(self.obj.get("status") or {}, patch)

    def event(self, obj, etype, reason, message, series_key=None):
        self.events.append((etype, reason, message))

    def annotate_pod(self, namespace, name, annotations):
        self.annotations.append((name, annotations))


@pytest.fixture
def rig(monkeypatch):
    stats = {"s": scheduler_stats(max_num_seqs=8, max_waiting=4)}
    wm = WorkerMetrics("smollm2", lambda: stats["s"])
    obj = {"metadata": {"name": "svc", "namespace": "ns", "uid": "u1"},
           "spec": {**SPEC, "disaggregation": {**SPEC["disaggregation"],
                                               "prefill": dict(SPEC["disaggregation"]["prefill"])}}}
    kube = PoolKube(obj)
    calls, script = [], []

    def decide(now, obs, spec, state):
        calls.append((obs, spec, state))
        return script.pop(0)

    monkeypatch.setattr(policy, "decide", decide)
    puts = []

    def handler(request: httpx.Request):
        puts.append((request.url.host, request.content))
        return httpx.Response(200, json={})

    scaler = loop.Autoscaler(kube, TextSource(wm), httpx.AsyncClient(transport=httpx.MockTransport(handler)),
                             wall_clock=lambda: NOW, drain_unready_wait_s=0.0)
    return dataclasses.make_dataclass("Rig", ["kube", "scaler", "calls", "script", "puts"])(
        kube, scaler, calls, script, puts)


def test_both_pools_decided_and_scaled_each_its_own_way(rig):
    workers_state, prefill_state = policy.PolicyState(service_s=1.0), policy.PolicyState(service_s=2.0)
    rig.script += [_decision(3, "ScaleUpGoodput", limits={"w1": policy.Limits(8, 4)}, state=workers_state, current=2),
                   _decision(2, "ScaleUpSaturation", limits={"p1": policy.Limits(8, 4)}, state=prefill_state)]
    decisions = asyncio.run(rig.scaler.tick())
    assert decisions[("ns", "svc")].replicas == 3  # the service's decision is its workers'
    (w_obs, w_spec, _), (p_obs, p_spec, _) = rig.calls
    assert [p.name for p in w_obs.ready] == ["w1"] and w_obs.current_replicas == 2
    assert [p.name for p in p_obs.ready] == ["p1"] and p_obs.current_replicas == 1 and p_obs.router is None
    assert (w_spec.max_replicas, p_spec.max_replicas) == (6, 3)
    assert rig.kube.scales == [3] and rig.kube.prefill_scales == [2]
    workers_patch, prefill_patch = rig.kube.patches
    assert workers_patch["autoscaler"]["desiredReplicas"] == 3 and "prefill" not in workers_patch["autoscaler"]
    assert set(prefill_patch) == {"autoscaler"}  # status.admission is the workers' (the router's bound)
    assert prefill_patch["autoscaler"]["prefill"]["desiredReplicas"] == 2
    st = rig.kube.obj["status"]["autoscaler"]
    assert st["desiredReplicas"] == 3 and st["prefill"]["desiredReplicas"] == 2
    # the prefill pod's limits are bounded by its pool's maxNumSeqs (4), the worker's by spec.engine's (16)
    assert ("10.244.0.8", b'{"max_num_seqs":4,"max_waiting":4,"max_waiting_tokens":0}') in rig.puts
    assert not [p for p in rig.puts if p[0] == "10.244.0.7"]  # 8/4 already in force there
    assert [e[1] for e in rig.kube.events] == ["ScaleUpGoodput", "ScaleUpSaturation"]
    assert [e[2].startswith("prefill pool: ") for e in rig.kube.events] == [False, True]

    # the next pass resumes each pool from its own record, and the workers' write keeps the prefill record
    rig.script += [_decision(3, "Steady", limits={"w1": policy.Limits(8, 4)}, state=workers_state, current=3),
                   _decision(2, "Steady", limits={"p1": policy.Limits(4, 4)}, state=prefill_state, current=2)]
    asyncio.run(rig.scaler.tick())
    assert rig.calls[2][2] == workers_state and rig.calls[3][2] == prefill_state
    assert rig.kube.obj["status"]["autoscaler"]["prefill"]["desiredReplicas"] == 2


def test_turned_off_only_the_workers_are_decided(rig):
    rig.kube.obj["spec"]["disaggregation"]["enabled"] = False
    rig.script.append(_decision(2, "Steady", limits={"w1": policy.Limits(8, 4)}, current=2))
    asyncio.run(rig.scaler.tick())
    assert len(rig.calls) == 1 and rig.kube.prefill_scales == []


def test_the_workers_see_the_prefill_pods_coming_and_the_routers_fallbacks(rig):
    # rule 19's inputs: the prefill pool's last decision less its ready pods (3 - 1 = 2, read by the
    # workers on the next pass), and the routers' no_prefill_pod + prefill_failed over the interval
    rig.script += [_decision(2, "Steady", limits={"w1": policy.Limits(8, 4)}, current=2),
                   _decision(3, "ScaleUpGoodput", limits={"p1": policy.Limits(8, 4)})]
    asyncio.run(rig.scaler.tick())
    w_obs, p_obs = rig.calls[0][0], rig.calls[1][0]
    assert (w_obs.prefill_coming, w_obs.prefill_fallback) == (0, 0.0)
    assert (p_obs.prefill_coming, p_obs.prefill_fallback) == (0, 0.0)     # the prefill pool's own: none
    rig.scaler._router_view = None
    rig.scaler._observe_routers = lambda: _view(policy.RouterObservation(0, 0, 0.0, pd_fallback=6.0))
    rig.script += [_decision(2, "HoldPrefillStarting", limits={"w1": policy.Limits(8, 4)}, current=2),
                   _decision(3, "HoldStarting", limits={"p1": policy.Limits(8, 4)}, current=3)]
    asyncio.run(rig.scaler.tick())
    w_obs, p_obs = rig.calls[2][0], rig.calls[3][0]
    assert (w_obs.prefill_coming, w_obs.prefill_fallback) == (2, 6.0)
    assert (p_obs.prefill_coming, p_obs.prefill_fallback, p_obs.router) == (0, 0.0, None)


def test_a_deleted_service_is_forgotten_and_its_successor_starts_from_nothing(rig):
    rig.script += [_decision(2, "Steady", limits={"w1": policy.Limits(8, 4)}, current=2),
                   _decision(3, "ScaleUpGoodput", limits={"p1": policy.Limits(8, 4)})]
    asyncio.run(rig.scaler.tick())
    assert rig.scaler._prefill_coming == {("ns", "svc"): 2}                 # 3 ordered, 1 ready
    assert {k[:2] for k in rig.scaler._prev} == {("ns", "svc")}
    obj = rig.kube.obj
    rig.kube.obj = {**obj, "metadata": {**obj["metadata"], "deletionTimestamp": "2026-12-05T00:00:00Z"}}
    assert asyncio.run(rig.scaler.tick()) == {} and len(rig.calls) == 2   # not decided while deleted
    assert rig.scaler._prefill_coming == {} and rig.scaler._prev == {} and rig.scaler._tokens == {}
    rig.kube.obj = obj                                                     # created again, same name
    rig.script += [_decision(2, "Steady", limits={"w1": policy.Limits(8, 4)}, current=2),
                   _decision(1, "Steady", limits={"p1": policy.Limits(8, 4)})]
    asyncio.run(rig.scaler.tick())
    assert rig.calls[2][0].prefill_coming == 0                             # not the old service's 2


async def _view(obs):
    return {("ns", "svc"): obs}
