"""Operator latency, memory and resync cost: time InferenceServices from apply to Deployment created.

    eval "$(bash e2e/cluster.sh env)"     # a running cluster (bash e2e/cluster.sh start)
    python e2e/measure_latency.py [--count 50] [--interval 0]
    python e2e/measure_latency.py --preload 200 --count 60 --interval 1 --resync-passes 2

It applies the CRD, starts its own operator (``python -m goodput.operator --namespace NS``, resync period
``--resync-seconds``), creates ``--preload`` InferenceServices as a burst and waits for their Deployments,
then ``--count`` more ``--interval`` seconds apart (0 = a burst), all with ``replicas: 0`` (no worker
pods: this measures the control plane only), and watches Deployments in the namespace. Latency per
object = monotonic time the watch saw its Deployment ADDED minus the time just before the create call
was sent. Prints p50/p90/p99/max (nearest-rank), the operator's resident memory (VmRSS) idle and after
all objects settled plus its peak (VmHWM), the operator's CPU seconds in the window and the machine's load.

Then, with everything settled, it lets ``--resync-passes`` periodic resyncs run (no-op: nothing
changed) and reports per pass: the API requests the operator sent (from its "resync of N objects"
log line, per object and by method), the pass's duration, the operator's CPU seconds, and the writes
(POST/PUT/PATCH/DELETE) the API server counted (``apiserver_request_total``) on the operator's kinds
over the whole window: 0 is the goal. Cleans up its namespace and operator.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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


WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION")
OUR_RESOURCES = ("deployments", "services", "poddisruptionbudgets", "secrets", "inferenceservices")
RESYNC_LINE = re.compile(r"resync of (\d+) objects in ([0-9.]+) s: (\d+) API requests \(([^)]*)\)")


def apiserver_writes() -> dict[str, float]:
    """Writes the API server has counted so far on the operator's kinds, by "VERB resource[/sub]"."""
    from prometheus_client.parser import text_string_to_metric_families

    text = subprocess.run(["kubectl", "get", "--raw", "/metrics"], check=True, capture_output=True,
                          text=True).stdout
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "apiserver_request":  # the parser drops the counter's _total suffix
            continue
        for smp in fam.samples:
            lb = smp.labels
            if smp.name.endswith("_total") and lb.get("verb") in WRITE_VERBS and lb.get("resource") in OUR_RESOURCES:
                key = f"{lb['verb']} {lb['resource']}" + (f"/{lb['subresource']}" if lb.get("subresource") else "")
                out[key] = out.get(key, 0.0) + smp.value
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preload", type=int, default=0, help="InferenceServices created (as a burst) first")
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--interval", type=float, default=0.0, help="seconds between creates (0 = burst)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--resync-seconds", type=float, default=30.0, help="the operator's resync period")
    ap.add_argument("--resync-passes", type=int, default=0, help="no-op resync passes to measure (0 = none)")
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    a = ap.parse_args()
    if a.count < 1 or a.preload < 0 or a.resync_passes < 0:
        ap.error("--count must be >= 1, --preload and --resync-passes >= 0")
    kubernetes.config.load_kube_config()
    core, crds = kubernetes.client.CoreV1Api(), kubernetes.client.CustomObjectsApi()
    apps = kubernetes.client.AppsV1Api()
    subprocess.run(["kubectl", "apply", "-f", str(ROOT / "crds")], check=True, capture_output=True)
    subprocess.run(["kubectl", "wait", "--for=condition=Established", "--timeout=60s",
                    f"crd/{PLURAL}.{GROUP}"], check=True, capture_output=True)
    ns = f"latency-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    log_path = Path(f"/tmp/goodput-latency-operator-{ns}.log")
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GOODPUT_OPERATOR_RESYNC_SECONDS": str(a.resync_seconds)}
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
        preload: dict[str, float] = {}
        for i in range(a.preload):
            name = f"pre-{i:03d}"
            preload[name] = time.monotonic()
            crds.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body(name))
        deadline = time.monotonic() + a.timeout
        while not all(n in seen for n in preload) and time.monotonic() < deadline:
            time.sleep(0.1)
        pre_lat = [(seen[n] - preload[n]) * 1000 for n in preload if n in seen]
        if len(pre_lat) < len(preload):
            raise SystemExit(f"{len(preload) - len(pre_lat)} preloaded Deployments missing; see {log.name}")
        time.sleep(3 if a.preload else 0)  # their status writes settle
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
        resync: dict[str, object] = {}
        if a.resync_passes:
            resync = measure_resync(op.pid, log_path, 1 + a.preload + a.count, a.resync_passes,
                                    a.resync_seconds)
        result = {
            "preload": a.preload,
            "preload_p50_ms": round(percentile(pre_lat, 50), 1) if pre_lat else None,
            "preload_p99_ms": round(percentile(pre_lat, 99), 1) if pre_lat else None,
            "count": a.count, "interval_s": a.interval, "missing": len(missing),
            "p50_ms": round(percentile(lat, 50), 1), "p90_ms": round(percentile(lat, 90), 1),
            "p99_ms": round(percentile(lat, 99), 1), "max_ms": round(max(lat), 1),
            "operator_rss_idle_mib": round(idle["VmRSS"] / 1024, 1),
            "operator_rss_loaded_mib": round(loaded["VmRSS"] / 1024, 1),
            "operator_rss_peak_mib": round(loaded["VmHWM"] / 1024, 1),
            "operator_cpu_s": round(cpu, 2), "window_s": round(wall, 1), "send_s": round(send_s, 2),
            "loadavg_1m": float(Path("/proc/loadavg").read_text().split()[0]),
            "resync": resync,
        }
        if a.json:
            print(json.dumps(result))
        else:
            if a.preload:
                print(f"preload: {a.preload} InferenceServices as a burst: p50 {result['preload_p50_ms']} ms, "
                      f"p99 {result['preload_p99_ms']} ms")
            print(f"apply -> Deployment created, {a.count} InferenceServices "
                  f"({'burst' if not a.interval else f'every {a.interval}s'}):")
            print(f"  p50 {result['p50_ms']} ms   p90 {result['p90_ms']} ms   p99 {result['p99_ms']} ms   "
                  f"max {result['max_ms']} ms   missing {len(missing)}")
            print(f"operator RSS: idle {result['operator_rss_idle_mib']} MiB, with {a.count + 1} objects "
                  f"{result['operator_rss_loaded_mib']} MiB (peak {result['operator_rss_peak_mib']} MiB); "
                  f"operator CPU {result['operator_cpu_s']} s over {result['window_s']} s "
                  f"(machine load average {result['loadavg_1m']})")
            if resync:
                print(f"no-op resync of {resync['objects']} objects, {resync['passes']} passes: "
                      f"{resync['requests_per_object']} API requests per object per pass ({resync['by_method']}), "
                      f"{resync['pass_s']} s per pass, operator CPU {resync['cpu_s_per_pass']} s per pass, "
                      f"RSS {resync['rss_mib']} MiB; API server writes on our kinds: {resync['writes']}")
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


