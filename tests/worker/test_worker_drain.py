"""Drain of a real worker process: SIGTERM, and ``POST``/``DELETE /admin/drain`` (scale-in).

The worker must turn unready (GET /ready 503 "draining"), refuse new generate requests with 503
and an OpenAI error body (code ``draining``), finish the in-flight stream to its natural end
(``finish_reason`` length, every token, ``[DONE]``). After SIGTERM it then exits 0 on its own;
after ``POST /admin/drain`` it keeps running and ``DELETE /admin/drain`` makes it admit again.
"""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from conftest import ADMIN_TOKEN, start_server
from server_utils import TIMEOUT

MAX_TOKENS = 120  # long enough that the checks below run while the stream is still generating
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
STREAM = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
          "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _assert_refused_new(url: str) -> None:
    """Both generate routes answer 503 ``draining`` with Retry-After; read-only routes answer."""
    new = httpx.post(url + "/v1/completions", timeout=10,
                     json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    assert new.status_code == 503, new.text
    err = new.json()["error"]
    assert err["code"] == "draining" and "retry" in err["message"]
    assert new.headers["retry-after"] == "1"
    chat = httpx.post(url + "/v1/chat/completions", timeout=10,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "draining"
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200


def _read_to_end(first: str, lines) -> list[dict]:
    """The stream's events from ``first`` on; asserts it ended with ``[DONE]`` after every token."""
    events, done = [json.loads(first[6:])], False
    for line in lines:
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
    assert done
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    return events


@pytest.mark.timeout(600)
def test_sigterm_drains_in_flight_stream_refuses_new_and_exits_0():
    server = start_server(["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "512"])
    try:
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None  # generating

            server.proc.send_signal(signal.SIGTERM)

            ready = httpx.get(server.url + "/ready", timeout=10)
            assert ready.status_code == 503, ready.text
            assert ready.json()["status"] == "draining"
            assert ready.json()["inflight"] == 1  # our stream is still running: the checks are mid-drain

            new = httpx.post(server.url + "/v1/completions", timeout=10,
                             json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
            assert new.status_code == 503, new.text
            err = new.json()["error"]
            assert err["code"] == "draining" and "retry" in err["message"]
            assert new.headers["retry-after"] == "1"
            chat = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                              json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert chat.status_code == 503 and chat.json()["error"]["code"] == "draining"
            # read-only routes keep answering (the autoscaler scrapes a draining pod too)
            assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200

            _read_to_end(first, lines)

        assert server.proc.wait(timeout=60) == 0, server.log()[-3000:]
        assert "drained" in server.log()
    finally:
        server.stop()


@pytest.mark.timeout(600)
def test_admin_drain_finishes_streams_keeps_running_and_is_undone():
    server = start_server(["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "512"])
    url = server.url
    try:
        assert httpx.get(url + "/admin/drain", timeout=10).json() == \
            {"draining": False, "shutting_down": False, "inflight": 0}
        assert httpx.post(url + "/admin/drain", timeout=10).status_code == 401
        assert httpx.post(url + "/admin/drain", timeout=10,
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/ready", timeout=10).status_code == 200  # a refused POST changed nothing

        with httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None  # generating

            d = httpx.post(url + "/admin/drain", headers=AUTH, timeout=10)
            assert d.status_code == 200, d.text
            assert d.json() == {"draining": True, "shutting_down": False, "inflight": 1}
            # idempotent
            assert httpx.post(url + "/admin/drain", headers=AUTH, timeout=10).json()["draining"] is True

            ready = httpx.get(url + "/ready", timeout=10)
            assert ready.status_code == 503 and ready.json() == {"status": "draining", "inflight": 1}
            _assert_refused_new(url)
            _read_to_end(first, lines)

        # the stream ended, the process keeps serving (a SIGTERM drain would have exited 0 by now)
        assert httpx.get(url + "/admin/drain", timeout=10).json() == \
            {"draining": True, "shutting_down": False, "inflight": 0}
        assert httpx.get(url + "/ready", timeout=10).status_code == 503
        assert server.proc.poll() is None

        assert httpx.delete(url + "/admin/drain", timeout=10).status_code == 401
        u = httpx.delete(url + "/admin/drain", headers=AUTH, timeout=10)
        assert u.status_code == 200 and u.json() == {"draining": False, "shutting_down": False, "inflight": 0}
        assert httpx.delete(url + "/admin/drain", headers=AUTH, timeout=10).json()["draining"] is False
        assert httpx.get(url + "/ready", timeout=10).json()["status"] == "ready"
        ok = httpx.post(url + "/v1/completions", timeout=TIMEOUT,
                        json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2

        # admin-drained, then SIGTERM with a stream in flight: still a graceful drain (not an
        # immediate stop), DELETE cannot undo it, and the process exits 0 after the stream.
        with httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert httpx.post(url + "/admin/drain", headers=AUTH, timeout=10).status_code == 200
            server.proc.send_signal(signal.SIGTERM)
            state = httpx.get(url + "/admin/drain", timeout=10).json()
            assert state == {"draining": True, "shutting_down": True, "inflight": 1}
            c = httpx.delete(url + "/admin/drain", headers=AUTH, timeout=10)
            assert c.status_code == 409 and c.json()["error"]["code"] == "shutting_down"
            assert httpx.get(url + "/ready", timeout=10).status_code == 503
            _read_to_end(first, lines)
        assert server.proc.wait(timeout=60) == 0, server.log()[-3000:]
        assert "drained" in server.log()
    finally:
        server.stop()
