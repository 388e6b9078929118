"""HTTP API of the live worker: errors, admin, admission (400/429), metrics, disconnects.

Expected values come from the request itself (numbers we chose) and from the metric contract
(docs/metrics.md); metrics are read with prometheus_client's own text parser.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import ADMIN_TOKEN
from server_utils import TIMEOUT, completion, metric, metrics, post, stream

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ------------------------------------------------------------------------------------- basics

def test_health_ready_models_tokenize(server_main):
    url = server_main.url
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.get(url + "/ready").status_code == 200
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["smollm2"]
    assert models["data"][0]["max_model_len"] == 512
    tok = post(url, "/tokenize", {"prompt": "The capital of France is"}).json()
    body = completion(url, prompt="The capital of France is", max_tokens=1)
    assert tok["count"] == len(tok["tokens"]) == body["usage"]["prompt_tokens"]
    chat_tok = post(url, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_tok["count"] > 3  # the chat template adds role markers


def test_chat_completion_shape(server_main):
    r = post(server_main.url, "/v1/chat/completions",
             {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
              "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] <= 16


# ------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logit_bias": {"50": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"not_a_param": 1}, "not_a_param"),
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"stop": [""]}, "stop"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),  # legacy: send them as tools
    ("/v1/chat/completions", {"response_format": {"type": "grammar"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
])
def test_unsupported_or_invalid_parameters_are_400_naming_the_parameter(server_main, path, extra, param):
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    err = _error(post(server_main.url, path, {**body, "max_tokens": 2, **extra}), 400)
    assert err["param"] == param, err
    assert param in err["message"]
    assert err["type"] == "invalid_request_error"


def test_malformed_requests(server_main):
    url = server_main.url
    err = _error(httpx.post(url + "/v1/completions", content=b"{not json", timeout=TIMEOUT,
                            headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    err = _error(post(url, "/v1/completions", {"max_tokens": 2}), 400)
    assert err["param"] == "prompt" and "required" in err["message"]
    err = _error(post(url, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    err = _error(post(url, "/v1/completions", {"prompt": [1, 2, 10**9], "max_tokens": 2}), 400)
    assert "vocabulary" in err["message"]
    _error(httpx.get(url + "/v1/nothing-here"), 404)


def test_never_fits_is_400_with_the_numbers(server_main):
    err = _error(post(server_main.url, "/v1/completions", {"prompt": list(range(300, 310)), "max_tokens": 600}),
                 400)
    assert err["code"] == "never_fits"
    for number in ("10", "600", "512"):
        assert number in err["message"]


# -------------------------------------------------------------------------------------- admin

def test_admin_auth_and_limits(server_main):
    url = server_main.url
    before = httpx.get(url + "/admin/limits").json()
    assert before == {"max_num_seqs": 64, "max_waiting": 256, "max_waiting_tokens": 0}
    r = httpx.put(url + "/admin/limits", json={"max_num_seqs": 8})
    assert _error(r, 401) and r.headers["www-authenticate"] == "Bearer"
    _error(httpx.put(url + "/admin/limits", json={"max_num_seqs": 8},
                     headers={"Authorization": "Bearer wrong"}), 401)
    r = httpx.put(url + "/admin/limits", json={"max_num_seqs": 8}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"max_num_seqs": 8, "max_waiting": 256, "max_waiting_tokens": 0}
    assert metric(metrics(url), "goodput_admission_max_num_seqs") == 8
    assert httpx.get(url + "/admin/state").json()["limits"]["max_num_seqs"] == 8
    err = _error(httpx.put(url + "/admin/limits", json={"max_num_seqs": 0}, headers=AUTH), 400)
    assert err["param"] == "max_num_seqs"
    r = httpx.put(url + "/admin/limits", json=before, headers=AUTH)
    assert r.json() == before


def test_admin_writes_refused_without_configured_token(server_tiny):
    err = _error(httpx.put(server_tiny.url + "/admin/limits", json={"max_num_seqs": 2},
                           headers={"Authorization": "Bearer anything"}), 403)
    assert "GOODPUT_ADMIN_TOKEN" in err["message"]
    for method in ("POST", "DELETE"):
        err = _error(httpx.request(method, server_tiny.url + "/admin/drain",
                                   headers={"Authorization": "Bearer anything"}), 403)
        assert "GOODPUT_ADMIN_TOKEN" in err["message"]
    assert httpx.get(server_tiny.url + "/ready").status_code == 200


def test_queue_full_is_429_with_retry_after(server_main):
    url = server_main.url
    m0 = metrics(url)
    assert httpx.put(url + "/admin/limits", json={"max_waiting": 0}, headers=AUTH).status_code == 200
    try:
        r = post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        err = _error(r, 429)
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
        assert httpx.get(url + "/admin/state").json()["engine_state"] == "rejecting"
        m1 = metrics(url)
        assert metric(m1, "goodput_engine_state", state="rejecting") == 1
        assert (metric(m1, "goodput_requests_rejected_total", reason="queue_full")
                - metric(m0, "goodput_requests_rejected_total", reason="queue_full")) == 1
    finally:
        httpx.put(url + "/admin/limits", json={"max_waiting": 256}, headers=AUTH)
    assert completion(url, prompt="Hello", max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_max_waiting_tokens_is_set_shown_and_exported(server_main):
    """The token bound's wiring: PUT /admin/limits sets it in the scheduler (its admission is
    table-tested in tests/worker/engine/test_scheduler.py), GET and /admin/state show it, the
    gauge exports it; a negative value is a 400 naming the field."""
    url = server_main.url
    try:
        r = httpx.put(url + "/admin/limits", json={"max_waiting_tokens": 9000}, headers=AUTH)
        assert r.json() == {"max_num_seqs": 64, "max_waiting": 256, "max_waiting_tokens": 9000}
        assert httpx.get(url + "/admin/state").json()["limits"]["max_waiting_tokens"] == 9000
        assert metric(metrics(url), "goodput_admission_max_waiting_tokens") == 9000
        err = _error(httpx.put(url + "/admin/limits", json={"max_waiting_tokens": -1}, headers=AUTH), 400)
        assert err["param"] == "max_waiting_tokens"
    finally:
        httpx.put(url + "/admin/limits", json={"max_waiting_tokens": 0}, headers=AUTH)
    assert httpx.get(url + "/admin/limits").json()["max_waiting_tokens"] == 0


# ------------------------------------------------------------------------- streaming and load

def test_streamed_text_equals_non_streamed_text(server_main):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    plain = completion(server_main.url, **body)["choices"][0]
    events = stream(server_main.url, "/v1/completions", body)
    assert len(events) == 12  # one event per generated token
    assert "".join(e["choices"][0]["text"] for e in events) == plain["text"]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == plain["token_ids"]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * 11 + ["length"]
    chat = stream(server_main.url, "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5, "temperature": 0})
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def _one_stream(client: httpx.AsyncClient, url: str, i: int, cancel_after: int | None) -> int:
    body = {"prompt": f"Request number {i}: count with me. One, two,", "max_tokens": 10,
            "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True}
    events = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events += 1
                if cancel_after is not None and events >= cancel_after:
                    return events  # leaving the block closes the connection mid-stream
    return events


def test_64_concurrent_streams_with_cancellations_free_every_block(server_main):
    url = server_main.url
    m0 = metrics(url)
    cancelled = {i for i in range(64) if i % 4 == 0}

    async def run():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            return await asyncio.gather(*[
                _one_stream(client, url, i, 2 if i in cancelled else None) for i in range(64)])

    counts = asyncio.run(run())
    assert [c for i, c in enumerate(counts) if i not in cancelled] == [10] * 48
    deadline = time.monotonic() + 120
    while True:  # aborts are applied at the next step boundary
        state = httpx.get(url + "/admin/state").json()
        if state["running"] == 0 and state["waiting"] == 0:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    m1 = metrics(url)
    assert state["kv_blocks_used"] == 0
    assert metric(m1, "goodput_kv_cache_usage_ratio") == 0.0
    assert metric(m1, "goodput_requests_running") == 0 and metric(m1, "goodput_requests_waiting") == 0

    def delta(name, **labels):
        return metric(m1, name, **labels) - metric(m0, name, **labels)

    assert delta("goodput_requests_admitted_total") == 64
    assert delta("goodput_requests_finished_total", finished_reason="length") == 48
    assert delta("goodput_requests_finished_total", finished_reason="abort") == 16
    assert delta("goodput_requests_finished_total", finished_reason="stop") == 0
    # every aborted request produced at least the 2 tokens its client read
    assert 48 * 10 + 16 * 2 <= delta("goodput_generation_tokens_total") <= 64 * 10
    assert delta("goodput_time_to_first_token_seconds_count") == 64
    assert delta("goodput_e2e_request_latency_seconds_count") == 64
    assert state["counters"]["finished"]["abort"] == metric(m1, "goodput_requests_finished_total",
                                                            finished_reason="abort")


def test_counters_add_up(server_main):
    m = metrics(server_main.url)
    finished = sum(metric(m, "goodput_requests_finished_total", finished_reason=r)
                   for r in ("stop", "length", "abort"))
    in_flight = metric(m, "goodput_requests_running") + metric(m, "goodput_requests_waiting")
    assert metric(m, "goodput_requests_admitted_total") == finished + in_flight
    assert metric(m, "goodput_e2e_request_latency_seconds_count") == finished
    assert metric(m, "goodput_prefix_cache_hits_total") <= metric(m, "goodput_prefix_cache_queries_total")
    assert sum(metric(m, "goodput_engine_state", state=s)
               for s in ("running", "waiting", "rejecting", "blocked")) == 1
    assert metric(m, "goodput_requests_slo_met_total") <= finished
