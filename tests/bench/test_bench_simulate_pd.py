"""Prefill/decode disaggregation in the simulator (goodput.bench.pd), with hand-computed values.

A round step-time model (a = 10 ms, b = 1 ms per batched token, c = 1 us per attended token) and a
round link (1 MB/s, 1 ms; 1,000 bytes of KV per token: 1 ms of transfer per token) make every
latency a short hand sum.
"""
from __future__ import annotations

import json
import math

import pytest
from goodput.bench import pd
from goodput.bench import simulate as sim

HW = sim.StepTime("test", a=0.01, b=0.001, c=1e-6, num_blocks=2048, block_size=16, max_model_len=4096,
                  max_num_batched_tokens=512, kv_bytes_per_token=1000)
LINK = pd.Link("test", 1e6, 1e-3)


def trace_of(t, prompt, output, slo=(100.0, 1.0), duration=None):
    n = len(t)
    return sim.Trace("t", list(t), list(prompt), list(output), [0] * n, [slo],
                     duration or (max(t) + 1.0), 10, 1)


def step(tokens, attended):
    return 0.01 + 0.001 * tokens + 1e-6 * attended


def test_transfer_time_is_the_formula():
    h200 = sim.h200_step_time()
    # Llama-3-70B, bf16 KV (the h200 model's): 2 * 80 layers * 8 KV heads * 128 * 2 bytes
    assert h200.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert pd.kv_bytes(h200, 4000) == 4000 * 327_680
    assert pd.transfer_seconds(h200, pd.RDMA, 4000) == pytest.approx(4000 * 327_680 / 50e9 + 10e-6)
    assert pd.transfer_seconds(h200, pd.TCP, 4000) == pytest.approx(4000 * 327_680 / 3e9 + 100e-6)
    assert pd.transfer_seconds(HW, LINK, 1000) == pytest.approx(1.0 + 1e-3)
    with pytest.raises(ValueError):
        pd.kv_bytes(sim.StepTime("x", 0.0, 0.0, 0.0, 1), 1)


def test_one_remote_request_is_the_hand_sum():
    # 1,000-token prompt, 4 output tokens, arriving at t = 1 on an idle 1:1 fleet.
    # prefill replica: chunks of 512 and 488 tokens (attending 512 and 1,000), the second samples
    # the first token; transfer 1,000 tokens: 1.001 s; decode replica: 3 decode steps attending
    # 1,001, 1,002 and 1,003 tokens (the first feeds the first token back).
    r = pd.simulate_pd(trace_of([1.0], [1000], [4]), HW, 1, 1, LINK, threshold=0)
    prefill = step(512, 512) + step(488, 1000)
    ttft = prefill + 1.001
    decodes = [step(1, 1001), step(1, 1002), step(1, 1003)]
    assert (r.offered, r.finished, r.slo_met, r.remote, r.rejected) == (1, 1, 1, 1, 0)
    assert r.ttft == [pytest.approx(ttft)]
    assert r.tpot == [pytest.approx(sum(decodes) / 3)]
    assert r.transfer_s == [pytest.approx(1.001)]
    assert r.decode_prefill_tokens == 0


def test_one_local_request_is_colocated():
    # threshold 1,000: a 1,000-token prompt is not longer, so the decode replica serves it whole:
    # TTFT = the two prefill chunks, TPOT = 3 decode steps attending 1,001..1,003 tokens
    r = pd.simulate_pd(trace_of([1.0], [1000], [4]), HW, 1, 1, LINK, threshold=1000)
    assert (r.finished, r.remote, r.decode_prefill_tokens) == (1, 0, 1000)
    assert r.ttft == [pytest.approx(step(512, 512) + step(488, 1000))]
    assert r.tpot == [pytest.approx((step(1, 1001) + step(1, 1002) + step(1, 1003)) / 3)]


def test_transfers_out_of_one_prefill_replica_queue_on_its_link():
    # two 100-token prompts at t = 0 on one prefill replica over a 100 kB/s link (1.001 s per
    # transfer): the first is prefilled alone (step(100, 100) = 0.1101 s) and ships until
    # 1.1111; the second, prefilled next (done at 0.2202), waits for the link until then
    slow = pd.Link("slow", 1e5, 1e-3)
    r = pd.simulate_pd(trace_of([0.0, 0.0], [100, 100], [2, 2]), HW, 1, 1, slow, threshold=0)
    p = step(100, 100)
    assert sorted(r.ttft) == [pytest.approx(p + 1.001), pytest.approx(p + 2 * 1.001)]


