"""The Grafana dashboards of the Helm chart, built with Grafana's grafana-foundation-sdk.

    python helm/dashboards.py            # (re)write helm/goodput/dashboards/*.json
    python helm/dashboards.py --check    # exit 1 when a committed JSON differs from this code

The committed JSON is what the chart ships (ConfigMaps for the Grafana sidecar). Every metric name
comes from ``goodput.api.worker_metrics``, ``goodput.autoscaler.metric_names`` or
``goodput.api.router_metrics``; series labels are the ones the chart's PodMonitor adds
(``namespace``, ``pod``, ``inferenceservice``) plus the worker's ``model_name``, ``reason``,
``finished_reason``, ``state``; the router's own series carry ``namespace`` and ``inferenceservice``
(the service a request went to; its PodMonitor honours them), ``pod`` (the worker it picked),
``outcome`` and ``reason`` (docs/router-autoscaler-contract.md, "Router metrics"). ``queries()`` lists every PromQL
expression with its panel, for the tests (metric names exist; a real Prometheus evaluates each).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from goodput.autoscaler import metric_names as A
from goodput.api import router_metrics as R
from goodput.api import worker_metrics as W

OUT = Path(__file__).resolve().parent / "goodput" / "dashboards"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
# the selectors the dashboard variables drive
ISVC = 'namespace=~"$namespace", inferenceservice=~"$inferenceservice"'
POD = ISVC + ', pod=~"$pod"'
QUANTILES = (0.5, 0.9, 0.99)


def _thresholds(*steps: tuple[float | None, str]) -> dashboard.ThresholdsConfig:
    return dashboard.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in steps])


def _q(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)


def _ts(title: str, desc: str, unit: str, queries: list[tuple[str, str]], x: int, y: int, w: int = 12,
        h: int = 8, thresholds: dashboard.ThresholdsConfig | None = None, style: str = "off",
        bars: bool = False, min_val: float | None = 0, max_val: float | None = None) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(desc).unit(unit).datasource(DS)
         .grid_pos(dm.GridPos(h=h, w=w, x=x, y=y)).line_width(1).fill_opacity(10)
         .legend(_legend()))
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    if bars:
        p = p.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(80)
    if thresholds is not None:
        p = p.thresholds(thresholds).thresholds_style(
            common.GraphThresholdsStyleConfig().mode(cm.GraphTresholdsStyleMode(style)))
    for i, (expr, legend) in enumerate(queries):
        p = p.with_target(_q(expr, legend, chr(ord("A") + i)))
    return p


def _legend() -> common.VizLegendOptions:
    return (common.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE)
            .placement(cm.LegendPlacement.BOTTOM).show_legend(True).calcs(["mean", "max", "lastNotNull"]))


def _stat(title: str, desc: str, unit: str, expr: str, x: int, y: int, w: int = 6,
          thresholds: dashboard.ThresholdsConfig | None = None) -> stat.Panel:
    p = (stat.Panel().title(title).description(desc).unit(unit).datasource(DS)
         .grid_pos(dm.GridPos(h=4, w=w, x=x, y=y)).with_target(_q(expr, "{{inferenceservice}}", "A"))
         .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
         .graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.VALUE)
         .text_mode(cm.BigValueTextMode.VALUE_AND_NAME))
    if thresholds is not None:
        p = p.thresholds(thresholds)
    return p


def _var(name: str, label: str, query: str) -> dashboard.QueryVariable:
    return (dashboard.QueryVariable(name).label(label).datasource(DS).query(query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True)
            .all_value(".*").sort(dm.VariableSort.ALPHABETICAL_ASC)
            .current(dm.VariableOption(text="All", value="$__all", selected=True)))


def _ds_var() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")


def _quantiles(metric: str, by: str, sel: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{sel}}}[{RATE}])))",
             f"p{round(q * 100)} {{{{{by.split(', ')[-1]}}}}}") for q in QUANTILES]


def _offered(by: str, sel: str) -> str:
    return (f"sum by ({by}) (rate({W.REQUESTS_ADMITTED}_total{{{sel}}}[{RATE}]))"
            f" + sum by ({by}) (rate({W.REQUESTS_REJECTED}_total{{{sel}}}[{RATE}]))")


ATTAINMENT_RULE = "goodput:slo_attainment:ratio_rate5m"


def _attainment(by: str, sel: str) -> str:
    """THE attainment: the chart's recording rule (slo_met / (finished + refused), the autoscaler's
    definition, goodput.autoscaler.policy.attainment), per InferenceService; needs the chart's
    PrometheusRule (metrics.prometheusRule.enabled)."""
    return f"sum by ({by}) ({ATTAINMENT_RULE}{{{ISVC}}})"


def serving() -> dashboard.Dashboard:
    by = "namespace, inferenceservice"
    slo_line = _thresholds((None, "green"), (0.9, "red"))
    att_thr = _thresholds((None, "red"), (0.9, "green"))
    kv_thr = _thresholds((None, "green"), (0.8, "orange"), (0.95, "red"))
    d = (dashboard.Dashboard("goodput / Serving").uid("goodput-serving").tags(["goodput", "llm", "serving"])
         .description("Per InferenceService and per worker pod: load, admission, goodput and SLO "
                      "attainment, latency quantiles, engine state, KV cache and tokens.")
         .refresh("30s").time("now-1h", "now").timezone("browser").editable()
         .with_variable(_ds_var())
         .with_variable(_var("namespace", "Namespace", f"label_values({W.REQUESTS_RUNNING}, namespace)"))
         .with_variable(_var("inferenceservice", "InferenceService",
                             f'label_values({W.REQUESTS_RUNNING}{{namespace=~"$namespace"}}, inferenceservice)'))
         .with_variable(_var("pod", "Pod", f"label_values({W.REQUESTS_RUNNING}{{{ISVC}}}, pod)")))
    y = 0
    d = d.with_row(dashboard.Row("Now").grid_pos(dm.GridPos(h=1, w=24, x=0, y=y)))
    y += 1
    d = (d.with_panel(_stat("Offered load", "Requests per second arriving (admitted + rejected).", "reqps",
                            _offered(by, POD), 0, y))
         .with_panel(_stat("Goodput", "Requests per second that finished within both the TTFT and the TPOT SLO.",
                           "reqps", f"sum by ({by}) (rate({W.REQUESTS_SLO_MET}_total{{{POD}}}[{RATE}]))", 6, y))
         .with_panel(_stat("SLO attainment", "Requests meeting both SLOs / (finished + refused): the recording rule goodput:slo_attainment:ratio_rate5m.",
                           "percentunit", _attainment(by, POD), 12, y, thresholds=att_thr))
         .with_panel(_stat("Ready workers", "Worker pods exporting metrics.", "short",
                           f"count by ({by}) ({W.REQUESTS_RUNNING}{{{POD}}})", 18, y)))
    y += 4
    d = d.with_row(dashboard.Row("Load, admission and goodput (per InferenceService)")
                   .grid_pos(dm.GridPos(h=1, w=24, x=0, y=y)))
    y += 1
    d = (d.with_panel(_ts("Offered load", "Requests per second arriving: admitted + rejected.", "reqps",
                          [(_offered(by, POD), "{{inferenceservice}}")], 0, y))
         .with_panel(_ts("Admitted and rejected", "Admitted requests and rejections by reason "
                         "(queue_full = 429, never_fits/invalid = 400).", "reqps",
                         [(f"sum by ({by}) (rate({W.REQUESTS_ADMITTED}_total{{{POD}}}[{RATE}]))",
                           "admitted {{inferenceservice}}"),
                          (f"sum by ({by}, reason) (rate({W.REQUESTS_REJECTED}_total{{{POD}}}[{RATE}]))",
                           "rejected {{reason}} {{inferenceservice}}")], 12, y)))
    y += 8
    d = (d.with_panel(_ts("Goodput", "Requests per second finished within the SLO, against all finished "
                          "(stop or length).", "reqps",
                          [(f"sum by ({by}) (rate({W.REQUESTS_SLO_MET}_total{{{POD}}}[{RATE}]))",
                            "goodput {{inferenceservice}}"),
                           (f"sum by ({by}) (rate({W.REQUESTS_FINISHED}_total{{{POD}, finished_reason=~\"stop|length\"}}[{RATE}]))",
                            "finished {{inferenceservice}}")], 0, y))
         .with_panel(_ts("SLO attainment", "Requests meeting both SLOs / (finished + refused) (recording rule "
                         "goodput:slo_attainment:ratio_rate5m); the red line is the chart's default "
                         "attainment target 0.9.", "percentunit",
                         [(_attainment(by, POD), "{{inferenceservice}}")], 12, y,
                         thresholds=att_thr, style="dashed", max_val=1)))
    y += 8
    d = d.with_row(dashboard.Row("Latency (per InferenceService)").grid_pos(dm.GridPos(h=1, w=24, x=0, y=y)))
    y += 1
    slo_ttft = f"max by ({by}) ({W.SLO_TTFT_SECONDS}{{{POD}}})"
    slo_tpot = f"max by ({by}) ({W.SLO_TPOT_SECONDS}{{{POD}}})"
    d = (d.with_panel(_ts("TTFT", "Time to first token (arrival to first token), p50/p90/p99; dashed: the SLO.",
                          "s", _quantiles(W.TIME_TO_FIRST_TOKEN, by, POD) + [(slo_ttft, "SLO {{inferenceservice}}")],
                          0, y).override_by_regexp("SLO.*", [dm.DynamicConfigValue(
                              id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})]))
         .with_panel(_ts("TPOT", "Time per output token ((E2E - TTFT) / (output tokens - 1)), p50/p90/p99; "
                         "dashed: the SLO.", "s",
                         _quantiles(W.TIME_PER_OUTPUT_TOKEN, by, POD) + [(slo_tpot, "SLO {{inferenceservice}}")],
                         12, y).override_by_regexp("SLO.*", [dm.DynamicConfigValue(
                             id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})])))
    y += 8
    d = (d.with_panel(_ts("ITL", "Inter-token latency: every gap between consecutive output tokens.", "s",
                          _quantiles(W.INTER_TOKEN_LATENCY, by, POD), 0, y, w=8))
         .with_panel(_ts("E2E latency", "Arrival to last token.", "s",
                         _quantiles(W.E2E_REQUEST_LATENCY, by, POD), 8, y, w=8))
         .with_panel(_ts("Queue time", "Arrival to first scheduled (time waiting for admission to the batch).",
                         "s", _quantiles(W.REQUEST_QUEUE_TIME, by, POD), 16, y, w=8)))
    y += 8
    d = d.with_row(dashboard.Row("Engine (per pod)").grid_pos(dm.GridPos(h=1, w=24, x=0, y=y)))
    y += 1
    d = (d.with_panel(_ts("Running and waiting", "Requests in the running batch and admitted but waiting.",
                          "short", [(f"{W.REQUESTS_RUNNING}{{{POD}}}", "running {{pod}}"),
                                    (f"{W.REQUESTS_WAITING}{{{POD}}}", "waiting {{pod}}")], 0, y))
         .with_panel(_ts("KV cache usage", "Referenced KV blocks / all blocks (cached-but-free counts as free).",
                         "percentunit", [(f"{W.KV_CACHE_USAGE_RATIO}{{{POD}}}", "{{pod}}")], 12, y,
                         thresholds=kv_thr, style="dashed", max_val=1)))
    y += 8
    d = (d.with_panel(_ts("Tokens/s", "Prompt tokens admitted and tokens generated per second.", "short",
                          [(f"sum by (pod) (rate({W.PROMPT_TOKENS}_total{{{POD}}}[{RATE}]))", "prompt {{pod}}"),
                           (f"sum by (pod) (rate({W.GENERATION_TOKENS}_total{{{POD}}}[{RATE}]))",
                            "generated {{pod}}")], 0, y, w=8))
         .with_panel(_ts("Prefix-cache hit rate", "Prompt tokens served from the prefix cache / prompt tokens "
                         "looked up.", "percentunit",
                         [(f"sum by (pod) (rate({W.PREFIX_CACHE_HITS}_total{{{POD}}}[{RATE}])) / "
                           f"sum by (pod) (rate({W.PREFIX_CACHE_QUERIES}_total{{{POD}}}[{RATE}]))", "{{pod}}")],
                         8, y, w=8, max_val=1))
         .with_panel(_ts("Preemptions/s", "Requests preempted (KV blocks freed, recomputed later).", "ops",
                         [(f"sum by (pod) (rate({W.PREEMPTIONS}_total{{{POD}}}[{RATE}]))", "{{pod}}")],
                         16, y, w=8)))
    y += 8
    d = (d.with_panel(_ts("Admission limits", "Limits in force on each pod (set at start or by the autoscaler "
                          "through PUT /admin/limits).", "short",
                          [(f"{W.ADMISSION_MAX_NUM_SEQS}{{{POD}}}", "max_num_seqs {{pod}}"),
                           (f"{W.ADMISSION_MAX_WAITING}{{{POD}}}", "max_waiting {{pod}}")], 0, y, w=8))
         .with_panel(_ts("Engine steps", "Forward passes per second, and tokens each one computed on average "
                         "(prefill chunks + one per decode; the batch the token budget allows).", "short",
                         [(f"sum by (pod) (rate({W.ENGINE_STEPS}_total{{{POD}}}[{RATE}]))", "steps/s {{pod}}"),
                          (f"sum by (pod) (rate({W.BATCHED_TOKENS}_total{{{POD}}}[{RATE}])) / "
                           f"sum by (pod) (rate({W.ENGINE_STEPS}_total{{{POD}}}[{RATE}]))", "tokens/step {{pod}}")],
                         8, y, w=8))
         .with_panel(_ts("Engine state", "1 for the state each pod's engine is in (running, waiting, "
                         "rejecting, blocked).", "short",
                         [(f"{W.ENGINE_STATE}{{{POD}}} == 1", "{{pod}} {{state}}")], 16, y, w=8, max_val=1)))
    y += 8
    d = d.with_panel(_ts("Speculative decoding", "n-gram draft tokens proposed and accepted per second "
                         "(--speculative-mode; zero while off). Acceptance rate = accepted / proposed.", "short",
                         [(f"sum by (pod) (rate({W.SPEC_DECODE_DRAFT_TOKENS}_total{{{POD}}}[{RATE}]))",
                           "proposed {{pod}}"),
                          (f"sum by (pod) (rate({W.SPEC_DECODE_ACCEPTED_TOKENS}_total{{{POD}}}[{RATE}]))",
                           "accepted {{pod}}")], 0, y, w=8))
    d = (d.with_panel(_ts("KV transfer", "Disaggregated prefill: KV payload bytes per second sent by prefill "
                          "pods and received by decode pods (2·L·n_kv·d_head·bytes per token), and the leases "
                          "prefill pods hold now.", "Bps",
                          [(f"sum by (pod, direction) (rate({W.KV_TRANSFER_BYTES}_total{{{POD}}}[{RATE}]))",
                            "{{direction}} {{pod}}")], 8, y, w=8))
         .with_panel(_ts("Prefills by where", "Requests per second whose prompt was computed locally or "
                         "imported from a prefill pod (remote), and transfers that fell back to a local "
                         "prefill, by reason.", "ops",
                         [(f"sum by (pod, where) (rate({W.PREFILLS}_total{{{POD}}}[{RATE}]))", "{{where}} {{pod}}"),
                          (f"sum by (pod, reason) (rate({W.KV_TRANSFER_FALLBACKS}_total{{{POD}}}[{RATE}]))",
                           "fallback {{reason}} {{pod}}")], 16, y, w=8)))
    y += 8
    return _router_row(d, y, by)


# panels of the router row that are about the router itself, not one InferenceService
ROUTER_WIDE = ("Routing decisions", "Router added latency")


def _router_row(d: dashboard.Dashboard, y: int, by: str) -> dashboard.Dashboard:
    """The router (goodput.router): requests by outcome and by picked pod, held/queued requests,
    routing decisions by reason, fleet-queue wait, the router's added latency, upstream TTFT."""
    d = d.with_row(dashboard.Row("Router").grid_pos(dm.GridPos(h=1, w=24, x=0, y=y)))
    y += 1
    d = (d.with_panel(_ts("Router requests by outcome", "Requests through the router: success, error, refused "
                          "(router 429: fleet queue full), timeout (held or queued too long), client_abort.",
                          "reqps", [(f"sum by ({by}, outcome) (rate({R.REQUESTS_TOTAL}{{{ISVC}}}[{RATE}]))",
                                     "{{outcome}} {{inferenceservice}}")], 0, y, w=8))
         .with_panel(_ts("Router requests by pod", "Where the router sent requests: with prefix affinity a "
                         "conversation stays on one pod.", "reqps",
                         [(f"sum by (pod) (rate({R.REQUESTS_TOTAL}{{{POD}}}[{RATE}]))", "{{pod}}")], 8, y, w=8))
         .with_panel(_ts("Held and queued", "Requests the router holds (the service has no Ready pod: scale "
                         "from zero) or queues (every pod at its admission limits).", "short",
                         [(f"sum by ({by}) ({R.HELD_REQUESTS}{{{ISVC}}})", "held {{inferenceservice}}"),
                          (f"sum by ({by}) ({R.QUEUED_REQUESTS}{{{ISVC}}})", "queued {{inferenceservice}}")],
                         16, y, w=8)))
    y += 8
    d = (d.with_panel(_ts("Routing decisions", "Decisions per second by reason: affinity (longest prefix "
                          "match), rendezvous (no match), load_bound_fallback, queued, held, refused. All "
                          "services.", "ops",
                          [(f"sum by (reason) (rate({R.DECISIONS_TOTAL}[{RATE}]))", "{{reason}}")], 0, y, w=6))
         .with_panel(_ts("Router queue wait", "Time a request spent held or in the fleet queue, p50/p90/p99.",
                         "s", _quantiles(R.QUEUE_WAIT, by, ISVC), 6, y, w=6))
         .with_panel(_ts("Router added latency", "Router time before the upstream request is sent (parse, "
                         "hash, pick), p50/p99, every router replica. All services.", "s",
                         [(f"histogram_quantile({q}, sum by (le) (rate({R.OVERHEAD}_bucket[{RATE}])))",
                           f"p{round(q * 100)}") for q in (0.5, 0.99)], 12, y, w=6))
         .with_panel(_ts("Upstream TTFT", "First byte from the picked pod after the router sent the request, "
                         "p50/p90/p99.", "s", _quantiles(R.UPSTREAM_TTFT, by, ISVC), 18, y, w=6)))
    return d


