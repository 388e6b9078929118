"""The router under faults, over real HTTP on 127.0.0.1: a pod that answers 500 to
everything, a pod that resets every connection after accepting it, an engine restarted in place,
a client that sends its headers and then nothing.

Upstream pods are the stubs of tests/router/router_stub.py (and raw asyncio servers here for the
connection-level faults); the router is the real app served by uvicorn (with the router's own
HTTP protocol, goodput.router.serve, for the stalled-client tests). No timing is asserted:
waits poll a condition under a generous hang guard.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from goodput.router.app import POD_HEADER, RouterSettings, create_app
from goodput.router.discovery_static import StaticDiscovery
from goodput.router.fleet import PodInfo, ServiceInfo
from goodput.router.serve import protocol_class
from router_stub import ServerThread, StubState, make_stub
from test_router_app import HANG_GUARD_S, fleet, pod_of, router_metrics, sample, wait_until

N = 60


def _send_all(url: str, n: int = N, workers: int = 4) -> list[httpx.Response]:
    """``n`` completions with distinct prompts, ``workers`` at a time."""
    def one(i):
        return httpx.post(url + "/v1/completions", json={"model": "m1", "prompt": f"request {i} " * 40},
                          timeout=HANG_GUARD_S)
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(n)))


def test_a_pod_answering_500_is_ejected_and_its_requests_retried(caplog):
    """One of three pods answers 500 at once to every request: >= 99 % of 60 succeed and it is
    sent at most 5 of them (today: it attracts most of them, each one failed)."""
    caplog.set_level(logging.WARNING, logger="goodput.router")
    good_a, good_b = StubState("m1", "A"), StubState("m1", "B")
    bad = StubState("m1", "C", fail_status=500)
    with fleet({"m1": [good_a, good_b, bad]}) as r:
        out = _send_all(r.url)
        ok = [x for x in out if x.status_code == 200]
        assert len(ok) >= 0.99 * N, [x.status_code for x in out if x.status_code != 200]
        assert bad.received() <= 5, bad.received()
        assert {x.headers[POD_HEADER] for x in ok} <= {pod_of(r, "m1", 0), pod_of(r, "m1", 1)}
        bad_pod = pod_of(r, "m1", 2)
        assert sample(r.url, "goodput_router_ejections_total", namespace="", inferenceservice="m1", pod=bad_pod,
                      reason="consecutive_failures") == 1
        assert sample(r.url, "goodput_router_ejected_pods", namespace="", inferenceservice="m1") == 1
        lines = [rec.getMessage() for rec in caplog.records if "ejected pod" in rec.getMessage()]
        assert len(lines) == 1 and bad_pod in lines[0] and "consecutive_failures" in lines[0]
        assert "500 from the pod" in lines[0]


def test_an_ejected_pod_returns_through_a_probe():
    good = StubState("m1", "A")
    bad = StubState("m1", "B", fail_status=500)
    with fleet({"m1": [good, bad]}, outlier_base_ejection_s=0.2) as r:
        bad_pod = pod_of(r, "m1", 1)
        n = iter(range(100_000))

        def send() -> httpx.Response:
            resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": f"p{next(n)}"},
                              timeout=HANG_GUARD_S)
            assert resp.status_code == 200  # B's 500s are retried on A
            return resp

        wait_until(lambda: send() and sample(r.url, "goodput_router_ejected_pods", namespace="",
                                             inferenceservice="m1") == 1, "B ejected")
        bad.fail_status = None  # healthy again: the next request it is due for is its probe
        served = set()

        def probe_passed():
            resp = send()
            served.add(resp.headers[POD_HEADER])
            return bad_pod in served
        wait_until(probe_passed, "B served its probe")
        assert sample(r.url, "goodput_router_ejected_pods", namespace="", inferenceservice="m1") == 0


def test_the_last_pod_is_never_ejected():
    bad = StubState("m1", "A", fail_status=500)
    with fleet({"m1": [bad]}) as r:
        for _ in range(6):  # its own 500 reaches the client each time: there is no other pod
            resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": "x"}, timeout=HANG_GUARD_S)
            assert resp.status_code == 500 and resp.json()["error"]["message"] == "engine failure"
        assert bad.received() == 6
        assert sample(r.url, "goodput_router_ejected_pods", namespace="", inferenceservice="m1") == 0


class _ResetAfterAccept:
    """A raw HTTP/1.1 server on 127.0.0.1: ``GET`` → 200 JSON (so /ready and /metrics look fine);
    a ``POST`` is read, then its connection is reset (RST: SO_LINGER 0) without an answer."""

    def __init__(self):
        self.posts = 0
        self.started = threading.Event()

    async def _handle(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = next((int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length:")), 0)
                if length:
                    await reader.readexactly(length)
                if lines[0].startswith("POST"):
                    self.posts += 1
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                body = b'{"status": "ready"}' if lines[0].startswith("GET /ready") else b"{}"
                ctype = b"application/json" if lines[0].startswith("GET /ready") else b"text/plain"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def run(self):
        async def main():
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self.loop = asyncio.get_running_loop()
            self.stop = asyncio.Event()
            self.started.set()
            async with server:
                await self.stop.wait()
        asyncio.run(main())


def test_a_pod_resetting_connections_after_accept_is_ejected():
    """Clients were already fine (the retry before the first byte); now the pod is also set
    aside instead of being picked for most requests."""
    srv = _ResetAfterAccept()
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    assert srv.started.wait(HANG_GUARD_S)
    try:
        good_a, good_b = StubState("m1", "A"), StubState("m1", "B")
        with fleet({"m1": [good_a, good_b]}, extra_urls={"m1": [f"http://127.0.0.1:{srv.port}"]}) as r:
            out = _send_all(r.url)
            assert all(x.status_code == 200 for x in out), [x.status_code for x in out]
            assert srv.posts <= 5, srv.posts
            assert sample(r.url, "goodput_router_ejections_total", namespace="", inferenceservice="m1",
                          pod=f"127.0.0.1:{srv.port}", reason="consecutive_failures") == 1
    finally:
        srv.loop.call_soon_threadsafe(srv.stop.set)
        t.join(HANG_GUARD_S)


def test_per_pod_in_flight_gauge():
    hold = threading.Event()
    a, b = StubState("m1", "A", hold=hold), StubState("m1", "B", hold=hold)
    with fleet({"m1": [a, b]}) as r:
        with ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(httpx.post, r.url + "/v1/completions", timeout=HANG_GUARD_S,
                                json={"model": "m1", "prompt": f"g{i} " * 40}) for i in range(3)]
            wait_until(lambda: a.received() + b.received() == 3, "3 requests at the pods")
            m = router_metrics(r.url)
            got = {p: m[("goodput_router_pod_in_flight_requests",
                         (("inferenceservice", "m1"), ("namespace", ""), ("pod", pod_of(r, "m1", i))))]
                   for i, p in enumerate("AB")}
            assert got == {"A": a.received(), "B": b.received()}
            hold.set()
            assert all(f.result().status_code == 200 for f in futs)
        wait_until(lambda: sample(r.url, "goodput_router_pod_in_flight_requests", namespace="", inferenceservice="m1",
                                  pod=pod_of(r, "m1", 0)) == 0, "A back to 0")


# ---------------------------------------------------------------------------------- identity


def _prefix_request(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "m1", "prompt": "a long shared prefix. " * 60},
                      timeout=HANG_GUARD_S)


@pytest.mark.parametrize("learned_from", ["answer", "scrape"])
def test_engine_restarted_in_place_loses_its_cache_knowledge(learned_from):
    """The warm prefix went to pod X; X's engine restarts on the same address (a new instance
    id): the router forgets what X held at once, so the prefix is not sent back to it by
    ``affinity`` (today: it is, and the new engine hits none of it)."""
    a, b = StubState("m1", "A", instance="a-1"), StubState("m1", "B", instance="b-1")
    period = 0.05 if learned_from == "scrape" else 3600
    with fleet({"m1": [a, b]}, scrape_period_s=period) as r:
        first = _prefix_request(r.url)
        home = first.headers[POD_HEADER]
        assert _prefix_request(r.url).headers[POD_HEADER] == home
        assert sample(r.url, "goodput_router_decisions_total", reason="affinity") == 1
        st = a if home == pod_of(r, "m1", 0) else b
        st.instance = st.instance[0] + "-2"  # the same address, a new engine

        def restarts() -> float:
            return sample(r.url, "goodput_router_pod_restarts_total", namespace="", inferenceservice="m1", pod=home)
        if learned_from == "scrape":
            wait_until(lambda: restarts() == 1, "the scrape saw the new engine")
        else:  # no scrape: the first answer of the new engine says it (other prompts until one lands there)
            prompts = iter(range(10_000))
            wait_until(lambda: _answered_by(r, home, next(prompts)), "an answer from the new engine")
            assert restarts() == 1
        before = sample(r.url, "goodput_router_decisions_total", reason="affinity")
        third = _prefix_request(r.url)
        assert third.status_code == 200
        assert sample(r.url, "goodput_router_decisions_total", reason="affinity") == before == 1


def _answered_by(r, home: str, i: int) -> bool:
    resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": f"other {i}"}, timeout=HANG_GUARD_S)
    return resp.headers.get(POD_HEADER) == home


# ---------------------------------------------------------------------------------- stalled clients


@contextlib.contextmanager
def _router_with_deadlines(header_timeout_s: float, body_timeout_s: float):
    """The router app served by uvicorn with the router's own protocol (``serve.protocol_class``),
    in front of one stub."""
    settings = RouterSettings(scrape_period_s=0.05, header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s)
    with ServerThread(make_stub(StubState("m1", "A"))) as stub:
        srv = ServerThread(create_app(StaticDiscovery([f"m1={stub.url}"], period_s=0.05), settings))
        srv.server.config.http = protocol_class(settings.header_timeout_s)
        with srv as r:
            wait_until(lambda: httpx.get(r.url + "/ready").status_code == 200, "router ready")
            yield r


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the hang guard: a socket
    timeout, which fails the test)."""
    sock.settimeout(HANG_GUARD_S)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_connection_that_sends_no_complete_head_is_closed():
    with _router_with_deadlines(0.3, 60) as r:
        port = int(r.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as idle:
            assert _read_until_closed(idle) == b""  # nothing at all
        with socket.create_connection(("127.0.0.1", port)) as partial:
            partial.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n")
            assert _read_until_closed(partial) == b""  # part of a head, then nothing
        with socket.create_connection(("127.0.0.1", port)) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            kept.settimeout(HANG_GUARD_S)
            first = kept.recv(65536)
            assert first.startswith(b"HTTP/1.1 200")
            kept.sendall(b"GET /health HTTP/1.1\r\n")  # the next request's head never completes
            assert b"HTTP/1.1" not in _read_until_closed(kept)
        # a prompt client is served as before
        assert httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": "x"}).status_code == 200


def test_a_body_that_stops_arriving_is_answered_408_and_closed():
    with _router_with_deadlines(60, 0.3) as r:
        port = int(r.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"model\": ")
            answer = _read_until_closed(slow)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        err = json.loads(body)["error"]
        assert err["code"] == "body_timeout" and "--body-timeout" in err["message"]


# ---------------------------------------------------------------------------------- one name, one service


class _ThreeClaimants:
    """Kubernetes-like discovery: three InferenceServices in two namespaces, all serving "smollm2"
    (no servedModelName); ``urls[i]`` is the one Ready pod of service i."""

    def __init__(self, urls):
        self.urls = urls
        self.infos = [ServiceInfo("team-b", "chat", "smollm2", created="2026-12-01T11:00:00Z"),
                      ServiceInfo("team-a", "big", "smollm2", created="2026-12-01T10:00:00Z"),
                      ServiceInfo("team-a", "small", "smollm2", created="2026-12-01T12:00:00Z")]

    async def run(self, fleet):
        for info, url in zip(self.infos, self.urls):
            fleet.set_service(info)
            fleet.replace_pods(info.namespace, info.name, [PodInfo(name=f"{info.name}-0", url=url)])


def test_one_model_name_one_service():
    """The earliest created service owns the name: every request goes to it, /v1/models lists the
    name once and says which services are refused (today: listed three times, the request goes to
    the first by key, silently)."""
    stubs = [StubState("smollm2", n) for n in ("CHAT", "BIG", "SMALL")]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(make_stub(st))).url for st in stubs]
        r = stack.enter_context(ServerThread(create_app(_ThreeClaimants(urls), RouterSettings(scrape_period_s=0.05))))
        wait_until(lambda: httpx.get(r.url + "/ready").status_code == 200, "router ready")
        models = httpx.get(r.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["smollm2"]
        assert models[0]["inferenceservice"] == "team-a/big"
        assert models[0]["refused_inferenceservices"] == ["team-a/small", "team-b/chat"]
        for i in range(6):
            resp = httpx.post(r.url + "/v1/completions", json={"model": "smollm2", "prompt": f"q{i}"},
                              timeout=HANG_GUARD_S)
            assert resp.status_code == 200 and resp.headers[POD_HEADER] == "big-0"
        assert [st.received() for st in stubs] == [0, 6, 0]
        missing = httpx.post(r.url + "/v1/completions", json={"model": "nope", "prompt": "x"}).json()
        assert missing["error"]["message"].count("'smollm2'") == 1  # the 404 names each served model once


def test_a_real_worker_restarted_in_place_loses_its_cache_knowledge():
    """The same with real worker servers (tests/fake_engine.py's engine behind the worker's own
    app and its x-goodput-instance header): the worker process on one port is replaced by a new
    one on the same port; its first answer tells the router, which stops sending the warm prefix
    back to it by affinity."""
    from fake_engine import ByteTokenizer, make_engine
    from goodput.router.picker import PickConfig
    from goodput.worker.engine_args import EngineArgs
    from goodput.worker.server.app import create_app as worker_app

    class Tok(ByteTokenizer):
        def encode(self, text, add_special_tokens=True):
            return list(text.encode())

    def engine(args):
        eng = make_engine(num_blocks=64)
        eng.tokenizer = Tok()
        return eng

    def start(port=None) -> ServerThread:
        w = ServerThread(worker_app(EngineArgs(model="fake", served_model_name="m1"), engine_factory=engine,
                                    admin_token=""), port=port).__enter__()
        wait_until(lambda: httpx.get(w.url + "/ready").status_code == 200, "worker ready")
        return w

    workers = [start(), start()]
    try:
        disc = StaticDiscovery([f"m1={workers[0].url},{workers[1].url}"], period_s=3600)
        app = create_app(disc, RouterSettings(scrape_period_s=3600), pick_cfg=PickConfig(chunk_size=8))
        with ServerThread(app) as r:
            wait_until(lambda: httpx.get(r.url + "/ready").status_code == 200, "router ready")
            body = {"model": "m1", "prompt": "a warm shared prefix", "max_tokens": 2}
            home = httpx.post(r.url + "/v1/completions", json=body, timeout=HANG_GUARD_S).headers[POD_HEADER]
            assert httpx.post(r.url + "/v1/completions", json=body, timeout=HANG_GUARD_S).headers[POD_HEADER] == home
            assert sample(r.url, "goodput_router_decisions_total", reason="affinity") == 1
            i = next(k for k, w in enumerate(workers) if w.url.endswith(home))
            workers[i].__exit__(None, None, None)   # the engine goes away ...
            workers[i] = start(workers[i].port)     # ... and a new one starts on the same address
            prompts = iter(range(10_000))
            wait_until(lambda: _answered_by_real(r, home, next(prompts)), "an answer from the new engine")
            assert sample(r.url, "goodput_router_pod_restarts_total", namespace="", inferenceservice="m1",
                          pod=home) == 1
            assert httpx.post(r.url + "/v1/completions", json=body, timeout=HANG_GUARD_S).status_code == 200
            assert sample(r.url, "goodput_router_decisions_total", reason="affinity") == 1
    finally:
        for w in workers:
            w.__exit__(None, None, None)


def _answered_by_real(r, home: str, i: int) -> bool:
    resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": f"x{i}", "max_tokens": 1},
                      timeout=HANG_GUARD_S)
    assert resp.status_code == 200, resp.text
    return resp.headers.get(POD_HEADER) == home


