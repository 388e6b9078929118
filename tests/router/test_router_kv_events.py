"""The router following real workers' KV events (``--kv-events on``) over HTTP on 127.0.0.1: two
worker apps (the fake engine: 8 KV blocks of 4 tokens, byte tokens) behind the real router, chunks
of 8 token ids on both sides. The router's exact index holds what each worker's cache holds, so a
prompt evicted on the pod it was sent to goes to the pod that really holds it; with events off the
request-history index still sends it to the first pod. A worker restarted on its address is
resynced (new instance, empty cache). No timing is asserted: the test waits for states."""
from __future__ import annotations

import contextlib

import httpx
import pytest
from goodput.api.prefix import chunk_hashes
from goodput.router.app import POD_HEADER, RouterSettings, create_app
from goodput.router.discovery_static import StaticDiscovery, pod_name
from goodput.router.picker import PickConfig
from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.scheduler import Scheduler
from goodput.worker.engine_args import EngineArgs
from goodput.worker.llm_engine import LLMEngine
from goodput.worker.metrics import WorkerMetrics
from goodput.worker.server import kv_events as worker_kv
from goodput.worker.server.app import create_app as create_worker
from router_stub import ServerThread
from test_router_app import HANG_GUARD_S, sample, wait_until

from fake_engine import EOS, ByteTokenizer, CountingRunner

P = list(range(1, 21))     # 20 ids: chunks end at 8, 16, 20 -> 3 keys; 6 blocks with 2 tokens out
Q = list(range(100, 128))  # 28 ids + 2 out: all 8 blocks (evicts P's); chunks end 8, 16, 24, 28 -> 4 keys
KP = set(chunk_hashes("fake", "", None, token_ids=P, chunk_size=8))
KQ = set(chunk_hashes("fake", "", None, token_ids=Q, chunk_size=8))


def engine(args):
    config = EngineConfig(num_blocks=8, max_model_len=64, block_size=4, eos_token_ids=(EOS,),
                          max_num_batched_tokens=64, model_name="fake", revision="")
    eng = LLMEngine(config, Scheduler(config), CountingRunner(), ByteTokenizer())
    eng.metrics = WorkerMetrics("fake", eng.stats)
    return eng


def worker_app():
    return create_worker(EngineArgs(model="fake", served_model_name="fake"), engine_factory=engine, admin_token="")


@contextlib.contextmanager
def workers_and_router(kv_events: str):
    with contextlib.ExitStack() as stack:
        apps = [worker_app(), worker_app()]
        ws = [stack.enter_context(ServerThread(a)) for a in apps]
        for w in ws:
            wait_until(lambda w=w: httpx.get(w.url + "/ready").status_code == 200, "worker ready")
        s = RouterSettings(scrape_period_s=0.05, kv_events=kv_events)
        disc = StaticDiscovery([f"fake={ws[0].url},{ws[1].url}"], startup_timeout_s=s.hold_timeout_s,
                               period_s=s.scrape_period_s)
        r = stack.enter_context(ServerThread(create_app(disc, s, pick_cfg=PickConfig(chunk_size=8))))
        wait_until(lambda: httpx.get(r.url + "/ready").status_code == 200, "router ready")
        try:
            yield r, ws, apps
        finally:
            for a in apps:  # end the workers' event streams so that they stop at once
                a.state.server.draining = True


def post(url: str, prompt: list[int]) -> httpx.Response:
    resp = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 2},
                      timeout=HANG_GUARD_S)
    assert resp.status_code == 200, resp.text
    return resp


def worker_keys(w) -> set[int]:
    return {int(k, 16) for k in httpx.get(w.url + "/kv/snapshot").json()["keys"]}


@pytest.mark.parametrize("kv_events, goes_to", [("on", "holder"), ("off", "first")])
def test_an_evicted_prompt_goes_to_the_pod_that_really_holds_it(monkeypatch, kv_events, goes_to):
    monkeypatch.setattr(worker_kv, "CHUNK_SIZE", 8)
    with workers_and_router(kv_events) as (r, ws, _):
        router = r.server.config.app.router
        first = post(r.url, P).headers[POD_HEADER]           # the rendezvous pod of P
        x, y = sorted(ws, key=lambda w: pod_name(w.url) != first)
        wait_until(lambda: worker_keys(x) == KP, "P cached on the first pod")
        post(y.url, P)                                        # P straight to the other pod: cached there too
        post(x.url, Q)                                        # Q straight to the first: P evicted there
        wait_until(lambda: worker_keys(x) == KQ and worker_keys(y) == KP, "workers' caches")
        if kv_events == "on":
            ix = router.index.exact
            wait_until(lambda: ix.state(pod_name(x.url)) is not None and ix.state(pod_name(x.url)).keys == KQ
                       and ix.state(pod_name(y.url)) is not None and ix.state(pod_name(y.url)).keys == KP,
                       "the router's exact index")
        again = post(r.url, P).headers[POD_HEADER]
        assert again == pod_name((y if goes_to == "holder" else x).url)
        assert sample(r.url, "goodput_router_decisions_total", reason="affinity") == 1
        if kv_events == "on":
            assert sample(r.url, "goodput_router_kv_keys", namespace="", inferenceservice="fake",
                          pod=pod_name(y.url)) == 3
            assert sample(r.url, "goodput_router_kv_resyncs_total", namespace="", inferenceservice="fake",
                          pod=pod_name(x.url), reason="start") == 1


def test_a_worker_restarted_on_its_address_is_resynced(monkeypatch):
    monkeypatch.setattr(worker_kv, "CHUNK_SIZE", 8)
    with workers_and_router("on") as (r, ws, apps):
        ix = r.server.config.app.router.index.exact
        w = ws[0]
        post(w.url, P)
        name = pod_name(w.url)
        wait_until(lambda: ix.state(name) is not None and ix.state(name).keys == KP, "P indexed")
        old = ix.state(name).instance
        apps[0].state.server.draining = True                 # its event stream ends
        w.__exit__(None, None, None)
        new_app = worker_app()
        with ServerThread(new_app, port=w.port) as w2:        # a new engine on the same address
            wait_until(lambda: httpx.get(w2.url + "/ready").status_code == 200, "restarted worker ready")
            new_id = httpx.get(w2.url + "/kv/snapshot").json()["instance"]
            assert new_id != old
            wait_until(lambda: ix.state(name) is not None and ix.state(name).instance == new_id, "resynced")
            assert ix.state(name).keys == set()
            new_app.state.server.draining = True
