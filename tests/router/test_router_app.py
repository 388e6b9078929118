"""The router over real HTTP: upstream stubs (tests/router/router_stub.py) on 127.0.0.1 ports,
the router app served by uvicorn, the real ``openai`` client and httpx as clients.

No timing is asserted: waits poll a condition with a generous hang guard.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import openai
import pytest
from goodput.router.app import POD_HEADER, RouterSettings, create_app
from goodput.router.discovery_static import StaticDiscovery
from prometheus_client.parser import text_string_to_metric_families
from router_stub import ServerThread, StubState, make_stub

HANG_GUARD_S = 60.0


def wait_until(cond, what: str):
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


def router_metrics(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(url: str, name: str, **labels) -> float:
    return router_metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


@contextlib.contextmanager
def fleet(models: dict[str, list[StubState]], extra_urls: dict[str, list[str]] | None = None, pick_cfg=None,
          **settings):
    """Start every stub, then the router with ``--static model=urls`` for each model."""
    with contextlib.ExitStack() as stack:
        urls: dict[str, list[str]] = {m: [] for m in models}
        servers: dict[str, list[ServerThread]] = {m: [] for m in models}
        for m, stubs in models.items():
            for st in stubs:
                servers[m].append(stack.enter_context(ServerThread(make_stub(st))))
                urls[m].append(servers[m][-1].url)
        for m, more in (extra_urls or {}).items():
            urls.setdefault(m, []).extend(more)
        settings.setdefault("scrape_period_s", 0.05)
        s = RouterSettings(**settings)
        disc = StaticDiscovery([f"{m}={','.join(u)}" for m, u in urls.items()],
                               startup_timeout_s=s.hold_timeout_s, period_s=s.scrape_period_s)
        router = stack.enter_context(ServerThread(create_app(disc, s, pick_cfg=pick_cfg)))
        wait_until(lambda: httpx.get(router.url + "/ready").status_code == 200, "router ready")
        router.stub_urls, router.stub_servers = urls, servers
        yield router


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)


def pod_of(router, model: str, i: int) -> str:
    return router.stub_urls[model][i].removeprefix("http://")


# ---------------------------------------------------------------------------------- routing


def test_routes_by_model_streaming_and_not():
    a, b = StubState("m1", "A"), StubState("m2", "B")
    with fleet({"m1": [a], "m2": [b]}) as r:
        c = client(r)
        out = c.completions.create(model="m1", prompt="hello", max_tokens=3)
        assert out.choices[0].text == "A-0 A-1 A-2 "
        chat = c.chat.completions.create(model="m2", messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content == "B-0 B-1 B-2 "
        pieces = [ev.choices[0].delta.content for ev in c.chat.completions.create(
            model="m2", messages=[{"role": "user", "content": "hi"}], stream=True)]
        assert pieces == ["B-0 ", "B-1 ", "B-2 "]
        assert (a.received(), b.received()) == (1, 2)
        # the body reached the pod unchanged
        assert b.bodies[0] == {"model": "m2", "messages": [{"role": "user", "content": "hi"}]}
        for m, pod, n in (("m1", pod_of(r, "m1", 0), 1), ("m2", pod_of(r, "m2", 0), 2)):
            # a stream is counted when the router closes it, just after the client saw its end
            wait_until(lambda m=m, pod=pod, n=n: sample(r.url, "goodput_router_requests_total", namespace="",
                                                        inferenceservice=m, model=m, pod=pod,
                                                        outcome="success") == n, f"{n} successes for {m}")


def test_unknown_model_is_404_naming_it():
    with fleet({"m1": [StubState("m1", "A")]}) as r:
        with pytest.raises(openai.NotFoundError) as e:
            client(r).completions.create(model="nope", prompt="x")
        body = e.value.response.json()
        assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == "model_not_found"
        assert "'nope'" in body["error"]["message"] and "'m1'" in body["error"]["message"]
        assert httpx.get(r.url + "/v1/models/nope").status_code == 404


@pytest.mark.parametrize("content,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"", 400, "empty body"),
    (b"[1, 2]", 400, "JSON array"),
    (b'{"prompt": "x"}', 400, "'model' is a required parameter"),
    (b'{"model": 3, "prompt": "x"}', 400, "'model' must be"),
    (json.dumps({"model": "m1", "prompt": "x" * 2000}).encode(), 413, "1000 bytes"),
])
def test_bad_input(content, status, needle):
    st = StubState("m1", "A")
    with fleet({"m1": [st]}, max_body_bytes=1000) as r:
        resp = httpx.post(r.url + "/v1/completions", content=content,
                          headers={"content-type": "application/json"})
        assert resp.status_code == status
        err = resp.json()["error"]
        assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
        assert st.received() == 0


def test_models_aggregated_and_by_id():
    with fleet({"m2": [StubState("m2", "B")], "m1": [StubState("m1", "A")]}) as r:
        models = client(r).models.list()
        assert [m.id for m in models.data] == ["m1", "m2"]
        card = httpx.get(r.url + "/v1/models/m1").json()
        assert card["id"] == "m1" and card["max_model_len"] == 512  # the pod's own card


def test_tokenize_by_model():
    with fleet({"m1": [StubState("m1", "A")], "m2": [StubState("m2", "B")]}) as r:
        out = httpx.post(r.url + "/tokenize", json={"model": "m2", "prompt": "ab"}).json()
        assert out["tokens"] == [ord("a"), ord("b")] and out["pod"] == "B"
        assert httpx.post(r.url + "/tokenize", json={"model": "zz", "prompt": "ab"}).status_code == 404


# ---------------------------------------------------------------------------------- streaming


def test_sse_passed_through_event_by_event():
    st = StubState("m1", "A", chunks=3, gate=threading.Semaphore(0))
    with fleet({"m1": [st]}) as r:
        with httpx.stream("POST", r.url + "/v1/completions", timeout=HANG_GUARD_S,
                          json={"model": "m1", "prompt": "x", "stream": True}) as resp:
            assert resp.status_code == 200 and resp.headers[POD_HEADER] == pod_of(r, "m1", 0)
            lines = resp.iter_lines()
            got = []
            for _ in range(3):
                line = next(lines)
                while not line:
                    line = next(lines)
                got.append(line)
                # the pod has not produced the next event yet: this one came through alone
                st.gate.release()
            rest = [x for x in lines if x]
        texts = [json.loads(x.removeprefix("data: "))["choices"][0]["text"] for x in got]
        assert texts == ["A-0 ", "A-1 ", "A-2 "] and rest == ["data: [DONE]"]


def test_client_gone_mid_stream_aborts_upstream():
    st = StubState("m1", "A", chunks=3, gate=threading.Semaphore(0))  # never released
    with fleet({"m1": [st]}) as r:
        with httpx.stream("POST", r.url + "/v1/completions", timeout=HANG_GUARD_S,
                          json={"model": "m1", "prompt": "x", "stream": True}) as resp:
            first = next(x for x in resp.iter_lines() if x)
            assert "A-0" in first
        # the client closed its connection: the router closes the upstream one
        wait_until(st.aborted.is_set, "upstream stream cancelled")
        wait_until(lambda: sample(r.url, "goodput_router_requests_total", namespace="", inferenceservice="m1",
                                  model="m1", pod=pod_of(r, "m1", 0), outcome="client_abort") == 1,
                   "client_abort counted")


def test_upstream_gone_mid_stream_ends_with_error_event():
    # the pod sends event 0, waits for the gate, then drops the connection
    st = StubState("m1", "A", chunks=3, die_after=1, gate=threading.Semaphore(0))
    with fleet({"m1": [st]}) as r:
        pieces = []
        with pytest.raises(openai.APIError) as e:
            for ev in client(r).completions.create(model="m1", prompt="x", stream=True):
                pieces.append(ev.choices[0].text)
                st.gate.release()
        assert pieces == ["A-0 "] and "mid-stream" in str(e.value)
        with httpx.stream("POST", r.url + "/v1/completions", timeout=HANG_GUARD_S,
                          json={"model": "m1", "prompt": "x", "stream": True}) as resp:
            lines = resp.iter_lines()
            first = next(x for x in lines if x)
            st.gate.release()
            rest = [x for x in lines if x]
        assert "A-0" in first and len(rest) == 1  # one error event, no [DONE]
        err = json.loads(rest[0].removeprefix("data: "))["error"]
        assert err["code"] == "upstream_error" and pod_of(r, "m1", 0) in err["message"]
        # counted when the router closes the upstream response, just after the client's stream ended
        wait_until(lambda: sample(r.url, "goodput_router_requests_total", namespace="", inferenceservice="m1",
                                  model="m1", pod=pod_of(r, "m1", 0), outcome="error") == 2, "2 errors counted")


# ---------------------------------------------------------------------------------- readiness


def test_no_ready_pod_holds_then_503_with_retry_after():
    st = StubState("m1", "A", draining=True)  # /ready 503 throughout
    with fleet({"m1": [st]}, hold_timeout_s=0.3, retry_after_s=3) as r:
        resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": "x"}, timeout=HANG_GUARD_S)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
        assert resp.json()["error"]["code"] == "no_ready_pod"
        assert st.received() == 0
        m = router_metrics(r.url)
        assert m[("goodput_router_held_requests", (("inferenceservice", "m1"), ("namespace", "")))] == 0
        assert m[("goodput_router_requests_total", (("inferenceservice", "m1"), ("model", "m1"),
                                                    ("namespace", ""), ("outcome", "timeout"), ("pod", "")))] == 1
        assert m[("goodput_router_decisions_total", (("reason", "held"),))] == 1


def test_known_service_exports_zero_series_before_its_first_request():
    """Per-service series exist from discovery on, at 0, so Prometheus' rate() counts the first
    requests (a series born at 4 reads as no increase)."""
    with fleet({"m1": [StubState("m1", "A")]}) as r:
        m = router_metrics(r.url)
        svc = (("inferenceservice", "m1"), ("namespace", ""))
        for name in ("goodput_router_held_requests", "goodput_router_queued_requests",
                     "goodput_router_queue_wait_seconds_count", "goodput_router_upstream_ttft_seconds_count"):
            assert m[(name, svc)] == 0, name
        assert m[("goodput_router_queue_wait_seconds_bucket", (("inferenceservice", "m1"), ("le", "+Inf"), ("namespace", "")))] == 0


def test_held_request_served_when_a_pod_turns_ready():
    st = StubState("m1", "A", draining=True)
    with fleet({"m1": [st]}, hold_timeout_s=HANG_GUARD_S) as r:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            r.url + "/v1/completions", json={"model": "m1", "prompt": "x"}, timeout=HANG_GUARD_S)))
        t.start()
        wait_until(lambda: sample(r.url, "goodput_router_held_requests", namespace="", inferenceservice="m1") == 1,
                   "request held")
        st.draining = False  # the pod turns Ready (scale from zero done)
        t.join(HANG_GUARD_S)
        assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == "A-0 A-1 A-2 "
        assert sample(r.url, "goodput_router_held_requests", namespace="", inferenceservice="m1") == 0


def test_scale_from_zero_learns_the_new_pods_limits_before_sending_held_requests():
    hold = threading.Semaphore(0)
    # not Ready and its limits unknown; once Ready: 1 + 1 in flight, router queue bound 1
    st = StubState("m1", "A", draining=True, metrics_when_ready=True, hold=hold, max_num_seqs=1, max_waiting=1)
    with fleet({"m1": [st]}, hold_timeout_s=HANG_GUARD_S) as r:
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(httpx.post(
            r.url + "/v1/completions", json={"model": "m1", "prompt": f"h{i}"}, timeout=HANG_GUARD_S)))
            for i in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: sample(r.url, "goodput_router_held_requests", namespace="", inferenceservice="m1") == 3,
                   "3 held")
        st.draining = False
        wait_until(lambda: st.received() == 2 and sample(r.url, "goodput_router_queued_requests", namespace="",
                                                         inferenceservice="m1") == 1, "2 sent, 1 queued")
        assert st.received() == 2  # the third waits in the router, not in the pod's queue
        for _ in range(3):
            hold.release()
        for t in threads:
            t.join(HANG_GUARD_S)
        assert [x.status_code for x in results] == [200, 200, 200] and st.received() == 3


def test_draining_pod_gets_no_new_request():
    a, b = StubState("m1", "A"), StubState("m1", "B")
    with fleet({"m1": [a, b]}) as r:
        a.draining = True  # /ready 503 draining and generate 503 draining
        served = set()
        for i in range(8):
            resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": f"p{i} " * 100},
                              timeout=HANG_GUARD_S)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"].startswith("B-0")
            served.add(resp.headers[POD_HEADER])
        assert served == {pod_of(r, "m1", 1)}
        # A refused at most the first request that reached it before the router knew (then retried)
        assert a.received() <= 1 and b.received() == 8


def test_pod_429_retried_on_another_pod_else_passed_through():
    a, b = StubState("m1", "A", refuse=True), StubState("m1", "B")
    with fleet({"m1": [a, b]}) as r:
        for i in range(8):
            resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": f"r{i} " * 100},
                              timeout=HANG_GUARD_S)
            assert resp.status_code == 200 and resp.headers[POD_HEADER] == pod_of(r, "m1", 1)
        assert b.received() == 8
        b.refuse = True  # no pod with room: the pod's own 429 reaches the client
        resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": "z"}, timeout=HANG_GUARD_S)
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "queue_full"


def test_retry_on_connection_refused_before_first_byte():
    a, b = StubState("m1", "A"), StubState("m1", "B")
    # one probe (both Ready), then none: the router keeps believing A Ready after it stops
    with fleet({"m1": [a, b]}, scrape_period_s=3600) as r:
        r.stub_servers["m1"][0].__exit__(None, None, None)  # A's port now refuses connections
        served = set()
        for i in range(12):
            resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": f"q{i} " * 100},
                              timeout=HANG_GUARD_S)
            assert resp.status_code == 200
            served.add(resp.headers[POD_HEADER])
        assert served == {pod_of(r, "m1", 1)} and b.received() == 12


def test_queue_bound_then_429_with_retry_after_and_priority_order():
    hold = threading.Semaphore(0)
    # capacity max_num_seqs + max_waiting = 1 + 2 = 3 in flight; router queue bound = max_waiting = 2
    st = StubState("m1", "A", hold=hold, max_num_seqs=1, max_waiting=2)
    with fleet({"m1": [st]}, retry_after_s=2) as r:
        wait_until(lambda: _limits_seen(r), "limits scraped")
        results: dict[str, httpx.Response] = {}

        def send(name, priority):
            results[name] = httpx.post(r.url + "/v1/completions", timeout=HANG_GUARD_S,
                                       json={"model": "m1", "prompt": name, "priority": priority})

        threads = [threading.Thread(target=send, args=(f"in{i}", 0)) for i in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: st.received() == 3, "3 in flight at the pod")
        queued = [("low", 5), ("high", -1)]
        for name, prio in queued:
            t = threading.Thread(target=send, args=(name, prio))
            threads.append(t)
            t.start()
            n = len(threads) - 3
            wait_until(lambda n=n: sample(r.url, "goodput_router_queued_requests", namespace="",
                                          inferenceservice="m1") == n, f"{n} queued")
        over = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": "over"}, timeout=HANG_GUARD_S)
        assert over.status_code == 429 and over.headers["retry-after"] == "2"
        assert over.json()["error"]["code"] == "queue_full" and st.received() == 3
        # one slot frees at a time: the queue's head goes first
        hold.release()
        wait_until(lambda: st.received() == 4, "the first queued request sent")
        hold.release()
        wait_until(lambda: st.received() == 5, "the second queued request sent")
        for _ in range(3):
            hold.release()
        for t in threads:
            t.join(HANG_GUARD_S)
        assert all(results[n].status_code == 200 for n in ("in0", "in1", "in2", "low", "high"))
        # the queue let the better priority (lower value) in first
        assert [b["prompt"] for b in st.bodies[3:]] == ["high", "low"]
        assert sample(r.url, "goodput_router_requests_total", namespace="", inferenceservice="m1", model="m1",
                      pod="", outcome="refused") == 1
        assert sample(r.url, "goodput_router_queued_requests", namespace="", inferenceservice="m1") == 0


def _limits_seen(r) -> bool:
    """The router read the pod's limits: ``/ready`` does not say, so ask the app object."""
    pods = [p for s in r.server.config.app.state.router.fleet.services() for p in s.pods.values()]
    return all(p.max_num_seqs is not None and p.max_waiting is not None for p in pods)


