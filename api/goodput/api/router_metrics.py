"""Metric names of the router: the Prometheus contract, with no side effects.

Standard library only (an import-linter contract checks it), so the autoscaler, the dashboards
and the tests use the same names as the router that exports them (``goodput.router.metrics``).
The table with types, labels and meanings is docs/router-autoscaler-contract.md ("Router
metrics"). Conventions as the worker's (``goodput.api.worker_metrics``): base units (seconds),
counters spelled without ``_total`` (prometheus_client appends it).
"""
from __future__ import annotations

# Gauges, labels (namespace, inferenceservice); the autoscaler reads these.
HELD_REQUESTS = "goodput_router_held_requests"
QUEUED_REQUESTS = "goodput_router_queued_requests"
# Gauges read from the fleet at scrape time: labels (namespace, inferenceservice, pod) / SERVICE_LABELS.
POD_IN_FLIGHT = "goodput_router_pod_in_flight_requests"
EJECTED_PODS = "goodput_router_ejected_pods"
KV_KEYS = "goodput_router_kv_keys"  # chunk keys the exact index holds for the pod (0: not in sync)
# Counters (exported as <name>_total).
REQUESTS = "goodput_router_requests"
DECISIONS = "goodput_router_decisions"
EJECTIONS = "goodput_router_ejections"
POD_RESTARTS = "goodput_router_pod_restarts"
CLASS_REQUESTS = "goodput_router_class_requests"   # by SLO class (the request's x-goodput-slo-class)
PD_DECISIONS = "goodput_router_pd_decisions"       # disaggregated prefill: remote or local, and why
KV_EVENTS = "goodput_router_kv_events"             # KV events applied to the exact index, by pod
KV_RESYNCS = "goodput_router_kv_resyncs"           # snapshots installed, by pod and reason
# Histograms (seconds).
QUEUE_WAIT = "goodput_router_queue_wait_seconds"
OVERHEAD = "goodput_router_overhead_seconds"
UPSTREAM_TTFT = "goodput_router_upstream_ttft_seconds"
CLASS_UPSTREAM_TTFT = "goodput_router_class_upstream_ttft_seconds"

# Labels.
SERVICE_LABELS = ("namespace", "inferenceservice")
REQUEST_LABELS = ("namespace", "inferenceservice", "model", "pod", "outcome")
DECISION_LABELS = ("reason",)
POD_LABELS = ("namespace", "inferenceservice", "pod")
EJECTION_LABELS = ("namespace", "inferenceservice", "pod", "reason")
CLASS_LABELS = ("namespace", "inferenceservice", "slo_class")
CLASS_REQUEST_LABELS = ("namespace", "inferenceservice", "slo_class", "outcome")
PD_DECISION_LABELS = ("namespace", "inferenceservice", "decision")
KV_RESYNC_LABELS = ("namespace", "inferenceservice", "pod", "reason")

# Label values.
OUTCOMES = ("success", "error", "refused", "timeout", "client_abort")
DECISION_REASONS = ("affinity", "rendezvous", "load_bound_fallback", "queued", "held", "refused")
PD_DECISIONS_VALUES = ("remote", "off", "short", "decode_pod_is_prefill", "no_prefill_pod", "prefill_failed",
                       "prefill_deferred")
EJECTION_REASONS = ("consecutive_failures", "success_rate", "failure_percentage", "probe_failed")
# start: the first snapshot of a pod; gap: a sequence gap or events no longer kept; instance: a
# new engine; error: the stream broke (connection, bad line) and the pod was out of sync meanwhile
KV_RESYNC_REASONS = ("start", "gap", "instance", "error")
# slo_class: the request's class name; "" when it names none, OTHER_CLASS beyond the router's
# --max-slo-classes distinct names (the label's cardinality stays bounded).
NO_CLASS = ""
OTHER_CLASS = "other"

# What the autoscaler reads (sample names as scraped).
REQUESTS_TOTAL = REQUESTS + "_total"
DECISIONS_TOTAL = DECISIONS + "_total"
