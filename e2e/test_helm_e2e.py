"""The Helm chart on a real API server and a REAL NODE, from the images, and a real Prometheus.

README's "Try it on a local cluster (no GPU)" steps, in file order (run.sh does `cluster.sh up`/`down`):
`helm install` with the chart's defaults (crds.install=false: `cluster.sh up` applied the CRD; the
chart's CRD template is checked by a server-side dry run) -> the chart's operator, autoscaler and router
pods run on the real node (a kubelet with containerd + runc through CRI, e2e/real-node.sh; the test
node is cordoned meanwhile) as containers of the images images/build.sh made (goodput/control-plane,
goodput/worker), with their ServiceAccount tokens, so they act with exactly the chart's RBAC ->
`kubectl apply -f crds/examples/local.yaml` -> `kubectl get gisvc` Ready -> a completion through a
router pod to the worker pod. What only a real runtime enforces is asserted: containerd:// container
IDs, the worker's non-root user, its read-only root filesystem, its memory limit in its cgroup, the
kubelet's own probes, logs, exec and port-forward; and a worker image that is not on the node gives
a condition naming it (and the kubelet's reason) and a Warning Event. Then a Prometheus (Debian package, 127.0.0.1) scrapes the
worker pods with the chart's PodMonitor relabelings (and the autoscaler with its ServiceMonitor's;
the targets come from the API server, see KubernetesFileSD), load is driven, and every PromQL expression of the two dashboards and of the
chart's rules is evaluated through its HTTP API. Then `helm upgrade` with a changed value and
`helm uninstall`, after which nothing of the release is left.

Test traffic goes only to 127.0.0.1 and pod IPs in 10.244.1.0/24 (the real node's pod bridge).
Pod start-to-Ready times on the real node go to $GOODPUT_E2E_LOGS/real-node-times.md.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conftest import REAL_NODE, ROOT, Kubectl, LogFile, pod_ip, wait_for
from test_operator_e2e import POD_READY_S

pytestmark = [pytest.mark.e2e]

CHART = ROOT / "helm" / "goodput"
RELEASE, RELEASE_NS = "gp", "goodput-system"
EXAMPLE = ROOT / "crds" / "examples" / "local.yaml"
NAME = "smollm2-local"
PROM_PORT = 19390
ROUTED_REQUESTS = 4  # drive_load sends these through the router
RATE_WINDOW = "5m"  # stands in for $__rate_interval: covers the whole load phase
_spec = importlib.util.spec_from_file_location("helm_dashboards", ROOT / "helm" / "dashboards.py")
dash = importlib.util.module_from_spec(_spec)  # helm/dashboards.py: the panels' queries
_spec.loader.exec_module(dash)

# Queries allowed to return no series under this load, and why.
MAY_BE_EMPTY = {
    "Scrape errors/s": "the autoscaler's scrape-error counter has a series only after a failed scrape",
}


def helm_bin() -> str:
    h = shutil.which("helm") or str(Path(os.environ.get("K8S_HOME", Path.home() / ".cache" / "goodput-k8s"))
                                     / "bin" / "helm")
    assert Path(h).exists(), "no helm: run `bash e2e/cluster.sh install`"
    return h


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([helm_bin(), *args], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, f"helm {' '.join(args)}: {r.stdout}\n{r.stderr}"
    return r


def rendered(*args: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(helm("template", RELEASE, str(CHART), "-n", RELEASE_NS, *args).stdout) if d]


def release_pods(kubectl: Kubectl, component: str) -> list[dict[str, Any]]:
    pods = kubectl.json("-n", RELEASE_NS, "get", "pods", "-l",
                        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def ready(p: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))


def processes_of(pod: str) -> list[tuple[int, list[str], dict[str, str]]]:
    """(pid, argv, env) of live processes of ``pod``'s containers, seen from the host (containerd's CRI
    sets HOSTNAME to the pod's name in every container)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if env.get("HOSTNAME") == pod and "ip" not in argv[:1]:
            out.append((int(d.name), argv, env))
    return out


@pytest.fixture(scope="module")
def release(kubectl: Kubectl, crd: dict, real_node: LogFile, operator, ns: str):
    """The chart installed as README says, onto the real node; the suite's own operator process is
    paused meanwhile (two operators would both reconcile)."""
    operator.stop()
    try:
        helm("install", RELEASE, str(CHART), "-n", RELEASE_NS, "--create-namespace", "--set", "crds.install=false",
             "--set", "operator.resyncSeconds=10", "--set", "autoscaler.period=2")
        yield RELEASE
    finally:
        helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", check=False)
        operator.start()


@pytest.fixture
def on_real_node(real_node: LogFile | None) -> LogFile:
    """The real kubelet's log; skips a test that needs what only the real node has."""
    if real_node is None:
        pytest.skip("no real node (the cluster was started with GOODPUT_REAL_NODE=0): the chart runs on the test kubelet")
    return real_node


