"""observe.py against the text a REAL worker registry renders (goodput.worker.metrics.WorkerMetrics,
no model needed), with the expected deltas computed by hand from the activity fed in."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from goodput.autoscaler import observe
from goodput.autoscaler.observe import MetricsParseError, observation, parse_sample
from goodput.api.worker_metrics import TIME_PER_OUTPUT_TOKEN, TIME_TO_FIRST_TOKEN, TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS
from goodput.worker.engine.scheduler import SchedulerStats
from goodput.api.states import EngineState
from goodput.worker.metrics import WorkerMetrics

SLO_TTFT_S, SLO_TPOT_S = 0.5, 0.05


def stats(running=0, waiting=0, used=0, blocks=10, max_num_seqs=8, max_waiting=16, admitted=0, rejected=None,
          finished=None, generation_tokens=0, preemptions=0) -> SchedulerStats:
    """A scheduler snapshot with the values the test names (the rest zero)."""
    return SchedulerStats(
        engine_state=EngineState.RUNNING, num_running=running, num_waiting=waiting, num_preempted_waiting=0,
        kv_usage_ratio=used / blocks, num_blocks=blocks, num_used_blocks=used, num_cached_blocks=0,
        block_size=16, enable_prefix_caching=True, max_num_seqs=max_num_seqs, max_waiting=max_waiting,
        max_waiting_tokens=0,
        admitted_total=admitted, rejected_total=dict(rejected or {}), finished_total=dict(finished or {}),
        preemptions_total=preemptions, prompt_tokens_total=0, generation_tokens_total=generation_tokens,
        prefix_cache_queries_total=0, prefix_cache_hits_total=0, steps_total=0, batched_tokens_total=0,
        spec_decode_drafts_total=0, spec_decode_draft_tokens_total=0, spec_decode_accepted_tokens_total=0)


def finished_request(ttft: float, tpot: float | None) -> SimpleNamespace:
    """What WorkerMetrics.observe_finished reads of an engine Request (timestamps already differenced)."""
    return SimpleNamespace(ttft=ttft, tpot=tpot, e2e=ttft + 1.0, arrival_time=0.0, prefill_time=ttft,
                           decode_time=1.0, inference_time=ttft + 1.0, num_prompt_tokens=5,
                           num_output_tokens=10, sampling_params=SimpleNamespace(max_tokens=16))


def _worker(aliases: bool = False) -> tuple[WorkerMetrics, dict]:
    holder = {"stats": stats()}
    wm = WorkerMetrics("smollm2", lambda: holder["stats"], slo_ttft_s=SLO_TTFT_S, slo_tpot_s=SLO_TPOT_S,
                       vllm_aliases=aliases)
    return wm, holder


def _finish(wm: WorkerMetrics, reason: str, ttft: float, tpot: float | None, queue: float = 0.0) -> None:
    wm.observe_first_token(ttft, queue_time_s=queue)
    wm.observe_finished(reason, finished_request(ttft, tpot))


def _interval_1(wm: WorkerMetrics, holder: dict) -> None:
    holder["stats"] = stats(
        running=3, waiting=2, used=30, blocks=100, max_num_seqs=8, max_waiting=16,
        admitted=10, rejected={"queue_full": 2, "never_fits": 1, "invalid": 0},
        finished={"stop": 5, "length": 2, "abort": 1}, generation_tokens=700, preemptions=1)
    _finish(wm, "stop", 0.04, 0.02)     # meets both
    _finish(wm, "length", 0.2, 0.06)    # TPOT 60 ms > 50 ms: missed
    _finish(wm, "stop", 1.2, None)      # one token: TTFT alone, 1.2 s > 0.5 s: missed
    _finish(wm, "abort", 0.1, 0.01)     # aborted: never counted as met


def _interval_2(wm: WorkerMetrics, holder: dict) -> None:
    holder["stats"] = stats(
        running=1, waiting=0, used=10, blocks=100, max_num_seqs=6, max_waiting=4,
        admitted=16, rejected={"queue_full": 5, "never_fits": 1, "invalid": 2},
        finished={"stop": 9, "length": 3, "abort": 1}, generation_tokens=1000, preemptions=4)
    _finish(wm, "stop", 0.3, 0.01, queue=0.1)      # met
    _finish(wm, "stop", 0.3, 0.04, queue=0.2)      # met
    _finish(wm, "length", 2.5, 0.2, queue=2.0)     # missed on both (queued 2 s of its 2.5 s TTFT)


def _text(wm: WorkerMetrics) -> str:
    return wm.render().decode()


def test_first_scrape_has_gauges_and_no_rates():
    wm, holder = _worker()
    _interval_1(wm, holder)
    o = observation("pod-a", None, parse_sample(_text(wm), 100.0), age_s=12.0)
    assert (o.name, o.running, o.waiting, o.kv_usage, o.max_num_seqs, o.max_waiting) == ("pod-a", 3, 2, 0.3, 8, 16)
    assert (o.interval_s, o.admitted, o.finished, o.slo_met, o.rejected_429, o.rejected_400, o.preempted,
            o.generation_tokens, o.ttft, o.tpot, o.age_s) == (0.0, 0, 0, 0, 0, 0, 0, 0, None, None, 12.0)


def test_cumulative_sample_from_real_registry():
    wm, holder = _worker()
    _interval_1(wm, holder)
    s = parse_sample(_text(wm), 100.0)
    # finished counts stop + length only (5 + 2); 400s are never_fits + invalid
    assert (s.admitted, s.finished, s.slo_met, s.rejected_429, s.rejected_400, s.preempted,
            s.generation_tokens) == (10, 7, 1, 2, 1, 1, 700)
    assert s.ttft.bounds == TTFT_BUCKETS + (math.inf,)
    assert s.tpot.bounds == TOKEN_LATENCY_BUCKETS + (math.inf,)
    assert s.ttft.count == 4 and s.ttft.sum == pytest.approx(0.04 + 0.2 + 1.2 + 0.1)
    assert s.tpot.count == 3  # the one-token request has no TPOT


def test_deltas_between_two_scrapes_hand_computed():
    wm, holder = _worker()
    _interval_1(wm, holder)
    s1 = parse_sample(_text(wm), 100.0)
    _interval_2(wm, holder)
    s2 = parse_sample(_text(wm), 105.0)
    o = observation("pod-a", s1, s2, age_s=30.0)
    assert o.interval_s == 5.0
    assert (o.running, o.waiting, o.kv_usage, o.max_num_seqs, o.max_waiting) == (1, 0, 0.1, 6, 4)
    assert o.admitted == 6                 # 16 - 10
    assert o.finished == 5                 # (9 + 3) - (5 + 2)
    assert o.slo_met == 2                  # the two 0.3 s / <= 40 ms requests
    assert o.rejected_429 == 3             # 5 - 2
    assert o.rejected_400 == 2             # (1 + 2) - (1 + 0)
    assert o.preempted == 3 and o.generation_tokens == 300
    # TTFT increase: 0.3, 0.3, 2.5
    assert o.ttft.count == 3 and o.ttft.sum == pytest.approx(3.1)
    by_le = dict(zip(o.ttft.bounds, o.ttft.counts))
    assert (by_le[0.2], by_le[0.3], by_le[2.0], by_le[3.0], by_le[math.inf]) == (0, 2, 2, 3, 3)
    assert o.ttft.fraction_le(0.5) == pytest.approx(2 / 3)
    # TPOT increase: 0.01, 0.04, 0.2
    assert o.tpot.count == 3 and o.tpot.sum == pytest.approx(0.25)
    by_le = dict(zip(o.tpot.bounds, o.tpot.counts))
    assert (by_le[0.005], by_le[0.01], by_le[0.04], by_le[0.05], by_le[0.2], by_le[math.inf]) == (0, 1, 2, 2, 3, 3)
    assert o.tpot.fraction_le(SLO_TPOT_S) == pytest.approx(2 / 3)
    # queue-time increase: 0.1, 0.2, 2.0 (interval 1 queued nothing: 4 zeros)
    assert s1.queue.count == 4 and s1.queue.sum == 0
    assert o.queue.count == 3 and o.queue.sum == pytest.approx(2.3)


def test_worker_restart_counts_from_zero():
    wm, holder = _worker()
    _interval_1(wm, holder)
    _interval_2(wm, holder)
    before = parse_sample(_text(wm), 100.0)
    fresh, holder2 = _worker()  # the process restarted: every series starts again at 0
    _interval_1(fresh, holder2)
    after = parse_sample(_text(fresh), 110.0)
    o = observation("pod-a", before, after)
    assert o.interval_s == 10.0
    # the new process' totals are the increase (admitted 16 -> 10 went down)
    assert (o.admitted, o.finished, o.slo_met, o.rejected_429, o.rejected_400, o.preempted,
            o.generation_tokens) == (10, 7, 1, 2, 1, 1, 700)
    assert o.ttft.count == 4 and o.tpot.count == 3
    assert all(c >= 0 for c in o.ttft.counts + o.tpot.counts)


def test_restart_seen_in_a_histogram_alone():
    # counters equal, but the TTFT histogram went down: still a restart (no negative bucket counts)
    wm, holder = _worker()
    _interval_1(wm, holder)
    _interval_2(wm, holder)
    before = parse_sample(_text(wm), 0.0)
    fresh, holder2 = _worker()
    holder2["stats"] = holder["stats"]
    _finish(fresh, "stop", 0.3, 0.01)
    o = observation("p", before, parse_sample(_text(fresh), 1.0))
    assert o.ttft.count == 1 and o.admitted == 16


def test_vllm_aliases_do_not_change_the_sample():
    a, ha = _worker(aliases=False)
    b, hb = _worker(aliases=True)
    for wm, h in ((a, ha), (b, hb)):
        _interval_1(wm, h)
    assert "vllm:num_requests_running" in _text(b)
    assert parse_sample(_text(a), 1.0) == parse_sample(_text(b), 1.0)


def test_not_a_goodput_worker_names_the_missing_metrics():
    with pytest.raises(MetricsParseError, match="missing metrics: .*goodput_requests_admitted_total"):
        parse_sample("# TYPE up gauge\nup 1\n", 0.0)
    wm, holder = _worker()
    text = "\n".join(line for line in _text(wm).splitlines() if not line.startswith(TIME_TO_FIRST_TOKEN))
    with pytest.raises(MetricsParseError, match=f"{TIME_TO_FIRST_TOKEN}_bucket"):
        parse_sample(text + "\n", 0.0)
    assert TIME_PER_OUTPUT_TOKEN in text


def test_garbage_is_a_parse_error():
    with pytest.raises(MetricsParseError):
        parse_sample("<html>502 Bad Gateway</html>\n", 0.0)


def test_simulator_builds_its_observations_from_the_same_table_and_delta():
    """The simulator (goodput.bench.simulate) reads its replicas as the loop reads a scrape: the
    fields of observe's table, turned into a PodObservation by observe.observation."""
    from goodput.bench.simulate import Replica
    from goodput.worker.engine.config import EngineConfig

    r = Replica("r0", created=0.0, ready_at=30.0, cfg=EngineConfig(num_blocks=64, max_model_len=256), slos=[(1.0, 0.1)])
    s = r.sample(31.0)
    assert set(s.gauges) == set(observe.GAUGES) and set(s.counters) == set(observe.COUNTERS)
    assert set(s.histograms) == set(observe.HISTOGRAMS)
    first = r.observe(35.0)
    assert (first.interval_s, first.admitted, first.ttft, first.load_s, first.age_s) == (0.0, 0.0, None, 30.0, 5.0)
    second = r.observe(40.0)
    assert second.interval_s == 5.0 and second.ttft is not None and second.ttft.count == 0
