"""Fuzz a worker's HTTP API from its own ``/openapi.json`` with schemathesis.

    python scripts/schemathesis_worker.py                      # starts a small worker itself
    python scripts/schemathesis_worker.py --url http://127.0.0.1:8000 --max-examples 50

Checks (schemathesis' names): ``not_a_server_error`` (no 5xx), ``status_code_conformance``
(no status the schema does not declare), ``content_type_conformance``,
``response_schema_conformance`` (bodies, and each SSE event, match the declared models) and
``negative_data_rejection`` (input the schema forbids is refused with a 4xx: strict types).
Afterwards the worker must be idle with 0 KV blocks in use (``GET /admin/state``): no bad input
leaks a block. Exit status 0 when all of that holds.

The self-started worker has ``--max-model-len 64``, so every generation is short (schemathesis
picks ``max_tokens`` freely; longer ones are refused with 400 at admission). ``PUT /admin/limits``
is exercised without a token (401 is its declared answer): with one, a generated
``max_waiting: 0`` would refuse every later generation. ``--cheap`` (what the test runs) loads
scripts/schemathesis_hooks.py, which caps generated ``max_tokens`` at 4.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,negative_data_rejection")
WORKER_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "64"]


def schemathesis_cmd() -> list[str]:
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    if exe is None:
        raise SystemExit("schemathesis is not installed (pip install -e '.[test]')")
    return [exe]


def run(url: str, max_examples: int, workers: int, seed: int, phases: str | None,
        report_dir: str, cheap: bool = False) -> tuple[int, str, dict]:
    """Run schemathesis against ``url``; returns (exit status, its output, /admin/state after)."""
    cmd = [*schemathesis_cmd(), "run", url + "/openapi.json", "--checks", CHECKS,
           "--max-examples", str(max_examples), "--seed", str(seed), "--workers", str(workers),
           "--request-timeout", "300", "--no-shrink", "--report-dir", report_dir]
    if phases:
        cmd += ["--phases", phases]
    env = dict(os.environ)
    if cheap:
        env["SCHEMATHESIS_HOOKS"] = "schemathesis_hooks"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                          env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=report_dir, env=env)
    deadline = time.monotonic() + 120
    while True:  # aborts and finishes are applied at the next engine step
        state = httpx.get(url + "/admin/state", timeout=30).json()
        if (state["running"] == 0 and state["waiting"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return proc.returncode, proc.stdout + proc.stderr, state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running worker (default: start one with " + " ".join(WORKER_FLAGS) + ")")
    ap.add_argument("--max-examples", type=int, default=5, help="test cases per operation and phase")
    ap.add_argument("--workers", type=int, default=1,
                    help="concurrent schemathesis workers (more than 1 can hit a CPython 3.11 ast bug in "
                         "hypothesis, \"AST constructor recursion depth mismatch\")")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--phases", default=None, help="e.g. coverage,fuzzing (default: all)")
    ap.add_argument("--cheap", action="store_true", help="cap generated max_tokens at 4")
    ns = ap.parse_args(argv)
    server = None
    if ns.url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from conftest import start_server  # the tests' launcher: a worker on a free port

        server = start_server(WORKER_FLAGS)
        ns.url = server.url
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.monotonic()
            rc, out, state = run(ns.url, ns.max_examples, ns.workers, ns.seed, ns.phases, tmp, ns.cheap)
        print(out)
        print(f"schemathesis exit status {rc} after {time.monotonic() - t0:.0f} s")
        print(f"after: running={state['running']} waiting={state['waiting']} "
              f"kv_blocks_used={state['kv_blocks_used']} counters={state['counters']}")
        if server is not None and "Traceback" in server.log():
            print("the worker logged a traceback:\n" + server.log()[-4000:])
            return 1
        return 0 if rc == 0 and state["kv_blocks_used"] == 0 and state["running"] == 0 else 1
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
