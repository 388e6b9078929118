"""Workloads (what each request asks for) and arrival processes (when it is sent), seeded.

A workload is a list of `RequestSpec`. `at` is the send offset in seconds from the start of the
run for open-loop arrivals and for injected requests; closed-loop requests have at=None and are
sent as soon as one of the C client slots is free.

Arrivals:
- closed loop at concurrency C: C outstanding requests at all times (a new one the moment one ends);
- Poisson at rate lambda: exponential inter-arrival gaps, mean 1/lambda;
- gamma at rate lambda with coefficient of variation cv: gaps ~ Gamma(shape k = 1/cv^2,
  scale = 1/(lambda k)); cv = 1 is Poisson, cv > 1 burstier;
- trace replay: the trace's own arrival offsets divided by a time scale.
"""
from __future__ import annotations

import csv
import os
import random
from dataclasses import asdict, dataclass
from datetime import datetime

from .prompts import PromptFactory

#: The Azure LLM inference 2023 code trace, kept in the repo (CC-BY 4.0; README and LICENSE beside it).
AZURE_CODE_TRACE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "data",
                                                "azure-llm-inference-2023", "code.csv"))


@dataclass
class RequestSpec:
    """prompt: text; prompt_tokens: its token count; max_tokens: output tokens to force
    (with ignore_eos); cls: the request class for per-class percentiles; at: send offset (s)."""

    prompt: str
    prompt_tokens: int
    max_tokens: int
    cls: str = "default"
    at: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("prompt")
        return d


def parse_range(s: str) -> tuple[int, int]:
    """'16:256' -> (16, 256); '64' -> (64, 64). ValueError on a bad or empty range."""
    parts = s.split(":")
    if len(parts) == 1:
        lo = hi = int(parts[0])
    elif len(parts) == 2:
        lo, hi = int(parts[0]), int(parts[1])
    else:
        raise ValueError(f"range must be N or LO:HI, got {s!r}")
    if lo < 1 or hi < lo:
        raise ValueError(f"range must satisfy 1 <= LO <= HI, got {s!r}")
    return lo, hi


def fixed(pf: PromptFactory, n: int, input_len: int, output_len: int, cls: str = "fixed") -> list[RequestSpec]:
    return [RequestSpec(pf.make(input_len), input_len, output_len, cls) for _ in range(n)]


def uniform(pf: PromptFactory, n: int, input_range: tuple[int, int], output_range: tuple[int, int],
            seed: int = 0, cls: str = "uniform") -> list[RequestSpec]:
    """Lengths drawn uniformly (inclusive) from the ranges with their own seeded generator."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = rng.randint(*input_range)
        o = rng.randint(*output_range)
        out.append(RequestSpec(pf.make(i), i, o, cls))
    return out


def shared_prefix(pf: PromptFactory, n: int, prefix_len: int, suffix_len: int, output_len: int,
                  cls: str = "shared-prefix") -> list[RequestSpec]:
    """n requests = one common system prompt of prefix_len tokens + a distinct suffix each."""
    prefix = pf.make(prefix_len) + "\n"
    p_tokens = pf.count(prefix)
    out = []
    for _ in range(n):
        suffix = pf.make(suffix_len, prefix=prefix)
        out.append(RequestSpec(prefix + suffix, p_tokens + suffix_len, output_len, cls))
    return out


def long_inject(pf: PromptFactory, n_short: int, short_in: int, short_out: int, long_in: int,
                long_out: int, inject_at: float) -> list[RequestSpec]:
    """Steady short requests (closed loop) plus one long prompt sent at `inject_at` seconds."""
    specs = fixed(pf, n_short, short_in, short_out, cls="short")
    specs.append(RequestSpec(pf.make(long_in), long_in, long_out, "long", at=inject_at))
    return specs


def poisson_times(n: int, rate: float, seed: int = 0) -> list[float]:
    return gamma_times(n, rate, 1.0, seed)


def gamma_times(n: int, rate: float, cv: float = 1.0, seed: int = 0) -> list[float]:
    """n arrival offsets (s), first at 0, gaps ~ Gamma(1/cv^2, 1/(rate/cv^2)) (mean 1/rate).

    Raises ValueError for rate <= 0 or cv <= 0.
    """
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0, got rate={rate}, cv={cv}")
    rng = random.Random(seed)
    k = 1.0 / (cv * cv)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.gammavariate(k, 1.0 / (rate * k))
    return out


def with_arrivals(specs: list[RequestSpec], times: list[float]) -> list[RequestSpec]:
    for s, t in zip(specs, times):
        s.at = t
    return specs


@dataclass
class TraceRow:
    t: float  # arrival offset from the first row (s)
    prompt_tokens: int
    output_tokens: int


def read_azure_trace(path: str) -> list[TraceRow]:
    """Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens) -> rows with
    offsets from the first arrival, in arrival order."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            ts = r["TIMESTAMP"].strip()
            # 7 fractional digits: trim to microseconds for datetime
            if "." in ts:
                head, frac = ts.split(".", 1)
                ts = f"{head}.{frac[:6]}"
            rows.append((datetime.fromisoformat(ts), int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    if not rows:
        raise ValueError(f"empty trace {path}")
    rows.sort(key=lambda x: x[0])
    t0 = rows[0][0]
    return [TraceRow((d - t0).total_seconds(), p, o) for d, p, o in rows]


def trace_workload(pf: PromptFactory, rows: list[TraceRow], *, rate_scale: float = 1.0,
                   token_scale: float = 1.0, max_prompt: int = 2048, max_output: int = 256,
                   start: float = 0.0, duration: float | None = None, cls: str = "trace",
                   output_scale: float | None = None) -> list[RequestSpec]:
    """Replay a window of the trace: arrivals from `start` for `duration` trace-seconds, sent at
    (t - start) / rate_scale (rate_scale > 1 compresses time = higher rate); token counts
    multiplied by token_scale (outputs by output_scale when given) then clipped to
    [1, max_prompt] / [1, max_output]."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    out = []
    for r in rows:
        if r.t < start or (duration is not None and r.t >= start + duration):
            continue
        p = min(max(1, round(r.prompt_tokens * token_scale)), max_prompt)
        o = min(max(1, round(r.output_tokens * (token_scale if output_scale is None else output_scale))), max_output)
        out.append(RequestSpec(pf.make(p), p, o, cls, at=(r.t - start) / rate_scale))
    return out
