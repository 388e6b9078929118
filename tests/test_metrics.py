"""Worker metrics: DESIGN.md's table (names, types, labels), SLO accounting, vLLM aliases.

The expected table below is copied from DESIGN.md's "Metrics contract", not from metrics.py, and
the exposition is read back with prometheus_client's own text parser.
"""
from __future__ import annotations

from goodput.worker.metrics import EngineStats, WorkerMetrics, slo_met
from prometheus_client.parser import text_string_to_metric_families

# DESIGN.md: name (as the parser reports it, i.e. counters without _total) -> (type, extra labels)
DESIGN_TABLE = {
    "goodput_requests_running": ("gauge", set()),
    "goodput_requests_waiting": ("gauge", set()),
    "goodput_kv_cache_usage_ratio": ("gauge", set()),
    "goodput_kv_cache_blocks": ("gauge", set()),
    "goodput_engine_state": ("gauge", {"state"}),
    "goodput_admission_max_num_seqs": ("gauge", set()),
    "goodput_admission_max_waiting": ("gauge", set()),
    "goodput_requests_admitted": ("counter", set()),
    "goodput_requests_rejected": ("counter", {"reason"}),
    "goodput_requests_finished": ("counter", {"finished_reason"}),
    "goodput_requests_slo_met": ("counter", set()),
    "goodput_prompt_tokens": ("counter", set()),
    "goodput_generation_tokens": ("counter", set()),
    "goodput_prefix_cache_queries": ("counter", set()),
    "goodput_prefix_cache_hits": ("counter", set()),
    "goodput_preemptions": ("counter", set()),
    "goodput_time_to_first_token_seconds": ("histogram", set()),
    "goodput_inter_token_latency_seconds": ("histogram", set()),
    "goodput_time_per_output_token_seconds": ("histogram", set()),
    "goodput_e2e_request_latency_seconds": ("histogram", set()),
    "goodput_request_queue_time_seconds": ("histogram", set()),
}
VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_success",
}

STATS = EngineStats(engine_state="blocked", running=3, waiting=5, kv_blocks_used=30,
                    kv_blocks_total=120, max_num_seqs=8, max_waiting=16, admitted=20,
                    rejected={"queue_full": 2, "never_fits": 1}, finished={"stop": 7, "length": 4,
                                                                           "abort": 1},
                    prompt_tokens=900, generation_tokens=300, prefix_cache_queries=800,
                    prefix_cache_hits=320, preemptions=6)


def parse(m: WorkerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def value(fams, name, **labels):
    for f in fams.values():
        for s in f.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((name, labels))


def test_names_types_and_labels_follow_design_table():
    m = WorkerMetrics("smollm2", lambda: STATS)
    fams = parse(m)
    goodput = {n for n in fams if n.startswith("goodput_")}
    assert goodput == set(DESIGN_TABLE)
    assert not any(n.startswith("vllm:") for n in fams)
    for name, (typ, extra) in DESIGN_TABLE.items():
        f = fams[name]
        assert f.type == typ, name
        for s in f.samples:
            assert s.labels["model_name"] == "smollm2"
            assert set(s.labels) - {"model_name", "le"} == extra, (name, s.labels)


def test_values_come_from_the_stats_snapshot():
    fams = parse(WorkerMetrics("m", lambda: STATS))
    assert value(fams, "goodput_requests_running") == 3
    assert value(fams, "goodput_requests_waiting") == 5
    assert value(fams, "goodput_kv_cache_usage_ratio") == 0.25
    assert value(fams, "goodput_kv_cache_blocks") == 120
    states = {s.labels["state"]: s.value for s in fams["goodput_engine_state"].samples}
    assert states == {"running": 0, "waiting": 0, "rejecting": 0, "blocked": 1}
    assert value(fams, "goodput_requests_rejected_total", reason="queue_full") == 2
    assert value(fams, "goodput_requests_rejected_total", reason="invalid") == 0
    assert value(fams, "goodput_requests_finished_total", finished_reason="abort") == 1
    assert value(fams, "goodput_prefix_cache_hits_total") == 320
    assert value(fams, "goodput_preemptions_total") == 6
    assert value(fams, "goodput_admission_max_waiting") == 16


def test_histograms_bucket_observations():
    m = WorkerMetrics("m", lambda: STATS)
    m.observe_first_token(0.04, 0.01)
    m.observe_first_token(0.4, 0.3)
    m.observe_itl([0.02, 0.02, 0.6])
    fams = parse(m)
    assert value(fams, "goodput_time_to_first_token_seconds_count") == 2
    assert value(fams, "goodput_time_to_first_token_seconds_bucket", le="0.05") == 1
    assert value(fams, "goodput_time_to_first_token_seconds_bucket", le="0.5") == 2
    assert abs(value(fams, "goodput_time_to_first_token_seconds_sum") - 0.44) < 1e-9
    assert value(fams, "goodput_inter_token_latency_seconds_bucket", le="0.02") == 2
    assert value(fams, "goodput_inter_token_latency_seconds_count") == 3
    assert value(fams, "goodput_request_queue_time_seconds_bucket", le="0.01") == 1


def test_slo_met_counts_finished_requests_within_both_slos():
    m = WorkerMetrics("m", lambda: STATS, slo_ttft_s=0.5, slo_tpot_s=0.05)
    m.observe_finished("stop", ttft_s=0.2, tpot_s=0.04, e2e_s=1.0)     # met
    m.observe_finished("length", ttft_s=0.6, tpot_s=0.01, e2e_s=1.0)   # TTFT too slow
    m.observe_finished("length", ttft_s=0.1, tpot_s=0.08, e2e_s=1.0)   # TPOT too slow
    m.observe_finished("length", ttft_s=0.1, tpot_s=None, e2e_s=0.1)   # one token: TTFT only
    m.observe_finished("abort", ttft_s=0.1, tpot_s=0.01, e2e_s=0.3)    # aborted never counts
    fams = parse(m)
    assert value(fams, "goodput_requests_slo_met_total") == 2
    assert value(fams, "goodput_e2e_request_latency_seconds_count") == 5
    assert value(fams, "goodput_time_per_output_token_seconds_count") == 4
    # the thresholds themselves, for the dashboards' SLO lines
    assert fams["goodput_slo_ttft_seconds"].type == "gauge"
    assert value(fams, "goodput_slo_ttft_seconds", model_name="m") == 0.5
    assert value(fams, "goodput_slo_tpot_seconds", model_name="m") == 0.05


def test_slo_gauges_only_for_the_slos_that_are_set():
    fams = parse(WorkerMetrics("m", lambda: STATS, slo_ttft_s=0.25))
    assert value(fams, "goodput_slo_ttft_seconds") == 0.25
    assert "goodput_slo_tpot_seconds" not in fams


def test_slo_rule():
    assert slo_met(1.0, 1.0, None, None)
    assert not slo_met(None, None, 0.1, None)
    assert slo_met(0.1, None, 0.1, 0.01)


def test_vllm_aliases_export_the_same_values():
    m = WorkerMetrics("m", lambda: STATS, vllm_aliases=True)
    m.observe_first_token(0.04, 0.01)
    fams = parse(m)
    assert VLLM_NAMES <= set(fams)
    assert value(fams, "vllm:num_requests_waiting") == 5
    assert value(fams, "vllm:kv_cache_usage_perc") == 0.25
    assert value(fams, "vllm:prefix_cache_queries_total") == 800
    assert value(fams, "vllm:request_success_total", finished_reason="stop") == 7
    assert value(fams, "vllm:time_to_first_token_seconds_count") == 1
    assert fams["vllm:num_preemptions"].type == "counter"
