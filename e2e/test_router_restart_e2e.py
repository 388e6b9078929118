"""A worker container killed in place on the local cluster: the router forgets its prefix cache at once.

The chart (operator and one router; no autoscaler) is installed as release ``gprr`` in its own
namespace, in front of one InferenceService with one worker pod. A prompt sent twice through the
router is placed by ``rendezvous``, then by ``affinity`` (the router recorded the pod as holding its
prefix), and the worker hits its prefix cache. Then the worker's process is killed by hand (the PID
``bash e2e/cluster.sh status`` names): the test kubelet restarts the container in the same pod, same
address (restartCount 1), and the new engine reports a new instance id (goodput.api.identity). Before
any other request, the router's scrape sees that id: ``goodput_router_pod_restarts_total`` for the pod
becomes 1. The same prompt is then placed by ``rendezvous`` again, not by ``affinity`` on knowledge
of a cache that no longer exists (the new engine hits 0 of its prompt tokens); the request after it
is ``affinity`` again (the router learned the new engine's cache).

Timing: no assertion depends on how fast anything is; waits are bounded polls.
"""
from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import pytest
import yaml
from goodput.api import router_metrics as R
from goodput.api import worker_metrics as W
from prometheus_client.parser import text_string_to_metric_families

from conftest import Kubectl, LogFile, wait_for
from test_cluster_ops_e2e import status_rows
from test_helm_e2e import CHART, helm, ready
from test_operator_e2e import POD_READY_S, pod_ip
from test_router_e2e import PYTHONPATH, SPEC, prefix_counters, system_prompt

pytestmark = [pytest.mark.e2e]

RELEASE, RNS = "gprr", "goodput-router-restart"
ROUTER_PORT = 8080
NAME = "restart"
SELECTOR = f"serving.goodput.dev/inferenceservice={NAME},app.kubernetes.io/component=worker"
MODEL = "smollm2"


def _samples(url: str) -> list[Any]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def decisions(router: str) -> dict[str, float]:
    """goodput_router_decisions_total by reason."""
    return {s.labels["reason"]: s.value for s in _samples(router) if s.name == R.DECISIONS_TOTAL}


def restarts_seen(router: str, ns: str, pod: str) -> float:
    """goodput_router_pod_restarts_total of one pod (0 before the first)."""
    return sum(s.value for s in _samples(router) if s.name == R.POD_RESTARTS + "_total"
               and s.labels.get("namespace") == ns and s.labels.get("pod") == pod)


def engine_instance(ip: str) -> str | None:
    """The instance id a worker reports on its /metrics."""
    for s in _samples(f"http://{ip}:8000"):
        if s.name == W.ENGINE_INSTANCE_INFO:
            return s.labels.get("instance_id")
    return None


