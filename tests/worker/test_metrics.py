"""Worker metrics: the contract table of docs/metrics.md (names, types, labels, vLLM aliases)
against a live scrape, values read from the scheduler's stats, SLO accounting, histograms.

The expected table is parsed from docs/metrics.md (the documentation users read), not from
metrics.py, and the exposition is read back with prometheus_client's own text parser.
"""
from __future__ import annotations


import pytest
from goodput.api import worker_metrics as metric_names
from goodput.worker.engine.request import Request
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.scheduler import SchedulerStats
from goodput.api.states import EngineState, FinishReason, RejectReason
from goodput.worker.metrics import WorkerMetrics, slo_met
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO

DOC = REPO / "docs" / "metrics.md"


def doc_table() -> dict[str, tuple[str, set[str], str | None]]:
    """docs/metrics.md's table: family name (as the parser reports it: counters without _total)
    -> (type, labels besides model_name, vLLM alias family or None)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].startswith("`goodput_"):
            continue
        name, typ, labels, _unit, alias, _meaning = cells
        name, alias = name.strip("`"), alias.strip("`") or None
        if typ == "counter":
            name = name.removesuffix("_total")
            alias = alias and alias.removesuffix("_total")
        rows[name] = (typ, {x.strip() for x in labels.split(",") if x.strip()}, alias)
    assert len(rows) >= 20, "the table in docs/metrics.md was not found"
    return rows


STATS = SchedulerStats(
    engine_state=EngineState.BLOCKED, num_running=3, num_waiting=5, num_preempted_waiting=1,
    kv_usage_ratio=0.25, num_blocks=120, num_used_blocks=30, num_cached_blocks=40, block_size=16,
    enable_prefix_caching=True, max_num_seqs=8, max_waiting=16, max_waiting_tokens=9000, admitted_total=20,
    rejected_total={"queue_full": 2, "never_fits": 1, "invalid": 0},
    finished_total={"stop": 7, "length": 4, "abort": 1}, preemptions_total=6,
    prompt_tokens_total=900, generation_tokens_total=300, prefix_cache_queries_total=800,
    prefix_cache_hits_total=320, steps_total=77, batched_tokens_total=1234, spec_decode_drafts_total=10,
    spec_decode_draft_tokens_total=40, spec_decode_accepted_tokens_total=25,
    prefills_total={"local": 11, "remote": 9}, kv_lease_expiries_total=2, num_leases=3, num_leased_blocks=12)


def finished_request(ttft: float | None, tpot: float | None, n_out: int = 3, prompt: int = 4,
                     max_tokens: int = 10, queue: float = 0.0) -> Request:
    """A finished Request with timestamps that give exactly this TTFT and TPOT (arrival at 0)."""
    r = Request("r", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), arrival_time=0.0)
    r.first_scheduled_time = queue
    if ttft is not None:
        for i in range(n_out):
            r.append_output_token(7, ttft + i * (tpot or 0.0))
    r.finished_time = r.token_times[-1] if r.token_times else 1.0
    return r


def parse(m: WorkerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def value(fams, name, **labels):
    for f in fams.values():
        for s in f.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((name, labels))


@pytest.mark.parametrize("aliases", [False, True])
def test_live_scrape_matches_the_documented_contract(aliases):
    table = doc_table()
    m = WorkerMetrics("smollm2", lambda: STATS, vllm_aliases=aliases, max_model_len=64, slo_ttft_s=0.5,
                      slo_tpot_s=0.05)  # the SLO gauges are exported only when the SLOs are set
    m.observe_finished("stop", finished_request(0.1, 0.01))
    fams = parse(m)
    assert {n for n in fams if n.startswith("goodput_")} == set(table)
    want_aliases = {alias for (_, _, alias) in table.values() if alias} if aliases else set()
    assert {n for n in fams if n.startswith("vllm:")} == want_aliases
    for name, (typ, labels, alias) in table.items():
        for fam_name in [name] + ([alias] if aliases and alias else []):
            f = fams[fam_name]
            assert f.type == typ, fam_name
            assert f.samples, fam_name
            for s in f.samples:
                assert s.labels["model_name"] == "smollm2"
                got = set(s.labels) - {"model_name", "le"}
                if fam_name == "vllm:cache_config_info":  # vLLM's own label names
                    assert got == {"block_size", "num_gpu_blocks", "enable_prefix_caching"}
                else:
                    assert got == labels, (fam_name, s.labels)


def test_metric_names_module_agrees_with_the_doc_and_the_enums():
    table = doc_table()
    declared = {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
    assert set(table) == declared
    documented = {name: alias for name, (_, _, alias) in table.items() if alias}
    assert {k: v.removesuffix("_total") if table[k][0] == "counter" else v
            for k, v in metric_names.VLLM_ALIASES.items()} == documented
    assert metric_names.ENGINE_STATES == ("running", "waiting", "rejecting", "blocked")
    assert set(metric_names.REJECT_REASONS) == {r.value for r in RejectReason}
    assert set(metric_names.FINISH_REASONS) == {"stop", "length", "abort"} == {r.value for r in FinishReason}


def test_every_scheduler_counter_is_exported():
    """A counter added to SchedulerStats cannot be left out of /metrics (nor a name left dangling)."""
    from dataclasses import fields
    counters = {f.name for f in fields(SchedulerStats) if f.name.endswith("_total")}
    assert counters == set(metric_names.SCHEDULER_COUNTERS)
    for name, label, _help in metric_names.SCHEDULER_COUNTERS.values():
        assert label is None or label in metric_names.LABEL_VALUES
    # /admin/state shows the same counters, named without _total
    assert STATS.counters()["admitted"] == 20 and STATS.counters()["batched_tokens"] == 1234
    assert set(STATS.counters()) == {c.removesuffix("_total") for c in counters}


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
    assert value(fams, "goodput_admission_max_waiting_tokens") == 9000
    assert value(fams, "goodput_engine_steps_total") == 77
    assert value(fams, "goodput_batched_tokens_total") == 1234
    assert value(fams, "goodput_spec_decode_draft_tokens_total") == 40
    assert value(fams, "goodput_spec_decode_accepted_tokens_total") == 25
    assert value(fams, "goodput_prefills_total", where="remote") == 9
    assert value(fams, "goodput_prefills_total", where="local") == 11
    assert value(fams, "goodput_kv_lease_expiries_total") == 2
    assert value(fams, "goodput_kv_leases") == 3
    assert value(fams, "goodput_kv_leased_blocks") == 12
    assert value(fams, "goodput_cache_config_info", block_size="16", num_blocks="120",
                 enable_prefix_caching="true") == 1


def test_kv_transfer_counters_and_histogram():
    m = WorkerMetrics("m", lambda: STATS)
    m.observe_kv_sent(46080 * 3)
    m.observe_kv_received(46080 * 5, 0.02)
    m.observe_kv_fallback("timeout")
    fams = parse(m)
    assert value(fams, "goodput_kv_transfer_bytes_total", direction="sent") == 138240
    assert value(fams, "goodput_kv_transfer_bytes_total", direction="received") == 230400
    assert value(fams, "goodput_kv_transfer_fallbacks_total", reason="timeout") == 1
    assert value(fams, "goodput_kv_transfer_fallbacks_total", reason="mismatch") == 0
    assert value(fams, "goodput_kv_transfer_seconds_count") == 1
    assert value(fams, "goodput_kv_transfer_seconds_bucket", le="0.025") == 1
    assert value(fams, "goodput_kv_transfer_seconds_bucket", le="0.01") == 0


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


def test_finished_request_histograms_follow_its_timestamps():
    # arrival 0, scheduled 0.25, tokens at 0.5, 0.75, 1.0: prefill 0.25, decode 0.5, inference 0.75
    m = WorkerMetrics("m", lambda: STATS, max_model_len=100)
    m.observe_finished("length", finished_request(0.5, 0.25, n_out=3, prompt=4, max_tokens=3, queue=0.25))
    m.observe_iteration(5)
    m.observe_iteration(1)
    fams = parse(m)
    assert value(fams, "goodput_request_prefill_time_seconds_sum") == 0.25
    assert value(fams, "goodput_request_decode_time_seconds_sum") == 0.5
    assert value(fams, "goodput_request_inference_time_seconds_sum") == 0.75
    assert value(fams, "goodput_e2e_request_latency_seconds_sum") == 1.0
    assert value(fams, "goodput_time_per_output_token_seconds_sum") == 0.25
    assert value(fams, "goodput_request_prompt_tokens_sum") == 4
    assert value(fams, "goodput_request_generation_tokens_sum") == 3
    assert value(fams, "goodput_request_params_max_tokens_sum") == 3
    assert value(fams, "goodput_request_params_n_sum") == 1
    assert value(fams, "goodput_iteration_tokens_sum") == 6
    assert value(fams, "goodput_iteration_tokens_count") == 2
    # 1-2-5 token buckets below max_model_len=100, then 100 itself, then +Inf
    les = [s.labels["le"] for s in fams["goodput_request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]


def test_slo_met_counts_finished_requests_within_both_slos():
    m = WorkerMetrics("m", lambda: STATS, slo_ttft_s=0.5, slo_tpot_s=0.05)
    m.observe_finished("stop", finished_request(0.25, 0.03125))              # met
    m.observe_finished("length", finished_request(0.625, 0.0078125))         # TTFT too slow
    m.observe_finished("length", finished_request(0.125, 0.078125))          # TPOT too slow
    m.observe_finished("length", finished_request(0.125, None, n_out=1))     # one token: TTFT only
    m.observe_finished("abort", finished_request(0.125, 0.0078125))          # aborted never counts
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
    m.observe_iteration(9)
    fams = parse(m)
    assert value(fams, "vllm:num_requests_waiting") == 5
    assert value(fams, "vllm:kv_cache_usage_perc") == 0.25
    assert value(fams, "vllm:prefix_cache_queries_total") == 800
    assert value(fams, "vllm:request_success_total", finished_reason="stop") == 7
    assert value(fams, "vllm:time_to_first_token_seconds_count") == 1
    assert value(fams, "vllm:iteration_tokens_total_sum") == 9
    assert value(fams, "vllm:cache_config_info", num_gpu_blocks="120", enable_prefix_caching="True") == 1
    assert fams["vllm:num_preemptions"].type == "counter"


@pytest.mark.slow
def test_vllm_metrics_test_counts_on_a_live_worker(server_tiny):
    """vLLM's own metrics test, redone against a live worker with --vllm-metric-aliases: after N
    sequential requests of P prompt tokens and M output tokens, the per-request histograms count
    N requests and sum N*P / N*M tokens, and tokens per step sum N*(P + M) over N*M steps (one
    prefill step that samples the first token, M - 1 decode steps). Deltas, as the session's
    server is shared; the prompt is shorter than a block, so no prefix-cache hit shortens it."""
    from server_utils import completion, metric, metrics
    N, P, M = 3, 5, 4
    prompt = [1000 + i for i in range(P)]
    before = metrics(server_tiny.url)
    for _ in range(N):
        body = completion(server_tiny.url, prompt=prompt, max_tokens=M, temperature=0, ignore_eos=True)
        assert body["usage"] == {"prompt_tokens": P, "completion_tokens": M, "total_tokens": P + M}
    after = metrics(server_tiny.url)

    def delta(name):
        return metric(after, name) - metric(before, name)

    expected = {
        "request_prompt_tokens_sum": N * P, "request_prompt_tokens_count": N,
        "request_generation_tokens_sum": N * M, "request_generation_tokens_count": N,
        "request_params_max_tokens_sum": N * M, "request_params_n_count": N,
        "request_queue_time_seconds_count": N, "request_prefill_time_seconds_count": N,
        "request_decode_time_seconds_count": N, "request_inference_time_seconds_count": N,
        "time_to_first_token_seconds_count": N, "e2e_request_latency_seconds_count": N,
        "prompt_tokens_total": N * P, "generation_tokens_total": N * M,
    }
    for suffix, want in expected.items():
        assert delta("vllm:" + suffix) == want, suffix
        assert delta("goodput_" + suffix) == want, suffix
    assert delta("vllm:iteration_tokens_total_sum") == N * (P + M)
    assert delta("vllm:iteration_tokens_total_count") == N * M
    assert delta("goodput_iteration_tokens_count") == N * M
    assert delta("goodput_engine_steps_total") == N * M
    assert delta("goodput_batched_tokens_total") == N * (P + M - 1)  # the last token is never fed back
    assert metric(after, "vllm:cache_config_info", block_size="16", num_gpu_blocks="4",
                  enable_prefix_caching="True") == 1



def test_count_buckets_end_with_max_value():
    cb = metric_names.count_buckets
    # 8192 is no 1-2-5 value: the 1-2-5 bounds below it, then 8192 (prompts of 5001..8192 tokens
    # fall in a finite bucket, +Inf holds no valid prompt)
    assert cb(8192) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 8192)
    assert cb(100) == (1, 2, 5, 10, 20, 50, 100)       # a 1-2-5 value: not repeated
    assert cb(3) == (1, 2, 3)
    assert cb(1) == (1,)
    assert cb(1 << 20)[-3:] == (500000, 1000000, 1048576)
    with pytest.raises(ValueError):
        cb(0)
