"""Fixtures for the e2e suite: the cluster of ``e2e/cluster.sh up`` (control plane, CRD, test kubelet),
the operator as a subprocess, and a namespace per test module.

The suite starts nothing that ``cluster.sh up`` starts (one copy of that code): the ``crd`` and
``kubelet`` fixtures only check that the cluster has them. Run through ``bash e2e/run.sh`` (``up``, pytest,
``down``), or by hand: ``eval "$(bash e2e/cluster.sh up)"; python -m pytest e2e; bash e2e/cluster.sh down``.
Without KUBECONFIG the suite is skipped.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "crds"


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.e2e)


def wait_for(fn: Callable[[], Any], timeout: float, what: str, interval: float = 0.5,
             on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll ``fn`` until it returns a truthy value; fail after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except Exception as e:  # noqa: BLE001 - transient API errors while things start
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    extra = on_timeout() if on_timeout else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}\n{extra}")


class Kubectl:
    def __init__(self, kubeconfig: str):
        self.kubeconfig = kubeconfig

    def run(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(["kubectl", "--kubeconfig", self.kubeconfig, *args], input=input,
                           capture_output=True, text=True, timeout=60, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r

    def json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.run(*args, "-o", "json").stdout)


class LogFile:
    """A process's log file (the test kubelet of ``cluster.sh up``, or a ``Proc``)."""

    def __init__(self, name: str, path: Path):
        self.name, self.log_path = name, path

    def log(self, tail: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return f"--- {self.name} log (last {tail} lines)\n" + "\n".join(lines[-tail:])


class Proc(LogFile):
    """A background helper process (the operator) with its log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]):
        super().__init__(name, log)
        self.argv, self.env = argv, env
        self.p: subprocess.Popen | None = None

    def start(self) -> Proc:
        with open(self.log_path, "ab") as f:
            f.write(f"--- start {' '.join(self.argv)}\n".encode())
            self.p = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                      start_new_session=True)
        return self

    def stop(self, timeout: float = 40) -> None:
        if self.p is None or self.p.poll() is not None:
            return
        os.killpg(self.p.pid, signal.SIGTERM)
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(timeout=10)


@pytest.fixture(scope="session")
def kubeconfig() -> str:
    kc = os.environ.get("KUBECONFIG")
    if not kc or not Path(kc).exists():
        pytest.skip("no cluster: run `bash e2e/run.sh` (or start e2e/cluster.sh and export KUBECONFIG)")
    return kc


@pytest.fixture(scope="session")
def kubectl(kubeconfig: str) -> Kubectl:
    k = Kubectl(kubeconfig)
    wait_for(lambda: k.run("get", "--raw", "/readyz", check=False).returncode == 0, 60, "the API server")
    return k


@pytest.fixture(scope="session")
def k8s(kubeconfig: str):
    import kubernetes

    kubernetes.config.load_kube_config(config_file=kubeconfig)
    return kubernetes.client


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory) -> Path:
    d = Path(os.environ.get("GOODPUT_E2E_LOGS") or tmp_path_factory.mktemp("e2e-logs"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def crd(kubectl: Kubectl) -> dict[str, Any]:
    """The CRD that ``cluster.sh up`` applied, Established and in discovery."""
    name = "inferenceservices.serving.goodput.dev"
    if kubectl.run("get", "crd", name, check=False).returncode != 0:
        pytest.fail(f"CRD {name} missing: start the cluster with `bash e2e/cluster.sh up`")
    kubectl.run("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")
    # discovery (kubectl's cache, the operator's) must see the new kind before anyone uses it
    wait_for(lambda: "gisvc" in kubectl.run("api-resources", "--api-group=serving.goodput.dev",
                                            "--cached=false", check=False).stdout, 30, "gisvc in discovery")
    return kubectl.json("get", "crd", name)


def _child_env(kubeconfig: str) -> dict[str, str]:
    env = dict(os.environ)
    env["KUBECONFIG"] = kubeconfig
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session")
def cluster_logs(kubeconfig: str) -> Path:
    """Where ``cluster.sh`` writes its logs: $GOODPUT_E2E_LOGS, else <run dir>/log."""
    return Path(os.environ.get("GOODPUT_E2E_LOGS") or Path(kubeconfig).parent / "log")


@pytest.fixture(scope="session")
def kubelet(kubectl: Kubectl, cluster_logs: Path) -> LogFile:
    """The test kubelet of ``cluster.sh up`` (pods as processes in network namespaces), node Ready."""
    k = LogFile("kubelet", cluster_logs / "kubelet.log")
    wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True" for c in kubectl.json(
        "get", "node", "goodput-e2e-node").get("status", {}).get("conditions", [])),
        30, "the test node Ready (start the cluster with `bash e2e/cluster.sh up`)", on_timeout=k.log)
    return k


TEST_NODE, REAL_NODE = "goodput-e2e-node", "goodput-e2e-real"
# the pod networks the suite may send traffic to: the test node's (e2e/kubelet.py) and the real node's CNI bridge
POD_NETS = (ipaddress.ip_network("10.244.0.0/24"), ipaddress.ip_network("10.244.1.0/24"))


def pod_ip(pod: dict[str, Any]) -> str:
    """``pod``'s IP, checked to be on one of the local cluster's pod networks (never another address)."""
    ip = pod["status"]["podIP"]
    assert any(ipaddress.ip_address(ip) in n for n in POD_NETS), f"pod IP {ip} is not a test pod address"
    return ip


def node_ready(kubectl: Kubectl, node: str) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in kubectl.json(
        "get", "node", node).get("status", {}).get("conditions", []))


def has_node(kubectl: Kubectl, node: str) -> bool:
    return kubectl.run("get", "node", node, check=False).returncode == 0


@pytest.fixture(scope="session", autouse=True)
def suite_schedules_to_the_test_node(kubeconfig: str, kubectl: Kubectl) -> None:
    """The suite's pods go to the test node (its files kill pod processes, read host logs): ``cluster.sh
    up`` schedules to the real node when it has one, so that node is cordoned and the test node uncordoned
    for the session. A module that wants the real node takes ``real_node``."""
    if has_node(kubectl, REAL_NODE):
        kubectl.run("cordon", REAL_NODE)
        kubectl.run("uncordon", TEST_NODE)


@pytest.fixture(scope="module")
def real_node(kubectl: Kubectl, cluster_logs: Path) -> Iterator[LogFile | None]:
    """The real node of ``cluster.sh up`` (kubelet + containerd + runc + CNI, e2e/real-node.sh), Ready,
    as the only schedulable node while the module runs: the test node is cordoned meanwhile (the
    module's pods, the ones its operator makes included, all run on the real node), then both are put
    back as the suite keeps them (the real node cordoned). Yields the real kubelet's log; None when the
    cluster has no real node (``cluster.sh up`` with GOODPUT_REAL_NODE=0: the module's pods run on the test
    kubelet; ``up`` fails when it cannot start the real node)."""
    if not has_node(kubectl, REAL_NODE):
        yield None
        return
    log = LogFile("real kubelet", cluster_logs / "real-kubelet.log")
    wait_for(lambda: node_ready(kubectl, REAL_NODE), 30,
             f"node {REAL_NODE} Ready (start the cluster with `bash e2e/cluster.sh up`)", on_timeout=log.log)
    kubectl.run("cordon", TEST_NODE)
    kubectl.run("uncordon", REAL_NODE)
    try:
        yield log
    finally:
        kubectl.run("cordon", REAL_NODE, check=False)
        kubectl.run("uncordon", TEST_NODE, check=False)


def _service_account_kubeconfig(kubectl: Kubectl, kubeconfig: str, out: Path, rbac: str = "operator-rbac.yaml",
                                sa: str = "goodput-operator", ns: str = "goodput-system") -> str:
    """A kubeconfig for ServiceAccount ``ns/sa`` of e2e/``rbac`` (applied first)."""
    kubectl.run("apply", "-f", str(ROOT / "e2e" / rbac))
    secret = wait_for(lambda: (kubectl.json("-n", ns, "get", "serviceaccount", sa).get("secrets") or [{}])[0]
                      .get("name"), 30, f"the {sa} token Secret")
    token = wait_for(lambda: kubectl.json("-n", ns, "get", "secret", secret).get("data", {}).get("token"),
                     30, "the token")
    import base64

    cfg = yaml.safe_load(Path(kubeconfig).read_text())
    cluster = cfg["clusters"][0]
    out.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": [cluster],
        "users": [{"name": sa, "user": {"token": base64.b64decode(token).decode()}}],
        "contexts": [{"name": sa, "context": {"cluster": cluster["name"], "user": sa}}],
        "current-context": sa}))
    return str(out)


@pytest.fixture(scope="session")
def operator(kubeconfig: str, kubectl: Kubectl, crd: dict, logs_dir: Path) -> Iterator[Proc]:
    """The operator, running with only the rules of e2e/operator-rbac.yaml."""
    env = _child_env(_service_account_kubeconfig(kubectl, kubeconfig, logs_dir / "operator.kubeconfig"))
    env["GOODPUT_OPERATOR_RESYNC_SECONDS"] = env.get("GOODPUT_OPERATOR_RESYNC_SECONDS", "10")
    proc = Proc("operator", [sys.executable, "-m", "goodput.operator", "--all-namespaces"],
                logs_dir / "operator.log", env).start()
    try:
        time.sleep(1)
        assert proc.p is not None and proc.p.poll() is None, proc.log()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def namespace(kubectl: Kubectl) -> Iterator[str]:
    ns = f"e2e-{uuid.uuid4().hex[:6]}"
    kubectl.run("create", "namespace", ns)
    wait_for(lambda: kubectl.run("-n", ns, "get", "serviceaccount", "default", check=False).returncode == 0,
             30, f"default ServiceAccount in {ns}")
    try:
        yield ns
    finally:
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def ns(namespace: str, kubectl: Kubectl):
    """The module's namespace; InferenceServices left in it are deleted first (their finalizers run
    while the operator still does). test_autoscaler_e2e overrides it to stop its load first."""
    yield namespace
    kubectl.run("-n", namespace, "delete", "inferenceservice", "--all", "--wait=false", check=False)


@pytest.fixture
def diag(kubectl: Kubectl, ns: str, operator, kubelet):
    """A callable returning the namespace's objects and events plus operator and kubelet log tails,
    for assertion messages."""
    def dump() -> str:
        return "\n".join([kubectl.run("-n", ns, "get", "all,pdb,secret,inferenceservice,events", "-o", "wide",
                                      check=False).stdout, operator.log(40), kubelet.log(30)])
    return dump
