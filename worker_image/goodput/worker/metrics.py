"""Prometheus metrics of a worker: the collectors and histograms behind every metric name.

The names live in :mod:`goodput.worker.metric_names` (no side effects); the
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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from goodput.worker.metric_names import (  # noqa: F401  (re-exported)
    ENGINE_STATES,
    REJECT_REASONS,
    FINISH_REASONS,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    KV_CACHE_USAGE_RATIO,
    KV_CACHE_BLOCKS,
    ENGINE_STATE,
    ADMISSION_MAX_NUM_SEQS,
    ADMISSION_MAX_WAITING,
    SLO_TTFT_SECONDS,
    SLO_TPOT_SECONDS,
    REQUESTS_ADMITTED,
    REQUESTS_REJECTED,
    REQUESTS_FINISHED,
    REQUESTS_SLO_MET,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PREEMPTIONS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    TIME_PER_OUTPUT_TOKEN,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
    VLLM_ALIASES,
    TTFT_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    E2E_BUCKETS,
)

# "_created" series only add noise to scrapes and dashboards (vLLM turns them off too).
disable_created_metrics()


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
        for gname, value, what in ((SLO_TTFT_SECONDS, slo_ttft_s, "TTFT"), (SLO_TPOT_SECONDS, slo_tpot_s, "TPOT")):
            if value is not None:
                Gauge(gname, f"The {what} SLO in seconds (threshold of goodput_requests_slo_met_total).",
                      ["model_name"], registry=self.registry).labels(model_name).set(value)
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