def test_output_of_one_token_needs_no_decode_replica_step():
    r = pd.simulate_pd(trace_of([0.0], [100], [1]), HW, 1, 1, LINK, threshold=0)
    assert (r.finished, r.tpot, r.decode_prefill_tokens) == (1, [], 0)
    assert r.ttft == [pytest.approx(step(100, 100) + 0.101)]


def small_trace(seed=0):
    return sim.synthetic_trace("long-prompt", seed, rate=3.0, duration=40.0, slo=(1.0, 0.15))


@pytest.mark.parametrize("prefill,decode", [(0, 3), (1, 3), (2, 3)])
def test_threshold_above_every_prompt_is_colocated_on_the_decode_replicas(prefill, decode):
    # nothing goes remote: the decode replicas serve everything exactly as simulate's fixed fleet
    # of `decode` replicas with least-loaded routing (the prefill replicas idle)
    h200 = sim.h200_step_time()
    tr = small_trace()
    r = pd.simulate_pd(tr, h200, prefill, decode, pd.RDMA, threshold=max(tr.prompt))
    s = sim.static_result(tr, decode, h200, 0.0, routing="least-loaded")
    assert r.remote == 0
    assert (r.offered, r.finished, r.slo_met, r.rejected) == (s.offered, s.finished, s.slo_met, s.rejected)
    inf = pd.simulate_pd(tr, h200, prefill, decode, pd.RDMA, threshold=math.inf)
    assert (inf.slo_met, inf.ttft, inf.tpot) == (r.slo_met, r.ttft, r.tpot)


@pytest.mark.parametrize("link", [pd.RDMA, pd.TCP])
def test_invariants_with_threshold_zero(link):
    h200 = sim.h200_step_time()
    tr = small_trace(1)
    r = pd.simulate_pd(tr, h200, 2, 2, link, threshold=0)
    assert r.rejected == 0 and r.remote == len(tr)
    assert sorted(r.finished_ids) == sorted(f"q{k}" for k in range(len(tr)))   # each exactly once
    assert r.finished == len(tr) == len(r.ttft)
    assert r.decode_prefill_tokens == 0          # decode replicas ran decodes only
    assert len(r.transfer_s) == len(tr)
    # transfer inside TTFT: no TTFT is shorter than its own transfer
    assert min(r.ttft) >= min(r.transfer_s)


def test_threshold_splits_by_prompt_length():
    # prompts of 500 and 1,000 tokens, threshold 600: only the second is prefilled remotely
    r = pd.simulate_pd(trace_of([0.0, 5.0], [500, 1000], [3, 3]), HW, 1, 1, LINK, threshold=600)
    assert (r.finished, r.remote, r.decode_prefill_tokens) == (2, 1, 500)


def test_threshold_counts_only_the_uncached_prompt():
    # prefix caching: the second request repeats the first one's 992-token prompt plus 40 tokens;
    # the first goes remote (cold) and the decode replica caches its imported KV (62 full
    # blocks), so only 40 tokens of the second are uncached (< threshold 100) and it stays local,
    # where without the cache it would go remote too
    ids1 = tuple(range(2, 994))
    ids2 = ids1 + tuple(range(5000, 5040))
    tr = trace_of([0.0, 10.0], [len(ids1), len(ids2)], [3, 3])
    tr.tokens, tr.prefix_caching = [ids1, ids2], True
    r = pd.simulate_pd(tr, HW, 1, 1, LINK, threshold=100)
    assert (r.finished, r.remote, r.decode_prefill_tokens) == (2, 1, 40)
    cold = trace_of([0.0, 10.0], [len(ids1), len(ids2)], [3, 3])
    assert pd.simulate_pd(cold, HW, 1, 1, LINK, threshold=100).remote == 2


def test_long_context_trace_shape():
    tr = sim.make_trace("long-context", duration=60.0)
    assert tr.slos == [(3.0, 0.05)] and len(tr) > 100
    assert all(2000 <= p <= 8000 and p + o < 8192 for p, o in zip(tr.prompt, tr.output))


def test_cli_writes_the_table(tmp_path, capsys):
    rc = sim.main(["--pd", "--trace", "long-context", "--duration", "15", "--pd-sizes", "2",
                   "--pd-thresholds", "0", "--pd-links", "rdma", "--out-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| 2 | colocated |" in out and "| 2 | P/D | 1:1 | rdma | 0 |" in out
    data = json.loads((tmp_path / "pd-long-context-h200.json").read_text())
    assert set(data["sizes"]["2"]["best"]) == {"rdma/0"}
    assert (tmp_path / "pd-long-context-h200.md").read_text().startswith("`python -m goodput.bench.simulate --pd")
