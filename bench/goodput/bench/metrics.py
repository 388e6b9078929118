"""Pure latency/throughput/goodput math over recorded request timelines.

Every time is a float in seconds from one monotonic clock (``time.perf_counter`` in the client).
Definitions (the same as the engine's per-request metrics, measured here at the client):

- TTFT  = time of the first output token - time the request was sent.
- ITL   = the gaps between consecutive output-token arrivals (n_out - 1 gaps per request).
- E2E   = time the response finished - time the request was sent.
- TPOT  = (E2E - TTFT) / (n_out - 1); undefined (None) when n_out <= 1.
- goodput = requests per second that finished AND met both SLOs (TTFT <= slo_ttft and
  TPOT <= slo_tpot; a request with one output token has no TPOT and meets the TPOT SLO).
  "Goodput" follows DistServe (Zhong et al., OSDI 2024): throughput counted only over requests
  that meet the latency contract.

Percentiles use linear interpolation between closest ranks (numpy's default "linear" method):
for sorted x of length n, p-th percentile is at rank r = (n - 1) * p / 100, interpolated between
x[floor(r)] and x[ceil(r)].
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

#: record.status values
OK = "ok"  # streamed to the end
REJECTED = "rejected"  # HTTP 429 (admission: queue full)
ERROR = "error"  # any other HTTP error, a transport error, or a malformed stream
CANCELLED = "cancelled"  # still in flight when the run's drain deadline passed

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's timeline as the client saw it.

    send_time: when the request was written (s, monotonic). scheduled_time: when the arrival
    process wanted it sent (open loop; equals send_time in closed loop). token_times: arrival
    time of each output token (one SSE event per token). end_time: when the stream ended.
    n_out: output tokens (the server's usage.completion_tokens when given, else len(token_times)).
    """

    request_id: str
    cls: str = "default"
    prompt_tokens: int = 0  # intended prompt length (tokens)
    max_tokens: int = 0
    scheduled_time: float = 0.0
    send_time: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    status: str = OK
    http_status: int | None = None
    error: str | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def n_out(self) -> int:
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        if self.status != OK or not self.token_times:
            return None
        return self.token_times[0] - self.send_time

    @property
    def e2e(self) -> float | None:
        if self.status != OK or self.end_time is None:
            return None
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        if self.status != OK:
            return []
        t = self.token_times
        return [t[i + 1] - t[i] for i in range(len(t) - 1)]

    @property
    def tpot(self) -> float | None:
        ttft, e2e, n = self.ttft, self.e2e, self.n_out
        if ttft is None or e2e is None or n <= 1:
            return None
        return (e2e - ttft) / (n - 1)

    def meets_slo(self, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
        """True when the request finished and met both SLOs (an unset SLO always holds)."""
        if self.status != OK or self.ttft is None:
            return False
        if slo_ttft_s is not None and self.ttft > slo_ttft_s:
            return False
        tpot = self.tpot
        if slo_tpot_s is not None and tpot is not None and tpot > slo_tpot_s:
            return False
        return True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        return cls(**d)


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) by linear interpolation; None for no values.

    Raises ValueError if p is outside [0, 100].
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    if not xs:
        return None
    r = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(r), math.ceil(r)
    return xs[lo] + (xs[hi] - xs[lo]) * (r - lo)


def _dist(values: Sequence[float]) -> dict:
    out: dict = {"n": len(values), "mean": (sum(values) / len(values)) if values else None}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p)
    out["max"] = max(values) if values else None
    return out


