"""The operator against a real kube-apiserver + controller-manager + scheduler, with real worker processes.

One InferenceService ("tiny", tiny engine settings) goes through its life in file order: apply ->
children with owner references -> pods Ready -> status Ready with url -> a completion through the POD
IP -> kubectl scale to 2 -> engine change rolls out -> operator restart writes nothing -> drift is
repaired -> delete garbage-collects children and stops the processes. Schema refusals and the
Degraded path use objects of their own. Test traffic goes only to pod IPs in 10.244.0.0/24 (network
namespaces made by e2e/kubelet.py), never to a Service ClusterIP.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conftest import Kubectl, pod_ip, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("kubelet", "operator")]

NAME = "tiny"
SELECTOR = f"serving.goodput.dev/inferenceservice={NAME},app.kubernetes.io/component=worker"
# tiny worker settings: fp32 (no conversion pass), a 16 MiB KV pool, one thread per worker
TINY_SPEC: dict[str, Any] = {
    "replicas": 1,
    "engine": {"dtype": "float32", "kvCacheMemory": "16Mi", "maxModelLen": 512, "maxNumSeqs": 4,
               "maxNumBatchedTokens": 256},
    "resources": {"gpu": 1, "cpu": "100m", "memory": "1Gi"},
    "podTemplate": {"env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
    "probes": {"startupTimeoutSeconds": 300, "periodSeconds": 1},
}
POD_READY_S = 240  # model load on 2 shared CPU cores


def manifest(ns: str, name: str, spec: dict[str, Any]) -> str:
    return yaml.safe_dump({"apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService",
                           "metadata": {"name": name, "namespace": ns}, "spec": spec})


def isvc(kubectl: Kubectl, ns: str, name: str = NAME) -> dict[str, Any]:
    return kubectl.json("-n", ns, "get", "inferenceservice", name)


def cond(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c
    return {}


def ready_pods(kubectl: Kubectl, ns: str) -> list[dict[str, Any]]:
    pods = kubectl.json("-n", ns, "get", "pods", "-l", SELECTOR)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]



def complete(ip: str, prompt: str = "The capital of France is", max_tokens: int = 4) -> dict[str, Any]:
    r = httpx.post(f"http://{ip}:8000/v1/completions", timeout=120, json={
        "model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def worker_pids(pod_names: set[str]) -> dict[str, int]:
    """Live processes started for these pods (the test kubelet sets HOSTNAME=<pod name>)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        host = env.get(b"HOSTNAME", b"").decode()
        if host in pod_names and any(b"goodput-worker" in c for c in cmd):
            found[host] = int(d.name)
    return found


# --------------------------------------------------------------------------------------- schema
@pytest.mark.timeout(60)
def test_crd_established(crd):
    conds = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conds["Established"] == "True" and conds["NamesAccepted"] == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["gisvc"]


@pytest.mark.timeout(60)
def test_examples_pass_server_validation_and_schema_is_published(kubectl: Kubectl, ns: str):
    examples = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "crds" / "examples").glob("*.yaml"))
    assert examples
    for ex in examples:
        r = kubectl.run("-n", ns, "apply", "--dry-run=server", "-f", ex)
        assert "created (server dry run)" in r.stdout, r.stdout
    # the structural schema is published: kubectl explain shows field descriptions from the pydantic models
    explain = wait_for(lambda: (r := kubectl.run("explain", "gisvc.spec.engine.maxNumSeqs", check=False))
                       .returncode == 0 and r.stdout, 30, "kubectl explain")
    assert "--max-num-seqs: most requests in the running set" in explain


