"""--prometheus-url: the PromQL source against a fake Prometheus HTTP API that serves, as an instant
vector, exactly the series a real worker registry renders (plus other pods' and other jobs' series)."""
from __future__ import annotations

import asyncio
import urllib.parse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from goodput.autoscaler import observe
from goodput.autoscaler.loop import ReadyPod
from goodput.autoscaler.promql import PrometheusSource, query_for
from goodput.worker.metrics import WorkerMetrics
from test_autoscaler_observe import finished_request, stats


def _worker_text(admitted: int) -> str:
    wm = WorkerMetrics("smollm2", lambda: stats(running=2, waiting=1, used=5, blocks=10, max_num_seqs=4,
                                                max_waiting=3, admitted=admitted, finished={"stop": 3, "length": 1}))
    wm.observe_first_token(0.2, 0.0)
    wm.observe_finished("stop", finished_request(0.2, 0.03))
    return wm.render().decode()


def _vector(text: str, namespace: str, pod: str) -> list[dict]:
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.append({"metric": {"__name__": s.name, **s.labels, "namespace": namespace, "pod": pod,
                                   "job": "kubernetes-pods"}, "value": [1.7e9, repr(float(s.value))]})
    return out


class FakePrometheus:
    def __init__(self, series: list[dict], status: str = "success"):
        self.series, self.status, self.queries = series, status, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query"
        q = urllib.parse.parse_qs(request.url.query.decode())["query"][0]
        self.queries.append(q)
        if self.status != "success":
            return httpx.Response(400, json={"status": "error", "errorType": "bad_data", "error": "parse error"})
        # evaluate the query's namespace/pod matchers the way Prometheus would
        ns = q.split('namespace="')[1].split('"')[0]
        pods = q.split('pod=~"')[1].split('"')[0].split("|")
        res = [s for s in self.series if s["metric"]["namespace"] == ns and s["metric"]["pod"] in pods
               and s["metric"]["__name__"] in observe.needed_series()]
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": res}})


def _pods(*names):
    return [ReadyPod(n, f"uid-{n}", "10.244.0.9", 1.0) for n in names]


def _run(fake, names, clock=lambda: 42.0):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as c:
            return await PrometheusSource(c, "http://prom.example:9090/", clock=clock).samples("ns1", _pods(*names))
    return asyncio.run(go())


def test_same_sample_as_a_direct_scrape():
    text_a, text_b = _worker_text(7), _worker_text(11)
    fake = FakePrometheus(_vector(text_a, "ns1", "a") + _vector(text_b, "ns1", "b")
                          + _vector(_worker_text(99), "other-ns", "a"))
    got = _run(fake, ["a", "b", "c"])
    assert got["a"] == observe.parse_sample(text_a, 42.0)
    assert got["b"] == observe.parse_sample(text_b, 42.0) and got["b"].admitted == 11
    assert isinstance(got["c"], observe.MetricsParseError) and "no series of pod ns1/c" in str(got["c"])
    [q] = fake.queries
    assert q.startswith('{__name__=~"goodput_requests_running|') and 'namespace="ns1"' in q and 'pod=~"a|b|c"' in q


def test_prometheus_error_makes_every_pod_unreachable():
    got = _run(FakePrometheus([], status="error"), ["a", "b"])
    assert set(got) == {"a", "b"} and all("parse error" in str(e) for e in got.values())


def test_query_names_every_series_once():
    q = query_for("ns", ["p"])
    names = q.split('"')[1].split("|")
    assert len(names) == len(set(names)) == len(observe.needed_series())
    assert "goodput_time_to_first_token_seconds_bucket" in names and "goodput_requests_admitted_total" in names


@pytest.mark.parametrize("missing", ["goodput_requests_admitted_total", "goodput_time_per_output_token_seconds_bucket"])
def test_a_pod_missing_one_series_is_unreachable(missing):
    series = [s for s in _vector(_worker_text(1), "ns1", "a") if s["metric"]["__name__"] != missing]
    got = _run(FakePrometheus(series), ["a"])
    assert isinstance(got["a"], observe.MetricsParseError) and missing in str(got["a"])
