"""The router's two-phase send (goodput.router.forward.remote_prefill) against stub workers: the
decode pod gets the transfer headers naming the prefill pod, a failed prefill call leaves the decode
pod to prefill locally, and a request that does not succeed after the prefill call has its lease
deleted on the prefill pod."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from goodput.api.disagg import KV_HANDLE_HEADER, KV_SOURCE_HEADER, REMOTE_PREFILL_HEADER
from goodput.router.app import RouterSettings, create_app
from goodput.router.discovery_static import StaticDiscovery
from server_utils import ServerThread


class Stub:
    """A worker stub: answers ``/v1/completions`` with ``status`` (JSON), or with a handle to a
    request carrying the remote-prefill header; records what it got."""

    def __init__(self, status: int = 200, prefill_status: int = 200) -> None:
        self.status, self.prefill_status = status, prefill_status
        self.requests: list[dict] = []
        self.deleted: list[str] = []
        self.lock = threading.Lock()
        app = FastAPI()

        @app.get("/ready")
        async def ready():
            return {"status": "ready"}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse("")

        @app.post("/v1/completions")
        async def completions(request: Request):
            h = dict(request.headers)
            with self.lock:
                self.requests.append(h)
            if REMOTE_PREFILL_HEADER in h:
                if self.prefill_status != 200:
                    return JSONResponse({"error": {"message": "boom"}}, status_code=self.prefill_status)
                return {"object": "kv.prefill", "handle": f"kv-{len(self.requests)}"}
            return JSONResponse({"choices": [{"text": "ok"}]} if self.status == 200 else
                                {"error": {"message": "bad"}}, status_code=self.status)

        @app.delete("/kv/leases/{handle}")
        async def delete(handle: str):
            with self.lock:
                self.deleted.append(handle)
            return Response(status_code=204)

        self.app = app


class Growing(StaticDiscovery):
    """Static discovery whose services report ``coming`` prefill pods ordered and not Ready (as
    ``status.pools.prefill`` does in Kubernetes)."""

    coming = 0

    def services(self):
        return [(replace(info, prefill_coming=self.coming), pods) for info, pods in super().services()]


@pytest.fixture
def fleet():
    def make(decode_status=200, prefill_status=200, prefill_coming=0):
        p, d = Stub(prefill_status=prefill_status), Stub(status=decode_status)
        servers = [ServerThread(p.app), ServerThread(d.app)]
        for s in servers:
            s.__enter__()
        disc = Growing([f"m={servers[0].url}#prefill,{servers[1].url}#decode"], period_s=0.05)
        disc.coming = prefill_coming
        r = ServerThread(create_app(disc, RouterSettings(scrape_period_s=0.05, pd_remote_prefill_min_tokens=0)))
        r.__enter__()
        servers.append(r)
        deadline = time.monotonic() + 30
        while httpx.get(r.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        made.append(servers)
        return r.url, servers[0].url, p, d

    made: list = []
    yield make
    for servers in made:
        for s in reversed(servers):
            s.__exit__(None, None, None)


def body():
    return {"model": "m", "prompt": "a prompt long enough for one chunk of the prefix index"}


def test_the_decode_pod_gets_the_handle_and_the_prefill_pods_url(fleet):
    r, p_url, p, d = fleet()
    resp = httpx.post(r + "/v1/completions", json=body())
    assert resp.status_code == 200
    assert len(p.requests) == 1 and p.requests[0][REMOTE_PREFILL_HEADER] == "1"
    assert len(d.requests) == 1
    assert d.requests[0][KV_HANDLE_HEADER] == "kv-1" and d.requests[0][KV_SOURCE_HEADER] == p_url
    assert p.deleted == []  # pulled by the decode pod (here: nobody needs to delete it)


def test_a_failed_prefill_call_leaves_the_decode_pod_to_prefill(fleet):
    r, _, p, d = fleet(prefill_status=500)
    assert httpx.post(r + "/v1/completions", json=body()).status_code == 200
    assert len(d.requests) == 1 and KV_HANDLE_HEADER not in d.requests[0]
    m = httpx.get(r + "/metrics").text
    assert 'goodput_router_pd_decisions_total{decision="prefill_failed",inferenceservice="m",namespace=""} 1.0' in m


def test_a_request_that_fails_after_the_prefill_frees_the_lease(fleet):
    r, _, p, d = fleet(decode_status=400)
    assert httpx.post(r + "/v1/completions", json=body()).status_code == 400
    deadline = time.monotonic() + 30  # the DELETE runs in the background
    while not p.deleted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.deleted == ["kv-1"]


def test_a_full_prefill_pod_while_more_are_starting_refuses_the_prompt(fleet):
    # the prefill pod answers 429 (its queue is full) and one more prefill pod is starting: the
    # client gets the router's 429 with Retry-After, the decode pod never sees the request
    r, _, p, d = fleet(prefill_status=429, prefill_coming=1)
    resp = httpx.post(r + "/v1/completions", json=body())
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert "starting" in resp.json()["error"]["message"]
    assert len(p.requests) == 1 and d.requests == []
    m = httpx.get(r + "/metrics").text
    assert 'goodput_router_pd_decisions_total{decision="prefill_deferred",inferenceservice="m",namespace=""} 1.0' in m


def test_a_full_prefill_pod_with_nothing_coming_leaves_the_decode_pod_to_prefill(fleet):
    r, _, p, d = fleet(prefill_status=429, prefill_coming=0)
    assert httpx.post(r + "/v1/completions", json=body()).status_code == 200
    assert len(d.requests) == 1 and KV_HANDLE_HEADER not in d.requests[0]
    m = httpx.get(r + "/metrics").text
    assert 'goodput_router_pd_decisions_total{decision="prefill_failed",inferenceservice="m",namespace=""} 1.0' in m
