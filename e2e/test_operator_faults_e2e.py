"""Faults a user meets, each on its own InferenceService against the real API server:
names of 63 characters, a child the API server refuses (4xx), quantities the server respells, a worker
that can never start (a missing model file) and a spec the operator can refuse before starting a pod.
Objects use ``replicas: 0`` wherever no worker process is needed (control plane only).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from conftest import Kubectl, wait_for
from test_operator_e2e import TINY_SPEC, cond, isvc, manifest

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("kubelet", "operator")]

RESYNC_S = float(os.environ.get("GOODPUT_OPERATOR_RESYNC_SECONDS", "10"))
LABEL = "serving.goodput.dev/inferenceservice"


def degraded(kubectl: Kubectl, ns: str, name: str, reason: str, diag, timeout: float = 45) -> dict[str, Any]:
    return wait_for(lambda: (o := isvc(kubectl, ns, name)) and cond(o, "Degraded").get("reason") == reason
                    and cond(o, "Degraded").get("status") == "True" and o, timeout, f"Degraded={reason}",
                    on_timeout=diag)


def warning_events(kubectl: Kubectl, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in kubectl.json("-n", ns, "get", "events")["items"]
            if e["involvedObject"]["name"] == name and e["reason"] == reason and e["type"] == "Warning"]


@pytest.mark.timeout(90)
def test_63_character_name_reconciles_and_labels_find_every_child(kubectl: Kubectl, ns: str, diag):
    name = "long-" + "x" * 58
    assert len(name) == 63
    kubectl.run("apply", "-f", "-", input=manifest(ns, name, {"replicas": 0}))
    obj = wait_for(lambda: (o := isvc(kubectl, ns, name)) and cond(o, "Ready").get("reason") == "ScaledToZero"
                   and o, 45, "status ScaledToZero", on_timeout=diag)
    assert cond(obj, "Degraded")["status"] == "False"
    for kind in ("deployment", "service", "poddisruptionbudget", "secret"):
        [child] = kubectl.json("-n", ns, "get", kind, "-l", f"{LABEL}={name}")["items"]
        assert len(child["metadata"]["name"]) <= 63
        assert child["metadata"]["ownerReferences"][0]["name"] == name
    secret = kubectl.json("-n", ns, "get", "secret", "-l", f"{LABEL}={name}")["items"][0]
    # child_name: 48 characters kept, 8 hex of sha256(name), the suffix
    assert secret["metadata"]["name"].startswith(name[:48] + "-") and secret["metadata"]["name"].endswith("-admin")
    dep = kubectl.json("-n", ns, "get", "deployment", name)
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"][0]
    assert env["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    # one character more: the CRD refuses it at once, naming the rule
    r = kubectl.run("apply", "-f", "-", input=manifest(ns, name + "y", {"replicas": 0}), check=False)
    assert r.returncode != 0 and "metadata.name" in r.stderr, r.stderr
    kubectl.run("-n", ns, "delete", "inferenceservice", name, "--wait=false")


@pytest.mark.timeout(90)
def test_child_refused_by_the_api_server_is_degraded_with_its_message(kubectl: Kubectl, ns: str, diag):
    """A pod label the schema cannot check: the Deployment write gets 422 and its message is reported."""
    name = "refused"
    kubectl.run("apply", "-f", "-", input=manifest(ns, name, {"replicas": 0,
                                                             "podTemplate": {"labels": {"bad key!": "x"}}}))
    obj = degraded(kubectl, ns, name, "ChildRefused", diag)
    msg = cond(obj, "Degraded")["message"]
    assert msg.startswith(f"the API server refused Deployment {ns}/{name} (422): ") and "bad key!" in msg, msg
    events = wait_for(lambda: warning_events(kubectl, ns, name, "ChildRefused"), 20, "a Warning event",
                      on_timeout=diag)
    assert "bad key!" in events[0]["message"]
    assert kubectl.run("-n", ns, "get", "service", name, check=False).returncode == 0  # the others were written
    kubectl.run("-n", ns, "patch", "inferenceservice", name, "--type=merge",
                "-p", '{"spec":{"podTemplate":{"labels":{"bad key!":null}}}}')
    wait_for(lambda: cond(isvc(kubectl, ns, name), "Degraded").get("status") == "False", 45, "Degraded=False",
             on_timeout=diag)
    assert kubectl.run("-n", ns, "get", "deployment", name, check=False).returncode == 0
    kubectl.run("-n", ns, "delete", "inferenceservice", name, "--wait=false")


@pytest.mark.timeout(120)
def test_quantities_the_server_respells_cause_no_write_on_resync(kubectl: Kubectl, ns: str, operator, diag):
    name = "quantities"
    kubectl.run("apply", "-f", "-", input=manifest(ns, name, {
        "replicas": 0, "resources": {"cpu": "0.0001", "memory": "99999999999Ti"}}))
    wait_for(lambda: cond(isvc(kubectl, ns, name), "Ready").get("reason") == "ScaledToZero", 45, "settled",
             on_timeout=diag)
    dep = kubectl.json("-n", ns, "get", "deployment", name)
    # what the API server stored (the table of tests/operator/test_operator_resources.py SERVER_SPELLINGS)
    res = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"] == {"cpu": "1m", "memory": "9223372036854775807"}, res
    time.sleep(2)  # in-flight Deployment status updates by the controller-manager
    before = kubectl.json("-n", ns, "get", "deployment", name)["metadata"]["resourceVersion"]
    log_size = operator.log_path.stat().st_size
    time.sleep(2 * RESYNC_S + 2)  # two periodic resyncs of every object
    with open(operator.log_path, "rb") as f:
        f.seek(log_size)
        window = f.read().decode(errors="replace")
    assert "resync of " in window  # the resyncs ran
    # the API server skips storing an unchanged object, so resourceVersion alone would not see a
    # rewrite of the same content: the operator logs every write it sends
    assert f"updated Deployment {ns}/{name}" not in window, window[-3000:]
    after = kubectl.json("-n", ns, "get", "deployment", name)
    assert after["metadata"]["resourceVersion"] == before
    kubectl.run("-n", ns, "delete", "inferenceservice", name, "--wait=false")


@pytest.mark.timeout(60)
def test_model_len_above_the_bundled_models_context_is_refused_at_once(kubectl: Kubectl, ns: str, diag):
    name = "too-long"
    kubectl.run("apply", "-f", "-", input=manifest(ns, name, {"replicas": 1, "engine": {"maxModelLen": 9000}}))
    obj = degraded(kubectl, ns, name, "InvalidEngineConfig", diag)
    assert cond(obj, "Degraded")["message"] == \
        "engine.maxModelLen (9000) exceeds the context length of model smollm2 (8192 tokens)"
    assert kubectl.run("-n", ns, "get", "deployment", name, check=False).returncode != 0  # no pod started
    wait_for(lambda: warning_events(kubectl, ns, name, "InvalidEngineConfig"), 20, "a Warning event")
    kubectl.run("-n", ns, "delete", "inferenceservice", name, "--wait=false")


@pytest.mark.timeout(240)
def test_missing_model_file_is_worker_crash_loop_with_the_workers_error(kubectl: Kubectl, ns: str, diag):
    name = "missing-model"
    missing = "/nonexistent/goodput-e2e/missing.gguf"
    spec = {**TINY_SPEC, "model": {"name": missing}}
    kubectl.run("apply", "-f", "-", input=manifest(ns, name, spec))
    obj = degraded(kubectl, ns, name, "WorkerCrashLoop", diag, timeout=180)
    msg = cond(obj, "Degraded")["message"]
    # the worker's own last error line, then where it came from
    assert msg.startswith(f"goodput-worker: the model failed to load: model '{missing}' is neither"), msg
    assert "exited with code 1 (Error)" in msg
    assert cond(obj, "Ready")["status"] == "False"
    events = wait_for(lambda: warning_events(kubectl, ns, name, "WorkerCrashLoop"), 20, "a Warning event",
                      on_timeout=diag)
    assert events[0]["message"] == msg
    # the test kubelet reports the container as a kubelet does
    [pod] = kubectl.json("-n", ns, "get", "pods", "-l", f"{LABEL}={name}")["items"]
    [cs] = pod["status"]["containerStatuses"]
    assert cs["restartCount"] >= 1 and cs["lastState"]["terminated"]["exitCode"] == 1
    assert cs["lastState"]["terminated"]["message"].strip().splitlines()[-1] == msg.split(" (worker in pod")[0]
    assert cs["state"].get("waiting", {}).get("reason") in (None, "CrashLoopBackOff")
    kubectl.run("-n", ns, "delete", "inferenceservice", name, "--wait=false")