def placed(router: str, prompt: str) -> tuple[str, str]:
    """Send ``prompt`` through the router: (the pod that served it, the decision reason the router
    counted for it)."""
    before = decisions(router)
    r = httpx.post(f"{router}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = decisions(router)
    moved = [k for k, v in after.items() if v != before.get(k, 0.0)]
    assert len(moved) == 1 and after[moved[0]] - before.get(moved[0], 0.0) == 1, (before, after)
    return r.headers["x-goodput-pod"], moved[0]


def container(kubectl: Kubectl, ns: str, pod: str) -> tuple[int, bool]:
    """(restartCount, Ready) of the pod's worker container."""
    p = kubectl.json("-n", ns, "get", "pod", pod)
    cs = ((p.get("status") or {}).get("containerStatuses") or [{}])[0]
    return int(cs.get("restartCount", 0)), ready(p)


@pytest.fixture(scope="module")
def release(kubectl: Kubectl, crd: dict, kubelet: LogFile, operator):
    """The chart with one router and no autoscaler, in its own namespace; the suite's operator is
    paused meanwhile (the chart's operator reconciles)."""
    operator.stop()
    env = json.dumps([{"name": "PYTHONPATH", "value": PYTHONPATH}])
    try:
        helm("install", RELEASE, str(CHART), "-n", RNS, "--create-namespace", "--set", "crds.install=false",
             "--set", "operator.resyncSeconds=10", "--set", "autoscaler.enabled=false", "--set", "router.replicas=1",
             "--set", "dashboards.enabled=false", "--set-json", f"operator.extraEnv={env}",
             "--set-json", f"router.extraEnv={env}")
        yield RELEASE
    finally:
        helm("uninstall", RELEASE, "-n", RNS, "--wait", check=False)
        operator.start()


@pytest.fixture
def diag(kubectl: Kubectl, ns: str, kubelet: LogFile):
    def dump() -> str:
        out = [kubectl.run("get", "pods", "-A", "-o", "wide", check=False).stdout, kubelet.log(30)]
        for f in sorted((kubelet.log_path.parent / "pods").glob(f"{RNS}_{RELEASE}-*.log")):
            out.append(LogFile(f.name, f).log(30))
        return "\n".join(out)
    return dump


@pytest.mark.timeout(2 * POD_READY_S + 300)
def test_a_worker_killed_in_place_loses_its_cache_knowledge_at_once(kubectl: Kubectl, release: str, ns: str,
                                                                    diag):
    kubectl.run("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": ns}, "spec": {**SPEC, "replicas": 1}}))

    def one_ready_worker() -> dict[str, Any] | None:
        pods = [p for p in kubectl.json("-n", ns, "get", "pods", "-l", SELECTOR)["items"]
                if not p["metadata"].get("deletionTimestamp")]
        return pods[0] if len(pods) == 1 and ready(pods[0]) else None

    worker = wait_for(one_ready_worker, POD_READY_S, "one Ready worker pod", interval=2, on_timeout=diag)
    name, ip = worker["metadata"]["name"], pod_ip(worker)
    routers = wait_for(lambda: [p for p in kubectl.json("-n", RNS, "get", "pods", "-l", (
        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=router"))["items"] if ready(p)],
        180, "the router pod Ready", on_timeout=diag)
    router = f"http://{pod_ip(routers[0])}:{ROUTER_PORT}"
    wait_for(lambda: MODEL in httpx.get(router + "/ready", timeout=30).json().get("models", []), 60,
             "the router serving the model", on_timeout=diag)
    prompt = system_prompt("restart") + " Question: where is the harbor?"

    # warm: the first request places the prompt, the second follows the router's prefix knowledge
    assert placed(router, prompt) == (name, "rendezvous")
    h0, _ = prefix_counters(ip)
    assert placed(router, prompt) == (name, "affinity")
    h1, _ = prefix_counters(ip)
    assert h1 > h0, "the worker should hit its prefix cache on the repeated prompt"
    before = engine_instance(ip)
    assert before and restarts_seen(router, ns, name) == 0

    # kill the worker's process by hand; the kubelet restarts the container in the same pod
    (row,) = wait_for(lambda: status_rows(ns, name), 30, f"{name} in cluster.sh status", on_timeout=diag)
    assert row["ip"] == ip
    os.kill(int(row["pid"]), signal.SIGKILL)
    wait_for(lambda: container(kubectl, ns, name) == (1, True), POD_READY_S, f"{name} restarted (restartCount 1) "
             "and Ready again", interval=1, on_timeout=diag)
    after = engine_instance(ip)
    assert after and after != before, (before, after)

    # no request was sent since the kill: the router's scrape saw the new engine and dropped its knowledge
    wait_for(lambda: restarts_seen(router, ns, name) == 1, 60, f"the router counting {name}'s restart",
             on_timeout=diag)
    h2, q2 = prefix_counters(ip)  # the new engine's counters
    assert placed(router, prompt) == (name, "rendezvous")
    h3, q3 = prefix_counters(ip)
    assert q3 > q2 and h3 == h2, "a new engine has an empty prefix cache"
    # the router learned the new engine's cache: affinity again
    assert placed(router, prompt) == (name, "affinity")
    assert restarts_seen(router, ns, name) == 1
