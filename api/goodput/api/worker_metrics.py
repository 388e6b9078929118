"""Metric names of a worker: the Prometheus contract, with no side effects.

Importing this module touches no Prometheus registry and imports nothing but the standard
library and the engine's enums (``goodput.api.states``, standard library only), so the
autoscaler, the Grafana dashboards' tests and the benchmarks can use the same names as the worker
that exports them (``goodput.worker.metrics``). The contract, with types, labels, units and the
vLLM aliases, is documented in ``docs/metrics.md``; a test compares that table with a live scrape.
Conventions: base units (seconds), ``_total`` counters, ratios in 0..1, label ``model_name`` on
every series.
"""
from __future__ import annotations

from goodput.api.states import EngineState, FinishReason, PrefillWhere, RejectReason

# Label values, derived from the engine's enums (one source).
ENGINE_STATES = tuple(s.value for s in EngineState)
REJECT_REASONS = tuple(r.value for r in RejectReason)
FINISH_REASONS = tuple(r.value for r in FinishReason)
# Disaggregated prefill (docs/disaggregation.md): where a prompt's KV was computed, which way KV
# bytes went, and why a decode worker prefilled locally although it was handed a transfer.
PREFILL_WHERE = tuple(w.value for w in PrefillWhere)
KV_DIRECTIONS = ("sent", "received")
KV_FALLBACK_REASONS = ("mismatch", "timeout", "error", "unsupported")

KV_EVENT_KINDS = ("stored", "evicted", "cleared")  # goodput.api.kv_events kinds that change the cache

