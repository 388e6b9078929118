"""The autoscaler's own Prometheus metrics (names in :mod:`goodput.autoscaler.metric_names`).

Its own registry, served by ``python -m goodput.autoscaler --metrics-port``. Every series carries
``namespace`` and ``inferenceservice``; a KEDA ``prometheus`` scaler or an HPA on external metrics
can follow ``goodput_autoscaler_desired_replicas`` instead of letting this autoscaler patch replicas.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from goodput.autoscaler import metric_names as n

LABELS = ("namespace", "inferenceservice")


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.desired = Gauge(n.DESIRED_REPLICAS, "Replicas the autoscaler decided last.", LABELS, registry=r)
        self.ready = Gauge(n.READY_REPLICAS, "Ready worker pods seen in the last pass.", LABELS, registry=r)
        self.starting = Gauge(n.STARTING_REPLICAS, "Worker pods still starting (model loading).", LABELS,
                              registry=r)
        self.decisions = Counter(n.DECISIONS, "Decisions by reason.", LABELS + ("reason",), registry=r)
        self.scrape_errors = Counter(n.SCRAPE_ERRORS, "Pod scrapes that failed or timed out.", LABELS, registry=r)
        self.loop_duration = Histogram(n.LOOP_DURATION, "Seconds of one reconcile pass over all services.",
                                       registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.max_num_seqs = Gauge(n.ADMISSION_MAX_NUM_SEQS, "max_num_seqs set on a replica.", LABELS + ("pod",),
                                  registry=r)
        self.max_waiting = Gauge(n.ADMISSION_MAX_WAITING, "max_waiting set on a replica.", LABELS + ("pod",),
                                 registry=r)
        self.infeasible = Counter(n.INFEASIBLE_REQUESTS, "Requests whose prompt no idle replica prefills within "
                                  "the TTFT SLO (kept out of the sizing).", LABELS, registry=r)
        self.capacity = Gauge(n.REPLICA_CAPACITY_TOKENS, "Capacity estimate of one replica: tokens/s at a full "
                              "step (0 until one model-load time of measurements).", LABELS, registry=r)
        self._pods: dict[tuple[str, str], set[str]] = {}

    def record(self, namespace: str, name: str, decision, replicas: int, ready: int, starting: int) -> None:
        """After one decision: gauges, the reason counter, per-pod limits (series of gone pods removed)."""
        self.desired.labels(namespace, name).set(replicas)
        self.ready.labels(namespace, name).set(ready)
        self.starting.labels(namespace, name).set(starting)
        self.decisions.labels(namespace, name, decision.reason).inc()
        self.infeasible.labels(namespace, name).inc(max(0.0, decision.infeasible))
        self.capacity.labels(namespace, name).set(decision.capacity_tokens)
        pods = set(decision.limits)
        for gone in self._pods.get((namespace, name), set()) - pods:
            for g in (self.max_num_seqs, self.max_waiting):
                try:
                    g.remove(namespace, name, gone)
                except KeyError:
                    pass
        for pod, lim in decision.limits.items():
            self.max_num_seqs.labels(namespace, name, pod).set(lim.max_num_seqs)
            self.max_waiting.labels(namespace, name, pod).set(lim.max_waiting)
        self._pods[(namespace, name)] = pods
