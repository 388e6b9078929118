"""Kubernetes discovery: InferenceService / pod objects → fleet records (tables), the mirror that
applies list and watch events to a real Fleet, and the reflector loop (list → watch → 410 → list)
driven by a scripted API. The watch against a real kube-apiserver runs in e2e/test_router_e2e.py."""
from __future__ import annotations

import argparse
import threading

import pytest
from goodput.router import discovery_k8s as dk
from goodput.api.crd import served_model_name
from goodput.router.discovery_k8s import FleetMirror, Reflector, pod_record, service_info
from goodput.router.fleet import Fleet, PodInfo, ServiceInfo


def isvc(name="chat", ns="team", model=None, status=None, probes=None, rv="1"):
    spec = {"model": model if model is not None else {"name": "smollm2"}}
    if probes is not None:
        spec["probes"] = probes
    obj = {"apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": name, "namespace": ns, "resourceVersion": rv}, "spec": spec}
    if status is not None:
        obj["status"] = status
    return obj


def pod(name="chat-1", ns="team", isvc_name="chat", ip="10.244.0.7", ready=True, deleting=False,
        annotations=None, phase="Running", port_name="http", port=8000, component="worker", rv="1"):
    meta = {"name": name, "namespace": ns, "resourceVersion": rv,
            "labels": {"app.kubernetes.io/component": component, "serving.goodput.dev/inferenceservice": isvc_name}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T15:00:00Z"
    if annotations:
        meta["annotations"] = annotations
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status,
            "spec": {"containers": [{"name": "worker", "ports": [{"name": port_name, "containerPort": port}]}]}}


# ------------------------------------------------------------------------------------- pure tables
@pytest.mark.parametrize("model_spec, want", [
    ({"name": "smollm2"}, "smollm2"),
    ({"name": "/models/llama/Llama-3.2-1B-Q4_0.gguf"}, "Llama-3.2-1B-Q4_0"),
    ({"name": "/models/x.gguf", "servedModelName": "assistant"}, "assistant"),
    ({"name": "smollm2", "servedModelName": None}, "smollm2"),
    ({}, "smollm2"),  # the CRD's default model
])
def test_served_model_name_is_the_workers(model_spec, want):
    assert served_model_name(model_spec) == want


@pytest.mark.parametrize("obj, want", [
    (isvc(), ServiceInfo("team", "chat", "smollm2", "", None, 600.0)),
    (isvc(model={"name": "smollm2", "servedModelName": "tiny", "revision": "r7"},
          status={"admission": {"maxWaiting": 4, "routerMaxQueued": 12}}, probes={"startupTimeoutSeconds": 90}),
     ServiceInfo("team", "chat", "tiny", "r7", 12, 90.0)),
    (isvc(status={"admission": {"routerMaxQueued": 0}}), ServiceInfo("team", "chat", "smollm2", "", 0, 600.0)),
    (isvc(status={"admission": None}), ServiceInfo("team", "chat", "smollm2", "", None, 600.0)),
    (isvc(status={"admission": {"routerMaxQueued": "12"}}), ServiceInfo("team", "chat", "smollm2", "", None, 600.0)),
    (isvc(status={"admission": {"routerMaxQueued": True}}), ServiceInfo("team", "chat", "smollm2", "", None, 600.0)),
], ids=["defaults", "every-field", "max-queued-zero", "admission-null", "not-an-int", "bool-is-not-int"])
def test_service_info(obj, want):
    assert service_info(obj) == want


U = "http://10.244.0.7:8000"


