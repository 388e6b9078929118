"""Worker ``/metrics`` text -> one cumulative sample per pod; two samples -> a ``PodObservation``.

Pure (no I/O): the loop fetches the text (or asks Prometheus) and keeps the previous sample.
Metric names come from :mod:`goodput.worker.metric_names` (the worker's contract, side-effect
free); the text is parsed with ``prometheus_client``'s parser.

Deltas follow Prometheus' ``increase()`` semantics on two raw samples: counter increase = current
- previous; a worker that restarted between the scrapes (any cumulative series went down — a
process restart resets all of them together) counts from zero, so the increase is the current
value. Histograms subtract bucket by bucket (still cumulative by ``le``), ``_count`` and ``_sum``.

What feeds the policy (``policy.PodObservation``):
  admitted       increase of goodput_requests_admitted_total
  finished       increase of goodput_requests_finished_total{finished_reason=stop|length}
                 (aborted requests — client disconnects — are neither met nor missed; the worker's
                 goodput_requests_slo_met_total counts only stop/length too)
  slo_met        increase of goodput_requests_slo_met_total
  rejected_429   increase of goodput_requests_rejected_total{reason=queue_full}
  rejected_400   increase of ...{reason=never_fits} + ...{reason=invalid}
  preempted      increase of goodput_preemptions_total
  generation_tokens  increase of goodput_generation_tokens_total
  ttft, tpot     histogram increases of goodput_time_to_first_token_seconds and
                 goodput_time_per_output_token_seconds
  queue          histogram increase of goodput_request_queue_time_seconds
  running, waiting, kv_usage, max_num_seqs, max_waiting: the current sample's gauges.
Several ``model_name`` label values (one worker serves one model, so normally one) are summed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from goodput.autoscaler.policy import HistogramDelta, PodObservation
from goodput.worker import metric_names as m


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format, or a metric the policy needs is missing."""


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram: ``counts[i]`` = observations <= ``bounds[i]`` (seconds,
    ascending, last = +Inf); ``count`` and ``sum`` as exported."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    count: float
    sum: float


@dataclass(frozen=True)
class PodSample:
    """One scrape of one worker: gauges and cumulative counters since the process started.

    ``time``: seconds (any fixed origin) at which the values were read; differences of two
    samples' times are the interval of their deltas.
    """

    time: float
    running: float
    waiting: float
    kv_usage: float
    max_num_seqs: float
    max_waiting: float
    admitted: float
    finished: float
    slo_met: float
    rejected_429: float
    rejected_400: float
    preempted: float
    generation_tokens: float
    ttft: Histogram
    tpot: Histogram
    queue: Histogram

    def counters(self) -> tuple[float, ...]:
        return (self.admitted, self.finished, self.slo_met, self.rejected_429, self.rejected_400,
                self.preempted, self.generation_tokens)


