"""Small HTTP helpers for the live-server tests (httpx, SSE parsing, Prometheus text parsing, an app
served in a thread)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port

TIMEOUT = httpx.Timeout(300.0, connect=10.0)


class ServerThread:
    """Serve ``app`` with uvicorn on 127.0.0.1:``port`` (free if None) in a daemon thread."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TIMEOUT, **kw)


def completion(url: str, **body) -> dict:
    """Non-streamed /v1/completions; asserts 200 and returns the JSON body."""
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def parse_sse(lines) -> tuple[list[dict], bool]:
    """SSE ``data:`` lines -> (JSON events, whether ``[DONE]`` was the last event)."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: "):]
        assert not done, "event after [DONE]"
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


def stream(url: str, path: str, body: dict) -> list[dict]:
    """A streamed request read to the end; asserts 200 and a final ``[DONE]``."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events, done = parse_sse(r.iter_lines())
    assert done
    return events


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed by prometheus_client: {(sample name, sorted labels w/o model_name): value}."""
    r = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    return m[(name, tuple(sorted(labels.items())))]
