"""Prometheus metrics of a worker: THE one module that spells every metric name.

The names, types and labels are the contract in ``DESIGN.md`` ("Metrics contract"); the
autoscaler and the Grafana dashboards read exactly these. Conventions: base units (seconds),
``_total`` counters, ratios in 0..1, label ``model_name`` on every series.

Where the values come from:

* Counters and gauges that the scheduler already keeps (running, waiting, KV usage, admitted,
  rejected, finished, tokens, prefix-cache queries/hits, preemptions) are read from an
  :class:`EngineStats` snapshot at scrape time by a custom collector, so there is exactly one
  source of truth and nothing is double counted.
* Latency histograms (TTFT, ITL, TPOT, E2E, queue time) and ``goodput_requests_slo_met_total``
  are observed by the engine as tokens arrive and requests finish.

With ``vllm_aliases=True`` the same values are also exported under vLLM's names (the list in
DESIGN.md), so dashboards, KEDA recipes and the Gateway API inference extension written for
vLLM work unchanged.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# "_created" series only add noise to scrapes and dashboards (vLLM turns them off too).
disable_created_metrics()

ENGINE_STATES = ("running", "waiting", "rejecting", "blocked")
REJECT_REASONS = ("queue_full", "never_fits", "invalid")
FINISH_REASONS = ("stop", "length", "abort")

# Metric names (DESIGN.md). Counters are spelled without "_total"; prometheus_client appends it.
REQUESTS_RUNNING = "goodput_requests_running"
REQUESTS_WAITING = "goodput_requests_waiting"
KV_CACHE_USAGE_RATIO = "goodput_kv_cache_usage_ratio"
KV_CACHE_BLOCKS = "goodput_kv_cache_blocks"
ENGINE_STATE = "goodput_engine_state"
ADMISSION_MAX_NUM_SEQS = "goodput_admission_max_num_seqs"
ADMISSION_MAX_WAITING = "goodput_admission_max_waiting"
REQUESTS_ADMITTED = "goodput_requests_admitted"
REQUESTS_REJECTED = "goodput_requests_rejected"
REQUESTS_FINISHED = "goodput_requests_finished"
REQUESTS_SLO_MET = "goodput_requests_slo_met"
PROMPT_TOKENS = "goodput_prompt_tokens"
GENERATION_TOKENS = "goodput_generation_tokens"
PREFIX_CACHE_QUERIES = "goodput_prefix_cache_queries"
PREFIX_CACHE_HITS = "goodput_prefix_cache_hits"
PREEMPTIONS = "goodput_preemptions"
TIME_TO_FIRST_TOKEN = "goodput_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "goodput_inter_token_latency_seconds"
TIME_PER_OUTPUT_TOKEN = "goodput_time_per_output_token_seconds"
E2E_REQUEST_LATENCY = "goodput_e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "goodput_request_queue_time_seconds"

# goodput name -> vLLM name, for --vllm-metric-aliases.
VLLM_ALIASES = {
    REQUESTS_RUNNING: "vllm:num_requests_running",
    REQUESTS_WAITING: "vllm:num_requests_waiting",
    KV_CACHE_USAGE_RATIO: "vllm:kv_cache_usage_perc",  # vLLM's is a 0..1 ratio despite the name
    PROMPT_TOKENS: "vllm:prompt_tokens",
    GENERATION_TOKENS: "vllm:generation_tokens",
    PREEMPTIONS: "vllm:num_preemptions",
    PREFIX_CACHE_QUERIES: "vllm:prefix_cache_queries",
    PREFIX_CACHE_HITS: "vllm:prefix_cache_hits",
    TIME_TO_FIRST_TOKEN: "vllm:time_to_first_token_seconds",
    INTER_TOKEN_LATENCY: "vllm:inter_token_latency_seconds",
    E2E_REQUEST_LATENCY: "vllm:e2e_request_latency_seconds",
    REQUESTS_FINISHED: "vllm:request_success",
}

# Bucket upper bounds in seconds. TTFT/queue time span fast CPU prefills to long queues; ITL and
# TPOT span GPU decode steps (ms) to a loaded CPU (hundreds of ms); E2E up to minutes.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
               120.0, 180.0, 300.0)


@dataclass
class EngineStats:
    """A consistent snapshot of the engine for metrics and ``GET /admin/state``.

    Counts are cumulative since start-up; token counters count tokens (prefix-cache queries and
    hits count prompt tokens looked up / served from cache). ``kv_blocks_used`` counts blocks
    with a reference (cached-but-free blocks count as free).
    """

    engine_state: str = "waiting"
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    max_num_seqs: int = 0
    max_waiting: int = 0
    admitted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0

    @property
    def kv_cache_usage_ratio(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def slo_met(ttft_s: float | None, tpot_s: float | None, slo_ttft_s: float | None,
            slo_tpot_s: float | None) -> bool:
    """Whether a finished request met both SLOs (an unset SLO is always met).

    TPOT is undefined for requests with at most one output token (``tpot_s is None``); such a
    request is judged on TTFT alone. A request without a first token never meets a TTFT SLO.
    """
    if slo_ttft_s is not None and (ttft_s is None or ttft_s > slo_ttft_s):
        return False
    if slo_tpot_s is not None and tpot_s is not None and tpot_s > slo_tpot_s:
        return False
    return True


class _StatsCollector(Collector):
    """Exports the scheduler-owned gauges and counters from an :class:`EngineStats` snapshot."""

    def __init__(self, model_name: str, stats_fn: Callable[[], EngineStats], aliases: bool):
        self._model = model_name
        self._stats_fn = stats_fn
        self._aliases = aliases

    def _names(self, name: str) -> list[str]:
        alias = VLLM_ALIASES.get(name) if self._aliases else None
        return [name, alias] if alias else [name]

    def _gauge(self, name: str, doc: str, value: float) -> Iterable[GaugeMetricFamily]:
        for n in self._names(name):
            g = GaugeMetricFamily(n, doc, labels=["model_name"])
            g.add_metric([self._model], value)
            yield g

    def _counter(self, name: str, doc: str, value: float) -> Iterable[CounterMetricFamily]:
        for n in self._names(name):
            c = CounterMetricFamily(n, doc, labels=["model_name"])
            c.add_metric([self._model], value)
            yield c

    def _labelled_counter(self, name: str, doc: str, label: str, keys: Iterable[str],
                          values: dict[str, int]) -> Iterable[CounterMetricFamily]:
        for n in self._names(name):
            c = CounterMetricFamily(n, doc, labels=["model_name", label])
            for k in keys:
                c.add_metric([self._model, k], values.get(k, 0))
            yield c

    def collect(self):
        s = self._stats_fn()
        yield from self._gauge(REQUESTS_RUNNING, "Requests in the running set.", s.running)
        yield from self._gauge(REQUESTS_WAITING,
                               "Requests admitted and waiting (including preempted ones).", s.waiting)
        yield from self._gauge(KV_CACHE_USAGE_RATIO,
                               "Referenced KV blocks / all blocks (cached-but-free counts as free).",
                               s.kv_cache_usage_ratio)
        yield from self._gauge(KV_CACHE_BLOCKS, "KV cache blocks in the pool (capacity).",
                               s.kv_blocks_total)
        g = GaugeMetricFamily(ENGINE_STATE, "1 for the engine's current state, else 0.",
                              labels=["model_name", "state"])
        for st in ENGINE_STATES:
            g.add_metric([self._model, st], 1.0 if s.engine_state == st else 0.0)
        yield g
        yield from self._gauge(ADMISSION_MAX_NUM_SEQS, "Current admission limit on running requests.",
                               s.max_num_seqs)
        yield from self._gauge(ADMISSION_MAX_WAITING, "Current admission limit on waiting requests.",
                               s.max_waiting)
        yield from self._counter(REQUESTS_ADMITTED, "Admitted requests.", s.admitted)
        yield from self._labelled_counter(REQUESTS_REJECTED, "Rejected requests by reason.", "reason",
                                          REJECT_REASONS, s.rejected)
        yield from self._labelled_counter(REQUESTS_FINISHED, "Finished requests by reason.",
                                          "finished_reason", FINISH_REASONS, s.finished)
        yield from self._counter(PROMPT_TOKENS, "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield from self._counter(GENERATION_TOKENS, "Generated tokens.", s.generation_tokens)
        yield from self._counter(PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.",
                                 s.prefix_cache_queries)
        yield from self._counter(PREFIX_CACHE_HITS, "Prompt tokens served from the prefix cache.",
                                 s.prefix_cache_hits)
        yield from self._counter(PREEMPTIONS, "Preemptions by recompute.", s.preemptions)


class _Hist:
    """One latency histogram, mirrored to its vLLM alias when aliases are on."""

    def __init__(self, registry: CollectorRegistry, name: str, doc: str, buckets, model: str,
                 aliases: bool):
        self._children = [Histogram(name, doc, ["model_name"], registry=registry,
                                    buckets=buckets).labels(model)]
        alias = VLLM_ALIASES.get(name) if aliases else None
        if alias:
            self._children.append(Histogram(alias, doc, ["model_name"], registry=registry,
                                            buckets=buckets).labels(model))

    def observe(self, value: float) -> None:
        for h in self._children:
            h.observe(value)


class WorkerMetrics:
    """The worker's Prometheus registry (its own, not the process-global default one).

    model_name: value of the ``model_name`` label (the served model name).
    stats_fn: returns a fresh :class:`EngineStats`; called on every scrape.
    slo_ttft_s, slo_tpot_s: SLO thresholds in seconds for ``goodput_requests_slo_met_total``
        (None = no SLO on that dimension).
    vllm_aliases: also export vLLM's names for the same values.
    """

    def __init__(self, model_name: str, stats_fn: Callable[[], EngineStats],
                 slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                 vllm_aliases: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.registry.register(_StatsCollector(model_name, stats_fn, vllm_aliases))
        self._slo_met = Counter(REQUESTS_SLO_MET,
                                "Finished requests (stop or length) meeting both the TTFT and TPOT SLOs.",
                                ["model_name"], registry=self.registry).labels(model_name)
        h = lambda name, doc, b: _Hist(self.registry, name, doc, b, model_name, vllm_aliases)
        self.ttft = h(TIME_TO_FIRST_TOKEN, "Time to first token: first token - arrival.", TTFT_BUCKETS)
        self.itl = h(INTER_TOKEN_LATENCY, "Every gap between consecutive output tokens.",
                     TOKEN_LATENCY_BUCKETS)
        self.tpot = h(TIME_PER_OUTPUT_TOKEN, "Per request: (E2E - TTFT) / (output tokens - 1).",
                      TOKEN_LATENCY_BUCKETS)
        self.e2e = h(E2E_REQUEST_LATENCY, "Per request: finished - arrival.", E2E_BUCKETS)
        self.queue_time = h(REQUEST_QUEUE_TIME, "Per request: first scheduled - arrival.", TTFT_BUCKETS)

    def observe_first_token(self, ttft_s: float, queue_time_s: float | None) -> None:
        self.ttft.observe(ttft_s)
        if queue_time_s is not None:
            self.queue_time.observe(queue_time_s)

    def observe_itl(self, gaps_s: Iterable[float]) -> None:
        for g in gaps_s:
            self.itl.observe(g)

    def observe_finished(self, finish_reason: str, ttft_s: float | None, tpot_s: float | None,
                         e2e_s: float | None) -> None:
        """Record one finished request (TTFT/ITL were observed as its tokens arrived)."""
        if e2e_s is not None and math.isfinite(e2e_s):
            self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if finish_reason in ("stop", "length") and slo_met(ttft_s, tpot_s, self.slo_ttft_s,
                                                             self.slo_tpot_s):
            self._slo_met.inc()

    def render(self) -> bytes:
        """The text exposition format (``text/plain; version=0.0.4``)."""
        return generate_latest(self.registry)
