"""The router on the local cluster, installed by the Helm chart, in front of real worker pods.

The chart (operator, autoscaler, router: 2 replicas) is installed as release ``gpr`` in its own
namespace; every control-plane pod runs as a process in its own network namespace with its
ServiceAccount token (the test kubelet), so the router works with exactly the chart's RBAC. There
is no kube-proxy: the test reaches the routers and the workers by pod IP. In file order:

1. An InferenceService with 3 worker pods; its ``status.url`` is the router's Service URL (the
   operator's ``--router-url``), as the ``URL`` column of ``kubectl get gisvc`` shows.
2. Prefix affinity, measured: a dozen conversations x 4 turns (a shared system prompt, a history
   that grows each turn) through the routers (turns alternate between the two replicas: they
   agree without shared state), then the same kind of conversations (another system prompt) sent
   to a pod picked at random per request (what kube-proxy does). For both: the workers' own
   prefix-cache counters (hit tokens / looked-up tokens, summed over the pods) and the client's
   TTFT p50/p90. Target: hit rate >= 0.8 through the router (its own test, expected to fail while
   the target is missed: the reason is on it). Then an A/B of the router's cache knowledge: two
   more pairs of routers started by the test on loopback (static discovery of the same three pods,
   the chart's flags but ``--kv-events off`` / ``on``), turns alternating within a pair, each pair
   sending the same conversations under its own ``cache_salt`` (the same text and replies, no
   shared cache): the KV-event index's hit rate must be at least the request-history index's. The table goes to ``$GOODPUT_E2E_LOGS/router-e2e.md`` (and to
   ``$GOODPUT_ROUTER_E2E_RESULTS`` when set).
3. A pod annotated ``serving.goodput.dev/draining: "true"`` gets no new request from the router.
4. Scale-in through the autoscaler (``maxReplicas`` lowered to 2) with streams on every pod (two on
   two of them, one on the third): the least busy pod is the one drained and removed, no stream is
   cut (the drained pod's included), and no request sent through the router meanwhile reaches it.
5. Scale from zero: at 0 replicas (``minReplicas: 0``) a request through the router is held, the
   autoscaler scales to 1 on the router's held count (``ScaleFromZero``) and the request gets 200.
6. Disaggregated prefill/decode: a second InferenceService with one decode and one prefill pod; 8
   prompts (98 to 2,000 tokens) through the router are prefilled remotely and decode to the same
   text as a local prefill, the KV bytes match the formula, nothing is left leased; a client that
   hangs up mid-prefill leaks nothing; the prefill pod killed under a request does not fail it.

Timing: no assertion depends on how fast anything is; waits are bounded polls.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from goodput.api import router_metrics as R
from goodput.api import worker_metrics as W
from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT, Kubectl, LogFile, Proc, wait_for
from test_helm_e2e import CHART, helm, ready
from test_operator_e2e import POD_READY_S, pod_ip

pytestmark = [pytest.mark.e2e]

RELEASE, RNS = "gpr", "goodput-router"
ROUTER_PORT = 8080
ROUTER_URL = f"http://goodput-router.{RNS}.svc:{ROUTER_PORT}"
NAME = "chat"
SELECTOR = f"serving.goodput.dev/inferenceservice={NAME},app.kubernetes.io/component=worker"
MODEL = "smollm2"
# the worktree's code in every pod (the operator's, the autoscaler's, the routers' and the workers')
PYTHONPATH = os.pathsep.join(str(ROOT / d) for d in ("operator", "autoscaler", "worker_image", "bench", "router"))
CONVERSATIONS, TURNS, REPLY_TOKENS, CONCURRENCY = 12, 4, 24, 3
HISTORY, EVENTS = "router, request-history index", "router, KV-event index"  # the A/B's modes
STREAM_TOKENS = 300  # busy pods' streams: long enough to outlive one autoscaler period, a drain, a deletion
# the least busy pod's stream: it must end within the test kubelet's grace-period cap (60 s) after the
# SIGTERM that follows its drain, on a loaded 2-core machine (a few tokens per second)
SHORT_STREAM_TOKENS = 60

SPEC: dict[str, Any] = {
    "model": {"name": MODEL},
    "engine": {"dtype": "float32", "kvCacheMemory": "128Mi", "maxModelLen": 1024, "maxNumSeqs": 4,
               "maxNumBatchedTokens": 256, "maxWaiting": 8},
    "resources": {"cpu": "500m", "memory": "1Gi"},
    "replicas": 3,
    "slo": {"ttftMs": 5000, "tpotMs": 500, "attainmentTarget": 0.9},
    "podTemplate": {"env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "PYTHONPATH", "value": PYTHONPATH}]},
    "probes": {"periodSeconds": 1},
}

WORDS = ("river", "garden", "engine", "window", "planet", "market", "ladder", "violin", "harbor", "pencil",
         "forest", "castle", "rocket", "candle", "bridge", "meadow", "silver", "thunder", "orchard", "lantern")


def system_prompt(phase: str) -> str:
    rng = random.Random(phase)
    facts = " ".join(f"Fact {i}: the {rng.choice(WORDS)} is near the {rng.choice(WORDS)}." for i in range(24))
    return f"You are the {phase} assistant. Answer in one short sentence. Remember these facts. {facts}"


def user_turn(phase: str, conv: int, turn: int) -> str:
    rng = random.Random(f"{phase}/{conv}/{turn}")
    return (f"Conversation {conv}, question {turn}: where is the {rng.choice(WORDS)} and what does "
            f"it have to do with the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?")


# ------------------------------------------------------------------------------------------ helpers
def worker_pods(kubectl: Kubectl, ns: str) -> list[dict[str, Any]]:
    return [p for p in kubectl.json("-n", ns, "get", "pods", "-l", SELECTOR)["items"]
            if not p["metadata"].get("deletionTimestamp")]


def router_pods(kubectl: Kubectl) -> list[dict[str, Any]]:
    pods = kubectl.json("-n", RNS, "get", "pods", "-l",
                        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=router")["items"]
    return sorted((p for p in pods if not p["metadata"].get("deletionTimestamp") and ready(p)),
                  key=lambda p: p["metadata"]["name"])


def prefix_counters(ip: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, looked-up tokens) of one worker, from its /metrics."""
    text = httpx.get(f"http://{ip}:8000/metrics", timeout=30).text
    got = {W.PREFIX_CACHE_HITS: 0.0, W.PREFIX_CACHE_QUERIES: 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            base = s.name.removesuffix("_total")
            if base in got and s.name.endswith("_total"):
                got[base] += s.value
    return got[W.PREFIX_CACHE_HITS], got[W.PREFIX_CACHE_QUERIES]


def fleet_counters(ips: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for ip in ips:
        h, q = prefix_counters(ip)
        hits, queries = hits + h, queries + q
    return hits, queries


def chat_stream(http: httpx.Client, base: str, messages: list[dict[str, str]],
                salt: str | None = None) -> tuple[str, float, str | None]:
    """One streamed chat completion (``salt``: its ``cache_salt``): (reply text, client TTFT in
    seconds, x-goodput-pod header)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, **({"cache_salt": salt} if salt else {})}
    t0 = time.monotonic()
    ttft, parts, done = None, [], False
    with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, (base, r.status_code, r.read()[:500])
        pod = r.headers.get("x-goodput-pod")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                for ch in ev["choices"]:
                    text = (ch.get("delta") or {}).get("content")
                    if text:
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        parts.append(text)
    assert done and ttft is not None, (base, parts)
    return "".join(parts), ttft, pod


def run_conversations(phase: str, target, salt: str | None = None) -> dict[str, Any]:
    """CONVERSATIONS x TURNS chat turns; turn k of every conversation runs (CONCURRENCY at a time)
    before turn k+1. ``target(conv, turn) -> base URL``; ``salt``: every request's ``cache_salt``
    (the same conversations under another salt share no cached block). Returns TTFTs and the pods
    that served."""
    system = system_prompt(phase)
    histories = [[{"role": "system", "content": system}] for _ in range(CONVERSATIONS)]
    ttfts: list[float] = []
    pods: list[list[str | None]] = [[] for _ in range(CONVERSATIONS)]
    lock = threading.Lock()
    with httpx.Client(timeout=httpx.Timeout(300, connect=10)) as http:
        for turn in range(TURNS):
            def one(conv: int) -> None:
                msgs = histories[conv] + [{"role": "user", "content": user_turn(phase, conv, turn)}]
                reply, ttft, pod = chat_stream(http, target(conv, turn), msgs, salt)
                with lock:
                    histories[conv] = msgs + [{"role": "assistant", "content": reply}]
                    ttfts.append(ttft)
                    pods[conv].append(pod)
            with ThreadPoolExecutor(CONCURRENCY) as ex:
                list(ex.map(one, range(CONVERSATIONS)))
    return {"ttfts": ttfts, "pods": pods}


def router_decisions(routers: list[str]) -> dict[str, float]:
    """goodput_router_decisions_total by reason, summed over the routers."""
    out: dict[str, float] = {}
    for base in routers:
        for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
            for s in fam.samples:
                if s.name == R.DECISIONS_TOTAL:
                    out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
    return out


def quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


class World:
    """What the tests, in file order, share."""
    rows: list[dict[str, Any]] = []


@contextlib.contextmanager
def host_router(name: str, workers: list[str], logs_dir: Path, *flags: str) -> Iterator[str]:
    """A router process on loopback with static discovery of ``workers`` (pod IPs): its base URL."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    static = f"{MODEL}=" + ",".join(f"http://{ip}:8000" for ip in workers)
    proc = Proc(name, [sys.executable, "-m", "goodput.router", "--host", "127.0.0.1", "--port", str(port),
                       "--static", static, *flags], logs_dir / f"{name}.log", env).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ok(f"{base}/ready"), 60, f"{name} ready", on_timeout=proc.log)
        yield base
    finally:
        proc.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_synced(base: str) -> int:
    """How many pods a router's KV-event index has installed a snapshot of."""
    pods = set()
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == R.KV_RESYNCS + "_total" and s.value > 0:
                pods.add(s.labels["pod"])
    return len(pods)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def release(kubectl: Kubectl, crd: dict, kubelet: LogFile, operator, ns: str):
    """The chart with the router, in its own namespace; the suite's operator is paused meanwhile (the
    chart's operator, started with --router-url, reconciles)."""
    operator.stop()
    env = json.dumps([{"name": "PYTHONPATH", "value": PYTHONPATH}])
    try:
        helm("install", RELEASE, str(CHART), "-n", RNS, "--create-namespace", "--set", "crds.install=false",
             "--set", "operator.resyncSeconds=10", "--set", "autoscaler.period=2", "--set", "autoscaler.replicas=1",
             "--set", "dashboards.enabled=false", "--set-json", f"operator.extraEnv={env}",
             "--set-json", f"autoscaler.extraEnv={env}", "--set-json", f"router.extraEnv={env}")
        yield RELEASE
    finally:
        helm("uninstall", RELEASE, "-n", RNS, "--wait", check=False)
        operator.start()


@pytest.fixture
def diag(kubectl: Kubectl, ns: str, kubelet: LogFile):
    def dump() -> str:
        out = [kubectl.run("get", "pods", "-A", "-o", "wide", check=False).stdout,
               kubectl.run("-n", ns, "get", "gisvc", NAME, "-o", "yaml", check=False).stdout[-3000:], kubelet.log(30)]
        for f in sorted((kubelet.log_path.parent / "pods").glob(f"{RNS}_{RELEASE}-*.log")):
            out.append(LogFile(f.name, f).log(30))
        return "\n".join(out)
    return dump


@pytest.fixture(scope="module")
def fleet(kubectl: Kubectl, release: str, ns: str):
    kubectl.run("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": ns}, "spec": SPEC}))
    return NAME


