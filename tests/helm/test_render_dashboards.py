"""scripts/render_dashboards.py's pure parts: Grafana's variable substitution and legend format.
(The rendering itself runs on the e2e suite's real Prometheus: e2e/test_helm_e2e.py.)"""
from __future__ import annotations

import importlib.util
import json

from conftest import REPO as ROOT

_spec = importlib.util.spec_from_file_location("render_dashboards", ROOT / "scripts" / "render_dashboards.py")
rd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rd)


def test_substitute_replaces_every_dashboard_variable():
    expr = ('sum(rate(x{namespace=~"$namespace", inferenceservice=~"$inferenceservice", pod=~"$pod"}'
            '[$__rate_interval]))')
    assert rd.substitute(expr, "prod", "llama", "30s") == \
        'sum(rate(x{namespace=~"prod", inferenceservice=~"llama", pod=~".*"}[30s]))'


def test_every_shipped_query_is_left_without_a_variable():
    for f in (ROOT / "helm" / "goodput" / "dashboards").glob("*.json"):
        board = json.loads(f.read_text())
        for p in rd._dashboards_module().panels(board):
            for t in p.get("targets") or []:
                assert "$" not in rd.substitute(t["expr"], "n", "i", "1m"), (f.name, p["title"], t["expr"])


def test_legend_format_as_grafana():
    assert rd.legend("{{inferenceservice}} p99", {"inferenceservice": "a", "pod": "p"}) == "a p99"
    assert rd.legend("{{ pod }}/{{missing}}", {"pod": "p"}) == "p/"
    assert rd.legend(None, {"b": "2", "a": "1"}) == "a=1, b=2"
    assert rd.legend("", {}) == "value"
