"""Drain-safe shutdown of a real worker process: SIGTERM while a stream is in flight.

The worker must turn unready (GET /ready 503 "draining"), refuse new generate requests with 503
and an OpenAI error body (code ``draining``), finish the in-flight stream to its natural end
(``finish_reason`` length, every token, ``[DONE]``) and then exit 0 on its own.
"""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from conftest import start_server
from server_utils import TIMEOUT

MAX_TOKENS = 120  # long enough that the checks below run while the stream is still generating


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

        assert server.proc.wait(timeout=60) == 0, server.log()[-3000:]
        assert "drained" in server.log()
    finally:
        server.stop()
