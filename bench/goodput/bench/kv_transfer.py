"""KV transfer between two workers on loopback (disaggregated prefill; docs/disaggregation.md).

    python -m goodput.bench.kv_transfer [--tokens 512,2048] [--dtype bfloat16] [--repeats 3]

Starts a prefill worker and a decode worker (``goodput-worker serve --role prefill|decode`` on
127.0.0.1, the bundled SmolLM2-135M, one torch thread each) and, for each prompt length T:

- pull: a remote prefill on the prefill worker, then the decode worker's request with the transfer
  handle; the decode worker's own ``goodput_kv_transfer_seconds`` and
  ``goodput_kv_transfer_bytes_total{direction="received"}`` give the pull's time and bytes
  (connect, stream, parse into host memory; 2·L·n_kv·d_head·bytes·T bytes);
- raw: the same stream read by a plain HTTP client (no parsing): the loopback ceiling;
- TTFT remote (prefill call + decode call to its first streamed token) vs TTFT local (the decode
  worker prefilling a fresh prompt of the same length itself).

What it shows honestly: loopback on one machine (no NIC), CPU prefill (slow, so the transfer is a
small part of TTFT here); on GPUs the prefill is ~100x faster and the link decides.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from goodput.api.disagg import KV_HANDLE_HEADER, KV_SOURCE_HEADER, REMOTE_PREFILL_HEADER


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(role: str, dtype: str, max_len: int) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tempfile.NamedTemporaryFile(prefix=f"kv-bench-{role}-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "goodput.worker", "serve", "--model", "smollm2", "--host",
                             "127.0.0.1", "--port", str(port), "--role", role, "--dtype", dtype,
                             "--max-model-len", str(max_len), "--kv-cache-memory", "1GiB",
                             "--max-num-batched-tokens", "2048", "--revision", "kv-bench",
                             "--kv-transfer-timeout-seconds", "120", "--num-threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{role} worker exited; log: {log.name}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{role} worker not ready; log: {log.name}")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def first_token_s(url: str, body: dict, headers: dict | None = None) -> float:
    """Seconds from sending a streamed completion to its first token's event."""
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers or {},
                      timeout=600) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
        return first


def prompt(n: int, salt: int) -> list[int]:
    """``n`` token ids, different for every ``salt`` from the first one (no prefix-cache hits)."""
    return [1000 + salt % 20000] + [(salt * 7919 + i * 104729) % 40000 + 1000 for i in range(1, n)]


def run(tokens: list[int], dtype: str, repeats: int) -> list[dict]:
    p_proc, p = start("prefill", dtype, max(tokens) + 64)
    d_proc, d = start("decode", dtype, max(tokens) + 64)
    rows, salt = [], 1
    try:
        for n in tokens:
            pulls, raws, remote, local, nbytes = [], [], [], [], 0
            for _ in range(repeats):
                body = {"prompt": prompt(n, salt), "max_tokens": 2, "temperature": 0}
                salt += 1
                m0 = scrape(d)
                t0 = time.perf_counter()
                res = httpx.post(p + "/v1/completions", json=body, headers={REMOTE_PREFILL_HEADER: "1"},
                                 timeout=600).json()
                tt = time.perf_counter() - t0
                tt += first_token_s(d, body, {KV_HANDLE_HEADER: res["handle"], KV_SOURCE_HEADER: p})
                m1 = scrape(d)
                key_s = ("goodput_kv_transfer_seconds_sum", ())
                key_b = ("goodput_kv_transfer_bytes_total", (("direction", "received"),))
                pulls.append(m1[key_s] - m0[key_s])
                nbytes = m1[key_b] - m0[key_b]
                remote.append(tt)
                # the raw stream alone, on a lease nobody else pulls
                body2 = {**body, "prompt": prompt(n, salt)}
                salt += 1
                h = httpx.post(p + "/v1/completions", json=body2, headers={REMOTE_PREFILL_HEADER: "1"},
                               timeout=600).json()["handle"]
                t0 = time.perf_counter()
                with httpx.stream("GET", f"{p}/kv/leases/{h}", timeout=600) as r:
                    got = sum(len(c) for c in r.iter_raw())
                raws.append((time.perf_counter() - t0, got))
                local.append(first_token_s(d, {**body, "prompt": prompt(n, salt)}))
                salt += 1
            pull = min(pulls)
            raw_s, raw_b = min(raws)
            rows.append({"tokens": n, "payload_bytes": int(nbytes), "pull_s": pull,
                         "pull_GBps": nbytes / pull / 1e9, "pull_s_per_1k_tokens": pull / n * 1000,
                         "raw_stream_s": raw_s, "raw_GBps": raw_b / raw_s / 1e9,
                         "ttft_remote_s": min(remote), "ttft_local_s": min(local)})
    finally:
        for proc in (d_proc, p_proc):
            proc.terminate()
            proc.wait(30)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,2048", help="prompt lengths (comma-separated)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=3, help="runs per length (the best is reported)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    a = ap.parse_args(argv)
    rows = run([int(x) for x in a.tokens.split(",")], a.dtype, a.repeats)
    print(f"{'tokens':>7} {'KV MB':>8} {'pull s':>8} {'pull GB/s':>9} {'s/1k tok':>9} {'raw GB/s':>9} "
          f"{'TTFT remote':>11} {'TTFT local':>10}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['payload_bytes'] / 1e6:>8.2f} {r['pull_s']:>8.4f} {r['pull_GBps']:>9.3f} "
              f"{r['pull_s_per_1k_tokens']:>9.4f} {r['raw_GBps']:>9.3f} {r['ttft_remote_s']:>11.3f} "
              f"{r['ttft_local_s']:>10.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
