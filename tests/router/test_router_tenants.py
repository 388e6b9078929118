"""Tenants in the router's fleet queue over real HTTP on 127.0.0.1 (stub worker of
tests/router/router_stub.py): a flooding tenant cannot crowd a light one out of a full queue,
tenants of a band take turns, a request's own queue timeout gives 429 with Retry-After. No
timing is asserted: the stub holds each request until the test releases it."""
from __future__ import annotations

import threading

import httpx
from router_stub import StubState
from test_router_app import HANG_GUARD_S, _limits_seen, fleet, sample, wait_until


def test_a_flooder_cannot_crowd_a_light_tenant_out_of_a_full_queue():
    hold = threading.Semaphore(0)
    # capacity max_num_seqs + max_waiting = 1 + 3 = 4 in flight; router queue bound = max_waiting = 3
    st = StubState("m1", "A", hold=hold, max_num_seqs=1, max_waiting=3)
    with fleet({"m1": [st]}, retry_after_s=2) as r:
        wait_until(lambda: _limits_seen(r), "limits scraped")
        results: dict[str, httpx.Response] = {}

        def send(name: str, headers: dict[str, str] | None = None, user: str | None = None) -> None:
            body = {"model": "m1", "prompt": name, **({"user": user} if user else {})}
            results[name] = httpx.post(r.url + "/v1/completions", json=body, headers=headers or {},
                                       timeout=HANG_GUARD_S)

        def queued() -> float:
            return sample(r.url, "goodput_router_queued_requests", namespace="", inferenceservice="m1")

        flood = {"x-goodput-tenant": "flood"}
        threads = [threading.Thread(target=send, args=(f"f{i}", flood)) for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: st.received() == 4, "4 in flight at the pod")
        # a request's own queue timeout (0 s): 429 queue_timeout with Retry-After, nothing else queued
        send("impatient", {"x-goodput-tenant": "other", "x-goodput-queue-timeout": "0"})
        assert results["impatient"].status_code == 429 and results["impatient"].headers["retry-after"] == "2"
        assert results["impatient"].json()["error"]["code"] == "queue_timeout"
        bad = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": "x"},
                         headers={"x-goodput-queue-timeout": "soon"}, timeout=HANG_GUARD_S)
        assert bad.status_code == 400
        # the flooder fills the queue (3 of 3), one at a time so their order is known
        for i in range(4, 7):
            t = threading.Thread(target=send, args=(f"f{i}", flood))
            threads.append(t)
            t.start()
            wait_until(lambda n=i - 3: queued() == n, f"{i - 3} queued")
        # the light tenant (the body's "user"): flood holds 3 queued > 0 + 1 -> the flooder's newest
        # (f6) gets 429 queue_full with Retry-After and the light request takes its place
        light = threading.Thread(target=send, args=("light",), kwargs={"user": "light"})
        light.start()
        threads.append(light)
        wait_until(lambda: "f6" in results, "the flooder's newest refused")
        assert results["f6"].status_code == 429 and results["f6"].headers["retry-after"] == "2"
        assert results["f6"].json()["error"]["code"] == "queue_full"
        assert queued() == 3
        # a second flooder request now finds flood 2, itself included, vs light 1: refused itself
        send("f7", flood)
        assert results["f7"].status_code == 429 and results["f7"].json()["error"]["code"] == "queue_full"
        # slots free one at a time: flood and light were never served from the queue, so the older
        # head goes first (f4), then light's turn (served longest ago), then f5
        for n in (5, 6, 7):
            hold.release()
            wait_until(lambda n=n: st.received() == n, f"request {n} at the pod")
        assert [b["prompt"] for b in st.bodies[4:]] == ["f4", "light", "f5"]
        for _ in range(4):
            hold.release()
        for t in threads:
            t.join(HANG_GUARD_S)
        assert results["light"].status_code == 200
        assert all(results[f"f{i}"].status_code == 200 for i in (0, 1, 2, 3, 4, 5))
        # refused: f6 (replaced), f7; timeout: impatient
        assert sample(r.url, "goodput_router_requests_total", namespace="", inferenceservice="m1", model="m1",
                      pod="", outcome="refused") == 2
        assert sample(r.url, "goodput_router_requests_total", namespace="", inferenceservice="m1", model="m1",
                      pod="", outcome="timeout") == 1


def test_requests_and_ttft_counted_per_slo_class():
    st = StubState("m1", "A")
    with fleet({"m1": [st]}, max_slo_classes=2) as r:
        sent = ["interactive", "interactive", "batch", "bulk", "bad name!", None]
        for i, cls in enumerate(sent):
            headers = {"x-goodput-slo-class": cls} if cls else {}
            resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": f"c{i}"}, headers=headers,
                              timeout=HANG_GUARD_S)
            assert resp.status_code == 200
        # the first 2 names get a label each; "bulk" is the third: "other"; no name, or not a name: ""
        want = {"interactive": 2, "batch": 1, "other": 1, "": 2}
        for cls, n in want.items():
            assert sample(r.url, "goodput_router_class_requests_total", namespace="", inferenceservice="m1",
                          slo_class=cls, outcome="success") == n, cls
            assert sample(r.url, "goodput_router_class_upstream_ttft_seconds_count", namespace="",
                          inferenceservice="m1", slo_class=cls) == n, cls
        assert sample(r.url, "goodput_router_class_requests_total", namespace="", inferenceservice="m1",
                      slo_class="bulk", outcome="success") == 0


def test_the_slo_class_header_travels_to_the_pod():
    """The worker judges a request by the class it names, so the router passes the header on as
    sent (even a name the router counts as "other" or "": the worker decides what it knows)."""
    st = StubState("m1", "A")
    with fleet({"m1": [st]}, max_slo_classes=1) as r:
        for cls in ("batch", "interactive", None):
            headers = {"x-goodput-slo-class": cls} if cls else {}
            resp = httpx.post(r.url + "/v1/completions", json={"model": "m1", "prompt": "x"}, headers=headers,
                              timeout=HANG_GUARD_S)
            assert resp.status_code == 200
        assert [h.get("x-goodput-slo-class") for h in st.headers] == ["batch", "interactive", None]