# -------------------------------------------------------------------------------------------- tests
@pytest.mark.timeout(2 * POD_READY_S + 120)
def test_routers_and_three_workers_ready_status_url_is_the_routers(kubectl: Kubectl, fleet: str, ns: str, diag):
    wait_for(lambda: len(router_pods(kubectl)) == 2, 180, "2 router pods Ready (discovery synced)", on_timeout=diag)
    wait_for(lambda: len([p for p in worker_pods(kubectl, ns) if ready(p)]) == 3, 2 * POD_READY_S,
             "3 Ready worker pods", interval=2, on_timeout=diag)
    wait_for(lambda: (kubectl.json("-n", ns, "get", "gisvc", NAME).get("status") or {}).get("url") == ROUTER_URL,
             60, "status.url = the router's URL", on_timeout=diag)
    table = kubectl.run("-n", ns, "get", "gisvc", NAME).stdout
    assert ROUTER_URL in table, table
    # the chart's RBAC is all the router has: it lists and watches, nothing else
    for verb, resource, allowed in (("watch", "pods", "yes"), ("list", "inferenceservices.serving.goodput.dev", "yes"),
                                    ("get", "secrets", "no"), ("patch", "pods", "no")):
        r = kubectl.run("auth", "can-i", verb, resource, "-A",
                        f"--as=system:serviceaccount:{RNS}:{RELEASE}-goodput-router", check=False)
        assert r.stdout.strip() == allowed, (verb, resource, r.stdout, r.stderr)
    for p in router_pods(kubectl):
        models = httpx.get(f"http://{pod_ip(p)}:{ROUTER_PORT}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.timeout(1200)
def test_prefix_affinity_through_the_router_vs_random_pods(kubectl: Kubectl, fleet: str, ns: str, logs_dir: Path,
                                                           diag):
    workers = sorted(pod_ip(p) for p in worker_pods(kubectl, ns) if ready(p))
    routers = [f"http://{pod_ip(p)}:{ROUTER_PORT}" for p in router_pods(kubectl)]
    assert len(workers) == 3 and len(routers) == 2
    rng = random.Random(7)
    results = {}

    def measure(mode: str, target, counted: list[str], phase: str | None = None, salt: str | None = None) -> None:
        h0, q0 = fleet_counters(workers)
        d0 = router_decisions(counted)
        run = run_conversations(phase or mode, target, salt)
        h1, q1 = fleet_counters(workers)
        d1 = router_decisions(counted)
        results[mode] = {"hits": h1 - h0, "queries": q1 - q0,
                         "decisions": {k: v - d0.get(k, 0) for k, v in d1.items() if v - d0.get(k, 0)}, **run}

    measure("router", lambda conv, turn: routers[turn % 2], routers)
    measure("random pod", lambda conv, turn: f"http://{rng.choice(workers)}:8000", [])
    # the A/B: the same conversations (same text, so the same replies) under two cache salts, each
    # through its own pair of routers alternating turns as the chart's do
    for mode, events in ((HISTORY, "off"), (EVENTS, "on")):
        with contextlib.ExitStack() as stack:
            pair = [stack.enter_context(host_router(f"router-kv-events-{events}-{i}", workers, logs_dir,
                                                    "--kv-events", events)) for i in range(2)]
            if events == "on":  # the index follows each pod's events once it has synced from its snapshot
                wait_for(lambda: all(kv_synced(b) == len(workers) for b in pair), 60,
                         "KV events synced with every pod")
            measure(mode, lambda conv, turn: pair[turn % 2], pair, phase="a/b", salt=events)
    rows = []
    for mode, r in results.items():
        stayed = sum(1 for ps in r["pods"] if len(set(ps)) == 1) if mode != "random pod" else None
        rows.append({"mode": mode, "requests": len(r["ttfts"]), "hit_rate": r["hits"] / r["queries"],
                     "hits": r["hits"], "queries": r["queries"], "p50": quantile(r["ttfts"], 0.5),
                     "p90": quantile(r["ttfts"], 0.9), "stayed": stayed})
    World.rows = rows
    lines = [f"Router e2e ({datetime.date.today().isoformat()}): {CONVERSATIONS} conversations x {TURNS} turns, "
             f"{REPLY_TOKENS}-token replies, {CONCURRENCY} at a time; 3 worker pods (SmolLM2-135M fp32, CPU, "
             "local cluster on a shared 2-core machine); prefix-cache counters from the workers' /metrics; "
             "TTFT measured by the client (through the router: router time included).", "",
             "| sent | requests | prefix-cache hit rate (hit / looked-up prompt tokens) | TTFT p50 | TTFT p90 | "
             "conversations on one pod |", "|---|---|---|---|---|---|"]
    for r in rows:
        stayed = "" if r["stayed"] is None else f"{r['stayed']}/{CONVERSATIONS}"
        lines.append(f"| {r['mode']} | {r['requests']} | {r['hit_rate']:.3f} ({r['hits']:.0f} / {r['queries']:.0f}) "
                     f"| {r['p50'] * 1000:.0f} ms | {r['p90'] * 1000:.0f} ms | {stayed} |")
    decisions = results["router"]["decisions"]
    letter = {pod: "ABC"[i] for i, pod in enumerate(sorted(p["metadata"]["name"] for p in worker_pods(kubectl, ns)))}
    paths = " ".join("".join(letter.get(p, "?") for p in ps) for ps in results["router"]["pods"])
    lines += ["", f"Routing decisions of the two routers over the router run ({R.DECISIONS_TOTAL}): "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(decisions.items()))
              + f"; the pod (A, B, C) of each turn, per conversation: {paths}."]
    text = "\n".join(lines) + "\n"
    (logs_dir / "router-e2e.md").write_text(text)
    out = os.environ.get("GOODPUT_ROUTER_E2E_RESULTS")
    if out:
        Path(out).write_text(text)
    print("\n" + text, file=sys.stderr)
    assert all(r["requests"] == CONVERSATIONS * TURNS for r in rows)