def summarize(
    records: Iterable[RequestRecord],
    *,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    duration_s: float | None = None,
    by_class: bool = True,
) -> dict:
    """Aggregate a run: counts, throughput, goodput and latency distributions.

    duration_s: the wall time to divide by; default = last end_time - first send_time over all
    records that were sent. Returns a dict with keys: counts (sent, ok, rejected, errors,
    cancelled, admitted = sent - rejected), rates (rejection_rate, error_rate as 0-1 of sent),
    duration_s, offered_rps ((sent - 1) / (last send - first send)), request_throughput_rps (ok / duration),
    output_token_throughput (sum n_out of ok / duration, tokens/s), total_token_throughput
    (prompt + output), goodput_rps, slo_attainment (met / sent), and ttft/itl/tpot/e2e
    distributions (seconds; ITL pooled over every gap of every ok request), plus "classes": the
    same per request class when by_class.
    """
    recs = list(records)
    sent = [r for r in recs if r.send_time is not None]
    ok = [r for r in sent if r.status == OK]
    if duration_s is None:
        ends = [r.end_time for r in sent if r.end_time is not None]
        starts = [r.send_time for r in sent]
        duration_s = (max(ends) - min(starts)) if ends and starts else 0.0
    dur = duration_s if duration_s and duration_s > 0 else float("nan")
    n_sent = len(sent)
    n_rej = sum(r.status == REJECTED for r in sent)
    n_err = sum(r.status == ERROR for r in sent)
    n_can = sum(r.status == CANCELLED for r in sent)
    met = sum(r.meets_slo(slo_ttft_s, slo_tpot_s) for r in sent)
    out_tok = sum(r.n_out for r in ok)
    prompt_tok = sum((r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_tokens) for r in ok)
    res = {
        "counts": {"sent": n_sent, "ok": len(ok), "rejected": n_rej, "errors": n_err,
                   "cancelled": n_can, "admitted": n_sent - n_rej, "slo_met": met},
        "rates": {"rejection_rate": n_rej / n_sent if n_sent else 0.0,
                  "error_rate": n_err / n_sent if n_sent else 0.0},
        "duration_s": duration_s,
        "offered_rps": _arrival_rate([r.send_time for r in sent], n_sent / dur),
        "request_throughput_rps": len(ok) / dur,
        "output_token_throughput": out_tok / dur,
        "total_token_throughput": (out_tok + prompt_tok) / dur,
        "output_tokens": out_tok,
        "prompt_tokens": prompt_tok,
        "goodput_rps": met / dur,
        "slo_attainment": met / n_sent if n_sent else None,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "ttft_s": _dist([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": _dist([g for r in ok for g in r.itls]),
        "tpot_s": _dist([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": _dist([r.e2e for r in ok if r.e2e is not None]),
    }
    if by_class:
        classes = sorted({r.cls for r in sent})
        res["classes"] = {
            c: summarize([r for r in sent if r.cls == c], slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                         duration_s=duration_s, by_class=False)
            for c in classes
        } if len(classes) > 1 else {}
    return res


def _arrival_rate(send_times: list[float], fallback: float) -> float:
    """(n - 1) / (last send - first send): the rate the requests were offered at; the fallback when
    all were sent at one instant."""
    if len(send_times) < 2 or max(send_times) <= min(send_times):
        return fallback
    return (len(send_times) - 1) / (max(send_times) - min(send_times))


def check_consistency(rec: RequestRecord, *, tol: float = 1e-9) -> list[str]:
    """Invariants a correctly recorded OK timeline satisfies; returns the violations (empty = fine).

    send <= first token <= ... <= last token <= end; TTFT <= E2E; ITL count = n_out - 1
    (requires one event per token); usage count equals the number of token events.
    """
    errs: list[str] = []
    if rec.status != OK:
        return errs
    t = rec.token_times
    if not t:
        return ["no tokens recorded"]
    if t[0] < rec.send_time - tol:
        errs.append("first token before send")
    if any(t[i + 1] < t[i] - tol for i in range(len(t) - 1)):
        errs.append("token times not monotonic")
    if rec.end_time is None or rec.end_time < t[-1] - tol:
        errs.append("end before last token")
    if rec.ttft is not None and rec.e2e is not None and rec.ttft > rec.e2e + tol:
        errs.append("TTFT > E2E")
    if len(rec.itls) != rec.n_out - 1:
        errs.append(f"ITL count {len(rec.itls)} != n_out - 1 = {rec.n_out - 1}")
    if rec.usage_completion_tokens is not None and rec.usage_completion_tokens != len(t):
        errs.append(f"usage says {rec.usage_completion_tokens} tokens, {len(t)} token events")
    return errs


def itl_timeline(records: Iterable[RequestRecord], t0: float = 0.0) -> list[tuple[float, float]]:
    """(time of the later token - t0, gap) for every ITL gap of OK records, sorted by time."""
    pts = []
    for r in records:
        if r.status != OK:
            continue
        t = r.token_times
        pts.extend((t[i + 1] - t0, t[i + 1] - t[i]) for i in range(len(t) - 1))
    return sorted(pts)


def mean_active(records: Iterable[RequestRecord], t0: float, t1: float, *, from_first_token: bool = True) -> float:
    """Time-average number of requests in decode over [t0, t1]: a request counts from its first
    token (or from its send when from_first_token=False) until its end. Divide by the max batch
    to get slot utilization. Raises ValueError when t1 <= t0."""
    if t1 <= t0:
        raise ValueError(f"empty window [{t0}, {t1}]")
    total = 0.0
    for r in records:
        if r.status != OK or not r.token_times or r.end_time is None:
            continue
        a = r.token_times[0] if from_first_token else r.send_time
        lo, hi = max(a, t0), min(r.end_time, t1)
        if hi > lo:
            total += hi - lo
    return total / (t1 - t0)


def window_itls(records: Iterable[RequestRecord], t_lo: float, t_hi: float, cls: str | None = None) -> list[float]:
    """ITL gaps (s) of OK records (of class cls, if given) whose later token arrived in [t_lo, t_hi]."""
    out = []
    for r in records:
        if r.status != OK or (cls is not None and r.cls != cls):
            continue
        t = r.token_times
        out.extend(t[i + 1] - t[i] for i in range(len(t) - 1) if t_lo <= t[i + 1] <= t_hi)
    return out
