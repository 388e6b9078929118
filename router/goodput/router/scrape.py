"""Periodic scrape of each pod's ``/metrics`` (Prometheus text, parsed by prometheus_client):
the worker's running / waiting requests, KV-cache usage and admission limits, written onto the
fleet's :class:`~goodput.router.fleet.Pod` records (names: ``goodput.api.worker_metrics``,
standard library only). Fetched through the router's one client (goodput.router.upstream: the
probe timeout bounds each scrape)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from goodput.api import worker_metrics as wmn
from goodput.api.identity import INSTANCE_LABEL
from prometheus_client.parser import text_string_to_metric_families

from goodput.router.fleet import Fleet, Pod, Service
from goodput.router.upstream import ERRORS, Upstream

log = logging.getLogger("goodput.router.scrape")

# metric -> Pod field: the contract's table (the autoscaler reads the same one)
_FIELDS = {metric: name for name, metric in wmn.LOAD_GAUGES.items()}
_INTS = set(wmn.COUNT_GAUGES)


def parse_pod_metrics(text: str) -> dict[str, float | int]:
    """Prometheus text → {field: value} for the fields of ``Pod`` the scrape fills (``running``,
    ``waiting``, ``kv_usage``, ``max_num_seqs``, ``max_waiting``, ``max_waiting_tokens``); a series summed over its
    samples; absent series are absent from the result. Raises ValueError on unparsable text."""
    out: dict[str, float | int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = _FIELDS.get(s.name)
            if name is not None:
                out[name] = out.get(name, 0) + s.value
    return {k: (int(v) if k in _INTS else float(v)) for k, v in out.items()}


def instance_id(text: str) -> str | None:
    """The engine id in a worker's ``/metrics`` (``goodput_engine_instance_info{instance_id}``);
    None when absent. Raises ValueError on unparsable text."""
    for fam in text_string_to_metric_families(text):
        if fam.name == wmn.ENGINE_INSTANCE_INFO:
            for s in fam.samples:
                if s.labels.get(INSTANCE_LABEL):
                    return s.labels[INSTANCE_LABEL]
    return None


async def scrape_pod(client: Upstream, pod: Pod,
                     on_instance: Callable[[Pod, str | None], None] | None = None) -> bool:
    """Scrape one pod; True when its limits changed (a queued request may now fit).
    ``on_instance(pod, engine id)`` with the id the scrape found (the router's restart check)."""
    try:
        r = await client.get(pod.url + "/metrics")
        if r.status != 200:
            return False
        text = r.body.decode("utf-8", errors="replace")
        values = parse_pod_metrics(text)
        instance = instance_id(text) if on_instance is not None else None
    except (*ERRORS, ValueError) as e:
        log.debug("scrape %s: %r", pod.url, e)
        return False
    if on_instance is not None:
        on_instance(pod, instance)
    before = (pod.max_num_seqs, pod.max_waiting)
    for k, v in values.items():
        setattr(pod, k, v)
    return (pod.max_num_seqs, pod.max_waiting) != before


async def scrape_forever(fleet: Fleet, client: Upstream, period_s: float,
                         on_limits: Callable[[Service], None],
                         on_instance: Callable[[Pod, str | None], None] | None = None) -> None:
    """Every ``period_s``: scrape every pod of every service at once; ``on_limits(service)`` for
    each service with a pod whose limits changed; ``on_instance`` as :func:`scrape_pod`."""
    while True:
        pods = [(svc, pod) for svc in fleet.services() for pod in svc.pods.values()]
        changed = await asyncio.gather(*(scrape_pod(client, pod, on_instance) for _, pod in pods))
        for svc in {svc.key: svc for (svc, _), c in zip(pods, changed) if c}.values():
            on_limits(svc)
        await asyncio.sleep(period_s)
