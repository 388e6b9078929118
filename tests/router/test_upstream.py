"""The router's one HTTP client (goodput.router.upstream) and its callers, against raw asyncio HTTP
servers on 127.0.0.1: the timeouts it declares, a scrape and a static ``/ready`` probe through it,
and a pod that accepts and never answers (the probe timeout ends the call; before the one client
stack, a scrape of such a pod waited forever). No timing is asserted: each call runs under a
generous hang guard.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from goodput.api import worker_metrics as wmn
from goodput.router.discovery_static import probe_ready
from goodput.router.fleet import Pod, PodInfo
from goodput.router.scrape import scrape_pod
from goodput.router.upstream import Timeouts, Upstream

HANG_GUARD_S = 60.0


def test_timeouts_are_declared_once_data_path_unbounded_probe_bounded():
    t = Timeouts(connect_s=3.0, probe_s=7.5)
    assert (t.data().total, t.data().sock_connect) == (None, 3.0)
    assert (t.probe().total, t.probe().sock_connect) == (7.5, 3.0)
    for bad in ((0, 1), (1, 0), (-1, 1)):
        with pytest.raises(ValueError):
            Timeouts(*bad)


def test_the_session_exists_only_between_open_and_close():
    up = Upstream(Timeouts(1, 1), max_connections=4)
    with pytest.raises(RuntimeError):
        up.session

    async def cycle():
        up.open()
        assert up.session.connector.limit == 4
        await up.close()
    asyncio.run(cycle())
    with pytest.raises(RuntimeError):
        up.session


@contextlib.asynccontextmanager
async def raw_server(answers: dict[str, tuple[int, bytes]] | None):
    """An HTTP/1.1 server on 127.0.0.1: ``answers`` maps a path to (status, body); None: it reads
    the request and never answers. Yields its base URL."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if answers is None:
                    await asyncio.sleep(3600)
                path = head.split(b" ", 2)[1].decode()
                status, body = answers.get(path, (404, b"{}"))
                writer.write(f"HTTP/1.1 {status} X\r\ncontent-length: {len(body)}\r\n"
                             "content-type: text/plain\r\n\r\n".encode() + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


def test_a_scrape_through_the_client_fills_the_pod_and_reports_the_engine_id():
    text = (f'{wmn.REQUESTS_RUNNING}{{model="m"}} 2\n{wmn.REQUESTS_RUNNING}{{model="n"}} 1\n'
            f"{wmn.KV_CACHE_USAGE_RATIO} 0.25\n{wmn.ADMISSION_MAX_NUM_SEQS} 8\n"
            f'{wmn.ENGINE_INSTANCE_INFO}{{instance_id="abc123"}} 1\n').encode()
    seen: list[tuple[str, str | None]] = []

    async def go():
        async with raw_server({"/metrics": (200, text)}) as url:
            up = Upstream(Timeouts(connect_s=5, probe_s=30), max_connections=4).open()
            try:
                pod = Pod(PodInfo(name="p", url=url, ready=True))
                changed = await scrape_pod(up, pod, lambda p, i: seen.append((p.name, i)))
                return pod, changed
            finally:
                await up.close()

    pod, changed = _run(go())
    # running is summed over its two series (2 + 1); max_num_seqs is new, so the limits changed
    assert (pod.running, pod.kv_usage, pod.max_num_seqs, pod.waiting) == (3, 0.25, 8, None)
    assert changed is True
    assert seen == [("p", "abc123")]


def test_a_pod_that_never_answers_ends_the_scrape_and_the_probe_at_the_probe_timeout():
    async def go():
        async with raw_server(None) as url:
            up = Upstream(Timeouts(connect_s=5, probe_s=0.3), max_connections=4).open()
            try:
                pod = Pod(PodInfo(name="p", url=url, ready=True))
                calls: list[str | None] = []
                changed = await scrape_pod(up, pod, lambda p, i: calls.append(i))
                return pod, changed, calls, await probe_ready(up, url)
            finally:
                await up.close()

    pod, changed, calls, ready = _run(go())
    assert changed is False and pod.running is None and calls == []  # nothing learned, nothing reported
    assert ready == (False, False)


@pytest.mark.parametrize(("status", "body", "expected"), [
    (200, b'{"status": "ready"}', (True, False)),
    (503, b'{"status": "draining"}', (False, True)),
    (503, b'{"status": "starting"}', (False, False)),
    (500, b"not json", (False, False)),
])
def test_the_static_ready_probe_through_the_client(status, body, expected):
    async def go():
        async with raw_server({"/ready": (status, body)}) as url:
            up = Upstream(Timeouts(connect_s=5, probe_s=30), max_connections=4).open()
            try:
                return await probe_ready(up, url)
            finally:
                await up.close()

    assert _run(go()) == expected