INVALID = {
    "negative-replicas": ({"replicas": -1}, "spec.replicas in body should be greater than or equal to 0"),
    "unknown-engine-field": ({"engine": {"maxNumSeq": 4}}, 'unknown field "maxNumSeq"'),
    "wrong-type": ({"engine": {"maxNumSeqs": "many"}}, "spec.engine.maxNumSeqs in body must be of type integer"),
    "bad-enum": ({"engine": {"dtype": "float64"}}, "spec.engine.dtype"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", INVALID)
def test_invalid_cr_refused_with_readable_message(kubectl: Kubectl, ns: str, case: str):
    spec, message = INVALID[case]
    r = kubectl.run("apply", "-f", "-", input=manifest(ns, f"bad-{case}", spec), check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert kubectl.run("-n", ns, "get", "inferenceservice", f"bad-{case}", check=False).returncode != 0


@pytest.mark.timeout(90)
def test_semantic_problem_is_degraded_with_event_then_recovers(kubectl: Kubectl, ns: str, diag):
    """maxNumBatchedTokens < blockSize passes the schema; the operator refuses to roll it out."""
    spec = {"replicas": 0, "engine": {"maxNumBatchedTokens": 8, "blockSize": 16}}
    kubectl.run("apply", "-f", "-", input=manifest(ns, "degraded", spec))
    obj = wait_for(lambda: (o := isvc(kubectl, ns, "degraded")) and cond(o, "Degraded").get("status") == "True"
                   and o, 30, "Degraded=True", on_timeout=diag)
    d = cond(obj, "Degraded")
    assert d["reason"] == "InvalidEngineConfig"
    assert "maxNumBatchedTokens (8)" in d["message"] and "blockSize (16)" in d["message"]
    assert cond(obj, "Ready")["status"] == "False"
    assert kubectl.run("-n", ns, "get", "deployment", "degraded", check=False).returncode != 0
    events = wait_for(lambda: [e for e in kubectl.json("-n", ns, "get", "events")["items"]
                               if e["involvedObject"]["name"] == "degraded" and e["reason"] == "InvalidEngineConfig"],
                      20, "a Warning event")
    assert events[0]["type"] == "Warning" and "maxNumBatchedTokens" in events[0]["message"]
    # fixing the spec rolls it out (0 replicas: no worker needed) and clears Degraded
    kubectl.run("-n", ns, "patch", "inferenceservice", "degraded", "--type=merge",
                "-p", '{"spec":{"engine":{"maxNumBatchedTokens":256}}}')
    obj = wait_for(lambda: (o := isvc(kubectl, ns, "degraded")) and cond(o, "Degraded").get("status") == "False"
                   and o, 30, "Degraded=False", on_timeout=diag)
    assert cond(obj, "Ready")["reason"] == "ScaledToZero"
    dep = kubectl.json("-n", ns, "get", "deployment", "degraded")
    assert "--max-num-batched-tokens" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    kubectl.run("-n", ns, "delete", "inferenceservice", "degraded", "--wait=false")


# ------------------------------------------------------------------------------------ lifecycle
@pytest.mark.timeout(POD_READY_S + 60)
def test_apply_creates_owned_children_ready_status_and_serves(kubectl: Kubectl, ns: str, diag):
    kubectl.run("apply", "-f", "-", input=manifest(ns, NAME, TINY_SPEC))
    owner = isvc(kubectl, ns)
    uid = owner["metadata"]["uid"]
    for kind in ("deployment", "service", "poddisruptionbudget", "secret"):
        name = f"{NAME}-admin" if kind == "secret" else NAME
        child = wait_for(lambda: kubectl.json("-n", ns, "get", kind, name), 30, f"{kind} {name}", on_timeout=diag)
        [ref] = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceService", NAME, uid, True)

    pods = wait_for(lambda: ready_pods(kubectl, ns), POD_READY_S, "a Ready worker pod", interval=1, on_timeout=diag)
    [pod] = pods
    ip = pod_ip(pod)
    assert pod["spec"]["nodeName"] == "goodput-e2e-node"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"

    obj = wait_for(lambda: (o := isvc(kubectl, ns)) and cond(o, "Ready").get("status") == "True" and o,
                   60, "status Ready=True", on_timeout=diag)
    st = obj["status"]
    assert st["url"] == f"http://{NAME}.{ns}.svc.cluster.local:8000"
    assert st["readyReplicas"] == 1 and st["observedGeneration"] == obj["metadata"]["generation"]
    assert st["selector"] == "app.kubernetes.io/component=worker,serving.goodput.dev/inferenceservice=tiny"

    # the Service's Endpoints point at the real worker
    eps = wait_for(lambda: kubectl.json("-n", ns, "get", "endpoints", NAME).get("subsets"), 30, "endpoints")
    assert [a["ip"] for a in eps[0]["addresses"]] == [ip]

    # a real completion through the pod IP
    body = complete(ip)
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"]
    # the admin token reached the worker from the operator's Secret
    token = kubectl.run("-n", ns, "get", "secret", f"{NAME}-admin", "-o", "jsonpath={.data.token}").stdout
    token = base64.b64decode(token).decode()
    ok = httpx.get(f"http://{ip}:8000/admin/limits", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    bad = httpx.put(f"http://{ip}:8000/admin/limits", headers={"Authorization": "Bearer wrong"},
                    json={"max_num_seqs": 2}, timeout=10)
    assert ok.status_code == 200 and bad.status_code == 401, (ok.text, bad.text)

    table = kubectl.run("-n", ns, "get", "gisvc").stdout
    assert table.split("\n")[0].split() == ["NAME", "READY", "REPLICAS", "AVAILABLE", "MODEL", "MODELNAME", "URL",
                                            "AGE"]
    assert table.split("\n")[1].split()[:7] == [NAME, "True", "1", "1", "smollm2", "Accepted", st["url"]]


@pytest.mark.timeout(POD_READY_S + 60)
def test_kubectl_scale_to_two_workers_answer(kubectl: Kubectl, ns: str, diag):
    kubectl.run("-n", ns, "scale", f"inferenceservice/{NAME}", "--replicas=2")
    assert isvc(kubectl, ns)["spec"]["replicas"] == 2
    wait_for(lambda: kubectl.json("-n", ns, "get", "deployment", NAME)["spec"]["replicas"] == 2, 30,
             "Deployment replicas 2", on_timeout=diag)
    pods = wait_for(lambda: len(p := ready_pods(kubectl, ns)) == 2 and p, POD_READY_S, "2 Ready pods",
                    interval=1, on_timeout=diag)
    ips = {pod_ip(p) for p in pods}
    assert len(ips) == 2
    for ip in ips:
        assert complete(ip, max_tokens=2)["usage"]["completion_tokens"] == 2
    assert len(worker_pids({p["metadata"]["name"] for p in pods})) == 2
    obj = wait_for(lambda: (o := isvc(kubectl, ns))["status"].get("readyReplicas") == 2 and o, 60,
                   "status.readyReplicas 2", on_timeout=diag)
    assert cond(obj, "Ready")["reason"] == "AllReplicasReady"
    raw = kubectl.run("get", "--raw",
                      f"/apis/serving.goodput.dev/v1alpha1/namespaces/{ns}/inferenceservices/{NAME}/scale").stdout
    scale = yaml.safe_load(raw)
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == obj["status"]["selector"]


@pytest.mark.timeout(2 * POD_READY_S)
def test_engine_change_rolls_out_new_pods_carry_it(kubectl: Kubectl, ns: str, diag):
    old = {p["metadata"]["name"] for p in ready_pods(kubectl, ns)}
    kubectl.run("-n", ns, "patch", "inferenceservice", NAME, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":3}}}')

    def rolled() -> list[dict[str, Any]] | None:
        pods = kubectl.json("-n", ns, "get", "pods", "-l", SELECTOR)["items"]
        ready = ready_pods(kubectl, ns)
        names = {p["metadata"]["name"] for p in pods}
        if len(pods) == 2 and len(ready) == 2 and not names & old:
            return ready
        return None

    pods = wait_for(rolled, 2 * POD_READY_S - 30, "2 new Ready pods replacing the old ones", interval=1,
                    on_timeout=diag)
    for p in pods:
        args = p["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "3"
        state = httpx.get(f"http://{pod_ip(p)}:8000/admin/state", timeout=10).json()
        assert state["limits"]["max_num_seqs"] == 3
    obj = wait_for(lambda: (o := isvc(kubectl, ns)) and cond(o, "Progressing").get("reason") == "Complete" and o,
                   60, "Progressing=False/Complete", on_timeout=diag)
    assert cond(obj, "Ready")["status"] == "True" and obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    wait_for(lambda: not worker_pids(old), 30, "the old pods' processes to stop")


def _versions(kubectl: Kubectl, ns: str) -> dict[str, str]:
    out = {}
    for kind, name in (("inferenceservice", NAME), ("deployment", NAME), ("service", NAME),
                       ("poddisruptionbudget", NAME), ("secret", f"{NAME}-admin")):
        out[kind] = kubectl.json("-n", ns, "get", kind, name)["metadata"]["resourceVersion"]
    return out


@pytest.mark.timeout(120)
def test_operator_restart_writes_nothing(kubectl: Kubectl, ns: str, operator, diag):
    wait_for(lambda: cond(isvc(kubectl, ns), "Progressing").get("reason") == "Complete", 60, "a settled object")
    time.sleep(3)  # let in-flight status/endpoint updates land
    before = _versions(kubectl, ns)
    operator.stop()
    log_size = operator.log_path.stat().st_size
    operator.start()

    def resumed() -> bool:
        with open(operator.log_path, "rb") as f:
            f.seek(log_size)
            return b"Resuming is processed" in f.read()

    wait_for(resumed, 60, "the restarted operator to resume the object", on_timeout=diag)
    # one more resync period so the periodic reconcile runs too
    time.sleep(float(os.environ.get("GOODPUT_OPERATOR_RESYNC_SECONDS", "10")) + 2)
    assert _versions(kubectl, ns) == before


@pytest.mark.timeout(120)
def test_drift_is_repaired(kubectl: Kubectl, ns: str, diag):
    svc_uid = kubectl.json("-n", ns, "get", "service", NAME)["metadata"]["uid"]
    kubectl.run("-n", ns, "delete", "service", NAME)
    new = wait_for(lambda: (s := kubectl.run("-n", ns, "get", "service", NAME, "-o", "json", check=False))
                   .returncode == 0 and yaml.safe_load(s.stdout), 45, "the Service to come back", on_timeout=diag)
    assert new["metadata"]["uid"] != svc_uid and new["metadata"]["ownerReferences"][0]["name"] == NAME
    # an edit by hand of a field the operator owns is set back (no pod churn: not in the pod template)
    kubectl.run("-n", ns, "patch", "deployment", NAME, "--type=merge", "-p", '{"spec":{"revisionHistoryLimit":9}}')
    wait_for(lambda: kubectl.json("-n", ns, "get", "deployment", NAME)["spec"]["revisionHistoryLimit"] == 3, 45,
             "revisionHistoryLimit set back to 3", on_timeout=diag)


@pytest.mark.timeout(150)
def test_delete_garbage_collects_children_and_stops_processes(kubectl: Kubectl, ns: str, diag):
    pods = ready_pods(kubectl, ns)
    names = {p["metadata"]["name"] for p in pods}
    ips = [pod_ip(p) for p in pods]
    assert len(worker_pids(names)) == len(names) == 2
    kubectl.run("-n", ns, "delete", "inferenceservice", NAME, "--wait=false")

    def gone() -> bool:
        for kind, name in (("deployment", NAME), ("service", NAME), ("poddisruptionbudget", NAME),
                           ("secret", f"{NAME}-admin")):
            if kubectl.run("-n", ns, "get", kind, name, check=False).returncode == 0:
                return False
        return not kubectl.json("-n", ns, "get", "pods", "-l", SELECTOR)["items"]

    # the garbage collector notices a new CRD's kind only every ~30 s
    wait_for(gone, 120, "children garbage-collected", interval=2, on_timeout=diag)
    wait_for(lambda: not worker_pids(names), 20, "worker processes to exit")
    for ip in ips:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{ip}:8000/health", timeout=2)


# ------------------------------------------------------------------------- disaggregated prefill/decode
PD = "pd"


@pytest.mark.timeout(2 * POD_READY_S + 120)
def test_disaggregation_runs_a_prefill_pool_and_removes_it_when_turned_off(kubectl: Kubectl, ns: str, diag):
    """spec.disaggregation.enabled: a second Deployment (the prefill pool, --role prefill, its own
    engine settings) beside the workers (--role decode), both pools in the status; turned off, the
    prefill Deployment and its pods go and the workers roll back to no role."""
    spec = {**TINY_SPEC, "disaggregation": {"enabled": True, "prefill": {
        "replicas": 1, "engine": {"maxNumBatchedTokens": 512}}}}
    kubectl.run("apply", "-f", "-", input=manifest(ns, PD, spec))
    prefill = wait_for(lambda: kubectl.json("-n", ns, "get", "deployment", f"{PD}-prefill"), 30,
                       "the prefill Deployment", on_timeout=diag)
    assert prefill["metadata"]["ownerReferences"][0]["name"] == PD

    def pool_pods(component: str) -> list[dict[str, Any]]:
        pods = kubectl.json("-n", ns, "get", "pods", "-l",
                            f"serving.goodput.dev/inferenceservice={PD},app.kubernetes.io/component={component}")
        return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]

    [decode] = wait_for(lambda: pool_pods("worker"), POD_READY_S, "a Ready decode pod", interval=1,
                        on_timeout=diag)
    [pre] = wait_for(lambda: pool_pods("prefill-worker"), POD_READY_S, "a Ready prefill pod", interval=1,
                     on_timeout=diag)
    d_args, p_args = (p["spec"]["containers"][0]["args"] for p in (decode, pre))
    assert d_args[d_args.index("--role") + 1] == "decode" and p_args[p_args.index("--role") + 1] == "prefill"
    assert p_args[p_args.index("--max-num-batched-tokens") + 1] == "512"
    assert d_args[d_args.index("--max-num-batched-tokens") + 1] == "256"
    # the Service's endpoints are the decode pod only
    eps = wait_for(lambda: kubectl.json("-n", ns, "get", "endpoints", PD).get("subsets"), 30, "endpoints")
    assert [a["ip"] for a in eps[0]["addresses"]] == [pod_ip(decode)]

    obj = wait_for(lambda: (o := isvc(kubectl, ns, PD)) and ((o["status"].get("pools") or {}).get("prefill") or {})
                   .get("readyReplicas") == 1 and cond(o, "Progressing").get("reason") == "Complete" and o,
                   60, "status.pools.prefill ready", on_timeout=diag)
    assert obj["status"]["pools"] == {"decode": {"desiredReplicas": 1, "replicas": 1, "readyReplicas": 1},
                                      "prefill": {"desiredReplicas": 1, "replicas": 1, "readyReplicas": 1}}
    assert cond(obj, "Ready")["message"] == "1/1 replicas ready; prefill pool 1/1 ready"
    wide = kubectl.run("-n", ns, "get", "gisvc", PD, "-o", "wide").stdout.split("\n")
    head, row = wide[0].split(), wide[1].split()
    assert row[head.index("PREFILL")] == "1"

    kubectl.run("-n", ns, "patch", "inferenceservice", PD, "--type=merge", "-p",
                '{"spec":{"disaggregation":{"enabled":false}}}')
    wait_for(lambda: kubectl.run("-n", ns, "get", "deployment", f"{PD}-prefill", check=False).returncode != 0,
             60, "the prefill Deployment deleted", on_timeout=diag)
    wait_for(lambda: not (isvc(kubectl, ns, PD)["status"].get("pools")), 60, "status.pools removed",
             on_timeout=diag)
    args = kubectl.json("-n", ns, "get", "deployment", PD)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--role" not in args
    kubectl.run("-n", ns, "delete", "inferenceservice", PD, "--wait=false")