@pytest.mark.xfail(strict=False, reason=(
    "measured 0.77-0.87 over six runs (bench/results/2026-12-01-router-e2e.md): the load bound moves "
    "conversations depending on how the 3 in-flight requests overlap; a new conversation's first turn is "
    "placed under the strict bound and its later turns may then move to their rendezvous home"))
def test_prefix_cache_hit_rate_through_the_router_meets_the_target():
    by = {r["mode"]: r for r in World.rows}
    assert by, "the measurement above did not run"
    assert by["router"]["hit_rate"] >= 0.8 and by["router"]["hit_rate"] > by["random pod"]["hit_rate"], World.rows


def test_kv_event_index_hits_at_least_as_often_as_the_request_history_index():
    by = {r["mode"]: r for r in World.rows}
    assert HISTORY in by and EVENTS in by, "the measurement above did not run"
    assert by[EVENTS]["hit_rate"] >= by[HISTORY]["hit_rate"], World.rows


def _served_by(http: httpx.Client, base: str, prompt: str) -> str:
    r = http.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.headers["x-goodput-pod"]


@pytest.mark.timeout(300)
def test_a_pod_annotated_draining_gets_no_new_request(kubectl: Kubectl, fleet: str, ns: str, diag):
    router = f"http://{pod_ip(router_pods(kubectl)[0])}:{ROUTER_PORT}"
    prompt = system_prompt("drain") + " Question: where is the river?"
    with httpx.Client(timeout=120) as http:
        home = _served_by(http, router, prompt)
        assert _served_by(http, router, prompt) == home  # affinity: the same pod again
        kubectl.run("-n", ns, "annotate", "pod", home, "serving.goodput.dev/draining=true")
        try:
            # the router learns it from its pod watch: the conversation moves, then stays away
            wait_for(lambda: _served_by(http, router, prompt) != home, 60, f"a request served by another pod "
                     f"than the draining {home}", on_timeout=diag)
            assert all(_served_by(http, router, prompt) != home for _ in range(5))
        finally:
            kubectl.run("-n", ns, "annotate", "pod", home, "serving.goodput.dev/draining-")


