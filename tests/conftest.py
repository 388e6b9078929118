"""Shared fixtures: live worker servers on 127.0.0.1 (one subprocess per distinct flag set).

Each server loads the real model (a few seconds), so there are only three flag sets, each
started lazily on first use and kept for the whole session:

- ``server_main``: fp32, a roomy pool, admin token set; most API, client and greedy tests.
- ``server_chunked``: fp32, ``--max-num-batched-tokens 8`` (prompts are chunk-prefilled) and
  ``--max-model-len 32`` (bug report 2).
- ``server_tiny``: fp32, a pool of 4 blocks x 16 tokens, ``--max-model-len 128`` (bug report 3,
  preemption by recompute), ``--vllm-metric-aliases``; started WITHOUT an admin token (admin
  writes -> 403).

``start_server(flags)`` is public for other test modules that need their own flags.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Triton reads TRITON_INTERPRET once, when it is first imported, and some modules import it early
# (llguidance.torch does, through goodput.worker.model.structured). Without a GPU every Triton kernel
# in the test process must run in the interpreter, so set it before any test module is imported.
if os.environ.get("GOODPUT_TEST_DEVICE", "cpu") == "cpu":
    try:
        import torch as _torch
        _cuda = _torch.cuda.is_available()
    except ImportError:
        _cuda = False
    if not _cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

REPO = Path(__file__).resolve().parents[1]

ADMIN_TOKEN = "test-admin-token"
# KV bytes per token of SmolLM2-135M in fp32 = 2 * L(30) * n_kv(3) * d_head(64) * 4 bytes.
# The tiny pool is written as bytes so the test names the exact block count it wants.
SMOLLM2_FP32_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """A worker subprocess. ``url`` is the base URL (no trailing slash)."""

    proc: subprocess.Popen
    url: str
    log_path: str
    flags: tuple[str, ...]

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(flags: list[str], admin_token: str | None = ADMIN_TOKEN,
                 ready_timeout_s: float = 300.0) -> LiveServer:
    """Start ``python -m goodput.worker serve --model smollm2 --host 127.0.0.1 --port <free>
    <flags>`` and wait for ``GET /ready``; raise with the server log if it dies or times out."""
    import httpx

    port = free_port()
    env = dict(os.environ)
    env.pop("GOODPUT_ADMIN_TOKEN", None)
    if admin_token is not None:
        env["GOODPUT_ADMIN_TOKEN"] = admin_token
    env.setdefault("HF_HUB_OFFLINE", "1")
    # One intra-op thread: test servers share 2 cores with pytest (and CI neighbours); OpenMP
    # spin-waiting with 2 threads on an oversubscribed machine makes a decode step ~5x slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    log = tempfile.NamedTemporaryFile(prefix="goodput-test-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "goodput.worker", "serve", "--model", "smollm2", "--host", "127.0.0.1",
           "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    server = LiveServer(proc, f"http://127.0.0.1:{port}", log.name, tuple(flags))
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server {cmd} exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server {cmd} not ready after {ready_timeout_s}s:\n{server.log()[-4000:]}")
        time.sleep(0.5)


def _session_server(flags: list[str], admin_token: str | None = ADMIN_TOKEN):
    server = start_server(flags, admin_token)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server_main():
    yield from _session_server(["--dtype", "float32", "--kv-cache-memory", "96MiB",
                                "--max-num-seqs", "64", "--max-model-len", "512"])


@pytest.fixture(scope="session")
def server_chunked():
    yield from _session_server(["--dtype", "float32", "--kv-cache-memory", "32MiB",
                                "--max-num-batched-tokens", "8", "--max-model-len", "32"])


TINY_POOL_BLOCKS = 4


@pytest.fixture(scope="session")
def server_tiny():
    kv_bytes = TINY_POOL_BLOCKS * 16 * SMOLLM2_FP32_KV_BYTES_PER_TOKEN
    yield from _session_server(["--dtype", "float32", "--kv-cache-memory", str(kv_bytes),
                                "--block-size", "16", "--max-model-len", "128", "--vllm-metric-aliases"],
                               admin_token=None)