def autoscaler() -> dashboard.Dashboard:
    by = "namespace, inferenceservice"
    d = (dashboard.Dashboard("goodput / Autoscaler").uid("goodput-autoscaler")
         .tags(["goodput", "llm", "autoscaling"])
         .description("The goodput autoscaler: replicas it wants and sees, its decisions with reasons, the "
                      "admission limits it sets, its own health.")
         .refresh("30s").time("now-1h", "now").timezone("browser").editable()
         .with_variable(_ds_var())
         .with_variable(_var("namespace", "Namespace", f"label_values({A.DESIRED_REPLICAS}, namespace)"))
         .with_variable(_var("inferenceservice", "InferenceService",
                             f'label_values({A.DESIRED_REPLICAS}{{namespace=~"$namespace"}}, inferenceservice)')))
    y = 0
    d = (d.with_panel(_ts("Desired vs ready replicas", "Replicas the autoscaler decided, ready pods it scraped, "
                          "pods still loading the model.", "short",
                          [(f"sum by ({by}) ({A.DESIRED_REPLICAS}{{{ISVC}}})", "desired {{inferenceservice}}"),
                           (f"sum by ({by}) ({A.READY_REPLICAS}{{{ISVC}}})", "ready {{inferenceservice}}"),
                           (f"sum by ({by}) ({A.STARTING_REPLICAS}{{{ISVC}}})", "starting {{inferenceservice}}")],
                          0, y))
         .with_panel(_ts("Decisions by reason", "Decisions per interval by reason (ScaleUpGoodput, "
                         "ScaleUpSaturation, HoldStarting, ScaleDownIdle, HoldMissingMetrics, Steady...).",
                         "short", [(f"sum by ({by}, reason) (increase({A.DECISIONS}_total{{{ISVC}}}[{RATE}]))",
                                    "{{reason}} {{inferenceservice}}")], 12, y, bars=True)))
    y += 8
    d = (d.with_panel(_ts("Admission limits set", "max_num_seqs and max_waiting the autoscaler set per replica.",
                          "short", [(f"{A.ADMISSION_MAX_NUM_SEQS}{{{ISVC}}}", "max_num_seqs {{pod}}"),
                                    (f"{A.ADMISSION_MAX_WAITING}{{{ISVC}}}", "max_waiting {{pod}}")], 0, y))
         .with_panel(_ts("Scrape errors/s", "Pod scrapes that failed or timed out.", "ops",
                         [(f"sum by ({by}) (rate({A.SCRAPE_ERRORS}_total{{{ISVC}}}[{RATE}]))",
                           "{{inferenceservice}}")], 12, y, w=6))
         .with_panel(_ts("Loop duration", "Seconds one reconcile pass took, p50/p99.", "s",
                         [(f"histogram_quantile({q}, sum by (le) (rate({A.LOOP_DURATION}_bucket[{RATE}])))",
                           f"p{round(q * 100)}") for q in (0.5, 0.99)], 18, y, w=6)))
    y += 8
    d = (d.with_panel(_ts("Replica capacity estimate", "Tokens/s one replica computes at a full step, from its "
                          "own prefill and decode rates (policy rule 14; 0 until one model load of "
                          "measurements).", "short",
                          [(f"sum by ({by}) ({A.REPLICA_CAPACITY_TOKENS}{{{ISVC}}})", "{{inferenceservice}}")],
                          0, y))
         .with_panel(_ts("Infeasible requests/s", "Requests whose prompt no idle replica prefills within the "
                         "TTFT SLO: counted, left out of the sizing (policy rule 16).", "ops",
                         [(f"sum by ({by}) (rate({A.INFEASIBLE_REQUESTS}_total{{{ISVC}}}[{RATE}]))",
                           "{{inferenceservice}}")], 12, y)))
    return d


DASHBOARDS = {"serving.json": serving, "autoscaler.json": autoscaler}


def render() -> dict[str, str]:
    """File name -> JSON text (sorted keys, 2-space indent, trailing newline)."""
    out = {}
    for name, fn in DASHBOARDS.items():
        obj = json.loads(JSONEncoder(sort_keys=True).encode(fn().build()))
        out[name] = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    return out


def panels(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in obj.get("panels", []):
        yield p
        yield from p.get("panels", [])


def queries(obj: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel or variable title, PromQL) for every target and query variable of a dashboard JSON."""
    for p in panels(obj):
        for t in p.get("targets") or []:
            if t.get("expr"):
                yield p["title"], t["expr"]
    for v in obj.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]
            yield f"variable {v['name']}", q if isinstance(q, str) else q.get("query", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail when the committed JSON is stale")
    a = ap.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT / name
        if a.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale (run `python helm/dashboards.py`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
