"""Metric names the autoscaler exports about itself, with no side effects.

The Grafana "Autoscaler" dashboard, the Helm chart's rules and a KEDA/HPA user reading the
autoscaler's recommendation all take these names from here. Every series carries the labels
``namespace`` and ``inferenceservice``; counters are spelled without ``_total`` (prometheus_client
appends it on export).
"""
from __future__ import annotations

DESIRED_REPLICAS = "goodput_autoscaler_desired_replicas"        # gauge: the replicas decided last
READY_REPLICAS = "goodput_autoscaler_ready_replicas"            # gauge: ready pods seen last
STARTING_REPLICAS = "goodput_autoscaler_starting_replicas"      # gauge: pods still loading
DECISIONS = "goodput_autoscaler_decisions"                      # counter, label `reason`
SCRAPE_ERRORS = "goodput_autoscaler_scrape_errors"              # counter: pod scrapes that failed
LOOP_DURATION = "goodput_autoscaler_loop_duration_seconds"      # histogram: one reconcile pass
ADMISSION_MAX_NUM_SEQS = "goodput_autoscaler_admission_max_num_seqs"  # gauge: limit set per replica
ADMISSION_MAX_WAITING = "goodput_autoscaler_admission_max_waiting"    # gauge: limit set per replica
INFEASIBLE_REQUESTS = "goodput_autoscaler_infeasible_requests"  # counter: requests no idle replica serves in TTFT
REPLICA_CAPACITY_TOKENS = "goodput_autoscaler_replica_capacity_tokens_per_second"  # gauge: capacity estimate