@pytest.mark.parametrize("obj, want", [
    (pod(), ("team", "chat", "chat-1", PodInfo("chat-1", U, ready=True))),
    (pod(ready=False), ("team", "chat", "chat-1", PodInfo("chat-1", U, ready=False))),
    (pod(deleting=True), ("team", "chat", "chat-1", PodInfo("chat-1", U, terminating=True))),
    (pod(annotations={"serving.goodput.dev/draining": "true"}),
     ("team", "chat", "chat-1", PodInfo("chat-1", U, draining=True))),
    (pod(annotations={"serving.goodput.dev/draining": "false"}), ("team", "chat", "chat-1", PodInfo("chat-1", U))),
    (pod(port_name="web", port=9000), ("team", "chat", "chat-1", PodInfo("chat-1", U))),  # unnamed: 8000
    (pod(port=8001), ("team", "chat", "chat-1", PodInfo("chat-1", "http://10.244.0.7:8001"))),
    (pod(ip="fd00::7"), ("team", "chat", "chat-1", PodInfo("chat-1", "http://[fd00::7]:8000"))),
    (pod(ip=None), ("team", "chat", "chat-1", None)),
    (pod(phase="Succeeded"), ("team", "chat", "chat-1", None)),
    (pod(phase="Failed"), ("team", "chat", "chat-1", None)),
    (pod(component="operator"), None),
    (pod(isvc_name=""), None),
], ids=["ready", "unready", "terminating", "draining", "draining-false", "unnamed-port", "http-port",
        "ipv6", "no-ip", "succeeded", "failed", "not-a-worker", "no-isvc-label"])
def test_pod_record(obj, want):
    assert pod_record(obj) == want


# ------------------------------------------------------------------------------------- the mirror
def _mirror():
    fleet = Fleet()
    changes = []
    fleet.add_listener(changes.append)
    return fleet, FleetMirror(fleet), changes


def _pods(fleet, key=("team", "chat")):
    svc = fleet.service(key)
    return None if svc is None else {n: p.info for n, p in svc.pods.items()}


def test_pods_before_their_service_join_it_when_it_appears():
    fleet, m, changes = _mirror()
    m.relist_pods(None, [pod("chat-1"), pod("chat-2", ip="10.244.0.8", ready=False)])
    assert fleet.services() == [] and changes == []
    m.relist_services(None, [isvc()])
    assert _pods(fleet) == {"chat-1": PodInfo("chat-1", U),
                            "chat-2": PodInfo("chat-2", "http://10.244.0.8:8000", ready=False)}
    assert [p.name for p in fleet.for_model("smollm2").routable_pods()] == ["chat-1"]


def test_events_turn_pods_unroutable_and_back_and_remove_them():
    fleet, m, changes = _mirror()
    m.relist_services(None, [isvc()])
    m.relist_pods(None, [pod("chat-1")])
    svc = fleet.for_model("smollm2")
    svc.pods["chat-1"].in_flight = 2  # the router's own view survives discovery updates
    for change in ({"annotations": {"serving.goodput.dev/draining": "true"}}, {"ready": False}, {"deleting": True}):
        m.pod_event("MODIFIED", pod("chat-1", **change))
        assert svc.routable_pods() == [] and svc.pods["chat-1"].in_flight == 2
        m.pod_event("MODIFIED", pod("chat-1"))
        assert [p.name for p in svc.routable_pods()] == ["chat-1"]
    m.pod_event("MODIFIED", pod("chat-1", ip=None))  # finished / lost its IP: gone from the fleet
    assert _pods(fleet) == {}
    m.pod_event("ADDED", pod("chat-1"))
    m.pod_event("DELETED", pod("chat-1", deleting=True))
    assert _pods(fleet) == {}


def test_writes_only_what_changed():
    fleet, m, changes = _mirror()
    m.relist_services(None, [isvc()])
    m.relist_pods(None, [pod("chat-1")])
    n = len(changes)
    m.pod_event("MODIFIED", pod("chat-1", rv="2"))  # same record (resourceVersion is not in it)
    m.service_event("MODIFIED", isvc(rv="2"))
    m.relist_services(None, [isvc(rv="3")])
    assert len(changes) == n
    m.service_event("MODIFIED", isvc(status={"admission": {"routerMaxQueued": 5}}))
    assert len(changes) == n + 1 and fleet.for_model("smollm2").info.router_max_queued == 5


def test_relist_removes_what_went_away_in_its_scope_only():
    fleet, m, changes = _mirror()
    m.relist_services("team", [isvc("chat", "team"), isvc("code", "team", model={"name": "smollm2",
                                                                                    "servedModelName": "code"})])
    m.relist_services("other", [isvc("chat2", "other", model={"name": "smollm2", "servedModelName": "c2"})])
    m.relist_pods("team", [pod("chat-1"), pod("code-1", isvc_name="code", ip="10.244.0.9")])
    # a 410 relist of namespace "team": "code" and its pod were deleted meanwhile
    m.relist_services("team", [isvc("chat", "team")])
    m.relist_pods("team", [pod("chat-1")])
    assert [s.key for s in fleet.services()] == [("other", "chat2"), ("team", "chat")]
    assert fleet.for_model("code") is None and _pods(fleet) == {"chat-1": PodInfo("chat-1", U)}
    m.service_event("DELETED", isvc("chat", "team"))
    assert fleet.for_model("smollm2") is None and m.pods == {("team", "chat"): {"chat-1": PodInfo("chat-1", U)}}


