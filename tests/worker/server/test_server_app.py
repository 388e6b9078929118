"""The FastAPI app in-process (no model): loading/ready/health life cycle and a failed load.

The engine factory builds an LLMEngine over the real scheduler with the counting fake runner of
tests/fake_engine.py (the token after t is t+1), so expected texts are known by hand.
"""
from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from goodput.worker.engine_args import EngineArgs
from goodput.worker.server.app import create_app
from fake_engine import TextByteTokenizer, make_engine


def test_loading_then_ready_then_serving():
    release = threading.Event()

    def factory(args):
        assert release.wait(30)
        eng = make_engine()
        eng.tokenizer = TextByteTokenizer()
        return eng

    app = create_app(EngineArgs(model="fake", served_model_name="fake"), engine_factory=factory,
                     admin_token="")
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "loading"}
        assert client.get("/ready").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "service_unavailable"
        assert client.get("/metrics").status_code == 503
        release.set()
        for _ in range(300):
            if client.get("/ready").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert client.get("/health").json()["status"] == "ok"
        body = client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 3,
                                                    "stop": "d"}).json()
        assert body["choices"][0]["text"] == "bc" and body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
        # an empty admin token counts as unset: writes are refused with 403
        assert client.put("/admin/limits", json={"max_num_seqs": 1}).status_code == 403
        assert 'goodput_requests_finished_total{finished_reason="stop",model_name="fake"} 1.0' \
            in client.get("/metrics").text


def test_failed_load_is_unhealthy():
    def factory(args):
        raise FileNotFoundError("no such model: nothing.gguf")

    app = create_app(EngineArgs(model="nothing.gguf"), engine_factory=factory)
    with TestClient(app) as client:
        for _ in range(100):
            if client.get("/health").status_code == 503:
                break
            threading.Event().wait(0.05)
        r = client.get("/health")
        assert r.status_code == 503 and "nothing.gguf" in r.json()["error"]
        assert client.get("/ready").status_code == 503
        err = client.post("/v1/completions", json={"prompt": "a"}).json()["error"]
        assert "failed to load" in err["message"]
        assert client.get("/v1/models").json()["data"][0]["id"] == "nothing"


def test_cli_flags_and_sizes():
    import pytest

    from goodput.worker.cli import build_parser, engine_args_from

    ns = build_parser().parse_args([
        "serve", "--model", "/models/x.gguf", "--dtype", "float32", "--device", "cpu",
        "--kv-cache-memory", "256MiB", "--block-size", "32", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "128", "--max-model-len", "1024", "--max-waiting", "0",
        "--no-enable-prefix-caching", "--scheduling-policy", "static", "--slo-ttft-ms", "500",
        "--slo-tpot-ms", "50", "--vllm-metric-aliases", "--attention-backend", "torch",
        "--revision", "r1", "--log-level", "debug"])
    a = engine_args_from(ns)
    assert (a.model_name, a.dtype, a.kv_cache_memory, a.block_size, a.max_num_seqs) == \
        ("x", "float32", 256 * 2**20, 32, 8)
    assert (a.max_num_batched_tokens, a.max_model_len, a.max_waiting, a.enable_prefix_caching) == \
        (128, 1024, 0, False)
    assert (a.scheduling_policy, a.slo_ttft_ms, a.slo_tpot_ms, a.vllm_metric_aliases) == \
        ("static", 500.0, 50.0, True)
    assert (a.attention_backend, a.revision) == ("torch", "r1")
    d = engine_args_from(build_parser().parse_args(["serve"]))
    assert (d.model, d.dtype, d.kv_cache_memory, d.enable_prefix_caching, d.scheduling_policy) == \
        ("smollm2", "bfloat16", 2**30, True, "continuous")
    for bad in (["serve", "--dtype", "float16"], ["serve", "--max-num-seqs", "0"],
                ["serve", "--kv-cache-memory", "lots"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_cli_exits_1_when_the_model_cannot_load(tmp_path):
    """`goodput-worker serve` with a bad --model stops and exits 1 (a pod then shows the error and
    backs off) instead of staying up, unready, forever."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import os

    missing = tmp_path / "missing.gguf"
    term = tmp_path / "termination-log"
    proc = subprocess.run(
        [sys.executable, "-m", "goodput.worker", "serve", "--model", str(missing),
         "--host", "127.0.0.1", "--port", str(port)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "GOODPUT_TERMINATION_MESSAGE_PATH": str(term)})
    assert proc.returncode == 1
    assert f"model '{missing}' is neither a bundled name" in proc.stderr
    # the same last error line is the termination message Kubernetes shows for the container
    assert term.read_text() == proc.stderr.strip().splitlines()[-1] + "\n"
