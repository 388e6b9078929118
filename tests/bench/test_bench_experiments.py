"""The experiments orchestrator end to end at a tiny scale, with a fake timing server standing in
for the worker (so the harness's plumbing is tested without loading a model): every selected
experiment writes its section, the PNGs exist, and the headline ratios are computed."""
import json
import os
import sys

import pytest

from goodput.bench import experiments
from goodput.bench.__main__ import main as bench_main


def test_experiments_with_fake_server(tmp_path, monkeypatch):
    def fake_cmd(port, model="smollm2", **flags):
        # HOL: a whole-prompt budget makes the fake prefill block decodes more (slower ITL)
        itl = "4" if flags.get("max_num_batched_tokens") == 4096 else "2"
        return [sys.executable, "-m", "goodput.bench.fake_server", "--port", str(port), "--itl-ms", itl]

    monkeypatch.setattr(experiments, "goodput_worker_cmd", fake_cmd)
    only = "1,2,3,4,7"
    if os.path.exists(experiments._trace_path()) if _has_trace() else False:
        only += ",6"
    bench_main(["experiments", "--only", only, "--quick", "--scale", "0.1", "--date", "2000-01-01",
                "--results-dir", str(tmp_path)])
    md = (tmp_path / "2000-01-01-cpu.md").read_text()
    for k in only.split(","):
        assert f"## {k}." in md
    assert "FAILED" not in md, md
    figs = tmp_path / "2000-01-01-cpu"
    for png in ("1-frontier.png", "2-hol-itl.png"):
        assert (figs / png).stat().st_size > 1000
    summary = json.loads((figs / "summary.json").read_text())
    assert summary["hol"]["ratio_off_over_on"] is not None
    assert summary["prefix"]["ratio_off_over_on"] is not None
    assert 0 < summary["static"]["continuous"]["slot_utilization"] <= 1.0
    rows = summary["roofline"]["rows"]
    assert {(r["dtype"], r["batch"]) for r in rows} == {(d, b) for d in ("float32", "bfloat16") for b in (1, 8, 32)}
    # measured steps came from the fake server (ITL 2 ms): the achieved fraction is bound / step
    r32 = next(r for r in rows if r["dtype"] == "bfloat16" and r["batch"] == 32)
    assert r32["achieved_fraction"] == pytest.approx(r32["bound_s"] / r32["measured_step_s"])
    assert "Exact server commands" in md


def _has_trace():
    try:
        experiments._trace_path()
        return True
    except FileNotFoundError:
        return False