# ---------------------------------------------------------------------------------- the reflector
class ScriptedAPI:
    """A list/watch source following a script: each list returns the next (items, rv) or raises it;
    each watch yields the next list of events or raises it. At the end of either script it sets
    ``stop`` (and a list raises), so the reflector's loop ends."""

    def __init__(self, lists, watches, stop):
        self.lists, self.watches, self.stop = list(lists), list(watches), stop
        self.watched_from: list[str] = []

    def list_fn(self):
        if not self.lists:
            self.stop.set()
            raise RuntimeError("end of the list script")
        step = self.lists.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    def watch_fn(self, rv):
        self.watched_from.append(rv)
        if not self.watches:
            self.stop.set()
            return iter(())
        step = self.watches.pop(0)
        if isinstance(step, Exception):
            raise step
        return iter(step)


def _ev(etype, name, rv):
    return {"type": etype, "object": {"metadata": {"name": name, "resourceVersion": rv}}}


def _run(lists, watches):
    stop = threading.Event()
    src = ScriptedAPI(lists, watches, stop)
    seen, sleeps = [], []
    r = Reflector("test", src.list_fn, src.watch_fn, on_list=lambda items: seen.append(("list", items)),
                  on_event=lambda t, o: seen.append((t, o["metadata"]["name"])), stop=stop, sleep=sleeps.append)
    r.run()
    return r, src, seen, sleeps


def test_reflector_resumes_from_the_last_version_and_relists_on_410():
    from kubernetes.client.exceptions import ApiException

    r, src, seen, sleeps = _run(
        lists=[(["a"], "10"), (["a", "b"], "30")],
        watches=[[_ev("ADDED", "b", "11"), {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}}],
                 [_ev("MODIFIED", "b", "16"),
                  {"type": "ERROR", "object": {"code": 410, "message": "too old resource version: 16 (25)"}}],
                 [_ev("DELETED", "a", "31")],
                 ApiException(status=410, reason="Gone")])
    # list@10 -> watch 10 (ends at the bookmark's 15) -> watch 15 -> 410 event -> list@30 -> watch 30
    # -> watch 31 -> 410 raised -> a third list: the end of the script (one error, one back-off)
    assert src.watched_from == ["10", "15", "30", "31"]
    assert seen == [("list", ["a"]), ("ADDED", "b"), ("MODIFIED", "b"), ("list", ["a", "b"]), ("DELETED", "a")]
    assert (r.lists, r.errors, sleeps) == (2, 1, [1.0])


def test_reflector_backs_off_on_errors_and_keeps_its_version():
    r, src, seen, sleeps = _run(
        lists=[([], "5")],
        watches=[ConnectionError("reset"), ConnectionError("reset"), [_ev("ADDED", "x", "6")],
                 ConnectionError("reset"), []])
    assert src.watched_from == ["5", "5", "5", "6", "6", "6"]
    assert seen == [("list", []), ("ADDED", "x")]
    assert sleeps == [1.0, 2.0, 1.0]  # doubling, back to the first delay after a watch that ended normally
    assert (r.lists, r.errors) == (1, 3)


def test_reflector_retries_a_failed_list():
    r, src, seen, sleeps = _run(lists=[ConnectionError("refused"), (["a"], "7")], watches=[])
    assert seen == [("list", ["a"])] and src.watched_from == ["7"]
    assert (r.lists, r.errors, sleeps) == (1, 1, [1.0])


def test_back_off_is_capped():
    r, src, seen, sleeps = _run(lists=[([], "1")], watches=[ConnectionError("x")] * 8)
    assert sleeps == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


