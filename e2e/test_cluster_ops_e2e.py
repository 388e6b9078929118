"""Operating goodput on the local cluster: what users of the chart and of `kubectl` run into.

- An InferenceService whose worker no node can take (more `nvidia.com/gpu` than the test node's 8, a
  `scheduling.nodeSelector` no node matches) is Degraded with reason Unschedulable and the scheduler's
  own message, and a Warning Event says it, long before the Deployment's progress deadline.
- The chart in namespaced mode (`watchNamespaces`): its operator needs no cluster-wide permission (no
  Namespace or CRD listing; nothing forbidden in its log) and reconciles an object in its namespace.
- Two overlapping releases: while that namespaced release runs, the suite's all-namespaces operator
  leaves its namespace alone (the namespaced one holds the namespace's Lease `goodput-operator`); after
  `helm uninstall` it takes the namespace back.
- `kubectl logs` and `kubectl logs -f` of a pod: the API server reaches the test kubelet's log endpoint
  at the node's only address, InternalIP 127.0.0.1.
- `bash e2e/cluster.sh status` names the host process that runs each pod's container: killing that PID
  by hand restarts the container (restartCount 1), and status then names the new process.

Test traffic goes only to 127.0.0.1 (the API server, the kubelet) and pod IPs in 10.244.0.0/24.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import Kubectl, LogFile, wait_for
from test_helm_e2e import CHART, helm, ready
from test_operator_e2e import cond, manifest

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("kubelet", "operator")]

RELEASE, RELEASE_NS = "gpns", "goodput-ns-system"
# well under the Deployment's progress deadline (600 s), after which the old code first said anything
EXPLAINED_S = 120
NOTHING = {"replicas": 1, "engine": {"dtype": "float32", "kvCacheMemory": "16Mi", "maxModelLen": 512},
           "resources": {"cpu": "100m", "memory": "1Gi"}}


def events(kubectl: Kubectl, ns: str, name: str) -> list[dict[str, Any]]:
    return [e for e in kubectl.json("-n", ns, "get", "events")["items"]
            if e["involvedObject"].get("name") == name and e["involvedObject"].get("kind") == "InferenceService"]


# ------------------------------------------------------------------------------------- unschedulable
@pytest.mark.timeout(EXPLAINED_S + 60)
def test_a_worker_no_node_can_take_is_explained(kubectl: Kubectl, ns: str, diag):
    cases = {
        # the test node advertises nvidia.com/gpu: 8 (e2e/kubelet.py --gpus)
        "too-many-gpus": ({**NOTHING, "resources": {**NOTHING["resources"], "gpu": 16}},
                          "Insufficient nvidia.com/gpu"),
        "no-such-node": ({**NOTHING, "scheduling": {"nodeSelector": {"gpu.example.com/model": "none"}}},
                         "didn't match Pod's node affinity"),  # kube-scheduler 1.20's words for a nodeSelector
    }
    for name, (spec, _) in cases.items():
        kubectl.run("apply", "-f", "-", input=manifest(ns, name, spec))
    for name, (_, words) in cases.items():
        deg = wait_for(lambda: (lambda c: c if c.get("status") == "True" else None)(
            cond(kubectl.json("-n", ns, "get", "gisvc", name), "Degraded")), EXPLAINED_S,
            f"{name} Degraded", on_timeout=diag)
        assert deg["reason"] == "Unschedulable", deg
        # the scheduler's own words, e.g. "0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s)
        # were unschedulable." (the real node of cluster.sh up is cordoned)
        assert re.search(r"0/\d+ nodes are available: .*" + re.escape(words), deg["message"]), deg
        assert "PodScheduled=False" in deg["message"]
        warn = wait_for(lambda: [e for e in events(kubectl, ns, name)
                                 if e["type"] == "Warning" and e["reason"] == "Unschedulable"], 30,
                        f"a Warning Event for {name}", on_timeout=diag)
        assert warn[0]["message"] == deg["message"]
        ready_c = cond(kubectl.json("-n", ns, "get", "gisvc", name), "Ready")
        assert ready_c["status"] == "False"
    for name in cases:
        kubectl.run("-n", ns, "delete", "gisvc", name, "--wait=false")


# ----------------------------------------------------------------------------- namespaced release
@pytest.fixture(scope="module")
def team_ns(kubectl: Kubectl):
    ns = f"e2e-team-{uuid.uuid4().hex[:6]}"
    kubectl.run("create", "namespace", ns)
    try:
        yield ns
    finally:
        kubectl.run("-n", ns, "delete", "gisvc", "--all", "--wait=false", check=False)
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def namespaced_release(kubectl: Kubectl, crd: dict, kubelet: LogFile, team_ns: str):
    helm("install", RELEASE, str(CHART), "-n", RELEASE_NS, "--create-namespace", "--set", "crds.install=false",
         "--set", f"watchNamespaces={{{team_ns}}}", "--set", "autoscaler.enabled=false",
         "--set", "operator.resyncSeconds=10")
    try:
        yield RELEASE
    finally:
        helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", check=False)
        kubectl.run("delete", "namespace", RELEASE_NS, "--wait=false", check=False)


def operator_pod(kubectl: Kubectl) -> dict[str, Any] | None:
    pods = [p for p in kubectl.json("-n", RELEASE_NS, "get", "pods", "-l",
                                    f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
                                    )["items"] if not p["metadata"].get("deletionTimestamp")]
    return pods[0] if len(pods) == 1 and ready(pods[0]) else None


def pod_log(kubelet: LogFile, ns: str, pod: str, container: str) -> str:
    return (kubelet.log_path.parent / "pods" / f"{ns}_{pod}_{container}.log").read_text(errors="replace")


@pytest.mark.timeout(300)
def test_namespaced_release_needs_no_cluster_permission(kubectl: Kubectl, kubelet: LogFile, namespaced_release: str,
                                                        team_ns: str, operator, diag):
    pod = wait_for(lambda: operator_pod(kubectl), 180, "the namespaced operator pod Ready", on_timeout=diag)
    # the release made nothing cluster-scoped
    assert not kubectl.run("get", "clusterrole,clusterrolebinding", "-l", f"app.kubernetes.io/instance={RELEASE}",
                           "-o", "name").stdout.strip()
    kubectl.run("apply", "-f", "-", input=manifest(team_ns, "team-svc", {**NOTHING, "replicas": 0}))
    wait_for(lambda: kubectl.run("-n", team_ns, "get", "deployment", "team-svc", check=False).returncode == 0, 60,
             "the Deployment made by the namespaced operator", on_timeout=diag)
    wait_for(lambda: cond(kubectl.json("-n", team_ns, "get", "gisvc", "team-svc"), "Ready").get("reason")
             == "ScaledToZero", 60, "its status written", on_timeout=diag)
    name = pod["metadata"]["name"]
    text = pod_log(kubelet, RELEASE_NS, name, "operator")
    assert f"created Deployment {team_ns}/team-svc" in text
    bad = [ln for ln in text.splitlines() if re.search(r"forbidden|not enough permissions|APIForbiddenError", ln, re.I)]
    assert not bad, "\n".join(bad[:10])
    # the namespace is claimed by that operator: the Lease names its pod
    lease = kubectl.json("-n", team_ns, "get", "lease", "goodput-operator")
    assert lease["spec"]["holderIdentity"].startswith(f"{name}/"), lease


@pytest.mark.timeout(300)
def test_overlapping_releases_partition_by_the_namespace_lease(kubectl: Kubectl, kubelet: LogFile,
                                                               namespaced_release: str, team_ns: str, operator,
                                                               ns: str, diag):
    # the suite's all-namespaces operator runs all along: it saw team-svc and left it to the namespaced one
    wait_for(lambda: f"namespace {team_ns} is claimed by a namespaced goodput operator" in operator.log(400), 60,
             "the all-namespaces operator yielding the namespace", on_timeout=diag)
    assert f"created Deployment {team_ns}/" not in operator.log(2000)
    # ... and still reconciles everywhere else
    kubectl.run("apply", "-f", "-", input=manifest(ns, "elsewhere", {**NOTHING, "replicas": 0}))
    wait_for(lambda: kubectl.run("-n", ns, "get", "deployment", "elsewhere", check=False).returncode == 0, 60,
             "the all-namespaces operator reconciling another namespace", on_timeout=diag)
    # the namespaced release goes (`helm uninstall` removes its Role with it, so its Lease lapses rather than
    # being released) and the all-namespaces operator takes the namespace back
    helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait")
    kubectl.run("-n", team_ns, "delete", "service", "team-svc")
    wait_for(lambda: kubectl.run("-n", team_ns, "get", "service", "team-svc", check=False).returncode == 0, 90,
             "the Service recreated by the all-namespaces operator", on_timeout=diag)
    assert f"created Service {team_ns}/team-svc" in operator.log(2000)
    kubectl.run("-n", ns, "delete", "gisvc", "elsewhere", "--wait=false")


# ------------------------------------------------------------------------------------- kubectl logs
COUNTER = "import itertools, time\nfor i in itertools.count():\n    print('line', i, flush=True)\n    time.sleep(0.3)\n"


@pytest.mark.timeout(240)
def test_kubectl_logs_and_follow_reach_the_test_kubelet_on_loopback(kubectl: Kubectl, kubelet: LogFile, ns: str,
                                                                    diag):
    node = kubectl.json("get", "node", "goodput-e2e-node")
    # one address, on loopback: nothing for the API server to resolve through the host's resolver
    assert node["status"]["addresses"] == [{"type": "InternalIP", "address": "127.0.0.1"}]
    port = node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"]
    assert port > 0
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "counter", "namespace": ns},
           "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
               "name": "count", "image": "local", "command": [Path(sys.executable).name, "-u", "-c", COUNTER]}]}}
    kubectl.run("apply", "-f", "-", input=yaml.safe_dump(pod))
    try:
        def numbers(text: str) -> list[int]:
            return [int(m) for m in re.findall(r"^line (\d+)$", text, re.M)]

        out = wait_for(lambda: (lambda t: t if len(numbers(t)) >= 4 else None)(
            kubectl.run("-n", ns, "logs", "counter", check=False).stdout), 120, "kubectl logs counter",
            on_timeout=diag)
        got = numbers(out)
        assert got == list(range(len(got))), out[:500]  # the whole run, in order, without the kubelet's lines
        assert "start #" not in out
        # the same lines as the file the test kubelet writes (docs: where pod logs are)
        assert out in pod_log(kubelet, ns, "counter", "count")
        tail = kubectl.run("-n", ns, "logs", "counter", "--tail=2").stdout.splitlines()
        assert len(tail) == 2 and numbers("\n".join(tail))[1] == numbers("\n".join(tail))[0] + 1
        # follow: lines written after kubectl started arrive on the open stream
        p = subprocess.Popen(["kubectl", "--kubeconfig", kubectl.kubeconfig, "-n", ns, "logs", "-f", "counter"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            last = max(got)
            seen = []
            for line in p.stdout:
                seen += numbers(line)
                if seen and max(seen) > last + 3:
                    break
            assert seen and max(seen) > last + 3, (seen, p.stderr.read() if p.poll() is not None else "")
            assert seen == list(range(seen[0], seen[0] + len(seen)))
        finally:
            p.kill()
            p.wait(timeout=10)
    finally:
        kubectl.run("-n", ns, "delete", "pod", "counter", "--wait=false", check=False)


# ------------------------------------------------------------------------------- cluster.sh status
SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(3600)\n"


def status_rows(ns: str, pod: str) -> list[dict[str, str]]:
    """The "pod processes" rows of `bash e2e/cluster.sh status` for one pod."""
    out = subprocess.run(["bash", str(Path(__file__).parent / "cluster.sh"), "status"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    table = out.split("pod processes", 1)[1].splitlines()[2:]
    rows = []
    for line in table:
        f = line.split(None, 7)
        if len(f) == 8 and f[:2] == [ns, pod]:
            rows.append(dict(zip(("ns", "pod", "ip", "netns", "pid", "elapsed", "rss", "command"), f)))
    return rows


@pytest.mark.timeout(240)
def test_status_names_the_process_of_each_pod_and_killing_it_restarts_the_container(kubectl: Kubectl, ns: str,
                                                                                     diag):
    command = [Path(sys.executable).name, "-u", "-c", SLEEPER, f"marker-{uuid.uuid4().hex[:8]}"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper", "namespace": ns},
           "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
               "name": "sleep", "image": "local", "command": command}]}}
    kubectl.run("apply", "-f", "-", input=yaml.safe_dump(pod))
    try:
        def running(restarts: int) -> dict[str, Any] | None:
            p = kubectl.json("-n", ns, "get", "pod", "sleeper")
            cs = (p.get("status") or {}).get("containerStatuses") or []
            return p if cs and "running" in cs[0]["state"] and cs[0]["restartCount"] == restarts else None

        ip = wait_for(lambda: running(0), 120, "pod sleeper running", on_timeout=diag)["status"]["podIP"]
        (row,) = wait_for(lambda: status_rows(ns, "sleeper"), 30, "sleeper in cluster.sh status", on_timeout=diag)
        pid = int(row["pid"])
        # the row's process is the pod's: its argv is the container's command, its network namespace the
        # one whose address is the pod IP
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        assert [a.decode() for a in argv][-len(command):] == command
        assert row["ip"] == ip
        inside = subprocess.run(["ip", "-n", row["netns"], "-4", "-o", "addr", "show", "dev", "eth0"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
        assert f" {ip}/" in inside
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/var/run/netns/{row['netns']}").st_ino
        os.kill(pid, signal.SIGKILL)   # by hand, as a user testing a crash would
        wait_for(lambda: running(1), 120, "sleeper restarted after its process was killed", on_timeout=diag)
        (again,) = wait_for(lambda: [r for r in status_rows(ns, "sleeper") if int(r["pid"]) != pid], 30,
                            "the restarted process in cluster.sh status", on_timeout=diag)
        argv = Path(f"/proc/{again['pid']}/cmdline").read_bytes().split(b"\0")[:-1]
        assert [a.decode() for a in argv][-len(command):] == command
    finally:
        kubectl.run("-n", ns, "delete", "pod", "sleeper", "--wait=false", check=False)
