"""The ``x-goodput-slo-class`` header over real HTTP (in-process app, the fake engine): a request
is judged by the class it names; an unknown or absent name is the default class, never an error.
Thresholds are set so that no timing decides the outcome: the default class's 1e9 ms is always
met, the ``strict`` class's 1 ns TTFT never is."""
from __future__ import annotations

import threading

from fastapi.testclient import TestClient
from goodput.api.policy import SloClass
from goodput.worker.engine_args import EngineArgs
from goodput.worker.metrics import WorkerMetrics
from goodput.worker.server.app import create_app
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import TextByteTokenizer, make_engine


def _factory(args):
    eng = make_engine()
    eng.tokenizer = TextByteTokenizer()
    eng.metrics = WorkerMetrics("fake", eng.stats, slo_ttft_s=1e6, slo_tpot_s=1e6,
                                slo_classes=(SloClass("strict", 1e-9, 1e6),))
    return eng


def _value(text: str, name: str, **labels) -> float:
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_requests_are_counted_in_the_class_they_name():
    app = create_app(EngineArgs(model="fake", served_model_name="fake"), engine_factory=_factory, admin_token="")
    with TestClient(app) as client:
        for _ in range(600):
            if client.get("/ready").status_code == 200:
                break
            threading.Event().wait(0.05)
        for cls in ("strict", "strict", "unknown", None):
            r = client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2},
                            headers={"x-goodput-slo-class": cls} if cls else {})
            assert r.status_code == 200, r.text
        text = client.get("/metrics").text
    assert _value(text, "goodput_requests_finished_by_class_total", slo_class="strict") == 2
    assert _value(text, "goodput_requests_slo_met_by_class_total", slo_class="strict") == 0
    assert _value(text, "goodput_requests_tpot_met_by_class_total", slo_class="strict") == 2
    assert _value(text, "goodput_requests_finished_by_class_total", slo_class="default") == 2
    assert _value(text, "goodput_requests_slo_met_by_class_total", slo_class="default") == 2
    assert _value(text, "goodput_requests_slo_met_total") == 2


def test_the_engine_queues_each_request_in_its_class_band():
    """``goodput.api.policy.slo_ranks``: here ``strict`` (TTFT 1 ns) is band 0 and the default class
    (TTFT 1e6 s) band 1, so a request naming no class, or an unknown one, queues behind ``strict``."""
    ranks: list[int] = []

    def factory(args):
        eng = _factory(args)
        add = eng.scheduler.add_request

        def spy(req, forks=()):
            ranks.append(req.slo_rank)
            ranks.extend(c.slo_rank for c in forks)
            return add(req, forks)
        eng.scheduler.add_request = spy
        return eng

    app = create_app(EngineArgs(model="fake", served_model_name="fake"), engine_factory=factory, admin_token="")
    with TestClient(app) as client:
        for _ in range(600):
            if client.get("/ready").status_code == 200:
                break
            threading.Event().wait(0.05)
        for cls, n in (("strict", 2), ("unknown", 1), (None, 1)):
            r = client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2, "n": n},
                            headers={"x-goodput-slo-class": cls} if cls else {})
            assert r.status_code == 200, r.text
    assert ranks == [0, 0, 1, 1]
