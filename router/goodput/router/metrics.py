"""The router's Prometheus registry: the series of ``goodput.api.router_metrics`` (the table in
docs/router-autoscaler-contract.md, "Router metrics"), on a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from goodput.api import router_metrics as mn

# "_created" series only add noise to scrapes and dashboards (as the worker).
disable_created_metrics()

# Buckets (seconds): overhead is sub-millisecond to a few ms; waits and TTFT span ms to minutes.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    """One registry per router app (tests run several in one process)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.held = Gauge(mn.HELD_REQUESTS, "Requests held: the service has no Ready pod (scale from zero).",
                          mn.SERVICE_LABELS, registry=r)
        self.queued = Gauge(mn.QUEUED_REQUESTS, "Requests in the router's fleet queue (every pod at its limits).",
                            mn.SERVICE_LABELS, registry=r)
        self.requests = Counter(mn.REQUESTS, "Requests by outcome (pod empty when none was chosen).",
                                mn.REQUEST_LABELS, registry=r)
        self.decisions = Counter(mn.DECISIONS, "Routing decisions by reason.", mn.DECISION_LABELS, registry=r)
        self.pd_decisions = Counter(mn.PD_DECISIONS, "Disaggregated prefill: requests whose prompt a prefill pod "
                                    "computed (remote) or the decode pod (the other decisions), by decision.",
                                    mn.PD_DECISION_LABELS, registry=r)
        self.queue_wait = Histogram(mn.QUEUE_WAIT, "Time in the fleet queue or hold.", mn.SERVICE_LABELS,
                                    buckets=WAIT_BUCKETS, registry=r)
        self.overhead = Histogram(mn.OVERHEAD, "Router-added latency before the upstream request is sent "
                                  "(excluding queue and hold).", buckets=OVERHEAD_BUCKETS, registry=r)
        self.upstream_ttft = Histogram(mn.UPSTREAM_TTFT, "First upstream byte after send.", mn.SERVICE_LABELS,
                                       buckets=WAIT_BUCKETS, registry=r)
        self.class_requests = Counter(mn.CLASS_REQUESTS, "Requests by SLO class (x-goodput-slo-class) and outcome.",
                                      mn.CLASS_REQUEST_LABELS, registry=r)
        self.class_ttft = Histogram(mn.CLASS_UPSTREAM_TTFT, "First upstream byte after send, by SLO class.",
                                    mn.CLASS_LABELS, buckets=WAIT_BUCKETS, registry=r)
        self.ejections = Counter(mn.EJECTIONS, "Pods set aside by outlier ejection, by reason.",
                                 mn.EJECTION_LABELS, registry=r)
        self.kv_events = Counter(mn.KV_EVENTS, "KV events applied to the exact index (--kv-events on).",
                                 mn.POD_LABELS, registry=r)
        self.kv_resyncs = Counter(mn.KV_RESYNCS, "Snapshots of a pod's KV cache keys installed, by reason.",
                                  mn.KV_RESYNC_LABELS, registry=r)
        self.restarts = Counter(mn.POD_RESTARTS, "Engine restarts in place seen (a new instance id): the "
                                "pod's prefix-cache knowledge was dropped.", mn.POD_LABELS, registry=r)

    def watch_fleet(self, fleet, outliers) -> None:
        """Export the per-pod in-flight counts and the ejected pods per service of ``fleet``
        (a :class:`~goodput.router.fleet.Fleet`), read at scrape time."""
        self.registry.register(_FleetCollector(fleet, outliers))

    def watch_kv(self, fleet, exact) -> None:
        """Export the keys the exact index (``goodput.router.kv_index.ExactIndex``, None: events
        off) holds per pod of ``fleet``, read at scrape time."""
        self.registry.register(_KvCollector(fleet, exact))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FleetCollector(Collector):
    """The fleet's runtime view as gauges at scrape time (one source: the Pod records)."""

    def __init__(self, fleet, outliers) -> None:
        self.fleet, self.outliers = fleet, outliers

    def collect(self):
        in_flight = GaugeMetricFamily(mn.POD_IN_FLIGHT, "Requests this router has open to the pod.",
                                      labels=mn.POD_LABELS)
        ejected = GaugeMetricFamily(mn.EJECTED_PODS, "Pods of the service set aside by outlier ejection "
                                    "(ejected, or due for their probe).", labels=mn.SERVICE_LABELS)
        for svc in self.fleet.services():
            for name, pod in sorted(svc.pods.items()):
                in_flight.add_metric([*svc.key, name], pod.in_flight)
            ejected.add_metric(list(svc.key), self.outliers.ejected_count(svc.key))
        yield in_flight
        yield ejected


class _KvCollector(Collector):
    """``goodput_router_kv_keys`` per pod: the exact index's keys (0 when not in sync or off)."""

    def __init__(self, fleet, exact) -> None:
        self.fleet, self.exact = fleet, exact

    def collect(self):
        g = GaugeMetricFamily(mn.KV_KEYS, "Chunk keys the router's exact index holds for the pod, from its KV "
                              "events (0: not in sync, or --kv-events off).", labels=mn.POD_LABELS)
        for svc in self.fleet.services():
            for name in sorted(svc.pods):
                g.add_metric([*svc.key, name], self.exact.size(name) if self.exact is not None else 0)
        yield g
