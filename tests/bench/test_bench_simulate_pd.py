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


# ---------------------------------------------------------------- autoscaled P/D, hindsight, capacity
def fixed(p, d, slo_met, duration=3600.0):
    """A fixed-split result of ``slo_met`` SLO-meeting requests over ``duration`` s (its
    replica-hours: (p + d) * duration / 3600)."""
    return pd.PDResult(f"pd-{p}:{d}", p, d, "rdma", 0.0, 1000, slo_met, slo_met, 0, duration,
                       prefill_hours=p * duration / 3600, decode_hours=d * duration / 3600)


def test_splits_upto_lists_every_split_by_n_then_p():
    assert pd.splits_upto(2) == [(1, 1)]
    assert pd.splits_upto(4) == [(1, 1), (1, 2), (2, 1), (1, 3), (2, 2), (3, 1)]
    assert len(pd.splits_upto(8)) == 1 + 2 + 3 + 4 + 5 + 6 + 7 == 28


def test_best_split_is_the_most_goodput_then_the_fewest_hours():
    rows = [fixed(1, 1, 500), fixed(3, 1, 900), fixed(4, 2, 990), fixed(5, 3, 990), fixed(2, 4, 990)]
    b = pd.best_split(rows)
    # 990 three times: 4:2 and 2:4 cost 6 replica-hours, 5:3 8; among 4:2 and 2:4, fewer prefill
    assert (b.prefill, b.decode) == (2, 4)
    assert (pd.best_split(rows[:3]).prefill, pd.best_split(rows[:3]).decode) == (4, 2)


def test_frontier_and_cheapest_split():
    rows = [fixed(1, 1, 500), fixed(3, 1, 900), fixed(4, 2, 990)]
    # 5 replica-hours buy 1:1 (2 h) or 3:1 (4 h): 3:1 has more goodput; 4:2 costs 6
    f = pd.frontier_split(rows, 5.0)
    assert (f.prefill, f.decode) == (3, 1)
    assert pd.frontier_split(rows, 1.5) is None
    # 800 SLO-meeting requests: 3:1 (900, 4 h) is the cheapest reaching it; 995: none
    c = pd.cheapest_split(rows, 800)
    assert (c.prefill, c.decode) == (3, 1)
    assert pd.cheapest_split(rows, 995) is None


def test_auto_verdict_by_hand():
    # autoscaled: 891 SLO-meeting requests over an hour on 4.5 replica-hours; best split 4:2 with
    # 990 on 6: goodput 891 / 990 = 0.9x, hours 4.5 / 6 = 0.75x -> met; the same money (4.5 h)
    # buys 3:1 (900): 891 / 900 = 0.99x; the cheapest split reaching 891 is 3:1 (4 h): 4.5 / 4
    auto = pd.PDResult("pd-auto", 1, 1, "rdma", 0.0, 1000, 891, 891, 0, 3600.0, prefill_hours=3.0,
                       decode_hours=1.5)
    c = pd.AutoComparison(None, None, auto, [fixed(1, 1, 500), fixed(3, 1, 900), fixed(4, 2, 990)], None)
    v = c.verdict()
    assert v == {"goodput_ratio": 0.9, "hours_ratio": 0.75, "met": True, "frontier": "3:1",
                 "frontier_goodput_ratio": 0.99, "cheapest_same_goodput": "3:1", "cheapest_hours_ratio": 1.125}
    auto.prefill_hours = 4.6   # 6.1 replica-hours: more than the best split's 6
    assert c.verdict()["met"] is False