@pytest.fixture
def diag(kubectl: Kubectl, ns: str, real_node: LogFile | None, kubelet: LogFile):
    def dump() -> str:
        out = [kubectl.run("get", "pods", "-A", "-o", "wide", check=False).stdout,
               kubectl.run("-n", ns, "get", "gisvc", "-o", "yaml", check=False).stdout[-3000:],
               kubectl.run("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-4000:],
               (real_node or kubelet).log(40)]
        for n in (RELEASE_NS, ns):
            for p in kubectl.json("-n", n, "get", "pods")["items"]:
                out.append(f"--- logs of {n}/{p['metadata']['name']}\n" + kubectl.run(
                    "-n", n, "logs", p["metadata"]["name"], "--all-containers", "--tail=25", check=False).stdout)
        return "\n".join(out)
    return dump


# ------------------------------------------------------------------------------------------ install
@pytest.mark.timeout(120)
def test_chart_crd_template_is_accepted_by_the_server(kubectl: Kubectl):
    text = helm("template", RELEASE, str(CHART), "-n", RELEASE_NS, "-s", "templates/crds.yaml").stdout
    r = kubectl.run("apply", "--dry-run=server", "-f", "-", input=text)
    assert "inferenceservices.serving.goodput.dev" in r.stdout


@pytest.mark.timeout(240)
def test_operator_and_autoscaler_run_as_pods_with_their_service_accounts(kubectl: Kubectl, release: str,
                                                                         real_node: LogFile | None, diag):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # one operator; the autoscaler's replicas (one leads through a Lease, the others stand by)
    for component, module, count in (("operator", "goodput.operator", 1),
                                     ("autoscaler", "goodput.autoscaler", values["autoscaler"]["replicas"])):
        pods = wait_for(lambda: (lambda ps: ps if len(ps) == count else None)(
            [p for p in release_pods(kubectl, component) if ready(p)]), 180,
            f"{count} {component} pod(s) Ready", on_timeout=diag)
        for pod in pods:
            assert pod["spec"]["serviceAccountName"] == f"{RELEASE}-goodput-{component}"
            procs = wait_for(lambda: [p for p in processes_of(pod["metadata"]["name"]) if module in p[1]], 30,
                             f"the {component} process", on_timeout=diag)
            _, argv, env = procs[0]
            assert argv[argv.index("-m") + 1] == module
            # in-cluster config: on the real node Service `kubernetes`'s ClusterIP, forwarded on the node
            # (no kube-proxy here); on the test kubelet its own forward
            assert env["KUBERNETES_SERVICE_HOST"] == ("10.0.0.1" if real_node else "10.244.0.1")
    names = {p["metadata"]["name"] for p in release_pods(kubectl, "autoscaler")}
    lease = wait_for(lambda: (kubectl.json("-n", RELEASE_NS, "get", "lease", f"{RELEASE}-goodput-autoscaler")
                              .get("spec") or {}).get("holderIdentity"), 60, "the autoscaler's Lease held",
                     on_timeout=diag)
    assert lease.rsplit("_", 1)[0] in names   # held by one of the two pods (POD_NAME_<hex>)
    # Ready came from the readiness probe on kopf's health endpoint, which answers at the pod IP
    (op,) = release_pods(kubectl, "operator")
    assert httpx.get(f"http://{pod_ip(op)}:8080/healthz", timeout=10).status_code == 200


@pytest.mark.timeout(POD_READY_S + 120)
def test_example_is_reconciled_by_the_chart_operator_ready_and_serves(kubectl: Kubectl, release: str, ns: str, diag):
    kubectl.run("-n", ns, "apply", "-f", str(EXAMPLE))
    # README: `kubectl wait --for=condition=Ready gisvc/...`; in slices, the Kubectl helper allows 60 s a call
    wait_for(lambda: kubectl.run("-n", ns, "wait", "--for=condition=Ready", f"gisvc/{NAME}", "--timeout=30s",
                                 check=False).returncode == 0, POD_READY_S, f"gisvc/{NAME} Ready", on_timeout=diag)
    # the URL column is the chart's router (the operator's --router-url)
    wait_for(lambda: re.search(rf"^{NAME}\s+True\s+1\s+1\s+smollm2\s+Accepted\s+http://goodput-router\.{RELEASE_NS}\.svc:8080\s",
                               kubectl.run("-n", ns, "get", "gisvc").stdout, re.M), 60,
             "the router's URL in kubectl get gisvc", on_timeout=diag)
    (pod,) = [p for p in kubectl.json("-n", ns, "get", "pods", "-l",
                                      f"serving.goodput.dev/inferenceservice={NAME}")["items"] if ready(p)]
    routers = wait_for(lambda: [p for p in release_pods(kubectl, "router") if ready(p)], 120, "a Ready router pod",
                       on_timeout=diag)
    # README: through the router (its pod IP: no kube-proxy here), then one pod directly
    for url in (f"http://{pod_ip(routers[0])}:8080", f"http://{pod_ip(pod)}:8000"):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].strip()