# Metric names. Counters are spelled without "_total"; prometheus_client appends it.
# Gauges (read from the scheduler's stats at scrape time).
REQUESTS_RUNNING = "goodput_requests_running"
REQUESTS_WAITING = "goodput_requests_waiting"
KV_CACHE_USAGE_RATIO = "goodput_kv_cache_usage_ratio"
KV_CACHE_BLOCKS = "goodput_kv_cache_blocks"
ENGINE_STATE = "goodput_engine_state"
ADMISSION_MAX_NUM_SEQS = "goodput_admission_max_num_seqs"
ADMISSION_MAX_WAITING = "goodput_admission_max_waiting"
ADMISSION_MAX_WAITING_TOKENS = "goodput_admission_max_waiting_tokens"
CACHE_CONFIG_INFO = "goodput_cache_config_info"
ENGINE_INSTANCE_INFO = "goodput_engine_instance_info"  # label instance_id (goodput.api.identity)
KV_LEASES = "goodput_kv_leases"
KV_LEASED_BLOCKS = "goodput_kv_leased_blocks"
# KV events (goodput.api.kv_events): the router chunk keys the prefix cache holds, and the events
# published (label kind: KV_EVENT_KINDS), read from the engine's KvEventLog at scrape time.
KV_EVENT_KEYS = "goodput_kv_event_keys"
KV_EVENTS = "goodput_kv_events"
# What one scrape says about a worker's load and limits, as both readers hold it: the router's
# fleet (``goodput.router.fleet.Pod``) and the autoscaler's ``PodObservation`` fields -> gauge (the
# current sample, summed over its series). One table for both.
LOAD_GAUGES: dict[str, str] = {
    "running": REQUESTS_RUNNING,
    "waiting": REQUESTS_WAITING,
    "kv_usage": KV_CACHE_USAGE_RATIO,
    "max_num_seqs": ADMISSION_MAX_NUM_SEQS,
    "max_waiting": ADMISSION_MAX_WAITING,
    "max_waiting_tokens": ADMISSION_MAX_WAITING_TOKENS,
}
COUNT_GAUGES = ("running", "waiting", "max_num_seqs", "max_waiting", "max_waiting_tokens")  # whole numbers; the rest ratios
# Counters (read from the scheduler's stats at scrape time, except SLO_MET).
REQUESTS_ADMITTED = "goodput_requests_admitted"
REQUESTS_REJECTED = "goodput_requests_rejected"
REQUESTS_FINISHED = "goodput_requests_finished"
REQUESTS_SLO_MET = "goodput_requests_slo_met"
PROMPT_TOKENS = "goodput_prompt_tokens"
GENERATION_TOKENS = "goodput_generation_tokens"
PREFIX_CACHE_QUERIES = "goodput_prefix_cache_queries"
PREFIX_CACHE_HITS = "goodput_prefix_cache_hits"
PREEMPTIONS = "goodput_preemptions"
ENGINE_STEPS = "goodput_engine_steps"
BATCHED_TOKENS = "goodput_batched_tokens"
SPEC_DECODE_DRAFTS = "goodput_spec_decode_drafts"
SPEC_DECODE_DRAFT_TOKENS = "goodput_spec_decode_draft_tokens"
SPEC_DECODE_ACCEPTED_TOKENS = "goodput_spec_decode_accepted_tokens"
PREFILLS = "goodput_prefills"
KV_LEASE_EXPIRIES = "goodput_kv_lease_expiries"
# Counters observed by the server as KV moves (disaggregated prefill).
KV_TRANSFER_BYTES = "goodput_kv_transfer_bytes"
KV_TRANSFER_FALLBACKS = "goodput_kv_transfer_fallbacks"
# Histograms (observed by the engine as steps run and requests finish).
TIME_TO_FIRST_TOKEN = "goodput_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "goodput_inter_token_latency_seconds"
TIME_PER_OUTPUT_TOKEN = "goodput_time_per_output_token_seconds"
E2E_REQUEST_LATENCY = "goodput_e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "goodput_request_queue_time_seconds"
REQUEST_INFERENCE_TIME = "goodput_request_inference_time_seconds"
REQUEST_PREFILL_TIME = "goodput_request_prefill_time_seconds"
REQUEST_DECODE_TIME = "goodput_request_decode_time_seconds"
REQUEST_PROMPT_TOKENS = "goodput_request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "goodput_request_generation_tokens"
REQUEST_PARAMS_N = "goodput_request_params_n"
REQUEST_PARAMS_MAX_TOKENS = "goodput_request_params_max_tokens"
ITERATION_TOKENS = "goodput_iteration_tokens"
KV_TRANSFER_SECONDS = "goodput_kv_transfer_seconds"
# gauges: the SLO thresholds the worker judges goodput_requests_slo_met by (exported only when set),
# so dashboards draw each service's own SLO line
SLO_TTFT_SECONDS = "goodput_slo_ttft_seconds"
SLO_TPOT_SECONDS = "goodput_slo_tpot_seconds"
# Counters per SLO class (label slo_class: "default", the unnamed class and requests naming an unknown
# one, or a class declared by --slo-class: a bounded set), each request judged by its own class's
# TTFT/TPOT: finished (stop or length), meeting both, meeting its TPOT
REQUESTS_FINISHED_BY_CLASS = "goodput_requests_finished_by_class"
REQUESTS_SLO_MET_BY_CLASS = "goodput_requests_slo_met_by_class"
REQUESTS_TPOT_MET_BY_CLASS = "goodput_requests_tpot_met_by_class"

