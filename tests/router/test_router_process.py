"""``python -m goodput.router`` as a process: serves, and a restart mid-load loses only the
requests in flight (the client's stream ends with an error, the pod's request is aborted, new
requests are served by the restarted router: the router keeps no state a restart would need)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
from router_stub import ServerThread, StubState, free_port, make_stub

HANG_GUARD_S = 60.0


def _start_router(port: int, stub_url: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "goodput.router", "--port", str(port), "--static",
                             f"m1={stub_url}", "--scrape-period", "0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "router did not become ready"
        time.sleep(0.05)


def test_restart_mid_stream_loses_only_the_stream_in_flight():
    st = StubState("m1", "A", chunks=3, gate=threading.Semaphore(0))
    port = free_port()
    with ServerThread(make_stub(st)) as stub:
        router = _start_router(port, stub.url)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=HANG_GUARD_S,
                              json={"model": "m1", "prompt": "x", "stream": True}) as resp:
                lines = resp.iter_lines()
                assert "A-0" in next(x for x in lines if x)
                router.kill()  # no goodbye: the process is gone mid-stream
                router.wait(HANG_GUARD_S)
                with pytest.raises(httpx.HTTPError):
                    for _ in lines:
                        pass
            # the pod's side of the stream was closed with the router's connection: aborted there
            assert st.aborted.wait(HANG_GUARD_S)
            st.gate = None
            router = _start_router(port, stub.url)
            r = httpx.post(url + "/v1/completions", json={"model": "m1", "prompt": "y"}, timeout=HANG_GUARD_S)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "A-0 A-1 A-2 "
        finally:
            router.kill()
            router.wait(HANG_GUARD_S)