# ------------------------------------------------------------------------ what only a real node enforces
def worker_pod(kubectl: Kubectl, ns: str, name: str = NAME) -> dict[str, Any]:
    (pod,) = [p for p in kubectl.json("-n", ns, "get", "pods", "-l", f"serving.goodput.dev/inferenceservice={name}")
              ["items"] if ready(p) and not p["metadata"].get("deletionTimestamp")]
    return pod


def in_worker(kubectl: Kubectl, pod: dict[str, Any], script: str) -> subprocess.CompletedProcess:
    """``sh -c script`` in the worker container through ``kubectl exec`` (the kubelet, then containerd)."""
    return kubectl.run("-n", pod["metadata"]["namespace"], "exec", pod["metadata"]["name"], "-c", "worker", "--",
                       "sh", "-c", script, check=False)


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", q)
    assert m, f"unexpected memory quantity {q!r}"
    return int(m.group(1)) * _BINARY.get(m.group(2) or "", 1)


def _seconds(a: str, b: str) -> int:
    import datetime

    t = lambda x: datetime.datetime.fromisoformat(x.replace("Z", "+00:00"))
    return int((t(b) - t(a)).total_seconds())


@pytest.mark.timeout(120)
def test_every_pod_runs_its_image_in_containerd_on_the_real_node(kubectl: Kubectl, release: str, ns: str, crd: dict,
                                                                 logs_dir: Path, on_real_node, diag):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    control_plane = f"{values['image']['repository']}:{values['image']['tag'] or app_version}"
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    worker_image = engine["properties"]["image"]["default"]  # the operator's default, as the CRD publishes it
    pods = [(worker_pod(kubectl, ns), worker_image)] + [
        (p, control_plane) for c in ("operator", "autoscaler", "router") for p in release_pods(kubectl, c)]
    assert len(pods) == 1 + 1 + values["autoscaler"]["replicas"] + values["router"]["replicas"], diag()
    rows = ["| pod | image | created -> container started (s) | created -> Ready (s) |", "|---|---|---|---|"]
    for pod, image in pods:
        name = pod["metadata"]["name"]
        assert pod["spec"]["nodeName"] == REAL_NODE, name
        (c,) = pod["spec"]["containers"]
        assert (c["image"], c["imagePullPolicy"]) == (image, "IfNotPresent"), name
        (cs,) = pod["status"]["containerStatuses"]
        assert cs["containerID"].startswith("containerd://") and "sha256:" in cs["imageID"], cs
        ready_at = next(x["lastTransitionTime"] for x in pod["status"]["conditions"] if x["type"] == "Ready")
        created = pod["metadata"]["creationTimestamp"]
        rows.append(f"| {name} | {image} | {_seconds(created, cs['state']['running']['startedAt'])} | "
                    f"{_seconds(created, ready_at)} |")
    (logs_dir / "real-node-times.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


@pytest.mark.timeout(120)
def test_the_runtime_confines_the_worker_as_its_pod_spec_says(kubectl: Kubectl, release: str, ns: str, on_real_node,
                                                              diag):
    pod = worker_pod(kubectl, ns)
    (c,) = pod["spec"]["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["runAsNonRoot"]
    # the image's own non-root user (runAsNonRoot: the kubelet refuses to start a root one)
    r = in_worker(kubectl, pod, "id -u")
    assert r.returncode == 0 and r.stdout.strip() == "65532", r.stdout + r.stderr
    # the root filesystem is read-only (EROFS, not a permission error), /tmp (an emptyDir) is writable
    r = in_worker(kubectl, pod, "echo x > /goodput-e2e-write")
    assert r.returncode != 0 and "Read-only file system" in r.stderr, r.stdout + r.stderr
    r = in_worker(kubectl, pod, "echo x > /tmp/goodput-e2e-write && cat /tmp/goodput-e2e-write")
    assert r.returncode == 0 and r.stdout.strip() == "x", r.stdout + r.stderr
    # the memory limit is the container's cgroup's (cgroup v1 or v2)
    r = in_worker(kubectl, pod, "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null"
                                " || cat /sys/fs/cgroup/memory.max")
    assert r.returncode == 0 and int(r.stdout.strip()) == quantity_bytes(c["resources"]["limits"]["memory"]), r.stdout


def _probe_counts(kubectl: Kubectl, pod: dict[str, Any]) -> dict[tuple[str, str], float]:
    """The real kubelet's own probe counters for ``pod`` ((probe_type, result) -> count), from its
    /metrics/probes through the API server's node proxy."""
    text = kubectl.run("get", "--raw", f"/api/v1/nodes/{REAL_NODE}/proxy/metrics/probes").stdout
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = re.match(r"prober_probe_total\{(.*)\} (\S+)$", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("pod") == pod["metadata"]["name"] and labels.get("namespace") == pod["metadata"]["namespace"]:
            out[(labels["probe_type"], labels["result"])] = float(m.group(2))
    return out


@pytest.mark.timeout(120)
def test_probes_logs_exec_and_port_forward_are_the_real_kubelets(kubectl: Kubectl, release: str, ns: str,
                                                                  on_real_node, diag):
    pod = worker_pod(kubectl, ns)
    counts = wait_for(lambda: (lambda c: c if c.get(("Readiness", "successful"), 0) >= 1 else None)(
        _probe_counts(kubectl, pod)), 30, "the kubelet's successful readiness probes of the worker", on_timeout=diag)
    assert counts.get(("Startup", "successful"), 0) >= 1, counts
    logs = kubectl.run("-n", ns, "logs", pod["metadata"]["name"], "-c", "worker").stdout
    assert logs.strip(), "kubectl logs returned nothing"
    r = in_worker(kubectl, pod, "echo $HOSTNAME")
    assert r.stdout.strip() == pod["metadata"]["name"]
    pf = subprocess.Popen(["kubectl", "--kubeconfig", kubectl.kubeconfig, "-n", ns, "port-forward",
                           f"pod/{pod['metadata']['name']}", ":8000"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        line = pf.stdout.readline()
        m = re.search(r"Forwarding from 127\.0\.0\.1:(\d+) -> 8000", line)
        assert m, line
        r = httpx.get(f"http://127.0.0.1:{m.group(1)}/health", timeout=30)
        assert r.status_code == 200, r.text
    finally:
        pf.terminate()
        pf.wait(timeout=10)


@pytest.mark.timeout(180)
def test_a_worker_image_not_on_the_node_gives_a_condition_and_a_warning_event(kubectl: Kubectl, release: str,
                                                                               ns: str, on_real_node, diag):
    name, image = "no-image", "goodput/worker:not-built"
    kubectl.run("-n", ns, "apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
        "spec": {"model": {"name": "smollm2"}, "engine": {"image": image}, "replicas": 1,
                 "resources": {"cpu": "100m", "memory": "256Mi"}}}))
    try:
        def degraded() -> dict[str, Any] | None:
            conds = kubectl.json("-n", ns, "get", "gisvc", name).get("status", {}).get("conditions", [])
            c = next((x for x in conds if x["type"] == "Degraded"), None)
            return c if c and c["status"] == "True" and c["reason"] == "ImagePullFailed" else None

        c = wait_for(degraded, 60, "Degraded=True ImagePullFailed", on_timeout=diag)
        assert image in c["message"], c
        assert re.search(r"\b(ErrImagePull|ImagePullBackOff|ErrImageNeverPull)\b", c["message"]), c
        events = wait_for(lambda: [e for e in kubectl.json("-n", ns, "get", "events")["items"]
                                   if e["involvedObject"].get("name") == name and e["type"] == "Warning"
                                   and e["reason"] == "ImagePullFailed"], 30, "the Warning Event", on_timeout=diag)
        assert image in events[0]["message"]
        # the pod is the kubelet's: it never started a container, and says why
        (pod,) = kubectl.json("-n", ns, "get", "pods", "-l", f"serving.goodput.dev/inferenceservice={name}")["items"]
        (cs,) = pod["status"]["containerStatuses"]
        assert cs["state"].get("waiting", {}).get("reason") in ("ErrImagePull", "ImagePullBackOff"), cs
    finally:
        kubectl.run("-n", ns, "delete", "gisvc", name, "--wait=true", "--timeout=60s", check=False)


# --------------------------------------------------------------------------------------- Prometheus
def _meta(prefix: str, labels: dict[str, str]) -> dict[str, str]:
    return {f"{prefix}_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v for k, v in (labels or {}).items()}


class KubernetesFileSD:
    """Kubernetes service discovery for Prometheus through file_sd.

    Debian's Prometheus is built without kubernetes_sd_configs, so this thread lists pods (role "pod")
    and Endpoints (role "endpoints") from the API server every second and writes them as file_sd
    targets carrying the same ``__meta_kubernetes_*`` labels kubernetes_sd would; the chart's
    PodMonitor/ServiceMonitor relabelings then apply unchanged.
    """

    def __init__(self, kubectl: Kubectl, directory: Path, pod_ns: tuple[str, ...], endpoints_ns: str):
        self.kubectl, self.dir, self.pod_ns, self.endpoints_ns = kubectl, directory, pod_ns, endpoints_ns
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.refresh()

    def _write(self, name: str, groups: list[dict[str, Any]]) -> None:
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.dir / name)

    def refresh(self) -> None:
        pods = []
        for pod_ns in self.pod_ns:
            for p in self.kubectl.json("-n", pod_ns, "get", "pods")["items"]:
                ip = p["status"].get("podIP")
                if not ip or p["metadata"].get("deletionTimestamp"):
                    continue
                for c in p["spec"]["containers"]:
                    for port in c.get("ports") or []:
                        pods.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                            "__meta_kubernetes_namespace": pod_ns, "__meta_kubernetes_pod_name": p["metadata"]["name"],
                            "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                            **_meta("__meta_kubernetes_pod_label", p["metadata"].get("labels"))}})
        self._write("pods.json", pods)
        eps = []
        services = {s["metadata"]["name"]: s for s in
                    self.kubectl.json("-n", self.endpoints_ns, "get", "services")["items"]}
        for e in self.kubectl.json("-n", self.endpoints_ns, "get", "endpoints")["items"]:
            svc = services.get(e["metadata"]["name"])
            for subset in e.get("subsets") or []:
                for addr in subset.get("addresses") or []:
                    for port in subset.get("ports") or []:
                        eps.append({"targets": [f"{addr['ip']}:{port['port']}"], "labels": {
                            "__meta_kubernetes_namespace": self.endpoints_ns,
                            "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                            **_meta("__meta_kubernetes_service_label", svc["metadata"].get("labels") if svc else {})}})
        self._write("endpoints.json", eps)

    def _run(self) -> None:
        while not self.stop_ev.wait(1.0):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - an API hiccup; the next round rewrites the files
                pass

    def start(self) -> KubernetesFileSD:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_ev.set()
        self.thread.join(timeout=10)


def _scrape_configs(sd_dir: Path) -> list[dict[str, Any]]:
    """Prometheus scrape configs equivalent to the chart's PodMonitors (workers, router) and ServiceMonitor."""
    objs = {(o["kind"], o["metadata"]["name"]): o for o in rendered("--set", "metrics.podMonitor.enabled=true",
                                                                    "--set", "metrics.serviceMonitor.enabled=true")}
    pm = objs[("PodMonitor", f"{RELEASE}-goodput-workers")]["spec"]
    sm = objs[("ServiceMonitor", f"{RELEASE}-goodput-autoscaler")]["spec"]
    rpm = objs[("PodMonitor", f"{RELEASE}-goodput-router")]["spec"]
    ep = pm["podMetricsEndpoints"][0]

    def keep(prefix: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [{"source_labels": [k], "regex": v, "action": "keep"} for k, v in _meta(prefix, labels).items()]

    workers = {
        "job_name": "goodput-workers", "metrics_path": ep["path"],
        "file_sd_configs": [{"files": [str(sd_dir / "pods.json")], "refresh_interval": "2s"}],
        "relabel_configs": keep("__meta_kubernetes_pod_label", pm["selector"]["matchLabels"]) + [
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": ep["port"], "action": "keep"}] + [
            {"source_labels": r["sourceLabels"], "target_label": r["targetLabel"]} for r in ep["relabelings"]],
    }
    sep = sm["endpoints"][0]
    autoscaler = {
        "job_name": "goodput-autoscaler", "metrics_path": sep["path"], "honor_labels": sep["honorLabels"],
        "file_sd_configs": [{"files": [str(sd_dir / "endpoints.json")], "refresh_interval": "2s"}],
        "relabel_configs": keep("__meta_kubernetes_service_label", sm["selector"]["matchLabels"]) + [
            {"source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": sep["port"], "action": "keep"}],
    }
    rep = rpm["podMetricsEndpoints"][0]
    router = {
        "job_name": "goodput-router", "metrics_path": rep["path"], "honor_labels": rep["honorLabels"],
        "file_sd_configs": [{"files": [str(sd_dir / "pods.json")], "refresh_interval": "2s"}],
        "relabel_configs": keep("__meta_kubernetes_pod_label", rpm["selector"]["matchLabels"]) + [
            {"source_labels": ["__meta_kubernetes_namespace"], "regex": "|".join(rpm["namespaceSelector"]["matchNames"]),
             "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": rep["port"], "action": "keep"}] + [
            {"source_labels": r["sourceLabels"], "target_label": r["targetLabel"]} for r in rep["relabelings"]],
    }
    return [workers, autoscaler, router]


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory) -> Path:
    (rule,) = rendered("--set", "metrics.prometheusRule.enabled=true", "-s", "templates/prometheusrule.yaml")
    path = tmp_path_factory.mktemp("rules") / "goodput.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


@pytest.fixture(scope="module")
def prometheus(kubectl: Kubectl, release: str, ns: str, rules_file: Path, logs_dir: Path, tmp_path_factory):
    prom = shutil.which("prometheus")
    assert prom, "no prometheus binary: run `bash e2e/cluster.sh install`"
    d = tmp_path_factory.mktemp("prometheus")
    sd = KubernetesFileSD(kubectl, d, (ns, RELEASE_NS), RELEASE_NS).start()
    cfg = {"global": {"scrape_interval": "2s", "evaluation_interval": "2s", "scrape_timeout": "2s"},
           "rule_files": [str(rules_file)], "scrape_configs": _scrape_configs(d)}
    (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    log = open(logs_dir / "prometheus.log", "ab")
    p = subprocess.Popen([prom, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                          f"--web.listen-address=127.0.0.1:{PROM_PORT}", "--log.level=warn"],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{PROM_PORT}"
    try:
        wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 60, "Prometheus ready")
        yield url
    finally:
        sd.stop()
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def query(url: str, expr: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]


def substitute(expr: str, ns: str) -> str:
    return (expr.replace("$__rate_interval", RATE_WINDOW).replace("$namespace", ns)
            .replace("$inferenceservice", NAME).replace("$pod", ".*"))


def drive_load(ip: str, router_ip: str) -> dict[str, int]:
    """Shared-prefix requests through the chart's router (prefix-cache hits, the router's series), a
    concurrent burst (queueing, maybe 429s), one request that can never fit (400), both straight to
    the worker. Returns status code counts."""
    codes: dict[int, int] = {}
    lock = threading.Lock()
    prefix = "You are a helpful assistant. Answer briefly and precisely. " * 4

    def one(prompt: str, max_tokens: int, base: str = f"http://{ip}:8000") -> None:
        try:
            r = httpx.post(f"{base}/v1/completions", timeout=300, json={
                "model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
            code = r.status_code
        except httpx.HTTPError:
            code = -1
        with lock:
            codes[code] = codes.get(code, 0) + 1

    for wave in ([(prefix + f"Question {i}: name a colour.", 8, f"http://{router_ip}:8080")
                  for i in range(ROUTED_REQUESTS)],
                 [(f"Burst request {i}: count to ten.", 12) for i in range(14)],
                 [("x " * 600, 16)]):
        threads = [threading.Thread(target=one, args=a) for a in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    return codes


@pytest.mark.timeout(600)
def test_every_dashboard_query_returns_data_from_a_real_prometheus(kubectl: Kubectl, release: str, ns: str,
                                                                   prometheus: str, logs_dir: Path, diag):
    (pod,) = [p for p in kubectl.json("-n", ns, "get", "pods", "-l",
                                      f"serving.goodput.dev/inferenceservice={NAME}")["items"] if ready(p)]
    wait_for(lambda: query(prometheus, f'up{{namespace="{ns}", inferenceservice="{NAME}"}} == 1')["result"], 60,
             "Prometheus scraping the worker", on_timeout=diag)
    routers = wait_for(lambda: [p for p in release_pods(kubectl, "router") if ready(p)], 120,
                       "a Ready router pod", on_timeout=diag)
    # the router the load goes through, scraped before the load: rate() needs its zero sample
    router = routers[0]["metadata"]["name"]
    wait_for(lambda: query(prometheus, f'up{{job="goodput-router", router_pod="{router}"}} == 1')["result"], 60,
             f"Prometheus scraping the router {router}", on_timeout=diag)
    codes = drive_load(pod_ip(pod), pod_ip(routers[0]))
    assert codes.get(200, 0) >= 5 and codes.get(400, 0) == 1, codes
    # the load is in Prometheus (no sleeps: wait for the counters), and the autoscaler has decided
    def finished() -> float:
        result = query(prometheus, f'sum(goodput_requests_finished_total{{namespace="{ns}"}})')["result"]
        return float(result[0]["value"][1]) if result else 0.0

    def routed() -> float:  # the unlabelled overhead histogram: every request the router sent upstream
        result = query(prometheus, 'sum(goodput_router_overhead_seconds_count{job="goodput-router"})')["result"]
        return float(result[0]["value"][1]) if result else 0.0

    wait_for(lambda: finished() >= codes[200], 60, "the finished requests scraped", on_timeout=diag)
    wait_for(lambda: routed() >= ROUTED_REQUESTS, 60, "the router's requests scraped", on_timeout=diag)
    wait_for(lambda: query(prometheus, f'goodput_autoscaler_decisions_total{{namespace="{ns}"}}')["result"], 60,
             "the autoscaler's decisions scraped", on_timeout=diag)

    report, failures = [], []
    for file in ("serving.json", "autoscaler.json"):
        board = json.loads((CHART / "dashboards" / file).read_text())
        for title, expr in dash.queries(board):
            if title.startswith("variable "):
                m = re.fullmatch(r"label_values\((.*), (\w+)\)", expr)
                assert m, expr
                result = query(prometheus, substitute(m.group(1), ns))["result"]
                values = sorted({r["metric"].get(m.group(2), "") for r in result} - {""})
                report.append((file, title, expr, len(values), bool(values)))
                if not values:
                    failures.append((title, expr, "no label values"))
                continue
            result = query(prometheus, substitute(expr, ns))["result"]
            finite = [r for r in result if not math.isnan(float(r["value"][1]))]
            report.append((file, title, expr, len(result), bool(finite)))
            if not result and title not in MAY_BE_EMPTY:
                failures.append((title, expr, "empty"))
            elif result and not finite and "histogram_quantile" in expr:
                failures.append((title, expr, "only NaN"))
    lines = ["| dashboard | panel | query | series | data |", "|---|---|---|---|---|"]
    lines += ["| {} | {} | `{}` | {} | {} |".format(f, t, e.replace("|", "\\|"), n, "yes" if ok else "no")
              for f, t, e, n, ok in report]
    (logs_dir / "dashboard-queries.md").write_text("\n".join(lines) + "\n")
    assert not failures, failures


_rspec = importlib.util.spec_from_file_location("render_dashboards", ROOT / "scripts" / "render_dashboards.py")
render_dashboards = importlib.util.module_from_spec(_rspec)  # scripts/render_dashboards.py: panels to PNG
_rspec.loader.exec_module(render_dashboards)


@pytest.mark.timeout(300)
def test_dashboards_render_to_png_from_the_real_prometheus(ns: str, prometheus: str, logs_dir: Path):
    """Every panel of both dashboards drawn from this Prometheus with the dashboards' own queries (after
    the load of the previous test). Written to $GOODPUT_E2E_LOGS/dashboards, and to
    $GOODPUT_DASHBOARD_PNG_DIR when set: `GOODPUT_DASHBOARD_PNG_DIR=docs/dashboards bash e2e/run.sh
    e2e/test_helm_e2e.py` regenerates the pictures in docs/ (docs/kubernetes.md, "Dashboards as pictures")."""
    outs = [logs_dir / "dashboards"]
    if os.environ.get("GOODPUT_DASHBOARD_PNG_DIR"):
        outs.append(Path(os.environ["GOODPUT_DASHBOARD_PNG_DIR"]).resolve())
    boards = {f.stem: json.loads(f.read_text()) for f in (CHART / "dashboards").glob("*.json")}
    want = {name: {p["title"] for p in dash.panels(b) if p.get("targets")} for name, b in boards.items()}
    for out in outs:
        # the run so far (install, load, scrapes) at 2 s steps; $__rate_interval as Grafana sets it for a 2 s
        # scrape and step: max(4 x scrape, step + scrape) = 8 s
        report = render_dashboards.render(prometheus, out, namespace=ns, inferenceservice=NAME, minutes=12,
                                          step=2, rate_interval="8s")
        for name in boards:
            png = out / f"{name}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
            drawn = {t.split(" (")[0] for t, n in report[name].items() if n > 0}
            missing = want[name] - drawn - set(MAY_BE_EMPTY)
            assert not missing, f"{name}: panels without a series: {sorted(missing)}"


@pytest.mark.timeout(300)
def test_chart_rules_pass_promtool_load_and_evaluate(release: str, ns: str, prometheus: str, rules_file: Path,
                                                     logs_dir: Path):
    r = subprocess.run([shutil.which("promtool") or "promtool", "check", "rules", str(rules_file)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

    def evaluated() -> list[dict[str, Any]] | None:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [rule for g in groups for rule in g["rules"]]
        return rules if rules and all(x["health"] == "ok" and x.get("lastEvaluation", "").startswith("20")
                                      for x in rules) else None

    rules = wait_for(evaluated, 60, "every rule evaluated with health ok")
    report = []
    for rule in rules:
        if rule["type"] == "recording":
            # the recorded series exists for our InferenceService
            result = wait_for(lambda: query(prometheus, f'{rule["name"]}{{namespace="{ns}"}}')["result"], 30,
                              f"recorded {rule['name']}")
            report.append((rule["name"], rule["query"], len(result), "recorded"))
        else:
            # alerts may legitimately be empty (nothing is wrong); the expression must parse and run
            result = query(prometheus, rule["query"])["result"]
            report.append((rule["name"], rule["query"], len(result), rule["state"]))
    (logs_dir / "rule-queries.md").write_text("\n".join(f"| {n} | `{q}` | {k} | {s} |" for n, q, k, s in report))
    assert {x[0] for x in report} >= {"GoodputEngineDown", "GoodputKVCacheSaturated", "GoodputSLOBurnRateFast",
                                      "goodput:slo_attainment:ratio_rate5m"}


# ------------------------------------------------------------------------------------ upgrade/remove
@pytest.mark.timeout(300)
def test_helm_upgrade_rolls_the_operator_with_the_new_value(kubectl: Kubectl, release: str, ns: str, diag):
    (old,) = release_pods(kubectl, "operator")
    helm("upgrade", RELEASE, str(CHART), "-n", RELEASE_NS, "--reuse-values", "--set", "operator.resyncSeconds=7")

    def new_pod() -> dict[str, Any] | None:
        pods = release_pods(kubectl, "operator")
        if len(pods) == 1 and pods[0]["metadata"]["uid"] != old["metadata"]["uid"] and ready(pods[0]):
            return pods[0]
        return None

    pod = wait_for(new_pod, 180, "the upgraded operator pod Ready", on_timeout=diag)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["GOODPUT_OPERATOR_RESYNC_SECONDS"] == "7"
    wait_for(lambda: not processes_of(old["metadata"]["name"]), 60, "the old operator's processes gone")
    procs = wait_for(lambda: processes_of(pod["metadata"]["name"]), 30, "the new operator process")
    assert any(p[2].get("GOODPUT_OPERATOR_RESYNC_SECONDS") == "7" for p in procs)
    # the new operator works: a deleted child comes back on its next resync
    kubectl.run("-n", ns, "delete", "service", NAME)
    wait_for(lambda: kubectl.run("-n", ns, "get", "service", NAME, check=False).returncode == 0, 90,
             "the Service recreated by the upgraded operator", on_timeout=diag)
    assert helm("history", RELEASE, "-n", RELEASE_NS, "-o", "json").stdout.count('"revision"') == 2


@pytest.mark.timeout(300)
def test_a_kubectl_applied_crd_moves_under_the_chart(kubectl: Kubectl, release: str, ns: str, diag):
    """docs/kubernetes.md: `cluster.sh up` applied the CRD with kubectl; Helm 4 takes it over with server-side apply."""
    crd = "inferenceservices.serving.goodput.dev"
    before = kubectl.json("get", "crd", crd)["metadata"]
    assert "meta.helm.sh/release-name" not in (before.get("annotations") or {})
    helm("upgrade", RELEASE, str(CHART), "-n", RELEASE_NS, "--reuse-values", "--set", "crds.install=true",
         "--take-ownership", "--server-side=true", "--force-conflicts")
    meta = kubectl.json("get", "crd", crd)["metadata"]
    assert meta["uid"] == before["uid"]  # the same object, not a new one (that would have deleted every gisvc)
    assert meta["annotations"]["meta.helm.sh/release-name"] == RELEASE
    assert meta["annotations"]["meta.helm.sh/release-namespace"] == RELEASE_NS
    assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert kubectl.run("-n", ns, "get", "gisvc", NAME, check=False).returncode == 0


@pytest.mark.timeout(300)
def test_helm_uninstall_leaves_no_operator_objects(kubectl: Kubectl, release: str, ns: str, diag):
    pods = release_pods(kubectl, "operator") + release_pods(kubectl, "autoscaler")
    helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait")
    sel = f"app.kubernetes.io/instance={RELEASE}"

    def leftovers() -> list[str]:
        names = kubectl.run("-n", RELEASE_NS, "get", "deploy,rs,pods,svc,sa,cm,role,rolebinding", "-l", sel,
                            "-o", "name", check=False).stdout.split()
        names += kubectl.run("get", "clusterrole,clusterrolebinding", "-l", sel, "-o", "name",
                             check=False).stdout.split()
        return names

    wait_for(lambda: not leftovers(), 120, "no object of the release left",
             on_timeout=lambda: "\n".join(leftovers()) + diag())
    wait_for(lambda: not any(processes_of(p["metadata"]["name"]) for p in pods), 60,
             "the operator and autoscaler processes stopped")
    # what stays: the CRD (the release's since the move above, kept by helm.sh/resource-policy) and the
    # InferenceService with its workers
    assert kubectl.run("get", "crd", "inferenceservices.serving.goodput.dev", check=False).returncode == 0
    assert kubectl.run("-n", ns, "get", "gisvc", NAME, check=False).returncode == 0
    # ... with its workers still running (docs/kubernetes.md: delete the InferenceServices first to stop them)
    workers = [p for p in kubectl.json("-n", ns, "get", "pods", "-l",
                                       f"serving.goodput.dev/inferenceservice={NAME}")["items"] if ready(p)]
    assert workers and all(processes_of(p["metadata"]["name"]) for p in workers)
