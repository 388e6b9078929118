"""Two autoscaler instances against a real API server: one leads (a coordination.k8s.io Lease),
only it decides and writes; the leader is killed (SIGKILL: no release), the standby takes over
within a lease duration and resumes from the state in status.

Both run as `python -m goodput.autoscaler` with only the rules of e2e/autoscaler-rbac.yaml. The
InferenceService has replicas 0 (minReplicas 0): no pod needs to load, the autoscaler still decides
and writes status.autoscaler every pass it leads. Who decides is read from each instance's own
/metrics (``goodput_autoscaler_decisions_total`` counts the passes it reconciled).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import Kubectl, Proc, _child_env, _service_account_kubeconfig, wait_for

pytestmark = [pytest.mark.e2e]

NAME = "le"
LEASE_NS = "goodput-system"
LEASE_S, RENEW_S, RETRY_S = 6, 4, 1
PORTS = {"a": 19291, "b": 19292}
SPEC = {"model": {"name": "smollm2"}, "replicas": 0,
        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}}


def decisions(port: int, ns: str) -> float:
    """This instance's reconciled passes of ns/NAME (0 when it never reconciled it)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "goodput_autoscaler_decisions_total"
               and s.labels.get("namespace") == ns and s.labels.get("inferenceservice") == NAME)


def holder(kubectl: Kubectl, lease: str) -> tuple[str | None, int]:
    spec = kubectl.json("-n", LEASE_NS, "get", "lease", lease).get("spec") or {}
    return spec.get("holderIdentity"), int(spec.get("leaseTransitions") or 0)


@pytest.fixture
def instances(kubeconfig: str, kubectl: Kubectl, crd: dict, logs_dir: Path, ns: str):
    kc = _service_account_kubeconfig(kubectl, kubeconfig, logs_dir / "autoscaler-le.kubeconfig",
                                     rbac="autoscaler-rbac.yaml", sa="goodput-autoscaler")
    lease = f"goodput-autoscaler-{ns}"
    procs = {}
    for who, port in PORTS.items():
        env = _child_env(kc)
        env["POD_NAME"] = who     # holder identity "<who>_<hex>"
        procs[who] = Proc(f"autoscaler-{who}", [
            sys.executable, "-m", "goodput.autoscaler", "--namespace", ns, "--period", "1",
            "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
            "--lease-name", lease, "--lease-namespace", LEASE_NS, "--lease-duration", str(LEASE_S),
            "--renew-deadline", str(RENEW_S), "--retry-period", str(RETRY_S)],
            logs_dir / f"autoscaler-{who}.log", env).start()
    try:
        yield lease, procs
    finally:
        for p in procs.values():
            p.stop()
        kubectl.run("-n", LEASE_NS, "delete", "lease", lease, check=False)


def test_one_leader_writes_and_a_standby_takes_over_when_it_dies(kubectl: Kubectl, ns: str, instances):
    lease, procs = instances
    kubectl.run("-n", ns, "apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": ns}, "spec": SPEC}))
    logs = lambda: "\n".join(p.log(30) for p in procs.values())  # noqa: E731

    leader_id, transitions = wait_for(lambda: holder(kubectl, lease)[0] and holder(kubectl, lease), 60,
                                      "a lease holder", on_timeout=logs)
    leader = leader_id.split("_")[0]
    standby = "b" if leader == "a" else "a"
    # the leader decides and writes status; the standby decides nothing
    wait_for(lambda: decisions(PORTS[leader], ns) >= 3, 60, "three passes of the leader", on_timeout=logs)
    first = kubectl.json("-n", ns, "get", "inferenceservice", NAME)["status"]["autoscaler"]
    since = first["policyState"].get("since")
    assert first["desiredReplicas"] == 0
    before = decisions(PORTS[leader], ns)
    wait_for(lambda: decisions(PORTS[leader], ns) >= before + 3, 60, "three more passes", on_timeout=logs)
    assert decisions(PORTS[standby], ns) == 0, logs()
    assert holder(kubectl, lease)[0] == leader_id

    # the leader dies without releasing: the standby takes over once the lease stood still a duration
    os.killpg(procs[leader].p.pid, signal.SIGKILL)
    procs[leader].p.wait(10)
    new_id, new_transitions = wait_for(
        lambda: (h := holder(kubectl, lease))[0] != leader_id and h, LEASE_S * 10, "the standby's takeover",
        on_timeout=logs)
    assert new_id.startswith(standby + "_") and new_transitions == transitions + 1
    wait_for(lambda: decisions(PORTS[standby], ns) >= 2, 60, "the new leader's passes", on_timeout=logs)
    # it resumed from the state in status: the policy's history start is the first leader's
    after = kubectl.json("-n", ns, "get", "inferenceservice", NAME)["status"]["autoscaler"]
    assert after["policyState"].get("since") == since
