"""The load generator's metric math on hand-made timelines (values computed by hand below)."""
import math

import pytest
from goodput.bench.metrics import (
    CANCELLED,
    ERROR,
    OK,
    REJECTED,
    RequestRecord,
    check_consistency,
    itl_timeline,
    percentile,
    summarize,
)
from goodput.bench.workloads import gamma_times, parse_range, read_azure_trace


def rec(rid, send, tokens, end, cls="default", status=OK, usage=None, prompt=10):
    return RequestRecord(request_id=rid, cls=cls, prompt_tokens=prompt, send_time=send, token_times=list(tokens),
                         end_time=end, status=status, usage_completion_tokens=usage)


def test_per_request_formulas():
    # sent at 1.0; tokens at 1.5, 1.6, 1.8, 2.1; finished at 2.2
    r = rec("a", 1.0, [1.5, 1.6, 1.8, 2.1], 2.2)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.2)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    # TPOT = (E2E - TTFT) / (n - 1) = (1.2 - 0.5) / 3
    assert r.tpot == pytest.approx(0.7 / 3)
    assert r.n_out == 4
    assert check_consistency(r) == []


def test_single_token_has_no_tpot_and_meets_tpot_slo():
    r = rec("a", 0.0, [0.3], 0.31)
    assert r.tpot is None and r.itls == []
    assert r.meets_slo(0.5, 0.001)
    assert not r.meets_slo(0.2, None)


def test_percentile_linear_interpolation():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]  # sorted 1..5
    assert percentile(xs, 50) == 3.0
    # rank (5-1)*0.9 = 3.6 -> 4 + 0.6*(5-4)
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summary_counts_throughput_goodput():
    recs = [
        # ok, ttft 0.2, tpot (1.0-0.2)/4 = 0.2 -> meets (0.5, 0.25)
        rec("a", 0.0, [0.2, 0.4, 0.6, 0.8, 1.0], 1.0, cls="short"),
        # ok, ttft 1.0 -> misses TTFT SLO; 3 tokens, tpot (2.0-1.0)/2 = 0.5
        rec("b", 0.0, [1.0, 1.5, 2.0], 2.0, cls="long", prompt=100),
        # ok, ttft 0.1, 2 tokens tpot (0.5-0.1)/1 = 0.4 -> misses TPOT SLO
        rec("c", 1.0, [1.1, 1.5], 1.5, cls="short"),
        rec("d", 2.0, [], 2.01, cls="short", status=REJECTED),
        rec("e", 3.0, [], 3.5, cls="short", status=ERROR),
        rec("f", 3.0, [3.2], 4.0, cls="short", status=CANCELLED),
    ]
    s = summarize(recs, slo_ttft_s=0.5, slo_tpot_s=0.25)
    c = s["counts"]
    assert c == {"sent": 6, "ok": 3, "rejected": 1, "errors": 1, "cancelled": 1, "admitted": 5, "slo_met": 1}
    assert s["duration_s"] == pytest.approx(4.0)  # first send 0.0 .. last end 4.0
    assert s["request_throughput_rps"] == pytest.approx(3 / 4)
    assert s["output_tokens"] == 10
    assert s["output_token_throughput"] == pytest.approx(10 / 4)
    assert s["total_token_throughput"] == pytest.approx((10 + 10 + 100 + 10) / 4)
    assert s["goodput_rps"] == pytest.approx(1 / 4)
    assert s["slo_attainment"] == pytest.approx(1 / 6)
    assert s["rates"]["rejection_rate"] == pytest.approx(1 / 6)
    assert s["offered_rps"] == pytest.approx(5 / 3)  # sends at 0, 0, 1, 2, 3, 3
    # TTFTs of ok requests: 0.1, 0.2, 1.0
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["ttft_s"]["p90"] == pytest.approx(0.2 + 0.8 * 0.8)
    # ITLs pooled: a: 0.2 x4, b: 0.5 x2, c: 0.4 -> 7 gaps
    assert s["itl_s"]["n"] == 7
    assert s["itl_s"]["p50"] == pytest.approx(0.2)
    assert s["itl_s"]["max"] == pytest.approx(0.5)
    assert s["tpot_s"]["mean"] == pytest.approx((0.2 + 0.5 + 0.4) / 3)
    # per class: short = a, c (+ d, e, f), long = b
    assert set(s["classes"]) == {"short", "long"}
    assert s["classes"]["long"]["ttft_s"]["p50"] == pytest.approx(1.0)
    assert s["classes"]["short"]["counts"]["ok"] == 2


def test_consistency_catches_bad_timelines():
    assert "TTFT > E2E" in check_consistency(rec("a", 0.0, [0.5], 0.4))
    assert any("ITL count" in e or "usage" in e for e in check_consistency(rec("a", 0.0, [0.1, 0.2], 0.3, usage=3)))
    assert "token times not monotonic" in check_consistency(rec("a", 0.0, [0.2, 0.1], 0.3))
    assert check_consistency(rec("a", 0.0, [], 0.3, status=REJECTED)) == []


