"""Operator latency and memory: create N InferenceServices, time each one until its Deployment exists.

    eval "$(bash e2e/cluster.sh env)"     # a running cluster (bash e2e/cluster.sh start)
    python e2e/measure_latency.py [--count 50] [--interval 0]

It applies the CRD, starts its own operator (``python -m goodput.operator --namespace NS``), creates
``--count`` InferenceServices with ``replicas: 0`` (no worker pods: this measures the control plane only)
through the API, ``--interval`` seconds apart (0 = a burst), and watches Deployments in the namespace.
Latency per object = monotonic time the watch saw its Deployment ADDED minus the time just before the
create call was sent. Prints p50/p90/p99/max (nearest-rank), the operator's resident memory (VmRSS) idle and after all
objects settled plus its peak (VmHWM), the operator's CPU seconds in the window and the machine's load. Cleans up its namespace and operator.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import kubernetes
from kubernetes.client.exceptions import ApiException

ROOT = Path(__file__).resolve().parents[1]
GROUP, VERSION, PLURAL = "serving.goodput.dev", "v1alpha1", "inferenceservices"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (fields 14 and 15 of /proc/PID/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--interval", type=float, default=0.0, help="seconds between creates (0 = burst)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    a = ap.parse_args()
    if a.count < 1:
        ap.error("--count must be >= 1")
    kubernetes.config.load_kube_config()
    core, crds = kubernetes.client.CoreV1Api(), kubernetes.client.CustomObjectsApi()
    apps = kubernetes.client.AppsV1Api()
    subprocess.run(["kubectl", "apply", "-f", str(ROOT / "crds")], check=True, capture_output=True)
    subprocess.run(["kubectl", "wait", "--for=condition=Established", "--timeout=60s",
                    f"crd/{PLURAL}.{GROUP}"], check=True, capture_output=True)
    ns = f"latency-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    log = open(f"/tmp/goodput-latency-operator-{ns}.log", "wb")  # noqa: SIM115 - lives as long as the process
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    op = subprocess.Popen([sys.executable, "-m", "goodput.operator", "--namespace", ns], stdout=log,
                          stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            w = kubernetes.watch.Watch()
            try:
                for ev in w.stream(apps.list_namespaced_deployment, ns, timeout_seconds=5):
                    if ev["type"] == "ADDED":
                        seen.setdefault(ev["object"].metadata.name, time.monotonic())
                    if stop.is_set():
                        break
            except Exception:  # noqa: BLE001 - re-watch
                time.sleep(0.2)

    def body(name: str) -> dict:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name},
                "spec": {"replicas": 0}}

    try:
        threading.Thread(target=watch, daemon=True).start()
        # warm-up: the operator is up and has discovered the API once this one's Deployment appears
        crds.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body("warmup"))
        t = time.monotonic()
        while "warmup" not in seen:
            if op.poll() is not None or time.monotonic() - t > 60:
                raise SystemExit(f"operator not working; see {log.name}")
            time.sleep(0.05)
        time.sleep(2)
        idle = rss_kib(op.pid)
        cpu0, wall0 = cpu_seconds(op.pid), time.monotonic()
        sent: dict[str, float] = {}
        for i in range(a.count):
            name = f"svc-{i:03d}"
            sent[name] = time.monotonic()
            crds.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body(name))
            if a.interval:
                time.sleep(a.interval)
        send_s = time.monotonic() - wall0
        deadline = time.monotonic() + a.timeout
        while not all(n in seen for n in sent) and time.monotonic() < deadline:
            time.sleep(0.05)
        missing = [n for n in sent if n not in seen]
        lat = [(seen[n] - sent[n]) * 1000 for n in sent if n in seen]
        time.sleep(3)  # let status writes settle
        loaded = rss_kib(op.pid)
        cpu = cpu_seconds(op.pid) - cpu0
        wall = time.monotonic() - wall0
        result = {
            "count": a.count, "interval_s": a.interval, "missing": len(missing),
            "p50_ms": round(percentile(lat, 50), 1), "p90_ms": round(percentile(lat, 90), 1),
            "p99_ms": round(percentile(lat, 99), 1), "max_ms": round(max(lat), 1),
            "operator_rss_idle_mib": round(idle["VmRSS"] / 1024, 1),
            "operator_rss_loaded_mib": round(loaded["VmRSS"] / 1024, 1),
            "operator_rss_peak_mib": round(loaded["VmHWM"] / 1024, 1),
            "operator_cpu_s": round(cpu, 2), "window_s": round(wall, 1), "send_s": round(send_s, 2),
            "loadavg_1m": float(Path("/proc/loadavg").read_text().split()[0]),
        }
        if a.json:
            print(json.dumps(result))
        else:
            print(f"apply -> Deployment created, {a.count} InferenceServices "
                  f"({'burst' if not a.interval else f'every {a.interval}s'}):")
            print(f"  p50 {result['p50_ms']} ms   p90 {result['p90_ms']} ms   p99 {result['p99_ms']} ms   "
                  f"max {result['max_ms']} ms   missing {len(missing)}")
            print(f"operator RSS: idle {result['operator_rss_idle_mib']} MiB, with {a.count + 1} objects "
                  f"{result['operator_rss_loaded_mib']} MiB (peak {result['operator_rss_peak_mib']} MiB); "
                  f"operator CPU {result['operator_cpu_s']} s over {result['window_s']} s "
                  f"(machine load average {result['loadavg_1m']})")
            print(json.dumps(result))
        return 1 if missing else 0
    finally:
        stop.set()
        if op.poll() is None:
            os.killpg(op.pid, signal.SIGTERM)
            try:
                op.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(op.pid, signal.SIGKILL)
        try:
            core.delete_namespace(ns)
        except ApiException:
            pass


if __name__ == "__main__":
    raise SystemExit(main())
