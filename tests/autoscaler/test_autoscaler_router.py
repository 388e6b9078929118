"""The autoscaler's side of the router contract: the routers' ``/metrics`` (rendered by the real
router registry, ``goodput.router.metrics.RouterMetrics``) -> one ``RouterObservation`` per
service, summed over router replicas with counters as per-router deltas; the router pods found
in Kubernetes; the observation reaching ``decide``; ``routerMaxQueued`` reaching status."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from goodput.autoscaler import loop, observe, policy
from goodput.router.metrics import RouterMetrics


def router(held=None, queued=None, outcomes=None):
    """A real router registry: held/queued {(ns, svc): n}; outcomes {(ns, svc, outcome): count}."""
    rm = RouterMetrics()
    for (ns, svc), v in (held or {}).items():
        rm.held.labels(ns, svc).set(v)
    for (ns, svc), v in (queued or {}).items():
        rm.queued.labels(ns, svc).set(v)
    for (ns, svc, outcome), v in (outcomes or {}).items():
        rm.requests.labels(ns, svc, "m", "", outcome).inc(v)
    return rm


def test_parse_router_per_service():
    rm = router(held={("a", "s1"): 3}, queued={("a", "s1"): 2, ("b", "s2"): 7},
                outcomes={("a", "s1", "refused"): 4, ("a", "s1", "success"): 100, ("b", "s2", "refused"): 1})
    got = observe.parse_router(rm.render().decode(), 5.0)
    assert set(got) == {("a", "s1"), ("b", "s2")}
    assert (got[("a", "s1")].held, got[("a", "s1")].queued, got[("a", "s1")].refused) == (3, 2, 4)
    assert (got[("b", "s2")].held, got[("b", "s2")].queued, got[("b", "s2")].refused) == (0, 7, 1)
    assert observe.parse_router(RouterMetrics().render().decode(), 0.0) == {}   # no service yet


def _s(t, held, queued, refused):
    return observe.PodSample(time=t, gauges={"held": held, "queued": queued}, counters={"refused": refused},
                             histograms={})


# (previous, current) per router replica -> expected (held, queued, refused)
SUM_CASES = {
    "one router, first sample: no refused yet": ([(None, _s(5, 2, 1, 9))], (2, 1, 0.0)),
    "one router, second sample": ([(_s(0, 0, 0, 9), _s(5, 2, 1, 12))], (2, 1, 3.0)),
    "two routers summed": ([(_s(0, 0, 0, 1), _s(5, 1, 4, 3)), (_s(0, 0, 0, 10), _s(5, 2, 0, 15))], (3, 4, 7.0)),
    "a restarted router counts from zero": ([(_s(0, 0, 0, 50), _s(5, 0, 0, 2))], (0, 0, 2.0)),
}


@pytest.mark.parametrize("case", SUM_CASES)
def test_router_observation_sums_replicas(case):
    pairs, (held, queued, refused) = SUM_CASES[case]
    assert observe.router_observation(pairs) == policy.RouterObservation(held, queued, refused)


def _pod(name, ip, ready=True, deleting=False, ann=None):
    meta = {"name": name, "annotations": ann or {}}
    if deleting:
        meta["deletionTimestamp"] = "2027-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready",
                                                                      "status": "True" if ready else "False"}]}}


def test_router_targets():
    pods = [_pod("r2", "10.244.0.3", ann={"prometheus.io/port": "9000", "prometheus.io/path": "m"}),
            _pod("r1", "10.244.0.2"), _pod("r3", "10.244.0.4", ready=False),
            _pod("r4", "10.244.0.5", deleting=True), _pod("r5", None)]
    assert loop.router_targets(pods) == ["http://10.244.0.2:8080/metrics", "http://10.244.0.3:9000/m"]


class Routers:
    """Two router replicas behind an httpx transport, their texts from real registries."""

    def __init__(self):
        self.regs = {"10.244.0.2": router(), "10.244.0.3": router()}
        self.down: set[str] = set()

    def handler(self, request: httpx.Request):
        if request.url.host in self.down:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, content=self.regs[request.url.host].render())


def test_router_scraper_deltas_across_passes_and_discovery():
    rs = Routers()

    class Kube:
        def list_pods(self, namespace, selector):
            assert (namespace, selector) == ("goodput-system", "app.kubernetes.io/component=router")
            return [_pod("r1", "10.244.0.2")]

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(rs.handler)) as http:
            sc = loop.RouterScraper(http, 1.0, urls=["http://10.244.0.3:8080/metrics"], kube=Kube(),
                                    namespace="goodput-system")
            out = []
            a, b = rs.regs["10.244.0.2"], rs.regs["10.244.0.3"]
            a.requests.labels("ns", "svc", "m", "", "refused").inc(5)
            b.held.labels("ns", "svc").set(2)
            out.append(await sc.observe())          # first samples: refused counts nothing yet
            a.requests.labels("ns", "svc", "m", "", "refused").inc(3)
            b.requests.labels("ns", "svc", "m", "", "refused").inc(4)
            b.queued.labels("ns", "svc").set(6)
            out.append(await sc.observe())          # 3 + 4 refused in the interval
            rs.down.add("10.244.0.3")
            a.requests.labels("ns", "svc", "m", "", "refused").inc(1)
            out.append(await sc.observe())          # one router down: the other still counts
            rs.down.add("10.244.0.2")
            out.append(await sc.observe())          # none answered: no router view
            return out

    o = asyncio.run(main())
    assert o[0] == {("ns", "svc"): policy.RouterObservation(held=2, queued=0, refused=0.0)}
    assert o[1] == {("ns", "svc"): policy.RouterObservation(held=2, queued=6, refused=7.0)}
    assert o[2] == {("ns", "svc"): policy.RouterObservation(held=0, queued=0, refused=1.0)}
    assert o[3] is None


def test_router_view_reaches_decide(monkeypatch):
    from test_autoscaler_loop import FakeKube, _decision, _pod as worker_pod
    seen = []

    def decide(now, obs, spec, state):
        seen.append(obs.router)
        d = _decision(1, "Steady")
        object.__setattr__(d, "router_max_queued", 12)
        return d
    monkeypatch.setattr(policy, "decide", decide)

    class View:
        async def observe(self):
            return {("ns", "svc"): policy.RouterObservation(held=3, queued=1, refused=2.0)}

    class NoPods:
        async def samples(self, namespace, pods):
            return {p.name: httpx.ConnectTimeout("t") for p in pods}

    obj = {"metadata": {"name": "svc", "namespace": "ns", "uid": "u1"},
           "spec": {"replicas": 1, "autoscaling": {"enabled": True}}}
    kube = FakeKube(obj, [worker_pod("p1")])
    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={})))
    scaler = loop.Autoscaler(kube, NoPods(), http, routers=View())
    asyncio.run(scaler.tick())
    assert seen == [policy.RouterObservation(held=3, queued=1, refused=2.0)]
    assert kube.obj["status"]["admission"]["routerMaxQueued"] == 12
    # without routers: None, as the contract says
    seen.clear()
    scaler = loop.Autoscaler(kube, NoPods(), http)
    asyncio.run(scaler.tick())
    assert seen == [None]


def test_parse_router_counts_the_prefills_done_in_the_prefill_pools_place():
    # rule 19: no_prefill_pod + prefill_failed, per service; remote and short are not fallbacks
    rm = router(outcomes={("a", "s1", "success"): 1})
    for decision, n in (("remote", 50), ("short", 9), ("no_prefill_pod", 3), ("prefill_failed", 4)):
        rm.pd_decisions.labels("a", "s1", decision).inc(n)
    got = observe.parse_router(rm.render().decode(), 5.0)[("a", "s1")]
    assert got.counters["pd_fallback"] == 7.0
    prev = observe.PodSample(time=0.0, gauges={}, counters={"refused": 0.0, "pd_fallback": 2.0}, histograms={})
    assert observe.router_observation([(prev, got)]).pd_fallback == 5.0      # the interval's delta
    assert observe.router_observation([(None, got)]).pd_fallback == 0.0      # a first sample adds nothing