def test_itl_timeline_relative_to_start():
    pts = itl_timeline([rec("a", 10.0, [10.5, 10.7, 11.0], 11.0), rec("b", 10.0, [10.6, 10.65], 10.7)], t0=10.0)
    assert [round(t, 6) for t, _ in pts] == [0.65, 0.7, 1.0]
    assert [round(g, 6) for _, g in pts] == [0.05, 0.2, 0.3]


def test_gamma_arrivals_mean_rate_and_burstiness():
    # mean gap must be 1/rate; cv of the gaps must match the requested cv (law of large numbers)
    for cv in (1.0, 3.0):
        t = gamma_times(20000, rate=4.0, cv=cv, seed=1)
        gaps = [b - a for a, b in zip(t, t[1:])]
        m = sum(gaps) / len(gaps)
        sd = math.sqrt(sum((g - m) ** 2 for g in gaps) / len(gaps))
        assert m == pytest.approx(0.25, rel=0.05)
        assert sd / m == pytest.approx(cv, rel=0.1)
    assert gamma_times(5, 1.0, seed=3) == gamma_times(5, 1.0, seed=3)
    with pytest.raises(ValueError):
        gamma_times(3, 0.0)


def test_parse_range():
    assert parse_range("16:256") == (16, 256)
    assert parse_range("64") == (64, 64)
    for bad in ("0", "5:4", "1:2:3", "x"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_azure_trace_reader(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:17:04.0319600,3180,8\n"
                 "2023-11-16 18:17:03.9799600,4808,10\n"
                 "2023-11-16 18:17:05.4799600,110,27\n")
    rows = read_azure_trace(str(p))
    assert [r.prompt_tokens for r in rows] == [4808, 3180, 110]
    assert [round(r.t, 4) for r in rows] == [0.0, 0.052, 1.5]


def test_mean_active_and_window_itls():
    from goodput.bench.metrics import mean_active, window_itls
    # a decodes over [1, 3], b over [2, 6]; window [0, 4]: (2 + 2) / 4 = 1.0
    a = rec("a", 0.0, [1.0, 2.0, 3.0], 3.0, cls="short")
    b = rec("b", 0.5, [2.0, 5.0, 6.0], 6.0, cls="long")
    assert mean_active([a, b], 0.0, 4.0) == pytest.approx(1.0)
    # from send: a [0, 3], b [0.5, 4] -> (3 + 3.5) / 4
    assert mean_active([a, b], 0.0, 4.0, from_first_token=False) == pytest.approx(6.5 / 4)
    assert sorted(window_itls([a, b], 2.5, 5.5)) == pytest.approx([1.0, 3.0])
    assert window_itls([a, b], 2.5, 5.5, cls="short") == pytest.approx([1.0])
    with pytest.raises(ValueError):
        mean_active([a], 1.0, 1.0)


def test_pyspy_summary_self_and_inclusive(tmp_path):
    from goodput.bench.experiments import summarize_pyspy
    p = tmp_path / "raw.txt"
    # 10 samples: 6 in linear under forward, 3 in attention under forward, 1 idle in select
    p.write_text("step (worker/llm_engine.py:10);forward (worker/model/llama.py:20);linear (torch/f.py:5) 6\n"
                 "step (worker/llm_engine.py:10);forward (worker/model/llama.py:21);attn (worker/a.py:7) 3\n"
                 "select (selectors.py:468) 1\n")
    md = summarize_pyspy(str(p))
    assert md.startswith("10 samples")
    assert "| 60.0 | `linear (torch/f.py:5)` |" in md
    # inclusive per function: forward's two lines merge into 90 %
    assert "| 90.0 | `forward (worker/model/llama.py)` |" in md
    assert "| 30.0 | `attn (worker/a.py)` |" in md


def test_targets_table_marks_met_and_missed():
    from goodput.bench.experiments import targets_section
    md = targets_section({"side_by_side": {"varying (x)": {"32": {"ours": 100.0, "llama.cpp": 40.0, "HF static": 80.0},
                                                          "1": {"ours": 10.0, "llama.cpp": 30.0}}},
                          "hol": {"ratio_off_over_on": 6.0}})
    assert "| C=32 ours / llama.cpp (varying lengths) | 2.50× | >= 2x | met |" in md
    assert "| C=32 ours / HF static (varying lengths) | 1.25× | >= 1.5x | **missed** |" in md
    assert "| C=1 ours / llama.cpp | 0.33× | >= 0.5x | **missed** |" in md
    assert "| prefix cache: TTFT p50 off / on | not measured |" in md
