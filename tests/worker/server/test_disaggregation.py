"""Disaggregated prefill and decode with the real bundled model: a prefill worker and a decode
worker (two processes on 127.0.0.1), as the router drives them (docs/disaggregation.md).

Greedy output through the two workers must equal colocated serving token for token; the reference
is the prefill worker itself serving the plain request under another ``cache_salt`` (so it
computes the prompt from scratch, as a colocated worker does). The KV byte counters must equal
2·L·n_kv·d_head·bytes·T for the T tokens moved (SmolLM2-135M in fp32: 2·30·3·64·4 = 46080 bytes
per token); a dead, stalled or refusing prefill worker must end in a local prefill with the same
output; no lease may outlive the test."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from conftest import SMOLLM2_FP32_KV_BYTES_PER_TOKEN, free_port, start_server
from goodput.api.disagg import (
    KV_HANDLE_HEADER,
    KV_SOURCE_HEADER,
    REMOTE_PREFILL_HEADER,
    STREAM_VERSION,
    KvLayout,
    KvStreamHeader,
    encode_frame,
    encode_stream_header,
    tokens_digest,
)
from server_utils import TIMEOUT, metrics, parse_sse

pytestmark = pytest.mark.slow

COMMON = ["--dtype", "float32", "--kv-cache-memory", "48MiB", "--max-model-len", "1024",
          "--revision", "pd-test", "--kv-transfer-timeout-seconds", "8"]
BPT = SMOLLM2_FP32_KV_BYTES_PER_TOKEN  # 46080


@pytest.fixture(scope="module")
def pd():
    p = start_server(COMMON + ["--role", "prefill"])
    try:
        d = start_server(COMMON + ["--role", "decode"])
    except BaseException:
        p.stop()
        raise
    try:
        yield p.url, d.url
    finally:
        d.stop()
        p.stop()


def gauge(url: str, name: str, **labels) -> float:
    return metrics(url)[(name, tuple(sorted(labels.items())))]


def prefill(p: str, body: dict) -> dict:
    r = httpx.post(p + "/v1/completions", json=body, headers={REMOTE_PREFILL_HEADER: "1"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def decode(d: str, body: dict, handle: str, source: str, stream: bool = False) -> list[int]:
    headers = {KV_HANDLE_HEADER: handle, KV_SOURCE_HEADER: source}
    if stream:
        with httpx.stream("POST", d + "/v1/completions", json={**body, "stream": True}, headers=headers,
                          timeout=TIMEOUT) as r:
            assert r.status_code == 200, r.read()
            events, done = parse_sse(r.iter_lines())
        assert done
        return [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    r = httpx.post(d + "/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def colocated(url: str, body: dict, salt: str) -> list[int]:
    r = httpx.post(url + "/v1/completions", json={**body, "cache_salt": salt}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def long_prompt(url: str, n: int, topic: str) -> list[int]:
    """``n`` token ids of a text that starts with ``topic`` (prompts of different topics share no
    KV block, so no worker's prefix cache holds another's)."""
    text = ("The river carried the autumn leaves past the old mill, where the miller counted sacks of "
            "grain and told stories about the winters of his youth. ")
    ids = httpx.post(url + "/tokenize", json={"prompt": topic + ". " + text * 30}, timeout=TIMEOUT).json()["tokens"]
    assert len(ids) >= n
    return ids[:n]


def test_remote_prefill_greedy_output_equals_colocated(pd):
    p, d = pd
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               long_prompt(p, 700, "Mills"), long_prompt(p, 33, "Rivers")]
    sent0 = gauge(p, "goodput_kv_transfer_bytes_total", direction="sent")
    recv0 = gauge(d, "goodput_kv_transfer_bytes_total", direction="received")
    moved = 0
    for i, prompt in enumerate(prompts):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
                "ignore_eos": True}
        res = prefill(p, body)
        n = res["prompt_tokens"]
        assert res["kv_bytes"] == BPT * n and res["kv"]["revision"] == "pd-test"
        got = decode(d, body, res["handle"], p, stream=i % 2 == 1)
        want = colocated(p, body, salt=f"reference-{i}")
        assert got == want, f"prompt {i} ({n} tokens)"
        assert got[0] == res["first_token_id"]
        moved += n
        # the pulled lease is freed at once
        r = httpx.delete(p + f"/kv/leases/{res['handle']}", timeout=TIMEOUT)
        assert r.status_code == 404
    assert gauge(p, "goodput_kv_transfer_bytes_total", direction="sent") - sent0 == BPT * moved
    assert gauge(d, "goodput_kv_transfer_bytes_total", direction="received") - recv0 == BPT * moved
    assert gauge(d, "goodput_prefills_total", where="remote") == len(prompts)
    assert gauge(d, "goodput_kv_transfer_seconds_count") == len(prompts)
    assert gauge(p, "goodput_kv_leases") == 0 and gauge(p, "goodput_kv_leased_blocks") == 0


def test_decode_worker_pulls_only_what_its_prefix_cache_lacks(pd):
    p, d = pd
    base = long_prompt(p, 200, "Partial")
    body0 = {"prompt": base[:70], "max_tokens": 2, "temperature": 0}
    assert httpx.post(d + "/v1/completions", json=body0, timeout=TIMEOUT).status_code == 200
    # the decode worker now holds blocks 0-3 (64 tokens) of the prompt
    body = {"prompt": base[:150], "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    recv0 = gauge(d, "goodput_kv_transfer_bytes_total", direction="received")
    res = prefill(p, body)
    got = decode(d, body, res["handle"], p)
    assert gauge(d, "goodput_kv_transfer_bytes_total", direction="received") - recv0 == BPT * (150 - 64)
    assert got == colocated(p, body, salt="reference-partial")


def test_cancel_between_the_phases_frees_the_lease(pd):
    p, _ = pd
    res = prefill(p, {"prompt": "Cancel me, please, after the prefill", "max_tokens": 5})
    assert gauge(p, "goodput_kv_leases") == 1
    assert gauge(p, "goodput_kv_leased_blocks") == 1
    assert httpx.delete(p + f"/kv/leases/{res['handle']}", timeout=TIMEOUT).status_code == 204
    assert httpx.delete(p + f"/kv/leases/{res['handle']}", timeout=TIMEOUT).status_code == 404
    assert httpx.get(p + f"/kv/leases/{res['handle']}", timeout=TIMEOUT).status_code == 404
    assert gauge(p, "goodput_kv_leases") == 0 and gauge(p, "goodput_kv_leased_blocks") == 0


def test_roles_and_bad_headers_are_refused_clearly(pd):
    p, d = pd
    body = {"prompt": "Hello", "max_tokens": 2}
    r = httpx.post(d + "/v1/completions", json=body, headers={REMOTE_PREFILL_HEADER: "1"}, timeout=TIMEOUT)
    assert r.status_code == 400 and "role is 'decode'" in r.json()["error"]["message"]
    r = httpx.post(p + "/v1/completions", json={**body, "n": 2}, headers={REMOTE_PREFILL_HEADER: "1"},
                   timeout=TIMEOUT)
    assert r.status_code == 400 and "1 prompt(s) x 2 choice(s)" in r.json()["error"]["message"]
    r = httpx.post(d + "/v1/completions", json=body, headers={KV_HANDLE_HEADER: "abc"}, timeout=TIMEOUT)
    assert r.status_code == 400 and KV_SOURCE_HEADER in r.json()["error"]["message"]
    r = httpx.post(d + "/v1/completions", json=body, headers={KV_HANDLE_HEADER: "a b",
                                                               KV_SOURCE_HEADER: p}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == KV_HANDLE_HEADER
    r = httpx.post(d + "/v1/completions", json=body, headers={KV_HANDLE_HEADER: "abc",
                                                               KV_SOURCE_HEADER: "file:///etc"}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == KV_SOURCE_HEADER
    assert httpx.get(p + "/kv/leases/nope", timeout=TIMEOUT).status_code == 404


class RawServer:
    """A TCP server on 127.0.0.1 that answers every connection with ``reply`` and then either
    hangs (``close=False``: a stalled prefill worker) or closes (a prefill worker that died)."""

    def __init__(self, reply: bytes, close: bool) -> None:
        self.reply, self.close = reply, close
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            c.recv(65536)
            c.sendall(self.reply)
            if self.close:
                c.close()

    def stop(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _stream_reply(prompt_ids: list[int], revision: str = "pd-test") -> bytes:
    """An HTTP answer with a valid stream header (the decode worker's layout unless ``revision``
    says otherwise) and one of the prompt's 2 blocks, although its length announces both."""
    kv = KvLayout(revision=revision, dtype="float32", block_size=16, layout="layer,kv,token,head,dim",
                  num_layers=30, num_kv_heads=3, head_dim=64)
    h = KvStreamHeader(version=STREAM_VERSION, handle="fake", kv=kv, num_tokens=len(prompt_ids), first_block=0,
                       num_blocks=2, first_token_id=1, tokens_digest=tokens_digest(prompt_ids))
    body = encode_stream_header(h) + encode_frame(0, 16) + bytes(16 * BPT)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/x-goodput-kv\r\n"
            b"content-length: %d\r\n\r\n" % (len(body) + 8 + 4 * BPT)) + body


