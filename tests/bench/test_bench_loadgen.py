"""The streaming client against a tiny fake OpenAI SSE server with known timing.

The fake server waits FIRST_DELAY before the first token and GAP between tokens, emits exactly
max_tokens one-token events plus a usage chunk, and answers 429 while MAX_INFLIGHT requests are
streaming. The tests assert counts, order and consistency of what the client recorded, never a
wall-clock threshold (a busy CI machine stretches and bunches any timing); rejections happen only
above the in-flight limit.
"""
import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from goodput.bench.loadgen import LoadConfig, run_load
from goodput.bench.metrics import OK, REJECTED, check_consistency, summarize
from goodput.bench.workloads import RequestSpec

FIRST_DELAY, GAP, MAX_INFLIGHT = 0.05, 0.01, 3


def make_app(state):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        state["bodies"].append(body)
        if state["inflight"] >= MAX_INFLIGHT:
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit", "param": None,
                                           "code": 429}}, status_code=429, headers={"Retry-After": "1"})
        n = body["max_tokens"]
        state["inflight"] += 1

        async def gen():
            try:
                await asyncio.sleep(FIRST_DELAY)
                for i in range(n):
                    if i:
                        await asyncio.sleep(GAP)
                    chunk = {"id": "x", "object": "text_completion", "model": body["model"],
                             "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) + "\n\n"
                yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                                     "total_tokens": 7 + n}}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    state = {"inflight": 0, "bodies": []}
    server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    th.join(10)


def specs(n, out):
    return [RequestSpec(prompt=f"hello {i}", prompt_tokens=7, max_tokens=out) for i in range(n)]


def test_closed_loop_timings_consistent(fake_server):
    url, state = fake_server
    cfg = LoadConfig(base_url=url, concurrency=2, progress=False)
    recs, info = asyncio.run(run_load(cfg, specs(6, 5)))
    assert info["model"] == "fake-model"  # discovered from /v1/models
    assert len(recs) == 6 and all(r.status == OK for r in recs)
    for r in recs:
        assert check_consistency(r) == []
        assert r.n_out == 5 and len(r.itls) == 4
        assert 0 < r.ttft <= r.e2e and min(r.itls) >= 0
        assert r.ttft + sum(r.itls) <= r.e2e + 1e-9  # tokens arrive in order, before the end
    body = state["bodies"][-1]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True}
    s = summarize(recs)
    assert s["output_tokens"] == 30 and s["counts"]["ok"] == 6


def test_open_loop_burst_gets_429s_counted(fake_server):
    url, _ = fake_server
    # 8 arrivals at the same instant; the fake server streams at most 3 at once -> 5 rejections
    sp = specs(8, 20)
    for s in sp:
        s.at = 0.0
    recs, _ = asyncio.run(run_load(LoadConfig(base_url=url, mode="open", progress=False), sp))
    s = summarize(recs)
    assert s["counts"]["sent"] == 8
    assert s["counts"]["ok"] == MAX_INFLIGHT
    assert s["counts"]["rejected"] == 8 - MAX_INFLIGHT
    assert all(r.http_status == 429 for r in recs if r.status == REJECTED)
    assert s["counts"]["admitted"] == MAX_INFLIGHT


def test_duration_stops_sending_and_injection_fires(fake_server):
    url, _ = fake_server
    sp = specs(200, 10)  # far more than fit in the duration
    long = RequestSpec("long one", 7, 2, cls="long", at=0.2)
    cfg = LoadConfig(base_url=url, concurrency=1, duration_s=0.6, drain_timeout_s=5, progress=False)
    recs, _ = asyncio.run(run_load(cfg, sp + [long]))
    # The slot sends its first request at once, and the injection fires: at least 2. Each request
    # takes at least FIRST_DELAY + 9*GAP = 0.14 s (the server sleeps that long), so one slot sends
    # at most ceil(0.6 / 0.14) = 5 before the duration ends, plus the injected one: a causal bound
    # that a slow machine can only lower.
    assert 2 <= len(recs) <= 6
    assert [r.cls for r in recs].count("long") == 1
    assert all(r.status == OK for r in recs)


def test_open_loop_without_arrival_times_is_refused():
    with pytest.raises(ValueError):
        asyncio.run(run_load(LoadConfig(base_url="http://127.0.0.1:9", mode="open", progress=False), specs(1, 1)))


def test_connection_refused_is_an_error_not_a_crash():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    recs, _ = asyncio.run(run_load(LoadConfig(base_url=f"http://127.0.0.1:{port}", model="m", progress=False),
                                   specs(2, 3)))
    assert [r.status for r in recs] == ["error", "error"]
    assert summarize(recs)["counts"]["errors"] == 2
