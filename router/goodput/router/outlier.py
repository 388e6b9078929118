"""Outlier ejection: set aside a pod that keeps failing, bring it back through a probe (pure).

Envoy's outlier detection is the reference (its ``consecutive_5xx``, ``success_rate`` and
``failure_percentage`` detectors, ``base_ejection_time``, ``max_ejection_time``), cut to what a
router in front of a few engine pods needs. Nothing here does I/O or reads a clock: every call
takes ``now`` (seconds, monotonic) and the router feeds it the outcome of each upstream attempt.

What counts (:data:`FAILURE`, :data:`SUCCESS`, :data:`NEUTRAL`; the router's
``goodput.router.forward.verdict``): an upstream 5xx (other than a ``draining`` 503), a
connection refused / reset / closed before the answer, or a stream cut mid-way is a failure; any
other answer (2xx, 3xx, 4xx: the client's fault) a success; a 429 or a ``draining`` 503 (the pod
is healthy and says so) and a client that went away count for nothing. A pod that fails fast
therefore counts as failing, not as empty: its in-flight count stays low, but its failures
accumulate and eject it.

When a pod is ejected (reason in :data:`REASONS`):

- ``consecutive_failures``: ``consecutive_failures`` failures in a row (a success resets the run);
- ``success_rate``: at the end of each ``interval_s`` window, among the service's pods with at
  least ``sr_min_requests`` attempts in the window (at least ``sr_min_hosts`` of them), a pod
  whose success rate is below ``mean - sr_stdev_factor * stdev`` (population stdev). As in Envoy,
  this needs enough pods to mean anything (with n pods no z-score exceeds (n-1)/sqrt(n): the
  default factor 1.9 fires from 6 pods on);
- ``failure_percentage``: in the same window, a pod with at least ``fp_min_requests`` attempts of
  which at least ``fp_threshold`` (a fraction) failed, however many pods there are;
- ``probe_failed``: its probe (below) failed.

An ejected pod receives no request for ``base_ejection_s * k`` seconds (at most
``max_ejection_s``), ``k`` the number of its ejections since it last served cleanly for
``max_ejection_s`` (the backoff grows on repeat). When that time is up the pod is *due*: the next
request picked for it is its probe (one at a time; the others keep avoiding it). A probe that
succeeds returns the pod (run and window counts cleared); one that fails ejects it again, for
longer. A probe that ends neutral leaves the pod due.

Never the last pod: an ejection happens only while at least one other routable pod of the
service is not ejected, and at most ``max_ejected_fraction`` of the routable pods (rounded down,
but always 1 when there are two or more) are ejected at once. A pod that would be ejected but
cannot stays in service with its counts (the next failure asks again).
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

SUCCESS, FAILURE, NEUTRAL = True, False, None

REASON_CONSECUTIVE = "consecutive_failures"
REASON_SUCCESS_RATE = "success_rate"
REASON_FAILURE_PERCENTAGE = "failure_percentage"
REASON_PROBE = "probe_failed"
REASONS = (REASON_CONSECUTIVE, REASON_SUCCESS_RATE, REASON_FAILURE_PERCENTAGE, REASON_PROBE)

PodKey = tuple[str, str, str]  # (namespace, InferenceService, pod name)


@dataclass(frozen=True)
class OutlierConfig:
    """Knobs of outlier ejection (seconds, counts, fractions). ``enabled=False``: nothing is
    ever ejected (the counts are still kept)."""

    enabled: bool = True
    consecutive_failures: int = 3
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejected_fraction: float = 0.5
    interval_s: float = 10.0
    sr_min_hosts: int = 5
    sr_min_requests: int = 20
    sr_stdev_factor: float = 1.9
    fp_threshold: float = 0.5
    fp_min_requests: int = 20

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError(f"consecutive_failures must be >= 1, got {self.consecutive_failures}")
        if not 0 < self.base_ejection_s <= self.max_ejection_s:
            raise ValueError(f"need 0 < base_ejection_s <= max_ejection_s, got {self.base_ejection_s}, "
                             f"{self.max_ejection_s}")
        if not 0 <= self.max_ejected_fraction <= 1:
            raise ValueError(f"max_ejected_fraction must be in [0, 1], got {self.max_ejected_fraction}")
        if not 0 < self.fp_threshold <= 1:
            raise ValueError(f"fp_threshold must be in (0, 1], got {self.fp_threshold}")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")


@dataclass(frozen=True)
class Ejection:
    """One ejection: the pod, why (one of :data:`REASONS`), for how long (seconds), until when
    (the ``now`` clock) and its ordinal ``k`` in the pod's streak (the backoff multiplier)."""

    pod: PodKey
    reason: str
    duration_s: float
    until: float
    k: int

    def describe(self) -> str:
        ns, svc, name = self.pod
        where = f"{ns}/{svc}" if ns else svc
        return f"ejected pod {name} of {where} for {self.duration_s:g} s ({self.reason}, ejection {self.k} in a row)"