@pytest.mark.parametrize("points,target,expected", [
    ([(2, 1.0), (3, 0.95), (4, 0.75)], 0.9, (3.25, True)),   # 3 + 1 * 0.05 / 0.2
    ([(2, 0.95), (3, 0.9)], 0.9, (3, False)),                 # never below: a lower bound
    ([(2, 0.8), (3, 0.95)], 0.9, (None, True)),               # the lowest rate already misses
    ([(1, 1.0), (2, 0.5), (3, 0.95)], 0.9, (1.2, True)),      # the first miss ends the walk: 1 + 0.1 / 0.5
    ([], 0.9, (None, True)),
])
def test_capacity_rate_by_hand(points, target, expected):
    rate, exact = pd.capacity_rate(points, target)
    assert exact is expected[1]
    assert rate == (None if expected[0] is None else pytest.approx(expected[0]))


def test_pool_specs_are_the_loops():
    # the prefill pool gets its own bounds, the workers the service's; both the trace's SLO and the
    # engine's max_num_seqs / max_waiting as the bound of the limits
    tr = sim.make_trace("long-context", duration=10.0)
    a = pd.pd_autoscale(tr, prefill_replicas=(1, 5), decode_replicas=(2, 7), initial=(2, 3))
    assert (a.prefill_spec.min_replicas, a.prefill_spec.max_replicas) == (1, 5)
    assert (a.decode_spec.min_replicas, a.decode_spec.max_replicas) == (2, 7)
    for s in (a.prefill_spec, a.decode_spec):
        assert (s.slo_ttft_s, s.slo_tpot_s, s.attainment_target) == (3.0, 0.05, 0.9)
    assert a.prefill_bound == a.decode_bound == pd.Limits(64, 256)
    assert (a.initial, a.load_time_s, a.period_s) == ((2, 3), 60.0, 5.0)


def test_pool_hours_count_each_pod_from_creation_to_gone():
    pool = pd._Pool("prefill", None, None, None, 5.0)
    a, b, c = (sim.Replica.__new__(sim.Replica) for _ in range(3))
    a.created, a.gone_at = 0.0, 30.0       # drained at 30: 30 s
    b.created, b.gone_at = 10.0, None      # still there at the end (100): 90 s
    c.created, c.gone_at = 40.0, 250.0     # gone after the end: counted to 100, 60 s
    pool.pods = [a, b, c]
    assert pool.hours(100.0) == pytest.approx((30 + 90 + 60) / 3600)


def test_an_idle_autoscaled_fleet_stays_at_its_minimum():
    # no request: both pools stay at their minimum (1:1), all ready from 0: 2 replicas x 60 s
    tr = trace_of([], [], [], duration=60.0)
    tr.slos = [(3.0, 0.05)]
    r = pd.simulate_pd(tr, HW, 0, 1, LINK, autoscale=pd.pd_autoscale(tr))
    assert (r.prefill_hours, r.decode_hours) == (pytest.approx(60 / 3600), pytest.approx(60 / 3600))
    assert {e[1:] for e in r.timeline} == {(1, 1, 1, 1)}
    assert [e[0] for e in r.timeline] == [5.0 * k for k in range(13)]


def test_autoscaled_fleet_serves_every_request_once_and_loads_its_new_pods():
    h200 = sim.h200_step_time()
    tr = sim.make_trace("long-context", duration=120.0)
    r = pd.simulate_pd(tr, h200, 0, 1, pd.RDMA, threshold=0, autoscale=pd.pd_autoscale(tr, load_time_s=30.0))
    # each request finished once or refused once; while the prefill pool loads, its one pod bounds
    # its queue by its prefill time (rule 18) and the router refuses what it refuses (prefill pods
    # are coming: prefill_deferred) rather than have the decode pod prefill it
    assert len(set(r.finished_ids)) == len(r.finished_ids) == r.finished
    assert r.finished + r.rejected == len(tr) and 0 < r.remote < len(tr) and 0 < r.deferred <= r.rejected
    # one prefill replica cannot carry 3 req/s of ~4k-token prompts: the prefill pool grows; what is
    # ordered at t is ready from t + 30 s, never before
    assert max(e[1] for e in r.timeline) > 1
    for t, p_set, p_ready, d_set, d_ready in r.timeline:
        assert p_ready <= max([q for (u, q, _, _, _) in r.timeline if u <= t - 30.0] or [1]) and d_ready >= 1
    assert r.replica_hours > 2 * 120 / 3600