class Stream(threading.Thread):
    """One long streamed completion straight to a pod; records whether it ended with every token."""

    def __init__(self, ip: str, i: int, max_tokens: int = STREAM_TOKENS):
        super().__init__(daemon=True)
        self.ip, self.i, self.max_tokens = ip, i, max_tokens
        self.started = threading.Event()
        self.tokens, self.finish, self.done, self.error = 0, None, False, None

    def run(self) -> None:
        body = {"model": MODEL, "prompt": f"Stream {self.i}: tell me a long story", "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"http://{self.ip}:8000/v1/completions", json=body, timeout=600) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        ch = json.loads(line[6:])["choices"]
                        if ch:
                            self.tokens += 1
                            self.started.set()
                            self.finish = ch[0].get("finish_reason") or self.finish
        except Exception as e:  # noqa: BLE001 - a cut stream is what the test reports
            self.error = repr(e)
        finally:
            self.started.set()


@pytest.mark.timeout(600)
def test_scale_in_drains_the_least_busy_pod_and_cuts_no_stream(kubectl: Kubectl, fleet: str, ns: str, diag):
    pods = sorted(worker_pods(kubectl, ns), key=lambda p: p["metadata"]["name"])
    assert len(pods) == 3 and all(ready(p) for p in pods)
    busy, least = pods[:2], pods[2]
    least_name = least["metadata"]["name"]
    # 2, 2 and 1 in flight
    streams = [Stream(pod_ip(p), i) for i, p in enumerate(busy * 2)] + [Stream(pod_ip(least), 4, SHORT_STREAM_TOKENS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(300) and s.error is None, s.error
    # the autoscaler takes over with room for 2: it drains the least busy pod, then lowers replicas
    kubectl.run("-n", ns, "patch", "gisvc", NAME, "--type=merge", "-p", json.dumps(
        {"spec": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2}}}))

    def annotated() -> str | None:
        for p in kubectl.json("-n", ns, "get", "pods", "-l", SELECTOR)["items"]:
            if (p["metadata"].get("annotations") or {}).get("serving.goodput.dev/draining") == "true":
                return p["metadata"]["name"]
        return None

    drained = wait_for(annotated, 120, "a pod annotated draining by the autoscaler", interval=0.5, on_timeout=diag)
    assert drained == least_name, (drained, least_name)
    # from now on, requests through the router never reach it (all answered 200 by the others)
    router = f"http://{pod_ip(router_pods(kubectl)[0])}:{ROUTER_PORT}"
    served: list[str] = []
    with httpx.Client(timeout=120) as http:
        def gone() -> bool:
            served.append(_served_by(http, router, f"Scale-in probe {len(served)}: hello"))
            return least_name not in {p["metadata"]["name"] for p in
                                      kubectl.json("-n", ns, "get", "pods", "-l", SELECTOR)["items"]}
        wait_for(gone, 240, f"the drained pod {least_name} deleted", interval=0.5, on_timeout=diag)
    assert served and least_name not in served, served
    assert kubectl.json("-n", ns, "get", "gisvc", NAME)["spec"]["replicas"] == 2
    for s in streams:
        s.join(timeout=600)
    bad = [(s.ip, s.tokens, s.finish, s.done, s.error) for s in streams
           if s.error or not s.done or s.finish != "length" or s.tokens != s.max_tokens]
    assert not bad, bad


@pytest.mark.timeout(POD_READY_S + 300)
def test_a_request_at_zero_replicas_is_held_and_served(kubectl: Kubectl, fleet: str, ns: str, diag):
    # one write: replicas 0 and minReplicas 0 (the autoscaler never sees one without the other)
    kubectl.run("-n", ns, "patch", "gisvc", NAME, "--type=merge", "-p", json.dumps(
        {"spec": {"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 1,
                                                 "scaleToZeroIdleSeconds": 3600}}}))
    wait_for(lambda: not kubectl.json("-n", ns, "get", "pods", "-l", SELECTOR)["items"], 180,
             "every worker pod gone", interval=1, on_timeout=diag)
    assert kubectl.json("-n", ns, "get", "gisvc", NAME)["spec"]["replicas"] == 0
    router = f"http://{pod_ip(router_pods(kubectl)[0])}:{ROUTER_PORT}"
    r = httpx.post(f"{router}/v1/completions", timeout=POD_READY_S + 240, json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
    status = kubectl.json("-n", ns, "get", "gisvc", NAME)
    reasons = [d.get("reason") for d in ((status.get("status") or {}).get("autoscaler") or {}).get("decisions", [])]
    assert "ScaleFromZero" in reasons, reasons
    assert status["spec"]["replicas"] == 1


# ------------------------------------------------------------------------- disaggregated prefill/decode
PD_NAME, PD_MODEL = "pd", "smollm2-pd"


def pd_prompt(i: int, words: int) -> str:
    """Prompt ``i``: ``words`` numbered words (about 4.7 SmolLM2 tokens each), then a question."""
    return " ".join(f"{WORDS[(i + k) % len(WORDS)]} {k}" for k in range(words)) + f". Which word came {i + 3}rd?"


# 8 prompts past the threshold: 98 to 2,000 tokens (SmolLM2 tokenizes every digit alone)
PD_PROMPTS = [pd_prompt(i, n) for i, n in enumerate((25, 40, 60, 90, 130, 200, 300, 420))]


def metric_sum(ip_port: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` (``*_total`` of a counter) whose labels include ``labels``."""
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"http://{ip_port}/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.mark.timeout(2 * POD_READY_S + 900)
def test_long_prompts_are_prefilled_by_the_prefill_pool_and_decoded_the_same(kubectl: Kubectl, release: str,
                                                                             ns: str, diag):
    """spec.disaggregation on the cluster, one prefill and one decode pod: the router sends every
    prompt longer than remotePrefillMinTokens to the prefill pod, the decode pod pulls its KV and
    streams; for 8 prompts (~100 to ~2,000 tokens) the greedy text equals the decode pod's own local
    prefill of the same prompt; the KV bytes received equal those sent and are a whole number of
    2*L*n_kv*d_head*4 (float32) per token; afterwards neither pod holds a lease or a request."""
    spec = {**SPEC, "replicas": 1, "model": {"name": MODEL, "servedModelName": PD_MODEL},
            "engine": {**SPEC["engine"], "maxModelLen": 4096, "kvCacheMemory": "256Mi"},
            "disaggregation": {"enabled": True, "remotePrefillMinTokens": 16, "prefill": {"replicas": 1}}}
    kubectl.run("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": PD_NAME, "namespace": ns}, "spec": spec}))
    try:
        def pool(component: str) -> list[dict[str, Any]]:
            pods = kubectl.json("-n", ns, "get", "pods", "-l", f"serving.goodput.dev/inferenceservice={PD_NAME},"
                                f"app.kubernetes.io/component={component}")["items"]
            return [p for p in pods if ready(p)]

        [decode] = wait_for(lambda: pool("worker"), 2 * POD_READY_S, "a Ready decode pod", interval=2,
                            on_timeout=diag)
        [prefill] = wait_for(lambda: pool("prefill-worker"), 2 * POD_READY_S, "a Ready prefill pod", interval=2,
                             on_timeout=diag)
        d, p = f"{pod_ip(decode)}:8000", f"{pod_ip(prefill)}:8000"
        router = f"http://{pod_ip(router_pods(kubectl)[0])}:{ROUTER_PORT}"
        wait_for(lambda: PD_MODEL in [m["id"] for m in httpx.get(f"{router}/v1/models", timeout=30).json()["data"]],
                 120, "the router serving the P/D service", on_timeout=diag)

        def remote() -> float:
            return metric_sum(d, W.PREFILLS + "_total", where="remote")

        def complete(base: str, prompt: str) -> dict[str, Any]:
            r = httpx.post(f"{base}/v1/completions", timeout=POD_READY_S, json={
                "model": PD_MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        # the router may not have seen the prefill pod Ready yet: the first prompt until one is pulled
        first = wait_for(lambda: (out := complete(router, PD_PROMPTS[0])) and remote() >= 1 and out, 180,
                         "a remote prefill through the router", interval=5, on_timeout=diag)
        via_router = [first] + [complete(router, q) for q in PD_PROMPTS[1:]]
        pulled = remote()
        assert pulled >= len(PD_PROMPTS), pulled
        received = metric_sum(d, W.KV_TRANSFER_BYTES + "_total", direction="received")
        sent = metric_sum(p, W.KV_TRANSFER_BYTES + "_total", direction="sent")
        per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: L=30, n_kv=3, d_head=64, float32
        assert received > 0 and received == sent and received % per_token == 0, (received, sent)
        assert max(r["usage"]["prompt_tokens"] for r in via_router) >= 1900  # the ~2,000-token prompt
        for q, got in zip(PD_PROMPTS, via_router):
            local = complete(f"http://{d}", q)  # no transfer: the decode pod prefills it itself
            assert got["choices"][0]["text"] == local["choices"][0]["text"], q[:40]
            assert got["usage"] == local["usage"]
        # nothing left behind: no lease on the prefill pod, no request on either
        for pod in (p, d):
            assert metric_sum(pod, W.KV_LEASES) == 0 and metric_sum(pod, W.KV_LEASED_BLOCKS) == 0, pod
            assert metric_sum(pod, W.REQUESTS_RUNNING) == 0, pod

        # a client that goes away between the phases leaks nothing: whatever the prefill pod leased
        # for it is deleted by the router or expires with the lease (--kv-lease-seconds, 30 s)
        longest = PD_PROMPTS[-1]
        try:  # a read timeout of 1 s: the client hangs up mid-prefill (~2,000 tokens take longer here)
            httpx.post(f"{router}/v1/completions", timeout=httpx.Timeout(30.0, read=1.0), json={
                "model": PD_MODEL, "prompt": longest, "max_tokens": 64, "temperature": 0})
        except httpx.TimeoutException:
            pass
        wait_for(lambda: all(metric_sum(pod, W.KV_LEASES) == 0 and metric_sum(pod, W.KV_LEASED_BLOCKS) == 0
                             and metric_sum(pod, W.REQUESTS_RUNNING) == 0 for pod in (p, d)),
                 90, "no lease and no request left after the client went away", interval=2, on_timeout=diag)

        # the prefill pod killed while a long prompt is on its way: the request still completes, with
        # the same text (the decode pod prefills locally when the pull or the prefill call fails)
        want = complete(f"http://{d}", longest)["choices"][0]["text"]
        with ThreadPoolExecutor(1) as pool_:
            fut = pool_.submit(complete, router, longest)
            time.sleep(0.5)
            kubectl.run("-n", ns, "delete", "pod", prefill["metadata"]["name"], "--grace-period=0", "--force",
                        check=False)
            got = fut.result(timeout=POD_READY_S)
        assert got["choices"][0]["text"] == want
    finally:
        kubectl.run("-n", ns, "delete", "gisvc", PD_NAME, "--wait=false", check=False)
