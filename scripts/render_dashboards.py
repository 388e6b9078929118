"""Render the chart's Grafana dashboards to PNG from a real Prometheus: every panel, the same PromQL.

    python scripts/render_dashboards.py --prometheus http://127.0.0.1:19390 --namespace NS \
        [--inferenceservice NAME] [--minutes 15] [--step 2] [--rate-interval 30s] [--out docs/dashboards]

Reads ``helm/goodput/dashboards/*.json`` (what the chart ships, built by ``helm/dashboards.py``), runs
each panel's targets through Prometheus' ``/api/v1/query_range`` (HTTP API: prometheus.io/docs,
"Range queries") over the last ``--minutes`` and draws them with matplotlib where the dashboard puts
them (``gridPos``: 24 columns, rows of 30 px in Grafana): time series as lines named by the target's
``legendFormat``, stat panels as their last value over a sparkline, rows as headings. Dashboard
variables become ``$namespace``/``$inferenceservice`` (regex matches, ``.*`` when not given) and
``$pod`` = ``.*``; ``$__rate_interval`` becomes ``--rate-interval``. Writes ``<out>/<dashboard>.png``
and prints, per panel, how many series it drew. The e2e suite runs it on its own Prometheus (see
``e2e/test_helm_e2e.py``; docs/kubernetes.md, "Dashboards as pictures").

Exit code 1 when a panel has no series (its title is printed), 2 on a Prometheus error.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BOARDS = ROOT / "helm" / "goodput" / "dashboards"
ROW_PX, COLS = 30, 24  # Grafana's grid: 24 columns; h counts rows of 30 px


def _dashboards_module() -> Any:
    spec = importlib.util.spec_from_file_location("helm_dashboards", ROOT / "helm" / "dashboards.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def substitute(expr: str, namespace: str, inferenceservice: str, rate_interval: str) -> str:
    """A panel's PromQL with the dashboard's variables replaced as Grafana would for one selection."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$namespace", namespace)
            .replace("$inferenceservice", inferenceservice).replace("$pod", ".*"))


def legend(fmt: str | None, metric: dict[str, str]) -> str:
    """Grafana's ``legendFormat``: ``{{label}}`` replaced by the series' label value."""
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in sorted(metric.items())) or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)


def query_range(client: Any, url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    r = client.get(f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step},
                   timeout=60)
    body = r.json()
    if r.status_code != 200 or body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def fetch(url: str, board: dict[str, Any], *, namespace: str, inferenceservice: str, rate_interval: str,
          start: float, end: float, step: float) -> list[tuple[dict[str, Any], list[tuple[str, list, list]]]]:
    """(panel, [(legend, times, values)]) for every panel of ``board`` in order (rows with no series)."""
    import httpx

    dash = _dashboards_module()
    out = []
    with httpx.Client() as client:
        for p in dash.panels(board):
            series = []
            for t in p.get("targets") or []:
                if not t.get("expr"):
                    continue
                expr = substitute(t["expr"], namespace, inferenceservice, rate_interval)
                for s in query_range(client, url, expr, start, end, step):
                    pts = [(float(ts), float(v)) for ts, v in s["values"]]
                    series.append((legend(t.get("legendFormat"), s["metric"]), [x for x, _ in pts],
                                   [y for _, y in pts]))
            out.append((p, series))
    return out


def _fmt_value(v: float, unit: str | None) -> str:
    if v != v:  # NaN
        return "NaN"
    if unit == "percentunit":
        return f"{v * 100:.1f} %"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    suffix = {"reqps": " req/s", "ops": "/s"}.get(unit or "", "")
    return f"{v:.3g}{suffix}"