def _index(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise MetricsParseError(f"not Prometheus text exposition format: {e}") from e
    return out


def _sum(idx, name: str, missing: list[str], **labels: str) -> float:
    series = idx.get(name)
    if series is None:
        missing.append(name)
        return 0.0
    return sum(v for lab, v in series if all(lab.get(k) == want for k, want in labels.items()))


def _histogram(idx, name: str, missing: list[str]) -> Histogram:
    buckets = idx.get(name + "_bucket")
    if not buckets:
        missing.append(name + "_bucket")
        return Histogram((math.inf,), (0.0,), 0.0, 0.0)
    by_le: dict[float, float] = {}
    for lab, v in buckets:
        le = float(lab["le"])  # "+Inf" -> inf
        by_le[le] = by_le.get(le, 0.0) + v
    bounds = tuple(sorted(by_le))
    if bounds[-1] != math.inf:
        raise MetricsParseError(f"{name}: no le=\"+Inf\" bucket")
    return Histogram(bounds, tuple(by_le[b] for b in bounds), _sum(idx, name + "_count", missing),
                     _sum(idx, name + "_sum", missing))


GAUGES = (m.REQUESTS_RUNNING, m.REQUESTS_WAITING, m.KV_CACHE_USAGE_RATIO, m.ADMISSION_MAX_NUM_SEQS,
          m.ADMISSION_MAX_WAITING)
COUNTERS = (m.REQUESTS_ADMITTED, m.REQUESTS_FINISHED, m.REQUESTS_SLO_MET, m.REQUESTS_REJECTED,
            m.PREEMPTIONS, m.GENERATION_TOKENS)
HISTOGRAMS = (m.TIME_TO_FIRST_TOKEN, m.TIME_PER_OUTPUT_TOKEN, m.REQUEST_QUEUE_TIME)


def needed_series() -> tuple[str, ...]:
    """Every sample name a :class:`PodSample` is built from (counters with ``_total``, histograms
    as ``_bucket``/``_count``/``_sum``) — e.g. for a PromQL ``__name__`` matcher."""
    return (GAUGES + tuple(c + "_total" for c in COUNTERS)
            + tuple(h + suffix for h in HISTOGRAMS for suffix in ("_bucket", "_count", "_sum")))


def parse_sample(text: str, time: float) -> PodSample:
    """Parse one worker's ``/metrics`` text (format 0.0.4) read at ``time`` seconds.

    Raises :class:`MetricsParseError` naming every missing metric when the text lacks one the
    policy needs (e.g. a server that is not a goodput worker), or when it does not parse.
    """
    return sample_from_series(_index(text), time)


def sample_from_series(idx: dict[str, list[tuple[dict[str, str], float]]], time: float) -> PodSample:
    """Build a :class:`PodSample` from ``{sample name: [(labels, value), ...]}`` of ONE pod (the
    shape both the text parser and a PromQL vector give). Raises :class:`MetricsParseError` naming
    the missing metrics."""
    miss: list[str] = []
    c = lambda name, **lab: _sum(idx, name + "_total", miss, **lab)  # noqa: E731
    g = lambda name: _sum(idx, name, miss)  # noqa: E731
    sample = PodSample(
        time=time,
        running=g(m.REQUESTS_RUNNING), waiting=g(m.REQUESTS_WAITING), kv_usage=g(m.KV_CACHE_USAGE_RATIO),
        max_num_seqs=g(m.ADMISSION_MAX_NUM_SEQS), max_waiting=g(m.ADMISSION_MAX_WAITING),
        admitted=c(m.REQUESTS_ADMITTED),
        finished=c(m.REQUESTS_FINISHED, finished_reason="stop") + c(m.REQUESTS_FINISHED, finished_reason="length"),
        slo_met=c(m.REQUESTS_SLO_MET),
        rejected_429=c(m.REQUESTS_REJECTED, reason="queue_full"),
        rejected_400=c(m.REQUESTS_REJECTED, reason="never_fits") + c(m.REQUESTS_REJECTED, reason="invalid"),
        preempted=c(m.PREEMPTIONS), generation_tokens=c(m.GENERATION_TOKENS),
        ttft=_histogram(idx, m.TIME_TO_FIRST_TOKEN, miss),
        tpot=_histogram(idx, m.TIME_PER_OUTPUT_TOKEN, miss),
        queue=_histogram(idx, m.REQUEST_QUEUE_TIME, miss))
    if miss:
        raise MetricsParseError("missing metrics: " + ", ".join(sorted(set(miss))))
    return sample


def restarted(prev: PodSample, cur: PodSample) -> bool:
    """True when some cumulative series went down between the samples (the worker restarted)."""
    if any(c < p for c, p in zip(cur.counters(), prev.counters())):
        return True
    for hp, hc in ((prev.ttft, cur.ttft), (prev.tpot, cur.tpot), (prev.queue, cur.queue)):
        if hc.bounds != hp.bounds or hc.count < hp.count or any(c < p for c, p in zip(hc.counts, hp.counts)):
            return True
    return False


def _hist_delta(prev: Histogram | None, cur: Histogram) -> HistogramDelta:
    if prev is None:
        return HistogramDelta(bounds=cur.bounds, counts=cur.counts, count=cur.count, sum=cur.sum)
    return HistogramDelta(bounds=cur.bounds, counts=tuple(c - p for c, p in zip(cur.counts, prev.counts)),
                          count=cur.count - prev.count, sum=cur.sum - prev.sum)


def observation(name: str, prev: PodSample | None, cur: PodSample, age_s: float = 0.0) -> PodObservation:
    """The policy's view of one ready pod: ``cur``'s gauges and the increases since ``prev``.

    ``prev`` None (first scrape of this pod): ``interval_s`` 0, every increase 0, no histograms —
    one sample says nothing about rates. A worker that restarted since ``prev`` counts from zero.
    ``age_s``: seconds since the pod became ready.
    """
    if prev is None:
        return PodObservation(
            name=name, running=int(cur.running), waiting=int(cur.waiting), kv_usage=cur.kv_usage,
            max_num_seqs=int(cur.max_num_seqs), max_waiting=int(cur.max_waiting), interval_s=0.0,
            admitted=0.0, finished=0.0, slo_met=0.0, rejected_429=0.0, rejected_400=0.0, preempted=0.0,
            generation_tokens=0.0, ttft=None, tpot=None, age_s=age_s)
    base = None if restarted(prev, cur) else prev
    d = (lambda f: getattr(cur, f)) if base is None else (lambda f: getattr(cur, f) - getattr(base, f))
    return PodObservation(
        name=name, running=int(cur.running), waiting=int(cur.waiting), kv_usage=cur.kv_usage,
        max_num_seqs=int(cur.max_num_seqs), max_waiting=int(cur.max_waiting),
        interval_s=max(0.0, cur.time - prev.time),
        admitted=d("admitted"), finished=d("finished"), slo_met=d("slo_met"),
        rejected_429=d("rejected_429"), rejected_400=d("rejected_400"), preempted=d("preempted"),
        generation_tokens=d("generation_tokens"),
        ttft=_hist_delta(base and base.ttft, cur.ttft), tpot=_hist_delta(base and base.tpot, cur.tpot),
        age_s=age_s, queue=_hist_delta(base and base.queue, cur.queue))
