"""The baseline autoscaling policies the simulator runs beside ours (``goodput.bench.simulate``).

Each is a ``SimPolicy``: ``tick(now, obs) -> (replicas, limits or None)`` every ``period_s``
seconds, reading the same ``goodput.autoscaler.policy.Observation`` the real loop builds. Their
rules follow the public algorithms named in each docstring (Kubernetes HPA, Knative KPA, llm-d's
saturation mode); static peak provisioning is the oracle of the peak.
"""
from __future__ import annotations

import math

from goodput.autoscaler.policy import Observation


class SimPolicy:
    """A policy under simulation: ``tick(now, obs) -> (replicas, limits or None)``."""

    name = "base"
    period_s = 5.0

    def tick(self, now: float, obs: Observation) -> tuple[int, dict | None]:
        raise NotImplementedError


class StaticPeak(SimPolicy):
    """Static provisioning for the peak: ``n`` replicas all the time."""

    name = "static-peak"
    period_s = 60.0

    def __init__(self, n: int) -> None:
        self.n = self.initial_replicas = n

    def tick(self, now, obs):
        return self.n, None


class HpaQueue(SimPolicy):
    """Kubernetes HPA on a Pods metric, the vLLM production-stack recipe: average
    ``num_requests_waiting`` target 5. Every 15 s: ratio = mean waiting / 5 with pods that have
    no metric yet (starting) counted as 0 on scale-up; inside the 10 % tolerance nothing moves;
    desired = ceil(current * ratio); scale-up limited to max(+100 %, +4) per period, scale-down
    to the largest recommendation of the last 300 s (the HPA controller's algorithm)."""

    name = "hpa-queue"
    period_s = 15.0

    def __init__(self, lo: int, hi: int, target: float = 5.0, tolerance: float = 0.1,
                 window_s: float = 300.0) -> None:
        self.lo, self.hi, self.target, self.tol, self.window = lo, hi, target, tolerance, window_s
        self.recs: list[tuple[float, int]] = []

    def tick(self, now, obs):
        cur = obs.current_replicas
        ready = [p for p in obs.ready]
        if not ready:
            return cur, None
        total = sum(p.waiting for p in ready)
        mean_ready = total / len(ready)
        if mean_ready > self.target:   # scale-up direction: missing pods count as 0
            n = cur
            ratio = total / max(1, n) / self.target
        else:                          # scale-down direction: missing pods count as at target
            n = len(ready)
            ratio = mean_ready / self.target
        if abs(ratio - 1.0) <= self.tol:
            desired = cur
        else:
            desired = math.ceil(ratio * n)
        desired = max(self.lo, min(self.hi, desired))
        self.recs.append((now, desired))
        self.recs = [(t, r) for t, r in self.recs if now - t <= self.window]
        if desired < cur:
            desired = max(r for _, r in self.recs)
        desired = min(desired, max(2 * cur, cur + 4))
        return desired, None


class Kpa(SimPolicy):
    """Knative Pod Autoscaler: concurrency (running + waiting per pod) target 100 at 70 %
    utilization (70 per pod); every 2 s, desired = ceil(window average of total concurrency / 70)
    over the 60 s stable window, or over the 6 s panic window when that asks for >= 2x the ready
    pods (panic: never scale down, stay >= 60 s); scale-down at most halves per tick."""

    name = "kpa"
    period_s = 2.0

    def __init__(self, lo: int, hi: int, target: float = 100.0, util: float = 0.7, stable_s: float = 60.0,
                 panic_s: float = 6.0, panic_threshold: float = 2.0) -> None:
        self.lo, self.hi = lo, hi
        self.per_pod = target * util
        self.stable_s, self.panic_s, self.threshold = stable_s, panic_s, panic_threshold
        self.samples: list[tuple[float, float]] = []
        self.panic_since: float | None = None
        self.max_panic = 0

    def tick(self, now, obs):
        cur = obs.current_replicas
        conc = float(sum(p.running + p.waiting for p in obs.ready))
        self.samples.append((now, conc))
        self.samples = [(t, c) for t, c in self.samples if now - t < self.stable_s]
        stable = [c for _, c in self.samples]
        panic = [c for t, c in self.samples if now - t < self.panic_s]
        d_stable = math.ceil(sum(stable) / len(stable) / self.per_pod)
        d_panic = math.ceil(sum(panic) / len(panic) / self.per_pod)
        ready = max(1, len(obs.ready))
        if d_panic / ready >= self.threshold:
            if self.panic_since is None:
                self.max_panic = cur
            self.panic_since = now
        elif self.panic_since is not None and now - self.panic_since >= self.stable_s:
            self.panic_since = None
        if self.panic_since is not None:
            self.max_panic = max(self.max_panic, d_panic, cur)
            desired = self.max_panic
        else:
            desired = max(d_stable, math.ceil(cur / 2))
        return max(self.lo, min(self.hi, desired)), None


class Saturation(SimPolicy):
    """Saturation ±1 (llm-d's variant autoscaler in saturation mode): every 15 s, +1 replica when
    any ready replica has KV usage >= 0.8 or >= 5 waiting; -1 when there is no queue anywhere and
    the load spread over one replica fewer keeps KV < 0.8 and the running requests within
    max_num_seqs; nothing while a pod is pending (the pending guard)."""

    name = "saturation"
    period_s = 15.0

    def __init__(self, lo: int, hi: int, kv: float = 0.8, queue: int = 5) -> None:
        self.lo, self.hi, self.kv, self.queue = lo, hi, kv, queue

    def tick(self, now, obs):
        cur = obs.current_replicas
        ready = obs.ready
        pending = cur - len(ready)
        if not ready or pending > 0:
            return cur, None
        if any(p.kv_usage >= self.kv or p.waiting >= self.queue for p in ready):
            return min(self.hi, cur + 1), None
        n = len(ready)
        if n > self.lo and n > 1 and all(p.waiting == 0 for p in ready):
            kv = sum(p.kv_usage for p in ready) / (n - 1)
            run = sum(p.running for p in ready) / (n - 1)
            if kv < self.kv and run < min(p.max_num_seqs for p in ready):
                return max(self.lo, cur - 1), None
        return cur, None
