"""Small seeded simulations of goodput.bench.simulate with hand-checkable outcomes.

A round step-time model (a = 10 ms, b = 1 ms per batched token, c = 0) makes latencies exact:
a 100-token prompt is one 512-budget prefill step of 0.01 + 0.100 = 0.110 s (TTFT), each decode
step alone 0.01 + 0.001 = 0.011 s (TPOT).
"""
from __future__ import annotations

import json
import math

import pytest

from goodput.bench import baselines
from goodput.bench import simulate as sim

HW = sim.StepTime("test", a=0.01, b=0.001, c=0.0, num_blocks=2048, block_size=16, max_model_len=4096,
                  max_num_batched_tokens=512)


def one_request_trace(slo):
    return sim.Trace("one", [1.0], [100], [10], [0], [slo], duration=10.0, max_replicas=1,
                     initial_replicas=1)


@pytest.mark.parametrize("slo,met", [
    ((0.115, 0.0115), 1),   # TTFT 0.110 <= 0.115 and TPOT 0.011 <= 0.0115
    ((0.105, 0.0115), 0),   # TTFT 0.110 > 0.105
    ((0.115, 0.0105), 0),   # TPOT 0.011 > 0.0105
])
def test_one_request_latencies_are_exact(slo, met):
    r = sim.simulate(one_request_trace(slo), baselines.StaticPeak(1), HW)
    assert (r.offered, r.finished, r.slo_met, r.rejected) == (1, 1, met, 0)


def test_static_peak_replica_hours_and_under_capacity_attainment():
    # 1 req/s of 100+10 tokens needs 0.11 + 9 * 0.011 = 0.21 s per request: far under capacity
    trace = sim.Trace("light", [float(t) for t in range(1, 120)], [100] * 119, [10] * 119, [0] * 119,
                      [(0.5, 0.05)], duration=120.0, max_replicas=3, initial_replicas=1)
    r = sim.simulate(trace, baselines.StaticPeak(3), HW)
    assert r.replica_hours == pytest.approx(3 * 120.0 / 3600.0)
    assert (r.attainment, r.rejection_rate, r.direction_changes) == (1.0, 0.0, 0)
    assert r.goodput_rps == pytest.approx(119 / 120.0)
    # our policy on the same light trace: never above what it started with, all SLOs met
    g = sim.simulate(trace, sim.make_policy("goodput", trace), HW)
    assert (g.attainment, g.rejected) == (1.0, 0)
    assert max(n for _, n, _ in g.timeline) <= 1


def test_overload_rejections_count_against_attainment():
    # 40 requests at once on one replica with max_waiting 4: the first starts a step at once
    # (running), the next 4 wait, the other 35 get 429 -> rejection rate 35/40, attainment 5/40
    trace = sim.Trace("burst", [1.0] * 40, [100] * 40, [10] * 40, [0] * 40, [(10.0, 1.0)],
                      duration=30.0, max_replicas=1, initial_replicas=1)
    r = sim.simulate(trace, baselines.StaticPeak(1), HW, max_num_seqs=2, max_waiting=4)
    assert (r.rejected, r.finished, r.slo_met) == (35, 5, 5)
    assert r.rejection_rate == pytest.approx(35 / 40)
    assert r.attainment == pytest.approx(5 / 40)


@pytest.mark.parametrize("seq,expected", [
    ([1, 1, 1], 0),
    ([1, 2, 3, 3, 4], 0),
    ([1, 2, 3, 2, 2, 4], 2),       # up, up, down, up
    ([4, 3, 2, 3, 2], 2),
])
def test_direction_changes(seq, expected):
    assert sim.direction_changes(seq) == expected


