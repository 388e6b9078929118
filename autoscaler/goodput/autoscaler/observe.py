"""Worker ``/metrics`` text -> one cumulative sample per pod; two samples -> a ``PodObservation``.

Pure (no I/O): the loop fetches the text (or asks Prometheus) and keeps the previous sample.
Metric names come from :mod:`goodput.api.worker_metrics` (the worker's contract, side-effect
free); the text is parsed with ``prometheus_client``'s parser.

Deltas follow Prometheus' ``increase()`` semantics on two raw samples: counter increase = current
- previous; a worker that restarted between the scrapes (any cumulative series went down — a
process restart resets all of them together) counts from zero, so the increase is the current
value. Histograms subtract bucket by bucket (still cumulative by ``le``), ``_count`` and ``_sum``.

What feeds the policy is declared once, in the tables :data:`COUNTERS`, :data:`HISTOGRAMS` and
:data:`GAUGES` (``policy.PodObservation`` field -> metric and label values): e.g. ``finished``
counts ``finished_reason`` stop and length only (aborted requests, client disconnects, are neither
met nor missed; the worker's ``goodput_requests_slo_met_total`` counts only stop/length too),
``rejected_429`` is ``reason=queue_full``, ``rejected_400`` never_fits + invalid. Counters become
increases, histograms bucket-wise increases, gauges are the current sample's. Several
``model_name`` label values (one worker serves one model, so normally one) are summed.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from goodput.autoscaler.policy import HistogramDelta, PodObservation, RouterObservation
from goodput.api import router_metrics as rm
from goodput.api.policy import SLO_CLASS_LABEL
from goodput.api import worker_metrics as m


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


# The counters and histograms the policy reads, declared once: PodObservation field -> (metric
# name without _total, {label: values summed}). A new counter is one row here (and its field in
# policy.PodObservation); the parser, the PromQL query, the delta and the simulator follow.
COUNTERS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "admitted": (m.REQUESTS_ADMITTED, {}),
    "finished": (m.REQUESTS_FINISHED, {"finished_reason": ("stop", "length")}),
    "slo_met": (m.REQUESTS_SLO_MET, {}),
    "rejected_429": (m.REQUESTS_REJECTED, {"reason": ("queue_full",)}),
    "rejected_400": (m.REQUESTS_REJECTED, {"reason": ("never_fits", "invalid")}),
    "preempted": (m.PREEMPTIONS, {}),
    "generation_tokens": (m.GENERATION_TOKENS, {}),
    "prompt_tokens": (m.PROMPT_TOKENS, {}),
    "prefix_cache_hits": (m.PREFIX_CACHE_HITS, {}),
}
# PodObservation field -> histogram metric name (seconds, except prompt_len: tokens)
HISTOGRAMS: dict[str, str] = {
    "ttft": m.TIME_TO_FIRST_TOKEN,
    "tpot": m.TIME_PER_OUTPUT_TOKEN,
    "queue": m.REQUEST_QUEUE_TIME,
    "prompt_len": m.REQUEST_PROMPT_TOKENS,    # tokens, not seconds: per finished request (rule 16)
}
# PodObservation field -> per-class counter (label slo_class): one dict {class: increase} per field.
# Optional: a worker without them (an older image) gives None, and the policy reads the histograms.
# In a PodSample they are flat counters named "<field>:<class>" (so restarts and deltas need nothing
# of their own).
CLASS_COUNTERS: dict[str, str] = {
    "class_finished": m.REQUESTS_FINISHED_BY_CLASS,
    "class_tpot_met": m.REQUESTS_TPOT_MET_BY_CLASS,
}
# PodObservation field -> gauge metric name (the current sample's value, never a delta): the
# contract's table, which the router reads too
GAUGES: dict[str, str] = m.LOAD_GAUGES
_INT_GAUGES = m.COUNT_GAUGES


@dataclass(frozen=True)
class PodSample:
    """One scrape of one worker: gauges and cumulative counters since the process started.

    ``time``: seconds (any fixed origin) at which the values were read; differences of two
    samples' times are the interval of their deltas. ``gauges``, ``counters``, ``histograms``:
    keyed by the fields of :data:`GAUGES`, :data:`COUNTERS`, :data:`HISTOGRAMS` (counts and
    seconds). The simulator builds these from its replicas' scheduler counters, the loop from a
    scrape: both take their deltas with :func:`delta`.
    """

    time: float
    gauges: dict[str, float]
    counters: dict[str, float]
    histograms: dict[str, Histogram]

    def __getattr__(self, name: str) -> Any:  # s.admitted, s.ttft, s.max_waiting, ...
        for part in ("gauges", "counters", "histograms"):
            d = self.__dict__.get(part)
            if d is not None and name in d:
                return d[name]
        raise AttributeError(name)


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


def needed_series() -> tuple[str, ...]:
    """Every sample name a :class:`PodSample` is built from (counters with ``_total``, histograms
    as ``_bucket``/``_count``/``_sum``) — e.g. for a PromQL ``__name__`` matcher."""
    names = list(GAUGES.values()) + [metric + "_total" for metric, _ in COUNTERS.values()]
    names += [h + suffix for h in HISTOGRAMS.values() for suffix in ("_bucket", "_count", "_sum")]
    names += [metric + "_total" for metric in CLASS_COUNTERS.values()]
    return tuple(dict.fromkeys(names))


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
    counters = {}
    for fld, (metric, labels) in COUNTERS.items():
        if not labels:
            counters[fld] = _sum(idx, metric + "_total", miss)
            continue
        [(label, values)] = labels.items()
        counters[fld] = sum(_sum(idx, metric + "_total", miss, **{label: v}) for v in values)
    for fld, metric in CLASS_COUNTERS.items():   # optional: absent on a worker without them
        for lab, v in idx.get(metric + "_total", ()):
            key = f"{fld}:{lab.get(SLO_CLASS_LABEL, '')}"
            counters[key] = counters.get(key, 0.0) + v
    sample = PodSample(
        time=time, gauges={fld: _sum(idx, metric, miss) for fld, metric in GAUGES.items()}, counters=counters,
        histograms={fld: _histogram(idx, metric, miss) for fld, metric in HISTOGRAMS.items()})
    if miss:
        raise MetricsParseError("missing metrics: " + ", ".join(sorted(set(miss))))
    return sample


def restarted(prev: PodSample, cur: PodSample) -> bool:
    """True when some cumulative series went down between the samples (the worker restarted)."""
    if any(cur.counters[k] < prev.counters.get(k, 0.0) for k in cur.counters):
        return True
    for k, hc in cur.histograms.items():
        hp = prev.histograms.get(k)
        if hp is None:
            continue
        if hc.bounds != hp.bounds or hc.count < hp.count or any(c < p for c, p in zip(hc.counts, hp.counts)):
            return True
    return False


def _hist_delta(prev: Histogram | None, cur: Histogram) -> HistogramDelta:
    if prev is None:
        return HistogramDelta(bounds=cur.bounds, counts=cur.counts, count=cur.count, sum=cur.sum)
    return HistogramDelta(bounds=cur.bounds, counts=tuple(c - p for c, p in zip(cur.counts, prev.counts)),
                          count=cur.count - prev.count, sum=cur.sum - prev.sum)


@dataclass(frozen=True)
class Delta:
    """The increases between two samples: ``interval_s`` (seconds; 0 = no previous sample),
    ``counters`` (field -> increase) and ``histograms`` (field -> HistogramDelta, or None without a
    previous sample)."""

    interval_s: float
    counters: dict[str, float]
    histograms: dict[str, HistogramDelta | None]


def delta(prev: PodSample | None, cur: PodSample) -> Delta:
    """Prometheus ``increase()`` on two raw samples, for every counter and histogram of the table.

    ``prev`` None (first scrape): interval 0, every increase 0, no histograms (one sample says
    nothing about rates). A worker that restarted since ``prev`` (:func:`restarted`) counts from
    zero: the increase is ``cur``'s value.
    """
    if prev is None:
        return Delta(0.0, {k: 0.0 for k in cur.counters}, {k: None for k in cur.histograms})
    base = None if restarted(prev, cur) else prev
    counters = {k: v - (base.counters.get(k, 0.0) if base else 0.0) for k, v in cur.counters.items()}
    hists = {k: _hist_delta(base.histograms.get(k) if base else None, h) for k, h in cur.histograms.items()}
    return Delta(max(0.0, cur.time - prev.time), counters, hists)


_OBS_FIELDS = frozenset(f.name for f in dataclasses.fields(PodObservation))


def observation(name: str, prev: PodSample | None, cur: PodSample, age_s: float = 0.0,
                load_s: float | None = None) -> PodObservation:
    """The policy's view of one ready pod: ``cur``'s gauges and the increases since ``prev``
    (:func:`delta`). ``age_s``: seconds since the pod became ready; ``load_s``: seconds from its
    creation to ready (None: unknown). Table fields that ``PodObservation`` does not have are left
    out."""
    d = delta(prev, cur)
    values: dict[str, Any] = {k: int(v) if k in _INT_GAUGES else v for k, v in cur.gauges.items()}
    values.update(d.counters)
    values.update(d.histograms)
    for k, v in d.counters.items():   # "class_finished:batch" -> class_finished["batch"]
        fld, sep, cls = k.partition(":")
        if sep and fld in CLASS_COUNTERS:
            values.setdefault(fld, {})[cls] = v
    values = {k: v for k, v in values.items() if k in _OBS_FIELDS}
    return PodObservation(name=name, interval_s=d.interval_s, age_s=age_s, load_s=load_s, **values)


# ------------------------------------------------------------------------------------------- router
# What the autoscaler reads of a router (docs/router-autoscaler-contract.md, "Router -> autoscaler"),
# per (namespace, inferenceservice): RouterObservation field -> metric (and label values summed).
ROUTER_GAUGES: dict[str, str] = {"held": rm.HELD_REQUESTS, "queued": rm.QUEUED_REQUESTS}
ROUTER_COUNTERS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "refused": (rm.REQUESTS, {"outcome": ("refused",)}),
    # disaggregated prefill the decode pod did in the prefill pool's place (policy rule 19)
    "pd_fallback": (rm.PD_DECISIONS, {"decision": ("no_prefill_pod", "prefill_failed")}),
}
ServiceKey = tuple[str, str]  # (namespace, inferenceservice)


def parse_router(text: str, time: float) -> dict[ServiceKey, PodSample]:
    """One router's ``/metrics`` text -> a sample per service it reports (gauges held and queued,
    the counter refused: cumulative). Raises :class:`MetricsParseError` when the text does not
    parse; a router that reports no service gives {}."""
    idx = _index(text)
    keys = {(lab.get("namespace", ""), lab.get("inferenceservice", ""))
            for name in list(ROUTER_GAUGES.values()) + [c[0] + "_total" for c in ROUTER_COUNTERS.values()]
            for lab, _ in idx.get(name, ())}
    out: dict[ServiceKey, PodSample] = {}
    for ns, svc in sorted(keys):
        miss: list[str] = []
        sel = {"namespace": ns, "inferenceservice": svc}
        gauges = {f: _sum(idx, metric, miss, **sel) if metric in idx else 0.0 for f, metric in ROUTER_GAUGES.items()}
        counters = {}
        for f, (metric, labels) in ROUTER_COUNTERS.items():
            [(label, values)] = labels.items()
            counters[f] = sum(_sum(idx, metric + "_total", miss, **sel, **{label: v}) for v in values) \
                if metric + "_total" in idx else 0.0
        out[(ns, svc)] = PodSample(time=time, gauges=gauges, counters=counters, histograms={})
    return out


def router_observation(pairs: list[tuple[PodSample | None, PodSample]]) -> RouterObservation:
    """One service's view summed over router replicas: ``pairs`` = (previous, current) sample of
    each router that reports it. held and queued: the current gauges' sum; refused and pd_fallback:
    the sum of each router's :func:`delta` (a restarted router counts from zero; a first sample adds
    nothing)."""
    held = sum(cur.gauges.get("held", 0.0) for _, cur in pairs)
    queued = sum(cur.gauges.get("queued", 0.0) for _, cur in pairs)
    deltas = [delta(prev, cur).counters for prev, cur in pairs]
    refused = sum(d.get("refused", 0.0) for d in deltas)
    fallback = sum(d.get("pd_fallback", 0.0) for d in deltas)
    return RouterObservation(held=int(held), queued=int(queued), refused=refused, pd_fallback=fallback)
