"""The simulator's SLO classes: each request judged by its own class and counted per class as the
worker exports it, and the policy handed the classes as the loop reads them from spec.slo.classes.
Latencies exact with the round step-time model of test_bench_simulate (a 100-token prompt: TTFT
0.110 s; decodes alone: TPOT 0.011 s)."""
from __future__ import annotations

from goodput.api.policy import SloClass
from goodput.bench import baselines
from goodput.bench import simulate as sim

from test_bench_simulate import HW


def test_each_request_counted_in_its_own_class():
    # two requests far apart (each alone: TTFT 0.110 s, TPOT 0.011 s); class "strict" (TTFT 0.1 s)
    # misses, class "loose" (TTFT 1 s, TPOT 20 ms) meets
    trace = sim.Trace("two", [1.0, 5.0], [100, 100], [10, 10], [0, 1], [(0.1, 0.02), (1.0, 0.02)],
                      duration=10.0, max_replicas=1, initial_replicas=1, class_names=["strict", "loose"])
    pol = baselines.StaticPeak(1)
    r = sim.simulate(trace, pol, HW)
    assert (r.finished, r.slo_met) == (2, 1)
    spec = sim.default_goodput_spec(trace)
    # the default class at the strictest SLO, each named class declared (as spec.slo.classes)
    assert (spec.slo_ttft_s, spec.slo_tpot_s) == (0.1, 0.02)
    assert spec.slo_classes == (SloClass("strict", 0.1, 0.02), SloClass("loose", 1.0, 0.02))


def test_a_replica_exports_the_per_class_counters():
    cfg = sim.EngineConfig(num_blocks=64, max_model_len=256, block_size=16, max_num_seqs=4,
                           max_num_batched_tokens=512, max_waiting=8)
    r = sim.Replica("p", 0.0, 0.0, cfg, [(0.1, 0.02), (1.0, 0.2)], class_names=["strict", "loose"])
    r.by_class["strict"] = [3, 2]
    r.by_class["loose"] = [5, 5]
    s = r.sample(1.0)
    assert {k: v for k, v in s.counters.items() if k.startswith("class_")} == {
        "class_finished:strict": 3, "class_finished:loose": 5, "class_tpot_met:strict": 2, "class_tpot_met:loose": 5}
    # a trace without named classes: nothing per class, the policy reads the histograms
    plain = sim.Replica("q", 0.0, 0.0, cfg, [(1.0, 0.1)])
    assert not any(k.startswith("class_") for k in plain.sample(1.0).counters)
    assert sim.default_goodput_spec(sim.make_trace("bursty")).slo_classes == ()
    assert [c.name for c in sim.default_goodput_spec(sim.make_trace("two-class")).slo_classes] == \
        ["interactive", "batch"]


def test_each_request_carries_its_class_band_and_a_strict_one_goes_first():
    """One replica, one slot: A (strict) runs 0-0.209 s; B (loose, TTFT 1 s) arrives at 0.01, C
    (strict, TTFT 0.35 s) at 0.02. By band C runs next: prefill 0.209-0.319 (TTFT 0.299), then B
    0.418-0.528 (TTFT 0.518): all three meet. First come first served would start C at 0.418
    (TTFT 0.508): a miss."""
    trace = sim.Trace("two", [0.0, 0.01, 0.02], [100, 100, 100], [10, 10, 10], [0, 1, 0],
                      [(0.35, 0.02), (1.0, 0.02)], duration=5.0, max_replicas=1, initial_replicas=1,
                      class_names=["strict", "loose"])
    assert trace.ranks() == [0, 1]
    r = sim.simulate(trace, baselines.StaticPeak(1), HW, max_num_seqs=1)
    assert (r.finished, r.slo_met) == (3, 3)
    plain = sim.Trace("one", [0.0, 0.01, 0.02], [100, 100, 100], [10, 10, 10], [0, 0, 0], [(0.35, 0.02)],
                      duration=5.0, max_replicas=1, initial_replicas=1)
    assert plain.ranks() == [0]
    assert (sim.simulate(plain, baselines.StaticPeak(1), HW, max_num_seqs=1).slo_met) == 2   # FCFS: C misses
    assert sim.make_trace("two-class").ranks() == [0, 1]