# ------------------------------------------------------------------------------------------- CLI
def test_cli_kubernetes_flags():
    from goodput.router.__main__ import parse
    _, _, _, d = parse(["--kubernetes", "--namespace", "a", "--namespace", "b", "--namespace", "a"])
    assert isinstance(d, dk.KubernetesDiscovery) and d.namespaces == ["a", "b"] and d.watch_timeout_s == 300
    _, _, _, d = parse(["--kubernetes", "--all-namespaces", "--watch-timeout", "30"])
    assert d.namespaces is None and d.watch_timeout_s == 30
    _, _, _, d = parse(["--kubernetes"])
    assert d.namespaces is None
    with pytest.raises(SystemExit):
        dk.from_args(argparse.Namespace(namespace=["a"], all_namespaces=True, watch_timeout=300))


def _with_role(obj, role):
    obj["metadata"]["labels"]["serving.goodput.dev/role"] = role
    return obj


@pytest.mark.parametrize("obj, role", [
    (_with_role(pod(), "decode"), "decode"),
    (_with_role(pod(component="prefill-worker"), "prefill"), "prefill"),
    (pod(component="prefill-worker"), "prefill"),      # the prefill pool's component says it
    (_with_role(pod(), "bogus"), "both"),
    (pod(), "both"),
], ids=["decode", "prefill-pool", "prefill-component-only", "unknown-role", "no-label"])
def test_pod_record_role_for_disaggregated_serving(obj, role):
    assert pod_record(obj)[3].role == role


@pytest.mark.parametrize("disagg, want", [
    (None, None),
    ({"enabled": False, "remotePrefillMinTokens": 100}, None),
    ({"enabled": True}, 512),                              # the CRD's default
    ({"enabled": True, "remotePrefillMinTokens": 0}, 0),
    ({"enabled": True, "remotePrefillMinTokens": 2048}, 2048),
])
def test_service_info_carries_the_remote_prefill_threshold(disagg, want):
    obj = isvc()
    if disagg is not None:
        obj["spec"]["disaggregation"] = disagg
    assert service_info(obj).remote_prefill_min_tokens == want


@pytest.mark.parametrize("slo, want", [
    (None, ()),
    ({"ttftMs": 500}, ()),                                                      # no named classes
    # TTFTs 0.5 < 1.0 (the unnamed class's) < 5.0 s: bands 0, 1, 2
    ({"ttftMs": 1000, "classes": [{"name": "interactive", "ttftMs": 500, "tpotMs": 50},
                                  {"name": "batch", "ttftMs": 5000, "tpotMs": 200}]},
     (("batch", 2), ("default", 1), ("interactive", 0))),
    # ttftMs unset: the CRD's default 1000 ms; equal TTFTs share a band whatever their TPOT
    ({"classes": [{"name": "chat", "ttftMs": 1000, "tpotMs": 50}, {"name": "bulk", "ttftMs": 4000, "tpotMs": 500}]},
     (("bulk", 1), ("chat", 0), ("default", 0))),
    ({"classes": [{"name": "bad", "ttftMs": -1, "tpotMs": 50}]}, ()),          # refused by the schema: no bands
])
def test_service_info_carries_each_slo_class_band(slo, want):
    obj = isvc()
    if slo is not None:
        obj["spec"]["slo"] = slo
    assert service_info(obj).slo_ranks == want


@pytest.mark.parametrize("status, want", [
    (None, 0),
    ({}, 0),
    ({"pools": None}, 0),
    ({"pools": {"prefill": {"desiredReplicas": 4, "replicas": 4, "readyReplicas": 1}}}, 3),   # 4 ordered, 1 Ready
    ({"pools": {"prefill": {"desiredReplicas": 2, "replicas": 3, "readyReplicas": 3}}}, 0),   # scaling in: none coming
    ({"pools": {"prefill": {"desiredReplicas": 2}}}, 2),                                      # readyReplicas absent: 0
    ({"pools": {"prefill": {"desiredReplicas": "2", "readyReplicas": 0}}}, 0),                # not an integer
    ({"pools": {"prefill": {"desiredReplicas": True, "readyReplicas": 0}}}, 0),
])
def test_service_info_carries_the_prefill_pods_coming(status, want):
    obj = isvc()
    if status is not None:
        obj["status"] = status
    assert service_info(obj).prefill_coming == want
