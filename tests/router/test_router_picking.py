"""Cost picking through the real router over HTTP on 127.0.0.1 (stub workers of
tests/router/router_stub.py): a cold burst sharing a new prefix is prefilled on at most two pods.
No timing is asserted: the stubs hold every request until all of them have arrived, so each pick
sees every earlier request open (the order they arrive in does not change the split)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from goodput.router.app import POD_HEADER
from goodput.router.picker import PickConfig
from router_stub import StubState
from test_router_app import HANG_GUARD_S, fleet, sample, wait_until

# ~1,500 tokens of English: 6,000 characters, 23 whole chunks of 256 and 112 characters of a 24th
PREFIX = ("You are a careful assistant for the billing team. Answer from the policy below. " * 80)[:6000]


@pytest.mark.parametrize("request_cost, want_split, want_decisions", [
    (0, [16, 0, 0], {"rendezvous": 1, "affinity": 15, "load_bound_fallback": 0}),
    # request 9 moves to P2 (load): the only fallback; 10-16 find P2 holding the prefix too
    (2, [8, 8, 0], {"rendezvous": 1, "affinity": 14, "load_bound_fallback": 1}),
])
def test_a_cold_burst_sharing_a_new_prefix_stays_on_two_pods(request_cost, want_split, want_decisions):
    _burst(PickConfig(cost=True, request_cost=request_cost), want_split, want_decisions)


def test_a_cold_burst_stays_on_two_pods_with_the_count_picker():
    """The same burst with the count picker (``cost=False``, eps 0.25, eps_pending 1): a pending
    prefill counts as held. Request k sees k - 1 open. 1: the rendezvous pod P1. 2: P1 holds 23
    chunks pending, over the plain bound ceil(1.25 * 2 / 3) = 1 but within the pending bound
    ceil(2 * 2 / 3) = 2: P1. 3: P1 (2 open) over both (2, 2): the fallback P2 (rendezvous order
    among the empty pods). 4: P1 and P2 both hold 23 (no gain, bound ceil(4 / 3) = 2): P1 over it,
    P2 (1 open) takes it as a fallback. 5-16: both over the plain bound ceil(k / 3), both within
    ceil(2k / 3), P3 holds nothing: the holder with fewer open requests (P1 on ties), alternating:
    8/8/0. Before this rule the same burst split 6/5/5: every pod prefilled the prefix."""
    _burst(PickConfig(cost=False), [8, 8, 0], {"rendezvous": 1, "affinity": 13, "load_bound_fallback": 2})


def test_the_default_picker_is_cost_picking():
    assert PickConfig().cost is True and PickConfig().request_cost == 0


def _burst(cfg: PickConfig, want_split, want_decisions):
    """16 requests sharing a new ~1,500-token prefix, all open at once, to 3 pods. Each is 24
    chunks (the 24th: the prefix's last 112 characters and the request's own question), 23
    shared; request_cost 0 (the default). The first goes to the rendezvous pod P1 (cost 24); the
    next see its pending prefill as held: P1 scores 24 + (k - 2) + 1 for request k, another pod
    24 + 23 = 47, so P1 takes all 16 (its last: 39 <= 47). With request_cost 2 (below) P1
    scores 26 + 3 (k - 2) + 3 against 24 + 2 + 23 = 49: requests 1-8 (29 .. 47), then P2 the other
    8 (29 .. 47 <= 49 < P1's 50)."""
    hold = threading.Event()
    stubs = [StubState("m1", name, hold=hold) for name in "ABC"]
    with fleet({"m1": stubs}, pick_cfg=cfg) as r:
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
        assert split == want_split, split
        assert len({x.headers[POD_HEADER] for x in out}) == sum(1 for n in want_split if n)
        # decisions: the first by rendezvous, the rest joined a pending prefill, or were moved by load
        got = {reason: sample(r.url, "goodput_router_decisions_total", reason=reason)
               for reason in ("rendezvous", "affinity", "load_bound_fallback")}
        assert got == want_decisions
        # every request ended: the pods' work and the pending holds are back to nothing
        router = r.server.config.app.router
        wait_until(lambda: all(p.work == 0 and p.in_flight == 0 for svc in router.fleet.services()
                               for p in svc.pods.values()), "work released")
        assert router.index.held() == 0


def test_a_streamed_answer_releases_its_prefill_work_at_the_first_token():
    """request_cost 2: a 2-chunk prompt ("x" * 300: chunks of 256 + 44 characters) on an idle
    pod costs 2 + 2 = 4; after the first streamed event only its request_cost (2) is left, and
    nothing once it ends. Its chunks stay held in the index until the end."""
    gate = threading.Semaphore(0)
    st = StubState("m1", "A", gate=gate)
    with fleet({"m1": [st]}, pick_cfg=PickConfig(cost=True, request_cost=2)) as r:
        router = r.server.config.app.router
        svc = next(iter(router.fleet.services()))
        pod = next(iter(svc.pods.values()))
        with httpx.stream("POST", r.url + "/v1/completions", timeout=HANG_GUARD_S,
                          json={"model": "m1", "prompt": "x" * 300, "stream": True}) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "A-0" in first
            wait_until(lambda: pod.work == 2, "prefill released at the first token")
            assert pod.in_flight == 1 and router.index.held() == 2
            for _ in range(st.chunks):
                gate.release()
            rest = list(lines)
        assert "data: [DONE]" in rest
        wait_until(lambda: pod.work == 0 and pod.in_flight == 0, "work released at the end")
        assert router.index.held() == 0
