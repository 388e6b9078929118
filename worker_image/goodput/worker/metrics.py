"""Prometheus metrics of a worker: the collectors and histograms behind every metric name.

The names live in :mod:`goodput.api.worker_metrics` (no side effects); the contract (names,
types, labels, units, vLLM aliases) is ``docs/metrics.md``. The autoscaler and the Grafana
dashboards read exactly these names.

Where the values come from:

* Gauges and counters the scheduler keeps (running, waiting, KV usage, engine state, limits,
  admitted, rejected, finished, tokens, prefix-cache queries/hits, preemptions, steps, batched
  tokens) are read from the scheduler's :class:`SchedulerStats` snapshot at scrape time by a
  custom collector: one source of truth, nothing double counted.
* Histograms (TTFT, ITL, TPOT, E2E, queue/prefill/decode/inference time, per-request token
  counts and parameters, tokens per step) and ``goodput_requests_slo_met_total`` are observed by
  the engine as steps run, tokens arrive and requests finish.

With ``vllm_aliases=True`` the same values are also exported under vLLM's names, so dashboards,
KEDA recipes and the Gateway API inference extension written for vLLM work unchanged.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from goodput.worker.engine.request import Request
from goodput.worker.engine.scheduler import SchedulerStats
from goodput.api.identity import INSTANCE_LABEL, new_instance_id
from goodput.api.policy import DEFAULT_SLO_CLASS, SLO_CLASS_LABEL, SloClass, class_of, rank_of, slo_ranks
from goodput.api.states import FinishReason
from goodput.api.worker_metrics import (
    ADMISSION_MAX_NUM_SEQS,
    ADMISSION_MAX_WAITING,
    ADMISSION_MAX_WAITING_TOKENS,
    CACHE_CONFIG_INFO,
    E2E_BUCKETS,
    E2E_REQUEST_LATENCY,
    ENGINE_INSTANCE_INFO,
    ENGINE_STATE,
    ENGINE_STATES,
    INTER_TOKEN_LATENCY,
    ITERATION_TOKENS,
    KV_CACHE_BLOCKS,
    KV_CACHE_USAGE_RATIO,
    KV_DIRECTIONS,
    KV_FALLBACK_REASONS,
    KV_LEASED_BLOCKS,
    KV_LEASES,
    KV_TRANSFER_BUCKETS,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_FALLBACKS,
    KV_TRANSFER_SECONDS,
    KV_EVENT_KEYS,
    KV_EVENT_KINDS,
    KV_EVENTS,
    LABEL_VALUES,
    REQUEST_DECODE_TIME,
    REQUEST_GENERATION_TOKENS,
    REQUEST_INFERENCE_TIME,
    REQUEST_PARAMS_MAX_TOKENS,
    REQUEST_PARAMS_N,
    REQUEST_PREFILL_TIME,
    REQUEST_PROMPT_TOKENS,
    REQUEST_QUEUE_TIME,
    REQUESTS_RUNNING,
    REQUESTS_FINISHED_BY_CLASS,
    REQUESTS_SLO_MET,
    REQUESTS_SLO_MET_BY_CLASS,
    REQUESTS_TPOT_MET_BY_CLASS,
    REQUESTS_WAITING,
    SCHEDULER_COUNTERS,
    SLO_TPOT_SECONDS,
    SLO_TTFT_SECONDS,
    TIME_PER_OUTPUT_TOKEN,
    TIME_TO_FIRST_TOKEN,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    VLLM_ALIASES,
    count_buckets,
)

# "_created" series only add noise to scrapes and dashboards (vLLM turns them off too).
disable_created_metrics()

# Largest value the token-count histograms resolve when the worker does not say its max_model_len.
DEFAULT_MAX_TOKENS_BUCKET = 1 << 20


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
    """Exports the scheduler-owned gauges and counters from a :class:`SchedulerStats` snapshot."""

    def __init__(self, model_name: str, stats_fn: Callable[[], SchedulerStats], aliases: bool):
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

    def _cache_config(self, s: SchedulerStats) -> Iterable[GaugeMetricFamily]:
        doc = "KV cache configuration as labels; the value is always 1."
        g = GaugeMetricFamily(CACHE_CONFIG_INFO, doc,
                              labels=["model_name", "block_size", "num_blocks", "enable_prefix_caching"])
        g.add_metric([self._model, str(s.block_size), str(s.num_blocks),
                      str(s.enable_prefix_caching).lower()], 1.0)
        yield g
        if self._aliases:  # vLLM's label names and spelling (str() of its config fields)
            g = GaugeMetricFamily(VLLM_ALIASES[CACHE_CONFIG_INFO], doc, labels=[
                "model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"])
            g.add_metric([self._model, str(s.block_size), str(s.num_blocks),
                          str(s.enable_prefix_caching)], 1.0)
            yield g

    def collect(self):
        s = self._stats_fn()
        yield from self._gauge(REQUESTS_RUNNING, "Requests in the running set.", s.num_running)
        yield from self._gauge(REQUESTS_WAITING,
                               "Requests admitted and waiting (including preempted ones).", s.num_waiting)
        yield from self._gauge(KV_CACHE_USAGE_RATIO,
                               "Referenced KV blocks / all blocks (cached-but-free counts as free).",
                               s.kv_usage_ratio)
        yield from self._gauge(KV_CACHE_BLOCKS, "KV cache blocks in the pool (capacity).", s.num_blocks)
        g = GaugeMetricFamily(ENGINE_STATE, "1 for the engine's current state, else 0.",
                              labels=["model_name", "state"])
        for st in ENGINE_STATES:
            g.add_metric([self._model, st], 1.0 if s.engine_state == st else 0.0)
        yield g
        yield from self._gauge(ADMISSION_MAX_NUM_SEQS, "Current admission limit on running requests.",
                               s.max_num_seqs)
        yield from self._gauge(ADMISSION_MAX_WAITING, "Current admission limit on waiting requests.",
                               s.max_waiting)
        yield from self._gauge(ADMISSION_MAX_WAITING_TOKENS, "Current admission limit on the prompt tokens "
                               "queued for prefill ahead of a new request, plus its own (0 = none).",
                               s.max_waiting_tokens)
        yield from self._cache_config(s)
        yield from self._gauge(KV_LEASES, "Remote prefills whose prompt KV is leased for a decode worker now.",
                               s.num_leases)
        yield from self._gauge(KV_LEASED_BLOCKS, "KV blocks those leases hold.", s.num_leased_blocks)
        for field_name, (name, label, doc) in SCHEDULER_COUNTERS.items():
            value = getattr(s, field_name)
            if label is None:
                yield from self._counter(name, doc, value)
            else:
                yield from self._labelled_counter(name, doc, label, LABEL_VALUES[label], value)


class _KvEventsCollector(Collector):
    """Exports the KV event log's counts (``goodput.api.kv_events``; zeros until a log is set)."""

    def __init__(self, model_name: str, owner: "WorkerMetrics"):
        self._model, self._owner = model_name, owner

    def collect(self):
        log = self._owner.kv_events
        g = GaugeMetricFamily(KV_EVENT_KEYS, "Router chunk keys the prefix cache holds (as published on /kv/events).",
                              labels=["model_name"])
        g.add_metric([self._model], log.held() if log is not None else 0)
        yield g
        c = CounterMetricFamily(KV_EVENTS, "KV events published, by kind.", labels=["model_name", "kind"])
        for k in KV_EVENT_KINDS:
            c.add_metric([self._model, k], log.events_total.get(k, 0) if log is not None else 0)
        yield c


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
    stats_fn: returns a fresh :class:`SchedulerStats`; called on every scrape.
    slo_ttft_s, slo_tpot_s: SLO thresholds in seconds for ``goodput_requests_slo_met_total``
        (None = no SLO on that dimension).
    vllm_aliases: also export vLLM's names for the same values.
    max_model_len: largest bucket of the per-request token histograms (1-2-5 buckets up to it).
    instance_id: this engine's identity (``goodput.api.identity``; None: a new one), exported as
        ``goodput_engine_instance_info{instance_id}``.
    slo_classes: the named SLO classes (``--slo-class``): a request assigned one
        (:meth:`assign_class`) is judged by its TTFT/TPOT, the others by ``slo_ttft_s`` /
        ``slo_tpot_s`` as class ``default``; ``goodput_requests_{finished,slo_met,tpot_met}_by_class``
        count each class (label ``slo_class``: ``default`` and these names only).
    """

    def __init__(self, model_name: str, stats_fn: Callable[[], SchedulerStats],
                 slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                 vllm_aliases: bool = False, max_model_len: int | None = None,
                 instance_id: str | None = None, slo_classes: tuple[SloClass, ...] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.instance_id = instance_id or new_instance_id()
        Gauge(ENGINE_INSTANCE_INFO, "Always 1; instance_id: this engine's id, new at every start.",
              ["model_name", INSTANCE_LABEL], registry=self.registry).labels(model_name, self.instance_id).set(1)
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.registry.register(_StatsCollector(model_name, stats_fn, vllm_aliases))
        self.kv_events = None  # the engine's KvEventLog, once the server attached one
        self.registry.register(_KvEventsCollector(model_name, self))
        for gname, value, what in ((SLO_TTFT_SECONDS, slo_ttft_s, "TTFT"), (SLO_TPOT_SECONDS, slo_tpot_s, "TPOT")):
            if value is not None:  # the thresholds themselves, for the dashboards' SLO lines
                Gauge(gname, f"The {what} SLO in seconds (threshold of goodput_requests_slo_met_total).",
                      ["model_name"], registry=self.registry).labels(model_name).set(value)
        self._slo_met = Counter(REQUESTS_SLO_MET,
                                "Finished requests (stop or length) meeting both the TTFT and TPOT SLOs.",
                                ["model_name"], registry=self.registry).labels(model_name)
        # per SLO class: name -> (TTFT, TPOT) thresholds; request id -> its class while it runs
        self.class_slos: dict[str, tuple[float | None, float | None]] = {DEFAULT_SLO_CLASS: (slo_ttft_s, slo_tpot_s)}
        self.class_slos.update((c.name, (c.ttft_s, c.tpot_s)) for c in slo_classes)
        # per SLO class: its queue band in the engine (Request.slo_rank; goodput.api.policy.slo_ranks)
        self.class_ranks = slo_ranks(slo_ttft_s, slo_classes)
        self._request_class: dict[str, str] = {}
        by_class = [(name, Counter(name, doc, ["model_name", SLO_CLASS_LABEL], registry=self.registry))
                    for name, doc in (
                        (REQUESTS_FINISHED_BY_CLASS, "Finished requests (stop or length) by SLO class."),
                        (REQUESTS_SLO_MET_BY_CLASS, "Finished requests (stop or length) meeting their own "
                                                    "SLO class's TTFT and TPOT, by SLO class."),
                        (REQUESTS_TPOT_MET_BY_CLASS, "Finished requests (stop or length) meeting their own "
                                                     "SLO class's TPOT, by SLO class."))]
        self._by_class = {c: tuple(counter.labels(model_name, c) for _, counter in by_class)
                          for c in self.class_slos}   # every series exported from the start, at 0
        h = lambda name, doc, b: _Hist(self.registry, name, doc, b, model_name, vllm_aliases)
        self.ttft = h(TIME_TO_FIRST_TOKEN, "Time to first token: first token - arrival.", TTFT_BUCKETS)
        self.itl = h(INTER_TOKEN_LATENCY, "Every gap between consecutive output tokens.",
                     TOKEN_LATENCY_BUCKETS)
        self.tpot = h(TIME_PER_OUTPUT_TOKEN, "Per request: (E2E - TTFT) / (output tokens - 1).",
                      TOKEN_LATENCY_BUCKETS)
        self.e2e = h(E2E_REQUEST_LATENCY, "Per request: finished - arrival.", E2E_BUCKETS)
        self.queue_time = h(REQUEST_QUEUE_TIME, "Per request: first scheduled - arrival.", TTFT_BUCKETS)
        self.prefill_time = h(REQUEST_PREFILL_TIME, "Per request: first token - first scheduled.",
                              TTFT_BUCKETS)
        self.decode_time = h(REQUEST_DECODE_TIME, "Per request: finished - first token.", E2E_BUCKETS)
        self.inference_time = h(REQUEST_INFERENCE_TIME, "Per request: finished - first scheduled.",
                                E2E_BUCKETS)
        tokens = count_buckets(max_model_len or DEFAULT_MAX_TOKENS_BUCKET)
        self.prompt_tokens = h(REQUEST_PROMPT_TOKENS, "Per finished request: prompt tokens.", tokens)
        self.generation_tokens = h(REQUEST_GENERATION_TOKENS, "Per finished request: generated tokens.",
                                   tokens)
        self.params_n = h(REQUEST_PARAMS_N, "Per finished request: the n parameter.", (1, 2, 5, 10, 20))
        self.params_max_tokens = h(REQUEST_PARAMS_MAX_TOKENS, "Per finished request: max_tokens.", tokens)
        self.iteration_tokens = h(ITERATION_TOKENS,
                                  "Per engine step: prompt tokens computed + tokens generated.",
                                  (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
        self._kv_bytes = Counter(KV_TRANSFER_BYTES, "KV payload bytes moved between prefill and decode "
                                 "workers (2·L·n_kv·d_head·bytes per token), by direction.",
                                 ["model_name", "direction"], registry=self.registry)
        self._kv_fallbacks = Counter(KV_TRANSFER_FALLBACKS, "Requests handed a KV transfer that prefilled "
                                     "locally instead, by reason.", ["model_name", "reason"], registry=self.registry)
        for d in KV_DIRECTIONS:
            self._kv_bytes.labels(model_name, d)
        for r in KV_FALLBACK_REASONS:
            self._kv_fallbacks.labels(model_name, r)
        self.kv_transfer_seconds = h(KV_TRANSFER_SECONDS, "Per KV pull: request sent to last byte received.",
                                     KV_TRANSFER_BUCKETS)

    def observe_kv_sent(self, nbytes: int) -> None:
        """KV payload bytes streamed to a decode worker (frame and header bytes excluded)."""
        self._kv_bytes.labels(self.model_name, "sent").inc(nbytes)

    def observe_kv_received(self, nbytes: int, seconds: float) -> None:
        """One completed KV pull: its payload bytes and its time (request sent -> last byte)."""
        self._kv_bytes.labels(self.model_name, "received").inc(nbytes)
        self.kv_transfer_seconds.observe(seconds)

    def observe_kv_fallback(self, reason: str) -> None:
        """A decode worker prefilled locally although handed a transfer (``KV_FALLBACK_REASONS``)."""
        self._kv_fallbacks.labels(self.model_name, reason).inc()

    def assign_class(self, request_ids: Iterable[str], name: str | None) -> str:
        """Judge these requests (an OpenAI request's engine requests) by the SLO class ``name`` (the
        ``x-goodput-slo-class`` header; None, empty or a class not declared: ``default``, never an
        error). Returns the class used. :meth:`observe_finished` forgets each request;
        :meth:`forget` undoes this for requests that were never admitted."""
        cls = class_of(name, self.class_slos)
        if cls != DEFAULT_SLO_CLASS:
            for rid in request_ids:
                self._request_class[rid] = cls
        return cls

    def class_rank(self, name: str | None) -> int:
        """The engine queue band (``Request.slo_rank``) of a request naming SLO class ``name``
        (:func:`goodput.api.policy.rank_of`: 0 without named classes)."""
        return rank_of(name, self.class_ranks)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the class of requests that will never finish (refused at admission)."""
        for rid in request_ids:
            self._request_class.pop(rid, None)

    def observe_first_token(self, ttft_s: float, queue_time_s: float | None) -> None:
        self.ttft.observe(ttft_s)
        if queue_time_s is not None:
            self.queue_time.observe(queue_time_s)

    def observe_itl(self, gaps_s: Iterable[float]) -> None:
        for g in gaps_s:
            self.itl.observe(g)

    def observe_iteration(self, num_tokens: int) -> None:
        """One engine step's tokens as vLLM counts them: prompt (prefill) tokens computed plus
        tokens sampled."""
        self.iteration_tokens.observe(num_tokens)

    def observe_finished(self, finish_reason: str, req: Request, n: int | None = 1) -> None:
        """Record one finished request from its timestamps (TTFT/ITL were observed as its tokens
        arrived). ``n``: the OpenAI ``n`` of the request (observed once per OpenAI request: None
        for the other samples of an ``n > 1`` request). A request finished without a
        ``finished_time`` (the engine failed) gets E2E up to now."""
        e2e_s = req.e2e
        if e2e_s is None and req.arrival_time is not None:
            e2e_s = time.monotonic() - req.arrival_time
        if e2e_s is not None and math.isfinite(e2e_s):
            self.e2e.observe(e2e_s)
        tpot_s = req.tpot
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        for hist, value in ((self.prefill_time, req.prefill_time), (self.decode_time, req.decode_time),
                            (self.inference_time, req.inference_time)):
            if value is not None:
                hist.observe(value)
        self.prompt_tokens.observe(req.num_prompt_tokens)
        self.generation_tokens.observe(req.num_output_tokens)
        if n is not None:
            self.params_n.observe(n)
        self.params_max_tokens.observe(req.sampling_params.max_tokens)
        cls = self._request_class.pop(getattr(req, "request_id", ""), DEFAULT_SLO_CLASS)
        if finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            ttft_slo, tpot_slo = self.class_slos[cls]
            finished, met, tpot_met = self._by_class[cls]
            finished.inc()
            if slo_met(None, tpot_s, None, tpot_slo):
                tpot_met.inc()
            if slo_met(req.ttft, tpot_s, ttft_slo, tpot_slo):
                met.inc()
                self._slo_met.inc()

    def render(self) -> bytes:
        """The text exposition format (``text/plain; version=0.0.4``)."""
        return generate_latest(self.registry)