def draw(title: str, panels: list[tuple[dict[str, Any], list[tuple[str, list, list]]]], path: Path,
         dpi: int = 60) -> None:
    """One PNG of the dashboard's panels at their grid positions (x axes: UTC time of day)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p, _ in panels)
    width_in, head_in = 20.0, 0.6
    height_in = rows * ROW_PX * width_in / (COLS * 55)  # Grafana's aspect: a column is ~55 px wide
    fig_h = height_in + head_in
    fig = plt.figure(figsize=(width_in, fig_h))
    fig.suptitle(f"{title}  (UTC)", fontsize=14, x=0.01, y=1 - 0.1 / fig_h, ha="left", va="top")
    top = height_in / fig_h
    # margins in inches, as fractions of the figure
    pad_top, pad_bottom, pad_left, pad_right = 0.3 / fig_h, 0.35 / fig_h, 0.55 / width_in, 0.12 / width_in
    for p, series in panels:
        g = p["gridPos"]
        x0, w = g["x"] / COLS, g["w"] / COLS
        y1 = top * (1 - g["y"] / rows)
        h = top * g["h"] / rows
        if p.get("type") == "row":
            fig.text(x0 + 0.005, y1 - h / 2, p["title"], fontsize=11, weight="bold", va="center")
            continue
        ax = fig.add_axes((x0 + pad_left, y1 - h + pad_bottom, w - pad_left - pad_right, h - pad_top - pad_bottom))
        unit = ((p.get("fieldConfig") or {}).get("defaults") or {}).get("unit")
        ax.set_title(p["title"] + (f"  [{unit}]" if unit and unit != "short" else ""), fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for name, ts, vs in series:
            when = [datetime.datetime.fromtimestamp(t, datetime.timezone.utc) for t in ts]
            ax.plot(when, vs, linewidth=1.2, label=name[:48])
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=datetime.timezone.utc))
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=6))
        if p.get("type") == "stat":
            last = series[0][2][-1] if series[0][2] else float("nan")
            ax.text(0.5, 0.55, _fmt_value(last, unit), ha="center", va="center", transform=ax.transAxes,
                    fontsize=16, weight="bold", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
            ax.set_xticks([])
        elif len(series) <= 8:
            ax.legend(fontsize=6, loc="upper left", frameon=False)
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    shrink(path)


def shrink(path: Path, colors: int = 64) -> None:
    """Rewrite the PNG with a palette of ``colors`` (Pillow, matplotlib's own dependency): ~3x smaller."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=colors)
    small.save(path, optimize=True)


def render(url: str, out: Path, *, namespace: str = ".*", inferenceservice: str = ".*", minutes: float = 15,
           step: float = 2, rate_interval: str = "30s", end: float | None = None) -> dict[str, dict[str, int]]:
    """Render every dashboard in BOARDS to ``out/<name>.png``; returns {dashboard: {panel title: series}}."""
    end = end if end is not None else datetime.datetime.now(datetime.timezone.utc).timestamp()
    start = end - minutes * 60
    report: dict[str, dict[str, int]] = {}
    for f in sorted(BOARDS.glob("*.json")):
        board = json.loads(f.read_text())
        panels = fetch(url, board, namespace=namespace, inferenceservice=inferenceservice,
                       rate_interval=rate_interval, start=start, end=end, step=step)
        draw(board.get("title", f.stem), panels, out / f"{f.stem}.png")
        counts: dict[str, int] = {}
        for p, series in panels:
            if p.get("type") != "row":
                key = p["title"] if p["title"] not in counts else f"{p['title']} ({p['type']})"
                counts[key] = len(series)
        report[f.stem] = counts
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prometheus", required=True, help="Prometheus base URL (127.0.0.1 in the e2e suite)")
    ap.add_argument("--namespace", default=".*", help="$namespace (a regex, as Grafana's multi-value variables)")
    ap.add_argument("--inferenceservice", default=".*", help="$inferenceservice (a regex)")
    ap.add_argument("--minutes", type=float, default=15, help="time range ending now")
    ap.add_argument("--step", type=float, default=2, help="seconds between points")
    ap.add_argument("--rate-interval", default="30s", help="what $__rate_interval stands for")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboards")
    a = ap.parse_args(argv)
    try:
        report = render(a.prometheus, a.out, namespace=a.namespace, inferenceservice=a.inferenceservice,
                        minutes=a.minutes, step=a.step, rate_interval=a.rate_interval)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    empty = []
    for name, counts in report.items():
        print(f"{a.out / name}.png")
        for title, n in counts.items():
            print(f"  {title}: {n} series")
            if n == 0:
                empty.append(f"{name}: {title}")
    if empty:
        print("panels without data: " + "; ".join(empty), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
