"""The router's added latency: the same open-loop load sent to the bench's stub server directly
and through the router, at several request rates.

    python -m goodput.bench.router_latency                       # 100, 500, 1000 req/s, 10 s each
    python -m goodput.bench.router_latency --rates 100,500 --duration 5 --out /tmp/r.md
    python -m goodput.bench.router_latency --rates 100 --sequential 5000   # one at a time too

Processes (each on its own free 127.0.0.1 port): the stub (``goodput.bench.fake_server``, zero
model time: TTFT 0, one token, so what is measured is HTTP and the router), the router
(``python -m goodput.router --static fake=<stub>``), and this load generator (aiohttp, one
event loop; requests sent at fixed intervals, ``stream: true``, ``max_tokens: 1``, the latency
is send → last byte of the SSE answer). For each rate: a direct run, then a run through the
router. Reported per rate: latency p50/p99 direct and routed, added = routed - direct (at each
percentile; the two runs are different requests), the ratio routed/direct, the achieved rate,
errors, the router's CPU seconds (from /proc via psutil) and requests/s per core (requests /
router CPU seconds), and the router's own ``goodput_router_overhead_seconds`` mean (time before
the upstream request is sent). The load generator shares the machine with both servers: on a
busy 2-core machine its own scheduling delay inflates both columns alike.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], url: str, timeout_s: float = 60.0) -> subprocess.Popen:
    import httpx
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{cmd} not ready")
        time.sleep(0.1)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


async def _run(url: str, rate: float, duration_s: float) -> dict:
    import aiohttp
    n = int(rate * duration_s)
    body = {"model": "fake", "prompt": "hello", "max_tokens": 1, "stream": True}
    lat: list[float] = []
    errors = 0
    late = 0
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        # warm the connection pool
        for _ in range(20):
            async with session.post(url + "/v1/completions", json=body) as r:
                await r.read()

        async def one():
            nonlocal errors
            t = time.perf_counter()
            try:
                async with session.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        return
            except aiohttp.ClientError:
                errors += 1
                return
            lat.append(time.perf_counter() - t)

        tasks = []
        t0 = time.perf_counter()
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.005:
                late += 1
            tasks.append(asyncio.create_task(one()))
        sent_s = time.perf_counter() - t0
        await asyncio.gather(*tasks)
    return {"lat": lat, "errors": errors, "achieved": n / sent_s, "late": late, "n": n}


async def _sequential(url: str, n: int) -> list[float]:
    """``n`` requests one after another (no queueing anywhere): latency of each."""
    import aiohttp
    body = {"model": "fake", "prompt": "hello", "max_tokens": 1, "stream": True}
    lat = []
    async with aiohttp.ClientSession() as session:
        for i in range(n + 20):
            t = time.perf_counter()
            async with session.post(url + "/v1/completions", json=body) as r:
                await r.read()
            if i >= 20:  # after a warm-up
                lat.append(time.perf_counter() - t)
    return lat


def _overhead(url: str) -> tuple[float, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    s = c = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for smp in fam.samples:
            if smp.name == "goodput_router_overhead_seconds_sum":
                s = smp.value
            elif smp.name == "goodput_router_overhead_seconds_count":
                c = smp.value
    return s, c


def main(argv: list[str] | None = None) -> None:
    import psutil
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100,500,1000", help="request rates (req/s), comma-separated")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    p.add_argument("--sequential", type=int, default=2000,
                   help="also send this many requests one at a time, direct and routed (0: skip)")
    p.add_argument("--out", default=None, help="markdown file (default bench/results/<date>-router-latency.md)")
    a = p.parse_args(argv)
    rates = [float(x) for x in a.rates.split(",")]
    env = dict(os.environ)
    stub_port, router_port = _free_port(), _free_port()
    stub_url, router_url = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{router_port}"
    stub = _start([sys.executable, "-m", "goodput.bench.fake_server", "--port", str(stub_port), "--ttft-ms", "0",
                   "--itl-ms", "0", "--prefill-ms-per-token", "0", "--max-inflight", "100000"], stub_url)
    router = _start([sys.executable, "-m", "goodput.router", "--port", str(router_port),
                     "--static", f"fake={stub_url}"], router_url)
    load_before = os.getloadavg()
    rows = []
    seq = None
    try:
        rp = psutil.Process(router.pid)
        if a.sequential:
            seq = (asyncio.run(_sequential(stub_url, a.sequential)), asyncio.run(_sequential(router_url, a.sequential)))
            d50, d99, r50, r99 = (1e3 * percentile(x, q) for x in seq for q in (50, 99))
            print(f"one at a time: direct p50 {d50:.2f} p99 {d99:.2f} ms | routed p50 {r50:.2f} p99 {r99:.2f} ms | "
                  f"added p50 {r50 - d50:+.2f} p99 {r99 - d99:+.2f} ms", flush=True)
        for rate in rates:
            direct = asyncio.run(_run(stub_url, rate, a.duration))
            cpu0 = sum(rp.cpu_times()[:2])
            o_sum0, o_cnt0 = _overhead(router_url)
            routed = asyncio.run(_run(router_url, rate, a.duration))
            cpu = sum(rp.cpu_times()[:2]) - cpu0
            o_sum, o_cnt = _overhead(router_url)
            row = {"rate": rate, "direct": direct, "routed": routed, "cpu_s": cpu,
                   "overhead_mean_ms": 1e3 * (o_sum - o_sum0) / max(1.0, o_cnt - o_cnt0)}
            rows.append(row)
            d50, d99 = (1e3 * percentile(direct["lat"], q) for q in (50, 99))
            r50, r99 = (1e3 * percentile(routed["lat"], q) for q in (50, 99))
            print(f"{rate:6.0f} req/s  direct p50 {d50:6.2f} p99 {d99:6.2f} ms | routed p50 {r50:6.2f} "
                  f"p99 {r99:6.2f} ms | added p50 {r50 - d50:+6.2f} p99 {r99 - d99:+6.2f} ms | "
                  f"ratio p99 {r99 / d99:.2f} | achieved {routed['achieved']:.0f} req/s | "
                  f"router {(routed['n'] - routed['errors']) / max(cpu, 1e-9):.0f} req/s per core", flush=True)
    finally:
        for proc in (router, stub):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    load_after = os.getloadavg()
    out = Path(a.out) if a.out else REPO / "bench" / "results" / f"{datetime.date.today()}-router-latency.md"
    out.write_text(_report(rows, a, load_before, load_after, seq))
    print(f"wrote {out}")


def _report(rows, a, load_before, load_after, seq=None) -> str:
    import importlib.util
    stack = ("uvicorn with httptools + uvloop" if importlib.util.find_spec("httptools") and
             importlib.util.find_spec("uvloop") else "uvicorn with h11 + asyncio (no httptools/uvloop installed)")
    lines = [
        f"# Router added latency ({datetime.date.today()}; {stack})",
        "",
        f"Command: `python -m goodput.bench.router_latency --rates {a.rates} --duration {a.duration:g}`",
        "",
        f"Servers (stub and router): {stack}. "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}. The stub, the router and the "
        "load generator share these cores with whatever else runs: on a busy machine the load generator's "
        "own scheduling delay inflates the direct and the routed column alike and the p99s are noisy.",
        "",
        "Stub: `goodput.bench.fake_server`, TTFT 0, one token, SSE (what is measured is HTTP and the router). "
        "Load: open loop at fixed intervals, aiohttp, one event loop; latency = send → last byte. "
        "Added = routed − direct at the same percentile (different requests). Requests/s per core = "
        "routed requests / the router process's CPU seconds during its run. Overhead = the router's own "
        "`goodput_router_overhead_seconds` mean (before the upstream request is sent).",
        "",
        "| rate (req/s) | achieved | direct p50 / p99 (ms) | routed p50 / p99 (ms) | added p50 / p99 (ms) | "
        "routed/direct p99 | errors | router CPU (cores) | req/s per core | router overhead mean (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d, rt = r["direct"], r["routed"]
        d50, d99 = (1e3 * percentile(d["lat"], q) for q in (50, 99))
        r50, r99 = (1e3 * percentile(rt["lat"], q) for q in (50, 99))
        cores = r["cpu_s"] / a.duration
        per_core = (rt["n"] - rt["errors"]) / max(r["cpu_s"], 1e-9)
        lines.append(f"| {r['rate']:.0f} | {rt['achieved']:.0f} | {d50:.2f} / {d99:.2f} | {r50:.2f} / {r99:.2f} | "
                     f"{r50 - d50:+.2f} / {r99 - d99:+.2f} | {r99 / d99:.2f} | {d['errors']} / {rt['errors']} | "
                     f"{cores:.2f} | {per_core:.0f} | {r['overhead_mean_ms']:.3f} |")
    lines += ["", "Errors: direct / routed. Target (issue): added p99 ≤ 5 ms at 500 req/s.", ""]
    if seq is not None:
        d50, d99, r50, r99 = (1e3 * percentile(x, q) for x in seq for q in (50, 99))
        lines += [f"One request at a time ({a.sequential} each, after 20 warm-up; no queueing anywhere): direct "
                  f"p50 {d50:.2f} / p99 {d99:.2f} ms, routed p50 {r50:.2f} / p99 {r99:.2f} ms, added "
                  f"p50 {r50 - d50:+.2f} / p99 {r99 - d99:+.2f} ms.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
