"""The worker's engine identity (goodput.api.identity): every answer carries the engine's
instance id, ``/metrics`` exports the same id, and a new start has a new one."""
from __future__ import annotations

import threading

from fastapi.testclient import TestClient
from goodput.worker.engine_args import EngineArgs
from goodput.api.identity import INSTANCE_HEADER
from goodput.worker.server.app import create_app
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import TextByteTokenizer, make_engine


def _factory(args):
    eng = make_engine()
    eng.tokenizer = TextByteTokenizer()
    return eng


def _started(client: TestClient) -> None:
    for _ in range(600):
        if client.get("/ready").status_code == 200:
            return
        threading.Event().wait(0.05)
    raise AssertionError("the worker never turned ready")


def _metric_id(text: str) -> str:
    ids = [s.labels["instance_id"] for f in text_string_to_metric_families(text)
           if f.name == "goodput_engine_instance_info" for s in f.samples]
    assert len(ids) == 1, ids
    return ids[0]


def test_every_answer_and_metrics_carry_the_instance_id_new_at_each_start():
    seen = []
    for _ in range(2):  # two starts of the same worker (a restart in place)
        app = create_app(EngineArgs(model="fake", served_model_name="fake"), engine_factory=_factory, admin_token="")
        with TestClient(app) as client:
            _started(client)
            ok = client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2})
            bad = client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": -1})
            metrics = client.get("/metrics")
            assert ok.status_code == 200 and bad.status_code == 400
            ids = {r.headers[INSTANCE_HEADER] for r in (ok, bad, metrics, client.get("/ready"))}
            assert ids == {_metric_id(metrics.text)}
            seen.append(ids.pop())
    assert seen[0] != seen[1] and all(len(i) == 16 for i in seen)
