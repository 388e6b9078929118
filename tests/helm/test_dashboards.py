"""The Grafana dashboards of the chart: the committed JSON is what helm/dashboards.py builds, and every
metric a query names is one of goodput.api.worker_metrics / goodput.autoscaler.metric_names /
goodput.api.router_metrics (with the suffix Prometheus gives its type). That each query parses and returns data is checked against a
real Prometheus in e2e/test_prometheus_e2e.py.
"""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

from goodput.autoscaler import metric_names as A
from goodput.api import router_metrics as R
from goodput.api import worker_metrics as W

from conftest import REPO as ROOT

DASHBOARDS = ROOT / "helm" / "goodput" / "dashboards"

spec = importlib.util.spec_from_file_location("helm_dashboards", ROOT / "helm" / "dashboards.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)

# PromQL words that are not metric names (functions, aggregations, keywords, label names the queries use)
PROMQL_WORDS = {
    "sum", "by", "without", "rate", "increase", "histogram_quantile", "max", "min", "avg", "count",
    "label_values", "on", "ignoring", "and", "or", "unless", "bool", "avg_over_time", "vector",
    "le", "namespace", "inferenceservice", "pod", "reason", "finished_reason", "state", "model_name", "outcome",
    "direction", "where",
}


def names(module) -> set[str]:
    return {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str) and v.startswith("goodput_")}


def exported_series() -> set[str]:
    """Every series name the two modules' metrics can produce (counters _total, histograms' parts)."""
    out = set()
    for n in names(W) | names(A) | names(R):
        out |= {n, f"{n}_total", f"{n}_bucket", f"{n}_sum", f"{n}_count"}
    return out


def recorded_series() -> set[str]:
    """The chart's recording rules (helm/goodput/templates/prometheusrule.yaml), with the windows
    of its ``range $w := list ...`` expanded."""
    text = (ROOT / "helm" / "goodput" / "templates" / "prometheusrule.yaml").read_text()
    windows = re.findall(r'"(\d+[smhd])"', re.search(r"range \$w := list ([^}]*)", text).group(1))
    out = set()
    for name, templated in re.findall(r"record: ([\w:]+)(\{\{ \$w \}\})?", text):
        out |= {name + w for w in windows} if templated else {name}
    return out


def metric_names_in(expr: str) -> set[str]:
    e = re.sub(r'"[^"]*"', '""', expr)          # label values
    e = re.sub(r"\{[^}]*\}", "", e)             # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)            # ranges
    e = re.sub(r"\$\w+", "", e)                 # dashboard variables
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e))
    return {w for w in words if w not in PROMQL_WORDS and not re.fullmatch(r"[0-9.e]+", w)}


