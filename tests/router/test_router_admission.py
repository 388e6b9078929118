"""Fleet admission on its own (no HTTP): hold, pick, priority queue, refuse, timeouts, cancellation.

Pods' limits are set by hand as the scrape would; each scenario runs on a fresh event loop."""
from __future__ import annotations

import asyncio

import pytest
from goodput.router.admission import Admission
from goodput.router.errors import APIError
from goodput.router.fleet import Fleet, PodInfo, ServiceInfo
from goodput.router.metrics import RouterMetrics
from goodput.router.picker import PickConfig, PrefixIndex, RouteKey

KEY = RouteKey("m", "", None, ())


def _setup(pods=(("a", True),), max_num_seqs=1, max_waiting=1, **kw):
    fleet = Fleet()
    fleet.set_service(ServiceInfo("ns", "svc", "m"))
    adm = Admission(fleet, RouterMetrics(), PrefixIndex(), PickConfig(), **kw)
    fleet.replace_pods("ns", "svc", [PodInfo(n, f"http://{n}:1", ready=r) for n, r in pods])
    for p in fleet.for_model("m").pods.values():
        p.max_num_seqs, p.max_waiting = max_num_seqs, max_waiting
    return fleet, adm


def test_pick_reserves_until_release_then_queue_then_refuse():
    async def main():
        fleet, adm = _setup()  # capacity 1 + 1 = 2 in flight; queue bound = max_waiting = 1
        svc = fleet.for_model("m")
        pod1, _, _ = await adm.acquire(svc, KEY)
        pod2, _, _ = await adm.acquire(svc, KEY)
        assert pod1 is pod2 and pod1.in_flight == 2 and pod1.at_limits
        queued = asyncio.ensure_future(adm.acquire(svc, KEY))
        await asyncio.sleep(0)
        assert not queued.done()
        with pytest.raises(APIError) as e:
            await adm.acquire(svc, KEY)
        assert (e.value.status, e.value.code, e.value.headers) == (429, "queue_full", {"Retry-After": "1"})
        adm.release(svc, pod1)  # room again: the queued request gets the pod
        pod3, _, _ = await queued
        assert pod3 is pod1 and pod1.in_flight == 2
    asyncio.run(main())


def test_queue_orders_by_priority_then_arrival():
    async def main():
        fleet, adm = _setup(max_num_seqs=1, max_waiting=0)
        svc = fleet.for_model("m")
        fleet.set_service(ServiceInfo("ns", "svc", "m", router_max_queued=3))
        pod, _, _ = await adm.acquire(svc, KEY)
        order = []

        async def wait(name, prio):
            p, _, _ = await adm.acquire(svc, KEY, prio)
            order.append(name)
            adm.release(svc, p)

        tasks = [asyncio.ensure_future(wait(n, p)) for n, p in (("late-5", 5), ("first-0", 0), ("second-0", 0))]
        await asyncio.sleep(0)
        adm.release(svc, pod)
        await asyncio.gather(*tasks)
        assert order == ["first-0", "second-0", "late-5"]
    asyncio.run(main())


def test_hold_until_ready_and_hold_timeout():
    async def main():
        fleet, adm = _setup(pods=(("a", False),), hold_timeout_s=3600)
        svc = fleet.for_model("m")
        held = asyncio.ensure_future(adm.acquire(svc, KEY))
        await asyncio.sleep(0)
        assert not held.done() and adm.metrics.held.labels("ns", "svc")._value.get() == 1
        fleet.set_pod("ns", "svc", PodInfo("a", "http://a:1", ready=True))
        pod, _, _ = await held
        assert pod.name == "a" and adm.metrics.held.labels("ns", "svc")._value.get() == 0

        fleet2, adm2 = _setup(pods=(("a", False),), hold_timeout_s=0.01, retry_after_s=4)
        with pytest.raises(APIError) as e:
            await adm2.acquire(fleet2.for_model("m"), KEY)
        assert (e.value.status, e.value.code, e.value.headers) == (503, "no_ready_pod", {"Retry-After": "4"})
    asyncio.run(main())


def test_removed_service_fails_its_waiters_with_404():
    async def main():
        fleet, adm = _setup(pods=(("a", False),))
        held = asyncio.ensure_future(adm.acquire(fleet.for_model("m"), KEY))
        await asyncio.sleep(0)
        fleet.remove_service("ns", "svc")
        with pytest.raises(APIError) as e:
            await held
        assert e.value.status == 404
    asyncio.run(main())


def test_cancelled_waiter_gives_back_a_pod_it_was_handed():
    async def main():
        fleet, adm = _setup(max_num_seqs=1, max_waiting=0)
        fleet.set_service(ServiceInfo("ns", "svc", "m", router_max_queued=1))
        svc = fleet.for_model("m")
        pod, _, _ = await adm.acquire(svc, KEY)
        queued = asyncio.ensure_future(adm.acquire(svc, KEY))
        await asyncio.sleep(0)
        adm.release(svc, pod)  # hands the pod to the waiter (in_flight back to 1) ...
        queued.cancel()        # ... which is cancelled before it runs (the client went away)
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert pod.in_flight == 0
    asyncio.run(main())


def test_queue_timeout_is_429():
    async def main():
        fleet, adm = _setup(max_num_seqs=1, max_waiting=1, queue_timeout_s=0.01)
        svc = fleet.for_model("m")
        await adm.acquire(svc, KEY)
        await adm.acquire(svc, KEY)
        with pytest.raises(APIError) as e:
            await adm.acquire(svc, KEY)
        assert (e.value.status, e.value.code) == (429, "queue_timeout")
        assert adm.metrics.queued.labels("ns", "svc")._value.get() == 0
    asyncio.run(main())


def test_band_and_request_queue_timeouts():
    async def main():
        # 1 in flight fills the pod; queue bound 3; band 5 waits at most 0 s, the rest 3600 s
        fleet, adm = _setup(max_num_seqs=1, max_waiting=0, queue_timeout_s=3600, band_timeouts_s={5: 0.0})
        fleet.set_service(ServiceInfo("ns", "svc", "m", router_max_queued=3))
        svc = fleet.for_model("m")
        pod, _, _ = await adm.acquire(svc, KEY)
        with pytest.raises(APIError) as e:   # band 5: its own 0 s
            await adm.acquire(svc, KEY, 5)
        assert (e.value.status, e.value.code, e.value.headers) == (429, "queue_timeout", {"Retry-After": "1"})
        with pytest.raises(APIError) as e:   # band 0, the request's own 0 s
            await adm.acquire(svc, KEY, 0, "t", 0.0)
        assert e.value.code == "queue_timeout"
        waiting = asyncio.ensure_future(adm.acquire(svc, KEY, 0, "t", 7200.0))  # min(7200, 3600): waits
        await asyncio.sleep(0)
        assert not waiting.done()
        adm.release(svc, pod)
        got, _, _ = await waiting
        assert got is pod and pod.in_flight == 1
    asyncio.run(main())


@pytest.mark.parametrize("given, want", [
    ([], {}),
    (["5=0.5", "-1=2"], {5: 0.5, -1: 2.0}),
])
def test_band_queue_timeout_setting(given, want):
    from goodput.router.app import RouterSettings
    assert RouterSettings(band_queue_timeout=given).band_timeouts() == want


@pytest.mark.parametrize("bad", [["5"], ["x=1"], ["5=-1"], ["5=inf"], ["5=1", "5=2"]])
def test_band_queue_timeout_setting_errors(bad):
    from goodput.router.app import RouterSettings
    with pytest.raises(ValueError):
        RouterSettings(band_queue_timeout=bad)
