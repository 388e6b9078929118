"""Run results -> JSON files, markdown tables and matplotlib PNGs."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable

from .metrics import RequestRecord, itl_timeline


def save_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=float)


def load_json(path: str):
    with open(path) as f:
        return json.load(f)


def _ms(x) -> str:
    return "–" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def fmt(x, nd=1) -> str:
    """A number with nd decimals; '–' for None/NaN (one formatting for every results table)."""
    return "–" if x is None or x != x else f"{x:.{nd}f}"


def fmt_ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def fmt_pct(x) -> str:
    return "–" if x is None else f"{x * 100:.0f}%"


def fmt_mb(x) -> str:
    """Bytes as decimal megabytes."""
    return "–" if x is None else f"{x / 1e6:.1f}"


_f = fmt


ROW_HEADER = ("| point | sent | offered req/s | admitted | 429 (rate) | err | ok | req/s | out tok/s | "
              "goodput req/s | SLO att. | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | TPOT p50/p99 ms | "
              "E2E p50/p99 s |")
ROW_SEP = "|" + "---|" * 15


def summary_row(label: str, s: dict) -> str:
    c = s["counts"]
    t, i, p, e = s["ttft_s"], s["itl_s"], s["tpot_s"], s["e2e_s"]
    att = s.get("slo_attainment")
    return (f"| {label} | {c['sent']} | {_f(s['offered_rps'], 2)} | {c['admitted']} | {c['rejected']} "
            f"({_f(s['rates']['rejection_rate'] * 100, 0)}%) | {c['errors']} | {c['ok']} | "
            f"{_f(s['request_throughput_rps'], 2)} | {_f(s['output_token_throughput'])} | "
            f"{_f(s['goodput_rps'], 2)} | {_f(att * 100 if att is not None else None, 0)}% | "
            f"{_ms(t['p50'])}/{_ms(t['p90'])}/{_ms(t['p99'])} | {_ms(i['p50'])}/{_ms(i['p90'])}/{_ms(i['p99'])} | "
            f"{_ms(p['p50'])}/{_ms(p['p99'])} | {_f(e['p50'], 2)}/{_f(e['p99'], 2)} |")


def markdown_table(points: Iterable[tuple[str, dict]], per_class: bool = True) -> str:
    lines = [ROW_HEADER, ROW_SEP]
    for label, s in points:
        lines.append(summary_row(label, s))
        if per_class:
            for cls, cs in (s.get("classes") or {}).items():
                lines.append(summary_row(f"{label} [{cls}]", cs))
    return "\n".join(lines)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_frontier(points: list[tuple[str, dict]], path: str, title: str) -> None:
    """Output tok/s (x) vs TTFT and ITL p50/p99 (y, ms), one marker per sweep point."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = [s["output_token_throughput"] for _, s in points]
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "itl_s", "ITL")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            y = [(s[key][q] or float("nan")) * 1e3 for _, s in points]
            ax.plot(x, y, style, label=f"{name} {q}")
            for (lab, _), xi, yi in zip(points, x, y):
                ax.annotate(lab, (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("output tokens / s")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_itl_timeline(series: dict[str, tuple[list[RequestRecord], float, tuple[float, float] | None]],
                      path: str, title: str) -> None:
    """ITL of every token (y, ms) against time (x, s) for each labelled run; the shaded span is
    the long prompt's life (send .. first token)."""
    plt = _plt()
    fig, axes = plt.subplots(len(series), 1, figsize=(10, 3 * len(series)), sharex=True, squeeze=False)
    for ax, (label, (recs, t0, span)) in zip(axes[:, 0], series.items()):
        pts = itl_timeline([r for r in recs if r.cls == "short"], t0)
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], ".", ms=2)
        if span:
            ax.axvspan(span[0] - t0, span[1] - t0, color="orange", alpha=0.25, label="long prompt in prefill")
            ax.legend(loc="upper right")
        ax.set_ylabel("short req. ITL (ms)")
        ax.set_yscale("log")
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(groups: dict[str, dict[str, float]], path: str, title: str, ylabel: str) -> None:
    """Grouped bars: groups = {x label: {series: value}}."""
    plt = _plt()
    import numpy as np
    xs = list(groups)
    series = sorted({k for g in groups.values() for k in g})
    w = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(8, 4))
    for j, sname in enumerate(series):
        vals = [groups[x].get(sname, float("nan")) for x in xs]
        ax.bar(np.arange(len(xs)) + j * w, vals, w, label=sname)
    ax.set_xticks(np.arange(len(xs)) + w * (len(series) - 1) / 2, xs)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