@dataclass
class _PodState:
    run: int = 0              # failures in a row
    ok: int = 0               # successes in the current window
    failed: int = 0           # failures in the current window
    ejected_until: float | None = None
    k: int = 0                # ejections in the current streak
    probing: bool = False     # a probe request is in flight
    clean_since: float | None = None  # returned (or first seen) at; the streak resets after max_ejection_s


@dataclass
class _Window:
    start: float


class Outliers:
    """Per-pod failure accounting and ejection state for every service (one per router).

    ``admits(pod, now)``: may a request be sent to the pod now (not ejected, or due with no probe
    in flight). ``claim(pod, now)``: the router picked the pod; claims the probe when due.
    ``record(pod, verdict, now, peers)``: the attempt's verdict; returns the ejections it caused
    (the pod's own, and the window's outliers when ``interval_s`` has passed). ``peers``: the
    routable pod names of the pod's service (the never-the-last-pod rule). ``forget(pod)``: the
    pod left, or it restarted (a new engine has no past).
    """

    def __init__(self, cfg: OutlierConfig | None = None) -> None:
        self.cfg = cfg or OutlierConfig()
        self._pods: dict[PodKey, _PodState] = {}
        self._windows: dict[tuple[str, str], _Window] = {}

    # ------------------------------------------------------------------ reads
    def ejected(self, pod: PodKey, now: float) -> bool:
        """Ejected and not yet due for its probe."""
        st = self._pods.get(pod)
        return st is not None and st.ejected_until is not None and now < st.ejected_until

    def admits(self, pod: PodKey, now: float) -> bool:
        st = self._pods.get(pod)
        if st is None or st.ejected_until is None:
            return True
        return now >= st.ejected_until and not st.probing

    def set_aside(self, pod: PodKey) -> bool:
        """Ejected, due or probing (not yet returned)."""
        st = self._pods.get(pod)
        return st is not None and st.ejected_until is not None

    def ejected_count(self, service: tuple[str, str]) -> int:
        """Pods of ``service`` set aside now (ejected, due or probing)."""
        return sum(1 for k, st in self._pods.items() if k[:2] == service and st.ejected_until is not None)

    # ------------------------------------------------------------------ updates
    def claim(self, pod: PodKey, now: float) -> bool:
        """The router sends a request to ``pod``: True when it is the pod's probe."""
        st = self._pods.get(pod)
        if st is None or st.ejected_until is None or now < st.ejected_until or st.probing:
            return False
        st.probing = True
        return True

    def unclaim(self, pod: PodKey) -> None:
        """The request that claimed the probe ended without a verdict (client gone, dropped
        from the queue): the pod stays due."""
        st = self._pods.get(pod)
        if st is not None:
            st.probing = False

    def forget(self, pod: PodKey) -> None:
        self._pods.pop(pod, None)

    def record(self, pod: PodKey, verdict: bool | None, now: float, peers: Collection[str]) -> list[Ejection]:
        """Account one attempt's verdict (SUCCESS / FAILURE / NEUTRAL); the ejections it causes."""
        st = self._pods.setdefault(pod, _PodState(clean_since=now))
        out: list[Ejection] = []
        if st.probing:
            st.probing = False
            if verdict is SUCCESS:
                self._return(st, now)
            elif verdict is FAILURE:
                out.append(self._eject(pod, st, REASON_PROBE, now))
            return out + self._sweep(pod[:2], now, peers)
        if verdict is NEUTRAL:
            return self._sweep(pod[:2], now, peers)
        if verdict is SUCCESS:
            st.run = 0
            st.ok += 1
        else:
            st.run += 1
            st.failed += 1
            if st.ejected_until is None and st.run >= self.cfg.consecutive_failures and self._may_eject(pod, peers):
                out.append(self._eject(pod, st, REASON_CONSECUTIVE, now))
        return out + self._sweep(pod[:2], now, peers)

    # ------------------------------------------------------------------ rules
    def _may_eject(self, pod: PodKey, peers: Collection[str]) -> bool:
        if not self.cfg.enabled:
            return False
        service = pod[:2]
        others_in = [p for p in peers if p != pod[2] and not self.set_aside((*service, p))]
        if not others_in:
            return False  # never the last pod
        n = len(set(peers) | {pod[2]})
        cap = max(1, math.floor(self.cfg.max_ejected_fraction * n))
        return self.ejected_count(service) + (0 if self.set_aside(pod) else 1) <= cap

    def _eject(self, pod: PodKey, st: _PodState, reason: str, now: float) -> Ejection:
        if st.clean_since is not None and now - st.clean_since >= self.cfg.max_ejection_s:
            st.k = 0  # served cleanly long enough: the backoff starts over
        st.k += 1
        duration = min(self.cfg.base_ejection_s * st.k, self.cfg.max_ejection_s)
        st.ejected_until = now + duration
        st.run = st.ok = st.failed = 0
        st.clean_since = None
        return Ejection(pod, reason, duration, st.ejected_until, st.k)

    def _return(self, st: _PodState, now: float) -> None:
        st.ejected_until = None
        st.run = st.ok = st.failed = 0
        st.clean_since = now

    def _sweep(self, service: tuple[str, str], now: float, peers: Collection[str]) -> list[Ejection]:
        """At the end of the service's window: the success-rate and failure-percentage outliers."""
        w = self._windows.setdefault(service, _Window(now))
        if now - w.start < self.cfg.interval_s:
            return []
        w.start = now
        pods = {k: st for k, st in self._pods.items() if k[:2] == service and st.ejected_until is None}
        verdicts = window_outliers({k[2]: (st.ok, st.failed) for k, st in pods.items()}, self.cfg)
        for st in pods.values():
            st.ok = st.failed = 0
        out = []
        for name, reason in verdicts:
            key = (*service, name)
            if self._may_eject(key, peers):
                out.append(self._eject(key, self._pods[key], reason, now))
        return out


def window_outliers(counts: dict[str, tuple[int, int]], cfg: OutlierConfig) -> list[tuple[str, str]]:
    """The pods one window's counts (name -> (successes, failures)) mark as outliers, as
    (name, reason), worst success rate first. Pure; see the module doc for the two rules."""
    out: dict[str, str] = {}
    rates = {n: ok / (ok + bad) for n, (ok, bad) in counts.items() if ok + bad >= cfg.sr_min_requests}
    if len(rates) >= cfg.sr_min_hosts:
        mean = sum(rates.values()) / len(rates)
        stdev = math.sqrt(sum((r - mean) ** 2 for r in rates.values()) / len(rates))
        floor = mean - cfg.sr_stdev_factor * stdev
        out.update({n: REASON_SUCCESS_RATE for n, r in rates.items() if r < floor})
    for n, (ok, bad) in counts.items():
        if n not in out and ok + bad >= cfg.fp_min_requests and bad / (ok + bad) >= cfg.fp_threshold:
            out[n] = REASON_FAILURE_PERCENTAGE
    return sorted(out.items(), key=lambda kv: (counts[kv[0]][0] / max(1, sum(counts[kv[0]])), kv[0]))