def load(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


def test_committed_json_is_what_the_generator_builds():
    rendered = gen.render()
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(rendered)
    for name, text in rendered.items():
        assert (DASHBOARDS / name).read_text() == text, f"stale {name}: run `python helm/dashboards.py`"


def test_metric_name_extraction_is_not_vacuous():
    # the checker finds names in the shapes the dashboards use, and flags a typo
    assert metric_names_in('histogram_quantile(0.9, sum by (le, pod) (rate(goodput_x_bucket{pod=~"$pod"}'
                           '[$__rate_interval])))') == {"goodput_x_bucket"}
    assert metric_names_in("a_total / b") == {"a_total", "b"}
    assert "goodput_request_running" not in exported_series()


@pytest.mark.parametrize("dashboard", ["serving.json", "autoscaler.json"])
def test_every_query_names_only_exported_metrics(dashboard: str):
    qs = list(gen.queries(load(dashboard)))
    assert len(qs) >= 8
    known = exported_series() | recorded_series()
    for title, expr in qs:
        found = metric_names_in(expr)
        assert found, (title, expr)
        assert found <= known, (title, found - known)


def test_serving_dashboard_covers_the_brief():
    d = load("serving.json")
    titles = {p["title"] for p in gen.panels(d)}
    assert {"Offered load", "Admitted and rejected", "Goodput", "SLO attainment", "TTFT", "ITL", "TPOT",
            "E2E latency", "Queue time", "Running and waiting", "KV cache usage", "Preemptions/s",
            "Prefix-cache hit rate", "Tokens/s", "Admission limits"} <= titles
    variables = [v["name"] for v in d["templating"]["list"]]
    assert variables == ["datasource", "namespace", "inferenceservice", "pod"]
    by_title = {p["title"]: p for p in gen.panels(d) if p["type"] == "timeseries"}
    # units
    assert by_title["TTFT"]["fieldConfig"]["defaults"]["unit"] == "s"
    assert by_title["KV cache usage"]["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert by_title["Offered load"]["fieldConfig"]["defaults"]["unit"] == "reqps"
    # SLO lines: the TTFT/TPOT panels plot the worker's own SLO gauge, dashed
    exprs = {p: [t["expr"] for t in by_title[p]["targets"]] for p in ("TTFT", "TPOT")}
    assert any(W.SLO_TTFT_SECONDS in e for e in exprs["TTFT"])
    assert any(W.SLO_TPOT_SECONDS in e for e in exprs["TPOT"])
    assert by_title["TTFT"]["fieldConfig"]["overrides"][0]["properties"][0]["id"] == "custom.lineStyle"
    # thresholds: KV usage warns at 80 % and is red at 95 %
    steps = by_title["KV cache usage"]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [(s["value"], s["color"]) for s in steps] == [(None, "green"), (0.8, "orange"), (0.95, "red")]
    # every panel query is scoped by the dashboard's variables (but the router-wide ones: decisions and
    # added latency have no service label)
    for title, expr in gen.queries(d):
        if not title.startswith("variable") and title not in gen.ROUTER_WIDE:
            assert '$namespace' in expr and '$inferenceservice' in expr, (title, expr)


def test_serving_dashboard_has_a_router_row():
    d = load("serving.json")
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows[-1] == "Router"
    row_y = next(p["gridPos"]["y"] for p in d["panels"] if p["type"] == "row" and p["title"] == "Router")
    below = {p["title"]: p for p in gen.panels(d) if p["type"] != "row" and p["gridPos"]["y"] > row_y}
    assert set(below) == {"Router requests by outcome", "Router requests by pod", "Held and queued",
                          "Routing decisions", "Router queue wait", "Router added latency", "Upstream TTFT"}
    q = {t: "\n".join(x["expr"] for x in p["targets"]) for t, p in below.items()}
    for n in (R.REQUESTS_TOTAL, R.HELD_REQUESTS, R.QUEUED_REQUESTS, R.DECISIONS_TOTAL, R.QUEUE_WAIT, R.OVERHEAD,
              R.UPSTREAM_TTFT):
        assert any(n in e for e in q.values()), n
    assert "by (pod)" in q["Router requests by pod"] and "outcome" in q["Router requests by outcome"]
    assert set(gen.ROUTER_WIDE) <= set(below)
    assert below["Router added latency"]["fieldConfig"]["defaults"]["unit"] == "s"


def test_autoscaler_dashboard_covers_the_brief():
    d = load("autoscaler.json")
    titles = {p["title"] for p in gen.panels(d)}
    assert {"Desired vs ready replicas", "Decisions by reason", "Admission limits set"} <= titles
    q = "\n".join(e for _, e in gen.queries(d))
    for n in (A.DESIRED_REPLICAS, A.READY_REPLICAS, A.DECISIONS, A.ADMISSION_MAX_NUM_SEQS, A.ADMISSION_MAX_WAITING):
        assert n in q


def test_panels_do_not_overlap():
    for name in ("serving.json", "autoscaler.json"):
        cells = set()
        for p in gen.panels(load(name)):
            g = p["gridPos"]
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, (name, p["title"])
                    cells.add((x, y))
            assert g["x"] + g["w"] <= 24
