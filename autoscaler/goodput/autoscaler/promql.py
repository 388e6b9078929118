"""``--prometheus-url``: read the workers' series from Prometheus instead of scraping each pod.

For fleets too large to scrape every period. One instant query per InferenceService and pass::

    {__name__=~"goodput_requests_running|...|goodput_time_per_output_token_seconds_sum",
     namespace="<ns>", pod=~"<ready pod>|<ready pod>|..."}

returns the same cumulative series a scrape would (the names from ``observe.needed_series()``),
so the deltas, counter resets and histogram increases are computed exactly as for direct scrapes
(``observe``). Assumes the usual Kubernetes pod scrape job that copies the pod's namespace and name
into the labels ``namespace`` and ``pod`` (the Helm chart's Prometheus does). The values lag by up
to one Prometheus scrape interval; over many passes the increases add up to the true totals. A pod
without series in the answer is *unreachable* for that pass (never a reason to scale down).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from goodput.autoscaler import observe

NAMESPACE_LABEL = "namespace"
POD_LABEL = "pod"


class PrometheusError(RuntimeError):
    """Prometheus answered with an error, or not with an instant vector."""


def query_for(namespace: str, pods: Sequence[str]) -> str:
    """The PromQL instant query for these pods' series (pod names are DNS labels: no regex escapes)."""
    names = "|".join(observe.needed_series())
    return (f'{{__name__=~"{names}",{NAMESPACE_LABEL}="{namespace}",'
            f'{POD_LABEL}=~"{"|".join(sorted(pods))}"}}')


class PrometheusSource:
    """A ``loop.MetricsSource`` backed by Prometheus' HTTP API (``GET /api/v1/query``)."""

    def __init__(self, client: httpx.AsyncClient, url: str, timeout_s: float = 2.0, clock=time.monotonic):
        self.client, self.url, self.timeout_s, self.clock = client, url.rstrip("/"), timeout_s, clock

    async def samples(self, namespace: str, pods: Sequence) -> dict[str, observe.PodSample | Exception]:
        names = [p.name for p in pods]
        try:
            r = await self.client.get(f"{self.url}/api/v1/query", params={"query": query_for(namespace, names)},
                                      timeout=self.timeout_s)
            body = r.json()
            if r.status_code != 200 or body.get("status") != "success":
                raise PrometheusError(f"Prometheus answered {r.status_code}: {body.get('error', body)!r}"[:300])
            if body["data"]["resultType"] != "vector":
                raise PrometheusError(f"expected an instant vector, got {body['data']['resultType']}")
        except (httpx.HTTPError, ValueError, KeyError, PrometheusError) as e:
            return {n: e for n in names}
        now = self.clock()
        per_pod: dict[str, dict[str, list[tuple[dict[str, str], float]]]] = {}
        for item in body["data"]["result"]:
            labels = dict(item["metric"])
            name, pod = labels.pop("__name__", None), labels.get(POD_LABEL)
            if name is None or pod not in names:
                continue
            per_pod.setdefault(pod, {}).setdefault(name, []).append((labels, float(item["value"][1])))
        out: dict[str, observe.PodSample | Exception] = {}
        for n in names:
            if n not in per_pod:
                out[n] = observe.MetricsParseError(f"Prometheus has no series of pod {namespace}/{n}")
                continue
            try:
                out[n] = observe.sample_from_series(per_pod[n], now)
            except observe.MetricsParseError as e:
                out[n] = e
        return out
