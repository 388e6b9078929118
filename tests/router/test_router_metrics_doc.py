"""The router's /metrics against the table users read (docs/router-autoscaler-contract.md,
"Router metrics"): every family there is exported with its type and labels, and nothing else
named goodput_router_*; metric_names.py spells the same names."""
from __future__ import annotations

from pathlib import Path

import httpx
from goodput.api import router_metrics as mn
from goodput.router.app import RouterSettings, create_app
from goodput.router.discovery_static import StaticDiscovery
from prometheus_client.parser import text_string_to_metric_families
from router_stub import ServerThread, StubState, make_stub

DOC = Path(__file__).resolve().parents[2] / "docs" / "router-autoscaler-contract.md"


def doc_table() -> dict[str, tuple[str, set[str]]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`goodput_router_"):
            continue
        name, typ, labels, _meaning = cells
        name = name.strip("`")
        if typ == "counter":
            name = name.removesuffix("_total")
        rows[name] = (typ, {x.strip() for x in labels.replace("—", "").split(",") if x.strip()})
    assert len(rows) >= 7, "the router metrics table was not found"
    return rows


def test_router_metrics_match_the_contract_table():
    table = doc_table()
    names = {mn.HELD_REQUESTS, mn.QUEUED_REQUESTS, mn.REQUESTS, mn.DECISIONS, mn.QUEUE_WAIT, mn.OVERHEAD,
             mn.UPSTREAM_TTFT, mn.POD_IN_FLIGHT, mn.EJECTED_PODS, mn.EJECTIONS, mn.POD_RESTARTS,
             mn.CLASS_REQUESTS, mn.CLASS_UPSTREAM_TTFT, mn.KV_KEYS, mn.KV_EVENTS, mn.KV_RESYNCS,
             mn.PD_DECISIONS}
    assert set(table) == names
    st, bad = StubState("m1", "A", instance="a-1", kv_events=True), StubState("m1", "B", fail_status=500, kv_events=True)
    with ServerThread(make_stub(st)) as stub, ServerThread(make_stub(bad)) as bad_stub:
        disc = StaticDiscovery([f"m1={stub.url},{bad_stub.url}"], period_s=0.05)
        with ServerThread(create_app(disc, RouterSettings(scrape_period_s=0.05))) as r:
            while httpx.get(r.url + "/ready").status_code != 200:
                pass
            # requests until B is ejected, and A's engine restarts: every labelled family has a sample
            i = 0
            while not bad.received() or "goodput_router_ejections_total{" not in httpx.get(r.url + "/metrics").text:
                i += 1
                assert httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": f"x{i}"}).status_code == 200
            st.instance = "a-2"
            while "goodput_router_pod_restarts_total{" not in httpx.get(r.url + "/metrics").text:
                pass
            while not all(f"{n}_total{{" in httpx.get(r.url + "/metrics").text for n in (mn.KV_EVENTS, mn.KV_RESYNCS)):
                pass  # kv events on: each pod's snapshot installed, its stream open
            fams = {f.name: f for f in text_string_to_metric_families(httpx.get(r.url + "/metrics").text)
                    if f.name.startswith("goodput_router_")}
    assert set(fams) == set(table)
    for name, (typ, labels) in table.items():
        fam = fams[name]
        assert fam.type == typ, name
        seen = set().union(*(set(s.labels) - {"le"} for s in fam.samples)) if fam.samples else set()
        assert seen == labels, name
