"""Cost picking through the real router over HTTP on 127.0.0.1 (stub workers of
tests/router/router_stub.py): a cold burst sharing a new prefix is prefilled on at most two pods.
No timing is asserted: the stubs hold every request until all of them have arrived, so each pick
sees every earlier request open (the order they arrive in does not change the split)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from goodput.router.app import POD_HEADER
from router_stub import StubState
from test_router_app import HANG_GUARD_S, fleet, sample, wait_until

# ~1,500 tokens of English: 6,000 characters, 23 whole chunks of 256 and 112 characters of a 24th
PREFIX = ("You are a careful assistant for the billing team. Answer from the policy below. " * 80)[:6000]


def test_a_cold_burst_sharing_a_new_prefix_stays_on_two_pods():
    """16 requests sharing a new ~1,500-token prefix, all open at once, to 3 pods. Each is 24
    chunks (the 24th: the prefix's last 112 characters and the request's own question), 23
    shared; request_cost 2. The first goes to the rendezvous pod P1 (cost 26); the next see its
    pending prefill as held: P1 costs 26 + 3 (k - 2) + 3, another pod 24 + 2 + 23 = 49, so P1
    takes requests 1-8 (8 x 29 .. 47 <= 49) and P2 the other 8 (29 .. 47 <= 49 < P1's 50).
    Counting requests instead (the bounded-load rule) split it 6/5/5: every pod prefilled it."""
    hold = threading.Event()
    stubs = [StubState("m1", name, hold=hold) for name in "ABC"]
    with fleet({"m1": stubs}) as r:
        def one(i: int) -> httpx.Response:
            return httpx.post(r.url + "/v1/completions", timeout=HANG_GUARD_S,
                              json={"model": "m1", "prompt": PREFIX + f" Question {i}: what is due?",
                                    "max_tokens": 4})
        with ThreadPoolExecutor(16) as pool:
            futs = [pool.submit(one, i) for i in range(16)]
            wait_until(lambda: sum(s.received() for s in stubs) == 16, "16 requests at the pods")
            split = sorted((s.received() for s in stubs), reverse=True)
            hold.set()
            out = [f.result() for f in futs]
        assert all(x.status_code == 200 for x in out), [x.status_code for x in out]
        assert split == [8, 8, 0], split
        assert len({x.headers[POD_HEADER] for x in out}) == 2
        # decisions: 1 rendezvous (the first), 14 affinity (they joined a pending prefill), 1 moved by load
        got = {reason: sample(r.url, "goodput_router_decisions_total", reason=reason)
               for reason in ("rendezvous", "affinity", "load_bound_fallback")}
        assert got == {"rendezvous": 1, "affinity": 14, "load_bound_fallback": 1}
        # every request ended: the pods' work and the pending holds are back to nothing
        router = r.server.config.app.router
        wait_until(lambda: all(p.work == 0 and p.in_flight == 0 for svc in router.fleet.services()
                               for p in svc.pods.values()), "work released")
        assert router.index.held() == 0