def _measure() -> None:
    """``PYTHONPATH=tests:tests/router python tests/router/test_router_faults.py``: the numbers of the two stub-pod findings
    (60 requests, 4 at a time, three pods of which one fails), printed."""
    a, b, bad = StubState("m1", "A"), StubState("m1", "B"), StubState("m1", "C", fail_status=500)
    with fleet({"m1": [a, b, bad]}) as r:
        ok = sum(x.status_code == 200 for x in _send_all(r.url))
        print(f"one pod answering 500: {ok}/{N} succeeded; the bad pod was sent {bad.received()} "
              f"(the others {a.received()}, {b.received()})")
    srv = _ResetAfterAccept()
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    srv.started.wait(HANG_GUARD_S)
    a, b = StubState("m1", "A"), StubState("m1", "B")
    with fleet({"m1": [a, b]}, extra_urls={"m1": [f"http://127.0.0.1:{srv.port}"]}) as r:
        ok = sum(x.status_code == 200 for x in _send_all(r.url))
        print(f"one pod resetting after accept: {ok}/{N} succeeded; the bad pod was sent {srv.posts} "
              f"(the others {a.received()}, {b.received()})")
    srv.loop.call_soon_threadsafe(srv.stop.set)


if __name__ == "__main__":
    _measure()