class _DropFirstPost:
    """A raw HTTP/1.1 server on 127.0.0.1: GET /ready → 200; the first POST's connection is closed
    without an answer (what a pod closing a pooled keep-alive connection looks like), later POSTs
    get a JSON completion."""

    def __init__(self):
        self.posts = 0
        self.loop = None
        self.port = None
        self.started = threading.Event()

    async def _handle(self, reader, writer):
        import asyncio
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = next((int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length:")), 0)
                if length:
                    await reader.readexactly(length)
                if lines[0].startswith("POST"):
                    self.posts += 1
                    if self.posts == 1:
                        writer.close()
                        return
                    body = json.dumps({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}).encode()
                elif lines[0].startswith("GET /ready"):
                    body = b'{"status": "ready"}'
                else:
                    body = b"{}"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def run(self):
        import asyncio

        async def main():
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self.loop = asyncio.get_running_loop()
            self.stop = asyncio.Event()
            self.started.set()
            async with server:
                await self.stop.wait()
        asyncio.run(main())


def test_closed_connection_before_first_byte_retried_on_the_same_pod_once():
    srv = _DropFirstPost()
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    assert srv.started.wait(HANG_GUARD_S)
    try:
        with fleet({}, extra_urls={"m1": [f"http://127.0.0.1:{srv.port}"]}) as r:
            resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": "x"}, timeout=HANG_GUARD_S)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "ok"
            assert srv.posts == 2  # the dropped one, then the retry on a new connection
    finally:
        srv.loop.call_soon_threadsafe(srv.stop.set)
        t.join(HANG_GUARD_S)


def test_a_conversation_stays_on_its_pod():
    stubs = [StubState("m1", n) for n in "ABC"]
    system = "You are a careful assistant. " * 12  # > one 256-character chunk
    with fleet({"m1": stubs}) as r:
        c = client(r)
        for conv in range(3):
            msgs = [{"role": "system", "content": system}]
            pods = []
            for turn in range(4):
                msgs.append({"role": "user", "content": f"conversation {conv}, question {turn}: " + "why? " * 20})
                raw = c.chat.completions.with_raw_response.create(model="m1", messages=msgs)
                pods.append(raw.headers[POD_HEADER])
                msgs.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
            assert len(set(pods)) == 1, pods
        # only the very first request found nothing in the index; every later one matched at least
        # the shared system prompt's chunk (one at a time: the load bound never moved one)
        assert sample(r.url, "goodput_router_decisions_total", reason="rendezvous") == 1
        assert sample(r.url, "goodput_router_decisions_total", reason="affinity") == 3 * 4 - 1
