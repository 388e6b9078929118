"""``--prometheus-url`` against a REAL Prometheus scraping a REAL worker (no cluster needed).

Prometheus (the binary e2e/cluster.sh installs) scrapes one worker on 127.0.0.1 every second, with
the ``namespace`` and ``pod`` labels a Kubernetes pod scrape job adds. The PromQL source must give
exactly the sample a direct scrape gives once Prometheus has caught up, and the deltas between two
such samples must count the requests sent in between.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import wait_for
from goodput.autoscaler import observe
from goodput.autoscaler.loop import DirectScraper, ReadyPod
from goodput.autoscaler.promql import PrometheusSource

NS, POD = "team-a", "chat-7f9c-abcde"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "goodput.worker", "serve", "--model", "smollm2", "--host",
                              "127.0.0.1", "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16Mi",
                              "--max-model-len", "256"], stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: p.poll() is None and httpx.get(url + "/ready", timeout=2).status_code == 200, 300,
                 "the worker ready", on_timeout=lambda: log.read_text(errors="replace")[-2000:])
        yield port
    finally:
        p.terminate()
        p.wait(30)


@pytest.fixture(scope="module")
def prometheus(worker):
    binary = os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")
    if not binary:
        pytest.skip("no prometheus binary (bash e2e/cluster.sh install puts one on the cluster's PATH)")
    d = Path(tempfile.mkdtemp(prefix="goodput-prom-"))
    (d / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "goodput-workers", "static_configs": [
            {"targets": [f"127.0.0.1:{worker}"], "labels": {"namespace": NS, "pod": POD}}]}]}))
    port = _free_port()
    with open(d / "prometheus.log", "wb") as f:
        p = subprocess.Popen([binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                              f"--web.listen-address=127.0.0.1:{port}"], stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: p.poll() is None and httpx.get(url + "/-/ready", timeout=2).status_code == 200, 60,
                 "Prometheus ready", on_timeout=lambda: (d / "prometheus.log").read_text(errors="replace")[-2000:])
        yield url
    finally:
        p.terminate()
        p.wait(30)
        shutil.rmtree(d, ignore_errors=True)


def _complete(port: int, n: int) -> None:
    for i in range(n):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": f"Count to {i}:", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text


def _both(prom_url: str, port: int) -> tuple[observe.PodSample, observe.PodSample]:
    pod = ReadyPod(POD, "uid", "127.0.0.1", 10.0, metrics_port=port)

    async def go():
        async with httpx.AsyncClient() as c:
            direct = await DirectScraper(c, 5.0, clock=lambda: 0.0).samples(NS, [pod])
            via = await PrometheusSource(c, prom_url, timeout_s=5.0, clock=lambda: 0.0).samples(NS, [pod])
        return direct[POD], via[POD]
    return asyncio.run(go())


def _caught_up(prom_url: str, port: int):
    direct, via = _both(prom_url, port)
    return isinstance(via, observe.PodSample) and via == direct and via


@pytest.mark.timeout(420)
def test_promql_source_equals_a_direct_scrape_and_counts_deltas(worker, prometheus):
    _complete(worker, 3)
    first = wait_for(lambda: _caught_up(prometheus, worker), 30, "Prometheus to hold the worker's current series")
    assert first.admitted == 3 and first.finished == 3 and first.ttft.count == 3
    assert first.ttft.bounds[-1] == float("inf") and first.tpot.count == 3
    _complete(worker, 2)
    second = wait_for(lambda: _caught_up(prometheus, worker), 30, "Prometheus to see the next requests")
    o = observe.observation(POD, first, dataclasses.replace(second, time=5.0))
    assert (o.admitted, o.finished, o.ttft.count, o.tpot.count, o.interval_s) == (2, 2, 2, 2, 5.0)
    assert o.generation_tokens == 8  # 2 requests x 4 tokens (ignore_eos)