def test_cli_auto_and_capacity(tmp_path, capsys):
    rc = sim.main(["--pd", "--trace", "long-context", "--duration", "15", "--auto", "--pd-max-n", "3",
                   "--capacity", "1,2", "--pd-sizes", "2", "--pd-links", "rdma", "--pd-thresholds", "0",
                   "--out-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| autoscaled |" in out and "hindsight-best split" in out and "Capacity at attainment 0.9" in out
    auto = json.loads((tmp_path / "pd-auto-long-context-h200.json").read_text())
    assert len(auto["fixed"]) == 3 and set(auto["verdict"]) >= {"goodput_ratio", "hours_ratio", "met"}
    cap = json.loads((tmp_path / "pd-capacity-long-context-h200.json").read_text())
    assert cap["sizes"]["2"]["rates"] == [1.0, 2.0] and set(cap["sizes"]["2"]["capacity"]) == {"colocated", "1:1"}


def test_cli_auto_with_another_seed_writes_its_own_files(tmp_path):
    # seed 0 keeps pd-auto-<trace>-<hardware>; another seed gets -seed<N>, beside it
    rc = sim.main(["--pd", "--trace", "long-context", "--duration", "15", "--auto", "--pd-max-n", "2",
                   "--pd-links", "rdma", "--pd-thresholds", "0", "--seed", "1", "--out-dir", str(tmp_path)])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pd-auto-long-context-h200-seed1.json",
                                                          "pd-auto-long-context-h200-seed1.md"]
    auto = json.loads((tmp_path / "pd-auto-long-context-h200-seed1.json").read_text())
    assert auto["note"].startswith("seed 1,")
    assert "--seed 1" in (tmp_path / "pd-auto-long-context-h200-seed1.md").read_text().splitlines()[0]


def test_a_prefill_pod_that_refuses_leaves_the_prefill_to_the_decode_pod():
    # three 100-token prompts at t = 1 on 1:1, one running and one waiting per pod at most: the
    # prefill pod runs the first, queues the second and refuses the third (429); the router then
    # has the decode pod prefill it itself (its prefill_failed), as with no prefill pod at all
    r = pd.simulate_pd(trace_of([1.0, 1.0, 1.0], [100] * 3, [2] * 3), HW, 1, 1, LINK, threshold=0,
                       max_num_seqs=1, max_waiting=1)
    assert (r.offered, r.finished, r.remote, r.rejected) == (3, 3, 2, 0)
    assert r.decode_prefill_tokens == 100


class FixedOrder:
    """A stand-in for a pool's autoscaler: every tick asks for ``spec`` replicas, no limits."""

    def __init__(self, spec, period_s):
        self.spec, self.reasons = spec, {}

    def tick(self, now, obs):
        return self.spec, None


@pytest.mark.parametrize("defer, rejected, deferred, local_tokens", [(True, 1, 1, 100), (False, 0, 0, 200)])
def test_a_full_prefill_pod_defers_while_more_are_loading(monkeypatch, defer, rejected, deferred, local_tokens):
    # 1:1 at 0, one running and one waiting per pod at most; the tick at 5 s orders a second prefill
    # pod (ready at 65 s). Three 100-token prompts at t = 1: nothing is coming, the prefill pod
    # runs one, queues one and refuses the third, which the decode pod prefills (100 tokens there).
    # Three more at t = 6 (the first three are done by then): the third is refused again, now with
    # a prefill pod coming, so the router defers it (429: rejected, not prefilled on the decode
    # pod); with defer_full=False the decode pod prefills it as before (200 tokens there)
    monkeypatch.setattr(pd, "GoodputPolicy", FixedOrder)
    auto = pd.PDAutoscale(prefill_spec=2, decode_spec=1, initial=(1, 1), load_time_s=60.0, period_s=5.0)
    tr = trace_of([1.0] * 3 + [6.0] * 3, [100] * 6, [2] * 6)
    r = pd.simulate_pd(tr, HW, 0, 1, LINK, threshold=0, max_num_seqs=1, max_waiting=1, autoscale=auto,
                       defer_full=defer)
    assert (r.offered, r.rejected, r.deferred, r.remote) == (6, rejected, deferred, 4)
    assert r.finished == 6 - rejected and r.decode_prefill_tokens == local_tokens
    assert r.timeline[1][1:3] == (2, 1)    # at 5 s: 2 prefill pods ordered, 1 ready


def test_refine_capacity_bisects_inside_the_sweep_step(monkeypatch):
    # attainment falls linearly from 1.0 at 2 req/s to 0.8 at 2.5: it is 0.9 at 2.25. Bisecting
    # [2, 2.5] to 0.05: 2.25 (0.9, sustains) -> 2.375 (0.85) -> 2.3125 (0.875) -> 2.28125 (0.8875):
    # [2.25, 2.28125], each midpoint's trace made at its rate with the sweep's seed
    made = []

    def fake_trace(name, seed, hardware, duration, rate):
        made.append((name, seed, rate))
        return rate

    def fake_run(rate, hw, prefill, decode, link=None, *, threshold=0.0, prefill_max_batched_tokens=None):
        assert (prefill, decode) == (3, 1) and threshold == 0.0
        r = pd.PDResult("x", prefill, decode, "rdma", threshold, 1000, 0, 0, 0, 600.0)
        r.slo_met = round(1000 * (1.0 - 0.4 * (rate - 2.0)))
        return r

    monkeypatch.setattr(pd, "make_trace", fake_trace)
    monkeypatch.setattr(pd, "simulate_pd", fake_run)
    lo, hi, runs = pd.refine_capacity("long-context", HW, 3, 1, 2.0, 2.5, tol=0.05, seed=7)
    assert (lo, hi) == (2.25, 2.28125)
    assert [x for x, _ in runs] == [2.25, 2.375, 2.3125, 2.28125]
    assert [r.attainment for _, r in runs] == [0.9, 0.85, 0.875, pytest.approx(0.888, abs=1e-3)]
    assert made == [("long-context", 7, x) for x, _ in runs]


def test_capacity_sweep_stops_a_fleet_at_its_first_miss(monkeypatch):
    # attainment by fleet at rates 1, 2, 3, 4: colocated 1.0, 0.8 (miss at 2), then not run;
    # 1:1 1.0, 0.95, 0.85 (miss at 3), then not run. Capacities as without stopping:
    # colocated 1 + (1.0 - 0.9) / (1.0 - 0.8) = 1.5; 1:1 2 + (0.95 - 0.9) / (0.95 - 0.85) = 2.5
    att = {(0, 2): [1.0, 0.8, 0.7, 0.6], (1, 1): [1.0, 0.95, 0.85, 0.95]}
    ran = []

    def fake_run(rate, hw, prefill, decode, link=None, *, threshold=0.0, **kw):
        ran.append((prefill, decode, rate))
        r = pd.PDResult("x", prefill, decode, "rdma", threshold, 100, 0, 0, 0, 600.0)
        r.slo_met = round(100 * att[(prefill, decode)][int(rate) - 1])
        return r

    monkeypatch.setattr(pd, "make_trace", lambda name, seed, hardware, duration, rate: rate)
    monkeypatch.setattr(pd, "simulate_pd", fake_run)
    c = pd.capacity_sweep("long-context", HW, 2, [1.0, 2.0, 3.0, 4.0], stop_at_miss=True)
    assert sorted(ran) == [(0, 2, 1.0), (0, 2, 2.0), (1, 1, 1.0), (1, 1, 2.0), (1, 1, 3.0)]
    assert [r is None for r in c.colocated] == [False, False, True, True]
    assert [r is None for r in c.splits[(1, 1)]] == [False, False, False, True]
    caps = c.capacities()
    assert caps["colocated"] == (pytest.approx(1.5), True) and caps["1:1"] == (pytest.approx(2.5), True)
    assert c.bracket("colocated") == (1.0, 2.0) and c.bracket("1:1") == (2.0, 3.0)
    table = pd.capacity_table([c], HW, pd.RDMA, 600.0)
    assert "| 4 | - | - |" in table and "| 3 | - | 0.142 / 0.850 |" in table   # 85 met / 600 s


def test_run_fleet_gives_each_pool_its_budget(monkeypatch):
    # colocated: every replica's step budget is budgets.colocated (the hardware's replaced); P/D:
    # the prefill pool's is budgets.prefill, the decode pool keeps the hardware's
    calls = []

    def fake_run(tr, hw, prefill, decode, link=None, *, threshold=0.0, prefill_max_batched_tokens=None):
        calls.append((hw.max_num_batched_tokens, prefill, decode, threshold, prefill_max_batched_tokens))

    monkeypatch.setattr(pd, "simulate_pd", fake_run)
    b = pd.Budgets(colocated=2048, prefill=4096)
    pd.run_fleet(None, HW, 0, 4, pd.RDMA, 0.0, b)
    pd.run_fleet(None, HW, 3, 1, pd.RDMA, 0.0, b)
    pd.run_fleet(None, HW, 0, 4, pd.RDMA, 0.0)
    pd.run_fleet(None, HW, 3, 1, pd.RDMA, 0.0)
    assert calls == [(2048, 0, 4, math.inf, None), (512, 3, 1, 0.0, 4096), (512, 0, 4, math.inf, None),
                     (512, 3, 1, 0.0, None)]
    assert b.label() == "-colocated2048-prefill4096" and pd.Budgets().label() == ""


def test_cli_capacity_bisects(tmp_path):
    rc = sim.main(["--pd", "--trace", "long-context", "--duration", "15", "--capacity", "1,4", "--pd-sizes", "2",
                   "--pd-links", "rdma", "--pd-thresholds", "0", "--capacity-tol", "1", "--out-dir", str(tmp_path)])
    assert rc == 0
    cap = json.loads((tmp_path / "pd-capacity-long-context-h200.json").read_text())["sizes"]["2"]
    for k, v in cap["refined"].items():
        assert v["misses"] - v["sustains"] <= 1.0 and 1.0 <= v["sustains"] < v["misses"] <= 4.0 and v["runs"]
    assert "Bisected" in (tmp_path / "pd-capacity-long-context-h200.md").read_text() or not cap["refined"]


def test_the_decode_pool_holds_while_the_prefill_pool_loads():
    # rule 19 in the simulator: the one prefill pod refuses what it cannot start in time, the decode
    # pod prefills it (the router's prefill_failed, counted as the decode pool's prefill_fallback;
    # a router that does not defer, defer_full=False, as while no prefill pod is Ready at all);
    # the decode pool holds (HoldPrefillStarting) instead of ordering pods for that work, and never
    # orders while prefill pods are loading
    h200 = sim.h200_step_time()
    tr = sim.make_trace("long-context", duration=120.0)
    r = pd.simulate_pd(tr, h200, 0, 1, pd.RDMA, threshold=0, autoscale=pd.pd_autoscale(tr, load_time_s=30.0),
                       defer_full=False)
    assert r.reasons["decode"].get("HoldPrefillStarting", 0) > 0 and r.decode_prefill_tokens > 0
    prev_d = 1
    for t, p_set, p_ready, d_set, d_ready in r.timeline:
        if p_ready < p_set:
            assert d_set <= prev_d
        prev_d = d_set