def measure_resync(pid: int, log_path: Path, objects: int, passes: int, period: float) -> dict[str, object]:
    """Wait for ``passes`` resync passes over all ``objects`` after now; their cost from the operator's
    log lines, its CPU time over the window, and the API server's write counters over the window."""
    offset = log_path.stat().st_size
    writes0, cpu0 = apiserver_writes(), cpu_seconds(pid)
    found: list[re.Match] = []
    deadline = time.monotonic() + (passes + 1) * period + 120
    while len(found) < passes and time.monotonic() < deadline:
        time.sleep(1)
        text = log_path.read_bytes()[offset:].decode(errors="replace")
        found = [m for m in RESYNC_LINE.finditer(text) if int(m.group(1)) == objects][:passes]
    if len(found) < passes:
        raise SystemExit(f"saw {len(found)} of {passes} resync passes over {objects} objects; see {log_path}")
    cpu = cpu_seconds(pid) - cpu0
    writes1 = apiserver_writes()
    writes = {k: int(v - writes0.get(k, 0)) for k, v in writes1.items() if v - writes0.get(k, 0) > 0}
    by_method: dict[str, int] = {}
    for m in found:
        for part in filter(None, (x.strip() for x in m.group(4).split(","))):
            if part != "none":
                verb, n = part.rsplit(" ", 1)
                by_method[verb] = by_method.get(verb, 0) + int(n)
    total = sum(int(m.group(3)) for m in found)
    return {
        "objects": objects, "passes": passes, "period_s": period,
        "requests_per_object": round(total / passes / objects, 2),
        "by_method": {k: round(v / passes / objects, 2) for k, v in sorted(by_method.items())},
        "pass_s": round(sum(float(m.group(2)) for m in found) / passes, 2),
        "cpu_s_per_pass": round(cpu / passes, 2),
        "rss_mib": round(rss_kib(pid)["VmRSS"] / 1024, 1),
        "writes": writes,
    }


if __name__ == "__main__":
    raise SystemExit(main())
