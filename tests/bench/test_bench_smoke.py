"""Smoke run of the load generator against a live worker (the shared session server).

About 20 s of closed-loop load plus a short Poisson burst; asserts the recorded timelines are
self-consistent (send <= first token <= ... <= end, TTFT <= E2E, ITL count = tokens - 1), every
forced output length arrived, the counts add up, and the server's own generation-token counter
moved by exactly the tokens the client saw.
"""
import asyncio

import httpx
import pytest

from goodput.bench.loadgen import LoadConfig, run_load
from goodput.bench.metrics import OK, check_consistency, summarize
from goodput.bench.prompts import PromptFactory
from goodput.bench.workloads import fixed, gamma_times, uniform, with_arrivals

pytestmark = pytest.mark.slow


def _gen_tokens(base_url: str) -> int:
    return httpx.get(f"{base_url}/admin/state", timeout=10).json()["counters"]["generation_tokens"]


def test_closed_loop_smoke_against_worker(server_main):
    url = server_main.url
    pf = PromptFactory("smollm2", seed=0)
    specs = uniform(pf, 200, (8, 48), (4, 16), seed=0)
    before = _gen_tokens(url)
    cfg = LoadConfig(base_url=url, concurrency=4, duration_s=20, drain_timeout_s=60, progress=False)
    recs, info = asyncio.run(run_load(cfg, specs))
    after = _gen_tokens(url)
    assert info["model"], "model discovered from /v1/models"
    s = summarize(recs)
    c = s["counts"]
    assert c["sent"] == len(recs) >= 4
    assert c["sent"] == c["ok"] + c["rejected"] + c["errors"] + c["cancelled"]
    assert c["ok"] == c["sent"], [r.error for r in recs if r.status != OK][:3]
    by_id = {f"r{i + 1}": sp for i, sp in enumerate(specs)}
    for r in recs:
        assert check_consistency(r) == [], (r.request_id, check_consistency(r))
        assert r.ttft <= r.e2e
        assert len(r.itls) == r.n_out - 1
        # ignore_eos: exactly the forced length, one SSE event per token
        assert r.n_out == r.max_tokens == len(r.token_times)
        assert r.usage_prompt_tokens == by_id[r.request_id].prompt_tokens  # same tokenizer as the server
    assert s["output_tokens"] == after - before
    assert s["output_token_throughput"] > 0 and s["ttft_s"]["p50"] > 0


def test_open_loop_poisson_smoke_against_worker(server_main):
    url = server_main.url
    pf = PromptFactory("smollm2", seed=1)
    specs = with_arrivals(fixed(pf, 6, 16, 4), gamma_times(6, rate=2.0, cv=1.0, seed=1))
    recs, _ = asyncio.run(run_load(LoadConfig(base_url=url, mode="open", progress=False), specs))
    assert len(recs) == 6 and all(r.status == OK for r in recs)
    # open loop: each request is sent at its arrival time, not when the previous one ends
    t0 = min(r.scheduled_time for r in recs)
    for r, sp in zip(sorted(recs, key=lambda r: r.scheduled_time), specs):
        assert r.scheduled_time - t0 == pytest.approx(sp.at, abs=1e-6)
        assert r.send_time >= r.scheduled_time  # never early; lateness is the machine's, not asserted
        assert check_consistency(r) == []
