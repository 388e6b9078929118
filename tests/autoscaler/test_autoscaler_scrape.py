"""Scrapes over pooled keep-alive connections: the race between a server closing an idle connection
and a client reusing it, against real servers (a raw asyncio TCP server that plays the race
deterministically, and uvicorn with its keep-alive equal to the scrape period).

The race, as seen at ``--period 5`` against the worker's former uvicorn default keep-alive of 5 s:
``RemoteProtocolError: Server disconnected without sending a response``. The scraper sends an
idempotent GET once more on a new connection; the worker keeps connections longer than any period.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from goodput.autoscaler import loop, observe
from goodput.autoscaler.__main__ import build_parser
from goodput.worker.cli import KEEP_ALIVE_S, uvicorn_settings
from goodput.worker.engine.config import EngineArgs
from goodput.worker.metrics import WorkerMetrics
from test_autoscaler_observe import stats as scheduler_stats


def _metrics_text() -> bytes:
    return WorkerMetrics("smollm2", lambda: scheduler_stats(max_num_seqs=8, max_waiting=4)).render()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_keep_alive_outlasts_the_scrape_period():
    period = build_parser().parse_args([]).period
    kw = uvicorn_settings(EngineArgs(), logging.INFO)
    assert kw["timeout_keep_alive"] == KEEP_ALIVE_S and KEEP_ALIVE_S > period
    assert uvicorn.Config(app=None, **kw).timeout_keep_alive == KEEP_ALIVE_S  # a real uvicorn setting


class DropsSecondRequest:
    """HTTP/1.1 server on 127.0.0.1: answers the first request of a connection with keep-alive and
    closes the connection, without a response, when a second request arrives on it — what a server
    whose keep-alive timer fires as the client reuses the connection does. New connections: same."""

    def __init__(self, body: bytes):
        self.body, self.connections, self.requests = body, 0, 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
            if not head:
                break
            self.requests += 1
            if served:
                break  # the keep-alive expired: close, no response
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(self.body) + self.body)
            await writer.drain()
            served += 1
        writer.close()


def test_scrape_sends_the_get_once_more_when_a_pooled_connection_is_dropped():
    async def main():
        srv = DropsSecondRequest(_metrics_text())
        server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pod = loop.ReadyPod("p", "uid-p", "127.0.0.1", 10.0, port, "/metrics")
        async with server, httpx.AsyncClient() as http:
            scraper = loop.DirectScraper(http, timeout_s=2.0)
            first = await scraper.samples("ns", [pod])
            second = await scraper.samples("ns", [pod])   # reuses the pooled connection: dropped
        return srv, first, second

    srv, first, second = asyncio.run(main())
    assert isinstance(first["p"], observe.PodSample)
    assert isinstance(second["p"], observe.PodSample), second["p"]
    # 1st connection: request 1 answered, request 2 dropped; 2nd connection: the retry, answered
    assert (srv.connections, srv.requests) == (2, 3)


def test_a_refused_connection_is_not_retried():
    port = _free_port()   # nothing listens: a connect error says the pod is gone, not a race
    attempts = []

    def handler(request):
        attempts.append(request)
        raise httpx.ConnectError("connection refused")

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await loop.DirectScraper(http, 1.0).samples(
                "ns", [loop.ReadyPod("p", "u", "127.0.0.1", 1.0, port, "/metrics")])
    assert isinstance(asyncio.run(main())["p"], httpx.ConnectError) and len(attempts) == 1


async def _metrics_app(scope, receive, send):
    assert scope["type"] == "http"
    await receive()
    body = _metrics_text()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def uvicorn_keep_alive_1s():
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(_metrics_app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=1, lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    yield port
    server.should_exit = True
    t.join(10)


def test_scrapes_at_exactly_the_keep_alive_period_all_succeed(uvicorn_keep_alive_1s):
    """uvicorn with keep-alive 1 s, scraped every 1 s over one pooled connection: each scrape
    lands as the server closes the idle connection, and every one must still give a sample."""
    pod = loop.ReadyPod("p", "uid-p", "127.0.0.1", 10.0, uvicorn_keep_alive_1s, "/metrics")

    async def main():
        got = []
        async with httpx.AsyncClient() as http:
            scraper = loop.DirectScraper(http, timeout_s=2.0)
            for _ in range(8):
                t0 = time.monotonic()
                got.append((await scraper.samples("ns", [pod]))["p"])
                await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
        return got

    got = asyncio.run(main())
    assert [type(g).__name__ for g in got] == ["PodSample"] * 8