@pytest.mark.parametrize("case, reason", [("dead", "error"), ("stalled", "timeout"),
                                          ("died mid-stream", "error"), ("other revision", "mismatch")])
def test_a_failed_transfer_falls_back_to_a_local_prefill(pd, case, reason):
    p, d = pd
    ids = long_prompt(p, 20, f"Failure case {case}")
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    server = None
    if case == "dead":
        source = f"http://127.0.0.1:{free_port()}"  # nothing listens
    elif case == "stalled":  # answers, then never sends the rest: the pull's deadline ends it
        server = RawServer(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\nGPKV", close=False)
    elif case == "died mid-stream":
        server = RawServer(_stream_reply(ids), close=True)
    else:  # a prefill worker of another model revision: refused at the header
        server = RawServer(_stream_reply(ids, revision="pd-other"), close=False)
    source = server.url if server is not None else source
    before = gauge(d, "goodput_kv_transfer_fallbacks_total", reason=reason)
    local0 = gauge(d, "goodput_prefills_total", where="local")
    try:
        got = decode(d, body, "fake", source)
    finally:
        if server is not None:
            server.stop()
    assert gauge(d, "goodput_kv_transfer_fallbacks_total", reason=reason) == before + 1
    assert gauge(d, "goodput_prefills_total", where="local") == local0 + 1
    assert got == colocated(p, body, salt=f"reference-{case}")


def test_a_request_a_decode_worker_cannot_import_is_served_and_its_lease_deleted(pd):
    p, d = pd
    body = {"prompt": "Tell me about the sea", "max_tokens": 4, "temperature": 0}
    res = prefill(p, body)
    assert gauge(p, "goodput_kv_leases") == 1
    before = gauge(d, "goodput_kv_transfer_fallbacks_total", reason="unsupported")
    r = httpx.post(d + "/v1/completions", json={**body, "logprobs": 2},
                   headers={KV_HANDLE_HEADER: res["handle"], KV_SOURCE_HEADER: p}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert gauge(d, "goodput_kv_transfer_fallbacks_total", reason="unsupported") == before + 1
    deadline = time.monotonic() + 60  # the DELETE runs in the background
    while gauge(p, "goodput_kv_leases") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gauge(p, "goodput_kv_leases") == 0


def test_no_lease_or_block_outlives_the_requests(pd):
    p, d = pd
    for url in (p, d):
        assert gauge(url, "goodput_kv_leases") == 0
        assert gauge(url, "goodput_requests_running") == 0
        assert gauge(url, "goodput_kv_cache_usage_ratio") == 0


def test_through_the_router_long_prompts_go_remote_and_short_ones_stay_local(pd):
    from goodput.router.app import RouterSettings, create_app
    from goodput.router.discovery_static import StaticDiscovery
    from server_utils import ServerThread

    p, d = pd
    disc = StaticDiscovery([f"smollm2={p}#prefill,{d}#decode"], period_s=0.2)
    # 128 tokens ~ 512 characters = 2 chunks of 256: more than 2 uncached chunks go to the prefill worker
    with ServerThread(create_app(disc, RouterSettings(scrape_period_s=0.2, pd_remote_prefill_min_tokens=128))) as r:
        deadline = time.monotonic() + 60
        while httpx.get(r.url + "/ready", timeout=TIMEOUT).status_code != 200:
            assert time.monotonic() < deadline, "router not ready"
            time.sleep(0.05)
        remote0 = gauge(d, "goodput_prefills_total", where="remote")
        text = "Routers and tides. " + "The harbour master logged each ship that came in with the tide. " * 20
        body = {"model": "smollm2", "prompt": text, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
        via = httpx.post(r.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert via.status_code == 200, via.text
        assert via.json()["choices"][0]["token_ids"] == colocated(p, body, salt="reference-router")
        assert gauge(d, "goodput_prefills_total", where="remote") == remote0 + 1
        # streamed chat, long: remote too, the same text as colocated
        msgs = [{"role": "user", "content": "Summarise: " + text}]
        chat = {"model": "smollm2", "messages": msgs, "max_tokens": 8, "temperature": 0}
        with httpx.stream("POST", r.url + "/v1/chat/completions", json={**chat, "stream": True},
                          timeout=TIMEOUT) as s:
            events, done = parse_sse(s.iter_lines())
        assert done
        streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        ref = httpx.post(p + "/v1/chat/completions", json={**chat, "cache_salt": "reference-chat"}, timeout=TIMEOUT)
        assert streamed == ref.json()["choices"][0]["message"]["content"]
        assert gauge(d, "goodput_prefills_total", where="remote") == remote0 + 2
        # a short prompt is prefilled by the decode worker itself
        short = httpx.post(r.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2},
                           timeout=TIMEOUT)
        assert short.status_code == 200
        assert gauge(d, "goodput_prefills_total", where="remote") == remote0 + 2
        m = metrics(r.url)
        assert m[("goodput_router_pd_decisions_total",
                  (("decision", "remote"), ("inferenceservice", "smollm2"), ("namespace", "")))] == 2
        assert m[("goodput_router_pd_decisions_total",
                  (("decision", "short"), ("inferenceservice", "smollm2"), ("namespace", "")))] == 1
    assert gauge(p, "goodput_kv_leases") == 0