def test_h200_roofline_numbers():
    hw = sim.h200_step_time()
    # a = 1.5 ms + 70.6 GB / (4.8 TB/s * 0.7); b = 2 * 70.6e9 / (1979e12 * 0.5);
    # c = 2 * 80 * 8 * 128 * 2 B / (4.8e12 * 0.7)
    assert hw.a == pytest.approx(1.5e-3 + 70.6e9 / 3.36e12)
    assert hw.b == pytest.approx(2 * 70.6e9 / 989.5e12)
    assert hw.c == pytest.approx(327680 / 3.36e12)
    assert hw.num_blocks == int((0.9 * 141e9 - 70.6e9) // (327680 * 16))


def test_bursty_policies_small(tmp_path):
    """A 3-minute bursty trace through every policy: invariants, and a scale-up that does not pile
    up pods while the first ones load (load time 30 s, period 5 s)."""
    trace = sim.synthetic_trace("bursty", seed=1, rate=2.0, duration=180.0, prompt_median=64,
                                output_median=16, slo=(1.0, 0.1), max_replicas=6, initial_replicas=1)
    results = {p: sim.simulate(trace, sim.make_policy(p, trace), HW, load_time_s=30.0) for p in sim.POLICIES}
    for name, r in results.items():
        assert r.offered == len(trace)
        assert r.slo_met <= r.finished <= r.offered - r.rejected
        assert 0.0 <= r.attainment <= 1.0 and 0.0 <= r.rejection_rate <= 1.0
        assert all(1 <= n <= trace.max_replicas for _, n, _ in r.timeline), name
    assert results["static-peak"].replica_hours == pytest.approx(6 * 180.0 / 3600.0)
    g = results["goodput"]
    # no pile-up: while any pod is still loading (spec > ready), the spec never grows again
    # unless demand grew past what it was sized for: checked here as "at most one scale-up while
    # loading" on this trace, whose bursts are single steps
    ups_while_loading = sum(1 for (t0, n0, r0), (t1, n1, r1) in zip(g.timeline, g.timeline[1:])
                            if n1 > n0 and n0 > r0)
    assert ups_while_loading <= 1
    assert math.isfinite(g.goodput_rps)


def test_cli_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "r.json"
    rc = sim.main(["--trace", "bursty", "--policies", "static-peak,goodput", "--duration", "20",
                   "--rate", "0.5", "--json", str(out), "--out-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["trace"] == "bursty"
    assert set(data["policies"]) == {"static-peak", "goodput"}
    assert set(data["policies"]["goodput"]) == {"goodput_rps", "attainment", "rejection_rate",
                                                "replica_hours", "direction_changes", "frontier_attainment"}
    # 4 arrivals in 20 s, each served alone by one replica within its SLO: 1 replica suffices
    assert data["hindsight_static"]["replicas"] == 1
    assert data["hindsight_static"]["replica_hours"] == pytest.approx(20.0 / 3600.0, abs=1e-4)
    assert (tmp_path / "bursty-h200.md").read_text().count("| goodput |") == 1
    assert (tmp_path / "bursty-h200.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        sim.main(["--policies", "nope"])


def test_cpu_step_time_from_the_committed_fit():
    hw = sim.cpu_step_time()
    assert hw.a > 0 and hw.b > 0 and hw.c >= 0
    # 1 GiB of SmolLM2-135M bf16 KV (23,040 B/token) in 16-token blocks
    assert hw.num_blocks == (1 << 30) // (23040 * 16)
    trace = sim.Trace("cpu", [1.0, 2.0], [32, 32], [4, 4], [0, 0], [(60.0, 5.0)], duration=30.0,
                      max_replicas=1, initial_replicas=1)
    r = sim.simulate(trace, baselines.StaticPeak(1), hw)
    assert (r.finished, r.slo_met) == (2, 2)


def _fake(n: int, met: int) -> sim.Result:
    return sim.Result(f"static-{n}", 100, met, 0, 100, float(n), 0, 3600.0)


def test_fixed_fleets_hindsight_and_frontier():
    # a one-hour trace, so N replicas spend N replica-hours; attainment 0.5, 0.9, 1.0 for 1, 2, 3
    trace = sim.Trace("t", [], [], [], [], [(1.0, 0.1)], duration=3600.0, max_replicas=3, initial_replicas=1)
    ff = sim.FixedFleets(trace, HW, 60.0, {1: _fake(1, 50), 2: _fake(2, 90), 3: _fake(3, 100)})
    assert ff.hindsight(0.85) == 2          # 1 -> 0.5 < 0.85, 2 -> 0.9
    assert ff.hindsight(0.95) == 3
    assert ff.hindsight(0.9) == 2
    assert ff.hindsight(1.01) is None       # even 3 replicas miss it
    assert ff.frontier(1.25) == pytest.approx(0.5 + (0.9 - 0.5) * 0.25)   # 0.6
    assert ff.frontier(2.0) == pytest.approx(0.9)
    assert ff.frontier(0.5) == pytest.approx(0.25)    # between 0 replicas (0) and 1 (0.5)
    assert ff.frontier(3.5) == pytest.approx(1.0)     # past max_replicas: its attainment


def test_steady_trace_is_constant_rate_poisson():
    t = sim.make_trace("steady")
    # 5 req/s for 1800 s: 9000 expected arrivals, Poisson sd sqrt(9000) = 95
    assert t.duration == 1800.0 and t.initial_replicas == 2
    assert abs(len(t) - 9000) < 4 * 95
    # constant rate: each third of the trace holds a third of the arrivals (sd sqrt(3000) = 55)
    for k in range(3):
        n = sum(1 for x in t.t if 600 * k <= x < 600 * (k + 1))
        assert abs(n - 3000) < 4 * 55
    assert t.slos == [(1.0, 0.15)]


def test_mean_replicas_over_a_window():
    # 2 replicas from 0, 1 from 300 s, 3 from 900 s; over [600, 1200]: (300 * 1 + 300 * 3) / 600 = 2
    timeline = [(0.0, 2, 2), (300.0, 1, 1), (900.0, 3, 1)]
    assert sim.mean_replicas(timeline, 600.0, 1200.0) == pytest.approx(2.0)
    # over [0, 600]: (300 * 2 + 300 * 1) / 600 = 1.5
    assert sim.mean_replicas(timeline, 0.0, 600.0) == pytest.approx(1.5)
    assert sim.mean_replicas(timeline, 600.0, 600.0) == 0.0


def test_metric_noise_keeps_observations_consistent():
    import random

    from goodput.autoscaler.policy import HistogramDelta, PodObservation
    h = HistogramDelta((0.1, math.inf), (5.0, 10.0), 10.0, 1.0)
    p = PodObservation("a", 10, 2, 0.99, 64, 100, 5.0, 20.0, 10.0, 10.0, 0.0, 0.0, 0.0, 1000.0, h, h,
                       queue=h, prompt_tokens=5000.0)
    assert sim.noisy(p, random.Random(0), 0.0) is p
    rng = random.Random(1)
    for _ in range(200):
        q = sim.noisy(p, rng, 0.05)
        assert q.slo_met <= q.finished and 0.0 <= q.kv_usage <= 1.0 and q.running >= 0
        assert q.ttft.counts == h.counts and q.ttft.count == h.count    # bucket counts stay exact
    # the relative error's sd over many draws is about 0.05 (admitted: 20 * (1 + N(0, 0.05)))
    xs = [sim.noisy(p, rng, 0.05).admitted / 20.0 - 1.0 for _ in range(2000)]
    sd = math.sqrt(sum(x * x for x in xs) / len(xs))
    assert 0.045 < sd < 0.055
