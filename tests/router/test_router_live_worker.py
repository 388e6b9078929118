"""The router in front of the real worker (the real model, tests/conftest.py's ``server_main``):
what a client gets through the router equals what it gets from the worker directly."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
from goodput.router.app import POD_HEADER, RouterSettings, create_app
from goodput.router.discovery_static import StaticDiscovery
from router_stub import ServerThread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def routed(server_main):
    model = httpx.get(server_main.url + "/v1/models").json()["data"][0]["id"]
    disc = StaticDiscovery([f"{model}={server_main.url}"], period_s=0.5)
    with ServerThread(create_app(disc, RouterSettings(scrape_period_s=0.5))) as r:
        deadline = time.monotonic() + 60
        while httpx.get(r.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "router not ready"
            time.sleep(0.05)
        yield r, server_main, model


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_greedy_chat_through_router_equals_direct(routed):
    r, worker, model = routed
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    direct = _client(worker.url).chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    via = _client(r.url).chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    assert via.choices[0].message.content == direct.choices[0].message.content
    assert via.usage.prompt_tokens == direct.usage.prompt_tokens
    pieces = [c.choices[0].delta.content or "" for c in _client(r.url).chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == direct.choices[0].message.content


def test_models_tokenize_and_errors_match_worker(routed):
    r, worker, model = routed
    assert httpx.get(r.url + "/v1/models/" + model).json() == httpx.get(worker.url + "/v1/models/" + model).json()
    body = {"model": model, "prompt": "Hello router"}
    via = httpx.post(r.url + "/tokenize", json=body)
    assert via.json() == httpx.post(worker.url + "/tokenize", json=body).json()
    assert via.headers[POD_HEADER] == worker.url.removeprefix("http://")
    # the worker's own 400 (an unknown parameter) comes back as the worker wrote it
    bad = {"model": model, "prompt": "x", "no_such_param": 1}
    via_bad = httpx.post(r.url + "/v1/completions", json=bad)
    direct_bad = httpx.post(worker.url + "/v1/completions", json=bad)
    assert (via_bad.status_code, via_bad.json()) == (direct_bad.status_code, direct_bad.json())