# The scheduler's counters: SchedulerStats field -> (metric name, label or None, HELP). The worker
# exports each from the scheduler's snapshot; a labelled counter has one series per label value.
SCHEDULER_COUNTERS = {
    "admitted_total": (REQUESTS_ADMITTED, None, "Admitted requests."),
    "rejected_total": (REQUESTS_REJECTED, "reason", "Requests refused at admission, by reason."),
    "finished_total": (REQUESTS_FINISHED, "finished_reason", "Finished requests by reason."),
    "prompt_tokens_total": (PROMPT_TOKENS, None, "Prompt tokens of requests that started running."),
    "generation_tokens_total": (GENERATION_TOKENS, None, "Generated tokens."),
    "prefix_cache_queries_total": (PREFIX_CACHE_QUERIES, None, "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_total": (PREFIX_CACHE_HITS, None, "Prompt tokens served from the prefix cache."),
    "preemptions_total": (PREEMPTIONS, None, "Preemptions by recompute."),
    "steps_total": (ENGINE_STEPS, None, "Engine steps that ran at least one chunk."),
    "batched_tokens_total": (BATCHED_TOKENS, None,
                             "Tokens computed by the model in those steps (prefill chunks + decodes)."),
    "spec_decode_drafts_total": (SPEC_DECODE_DRAFTS, None,
                                 "Speculative steps: decodes that carried n-gram draft tokens."),
    "spec_decode_draft_tokens_total": (SPEC_DECODE_DRAFT_TOKENS, None, "Draft tokens proposed."),
    "spec_decode_accepted_tokens_total": (SPEC_DECODE_ACCEPTED_TOKENS, None,
                                          "Draft tokens accepted (equal to the target's own token)."),
    "prefills_total": (PREFILLS, "where", "Requests by where their prompt's KV was computed "
                                          "(local, or remote: imported from a prefill worker)."),
    "kv_lease_expiries_total": (KV_LEASE_EXPIRIES, None,
                                "Remote prefills' KV leases freed because nobody pulled them in time."),
}
LABEL_VALUES = {"reason": REJECT_REASONS, "finished_reason": FINISH_REASONS, "state": ENGINE_STATES,
                "where": PREFILL_WHERE}

# goodput name -> vLLM name, for --vllm-metric-aliases. Same value, same type; vLLM's
# cache_config_info carries its own label names (docs/metrics.md).
VLLM_ALIASES = {
    REQUESTS_RUNNING: "vllm:num_requests_running",
    REQUESTS_WAITING: "vllm:num_requests_waiting",
    KV_CACHE_USAGE_RATIO: "vllm:kv_cache_usage_perc",  # vLLM's is a 0..1 ratio despite the name
    CACHE_CONFIG_INFO: "vllm:cache_config_info",
    PROMPT_TOKENS: "vllm:prompt_tokens",
    GENERATION_TOKENS: "vllm:generation_tokens",
    PREEMPTIONS: "vllm:num_preemptions",
    SPEC_DECODE_DRAFTS: "vllm:spec_decode_num_drafts",
    SPEC_DECODE_DRAFT_TOKENS: "vllm:spec_decode_num_draft_tokens",
    SPEC_DECODE_ACCEPTED_TOKENS: "vllm:spec_decode_num_accepted_tokens",
    PREFIX_CACHE_QUERIES: "vllm:prefix_cache_queries",
    PREFIX_CACHE_HITS: "vllm:prefix_cache_hits",
    REQUESTS_FINISHED: "vllm:request_success",
    TIME_TO_FIRST_TOKEN: "vllm:time_to_first_token_seconds",
    INTER_TOKEN_LATENCY: "vllm:inter_token_latency_seconds",
    E2E_REQUEST_LATENCY: "vllm:e2e_request_latency_seconds",
    REQUEST_QUEUE_TIME: "vllm:request_queue_time_seconds",
    REQUEST_INFERENCE_TIME: "vllm:request_inference_time_seconds",
    REQUEST_PREFILL_TIME: "vllm:request_prefill_time_seconds",
    REQUEST_DECODE_TIME: "vllm:request_decode_time_seconds",
    REQUEST_PROMPT_TOKENS: "vllm:request_prompt_tokens",
    REQUEST_GENERATION_TOKENS: "vllm:request_generation_tokens",
    REQUEST_PARAMS_N: "vllm:request_params_n",
    REQUEST_PARAMS_MAX_TOKENS: "vllm:request_params_max_tokens",
    ITERATION_TOKENS: "vllm:iteration_tokens_total",  # vLLM's histogram name ends in _total
}

# Bucket upper bounds in seconds. TTFT/queue time span fast CPU prefills to long queues; ITL and
# TPOT span GPU decode steps (ms) to a loaded CPU (hundreds of ms); E2E up to minutes.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
# KV pulls: a few blocks over loopback (ms) to thousands of tokens over a pod network (seconds).
KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
               120.0, 180.0, 300.0)


def count_buckets(max_value: int) -> tuple[int, ...]:
    """1-2-5 bucket bounds below ``max_value``, then ``max_value`` itself: 1, 2, 5, 10, 20, 50,
    ..., max_value (for token counts and request parameters; vLLM buckets its token histograms
    the same way). The last finite bound is always ``max_value``, so every valid count (at most
    ``max_value``, e.g. a prompt within ``max_model_len``) lands in a finite bucket and ``+Inf``
    stays empty: a reader interpolating inside the buckets (the autoscaler's infeasible-request
    rule) never has to treat a valid prompt as longer than the last finite bound."""
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale >= max_value:
                out.append(max_value)
                return tuple(out)
            out.append(m * scale)
        scale *= 10
