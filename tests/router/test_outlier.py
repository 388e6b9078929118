"""Outlier ejection (goodput.router.outlier) as a table of (attempts, clock) -> ejections, by hand."""
from __future__ import annotations

import pytest
from goodput.router.outlier import (
    FAILURE,
    NEUTRAL,
    REASON_CONSECUTIVE,
    REASON_FAILURE_PERCENTAGE,
    REASON_PROBE,
    REASON_SUCCESS_RATE,
    SUCCESS,
    OutlierConfig,
    Outliers,
    window_outliers,
)

SVC = ("ns", "svc")
PEERS = ["a", "b", "c"]


def key(name: str):
    return (*SVC, name)


def feed(o: Outliers, name: str, verdicts, now: float = 0.0, peers=PEERS):
    out = []
    for v in verdicts:
        out += o.record(key(name), v, now, peers)
    return out


@pytest.mark.parametrize("verdicts,ejected", [
    ([FAILURE, FAILURE], False),                       # below the run of 3
    ([FAILURE, FAILURE, FAILURE], True),               # 3 in a row
    ([FAILURE, FAILURE, SUCCESS, FAILURE, FAILURE], False),  # a success resets the run
    ([FAILURE, NEUTRAL, FAILURE, NEUTRAL, FAILURE], True),   # 429 / draining neither reset nor count
])
def test_consecutive_failures(verdicts, ejected):
    o = Outliers(OutlierConfig(consecutive_failures=3))
    got = feed(o, "a", verdicts)
    assert [e.reason for e in got] == ([REASON_CONSECUTIVE] if ejected else [])
    assert o.ejected(key("a"), 0.0) is ejected
    assert o.admits(key("a"), 0.0) is not ejected


def test_never_the_last_pod_and_at_most_the_fraction():
    o = Outliers(OutlierConfig(consecutive_failures=1, max_ejected_fraction=0.5))
    assert feed(o, "a", [FAILURE], peers=["a"]) == []          # the only pod: never
    assert feed(o, "a", [FAILURE], peers=["a", "b"])[0].reason == REASON_CONSECUTIVE
    assert feed(o, "b", [FAILURE], peers=["a", "b"]) == []     # b is the last one in service
    # four pods, fraction 0.5: two may be out at once, not three
    o = Outliers(OutlierConfig(consecutive_failures=1, max_ejected_fraction=0.5))
    four = ["a", "b", "c", "d"]
    assert [len(feed(o, n, [FAILURE], peers=four)) for n in "abc"] == [1, 1, 0]
    # two pods and fraction 0: still one may go (floor 1), as Envoy
    o = Outliers(OutlierConfig(consecutive_failures=1, max_ejected_fraction=0.0))
    assert len(feed(o, "a", [FAILURE], peers=["a", "b"])) == 1


def test_backoff_grows_on_repeat_and_the_probe_brings_it_back():
    cfg = OutlierConfig(consecutive_failures=2, base_ejection_s=30, max_ejection_s=100)
    o = Outliers(cfg)
    (e1,) = feed(o, "a", [FAILURE, FAILURE], now=0)
    assert (e1.duration_s, e1.until, e1.k) == (30, 30, 1)
    assert not o.admits(key("a"), 29.9) and not o.claim(key("a"), 29.9)
    # due: exactly one request is its probe; the others keep avoiding it
    assert o.admits(key("a"), 30)
    assert o.claim(key("a"), 30) is True
    assert not o.admits(key("a"), 30) and o.claim(key("a"), 30) is False
    (e2,) = o.record(key("a"), FAILURE, 31, PEERS)  # the probe failed: out again, twice as long
    assert (e2.reason, e2.duration_s, e2.until, e2.k) == (REASON_PROBE, 60, 91, 2)
    assert o.claim(key("a"), 91)
    (e3,) = o.record(key("a"), FAILURE, 91, PEERS)
    assert (e3.duration_s, e3.k) == (90, 3)
    assert o.claim(key("a"), 181)
    (e4,) = o.record(key("a"), FAILURE, 181, PEERS)
    assert e4.duration_s == 100  # capped at max_ejection_s
    assert o.claim(key("a"), 281)
    assert o.record(key("a"), SUCCESS, 281, PEERS) == []  # the probe succeeded: back
    assert o.admits(key("a"), 281) and not o.set_aside(key("a"))
    # soon failing again: the streak goes on (k=5); after max_ejection_s of clean service it restarts
    assert feed(o, "a", [FAILURE, FAILURE], now=300)[0].k == 5
    assert o.claim(key("a"), 400)
    o.record(key("a"), SUCCESS, 400, PEERS)
    assert feed(o, "a", [FAILURE, FAILURE], now=400 + 100)[0].k == 1


def test_a_probe_ending_without_verdict_leaves_the_pod_due():
    o = Outliers(OutlierConfig(consecutive_failures=1))
    feed(o, "a", [FAILURE], now=0)
    assert o.claim(key("a"), 30)
    o.unclaim(key("a"))                     # the client went away
    assert o.admits(key("a"), 30) and o.claim(key("a"), 30)
    assert o.record(key("a"), NEUTRAL, 30, PEERS) == []   # a 429: still due, not returned
    assert o.set_aside(key("a")) and o.admits(key("a"), 30)


def test_forget_clears_a_restarted_pods_past():
    o = Outliers(OutlierConfig(consecutive_failures=2))
    feed(o, "a", [FAILURE, FAILURE])
    o.forget(key("a"))
    assert o.admits(key("a"), 0) and o.ejected_count(SVC) == 0


def test_disabled_ejects_nothing():
    o = Outliers(OutlierConfig(enabled=False, consecutive_failures=1))
    assert feed(o, "a", [FAILURE] * 5) == [] and o.admits(key("a"), 0)


@pytest.mark.parametrize("counts,want", [
    # six pods, one clearly worse: mean .9, population stdev .2236, floor .9 - 1.9*.2236 = .475
    ({"a": (20, 0), "b": (20, 0), "c": (20, 0), "d": (20, 0), "e": (20, 0), "f": (8, 12)},
     [("f", REASON_SUCCESS_RATE)]),
    # fewer than sr_min_hosts pods with enough requests: no success-rate verdict; 60 % failed >= 50 %
    ({"a": (20, 0), "b": (20, 0), "f": (8, 12)}, [("f", REASON_FAILURE_PERCENTAGE)]),
    # below the volume: nothing
    ({"a": (5, 0), "f": (0, 10)}, []),
    # every pod equally bad: no success-rate outlier; each over the failure percentage
    ({"a": (5, 15), "b": (5, 15)}, [("a", REASON_FAILURE_PERCENTAGE), ("b", REASON_FAILURE_PERCENTAGE)]),
])
def test_window_outliers(counts, want):
    cfg = OutlierConfig(sr_min_hosts=5, sr_min_requests=20, sr_stdev_factor=1.9, fp_threshold=0.5,
                        fp_min_requests=20)
    assert window_outliers(counts, cfg) == want


def test_the_window_sweep_ejects_an_intermittent_failer():
    """Never three in a row, but half of its answers fail: ejected when the window closes."""
    o = Outliers(OutlierConfig(interval_s=10, fp_min_requests=20, fp_threshold=0.5))
    out = []
    for i in range(30):
        out += o.record(key("a"), FAILURE if i % 2 else SUCCESS, i * 0.1, PEERS)
        out += o.record(key("b"), SUCCESS, i * 0.1, PEERS)
    assert out == []
    (e,) = o.record(key("b"), SUCCESS, 10.0, PEERS)
    assert (e.pod, e.reason) == (key("a"), REASON_FAILURE_PERCENTAGE)


@pytest.mark.parametrize("bad", [dict(consecutive_failures=0), dict(base_ejection_s=0),
                                 dict(base_ejection_s=10, max_ejection_s=5), dict(max_ejected_fraction=2),
                                 dict(fp_threshold=0), dict(interval_s=0)])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError):
        OutlierConfig(**bad)


def test_admission_skips_set_aside_pods_and_a_retry_skips_due_ones():
    from goodput.router.admission import Admission
    from goodput.router.fleet import Fleet, PodInfo, ServiceInfo
    from goodput.router.metrics import RouterMetrics
    from goodput.router.picker import PickConfig, PrefixIndex, route_key

    fleet = Fleet()
    fleet.set_service(ServiceInfo("ns", "svc", "m"))
    fleet.replace_pods("ns", "svc", [PodInfo(n, f"http://{n}") for n in "abc"])
    t = [0.0]
    o = Outliers(OutlierConfig(consecutive_failures=1, base_ejection_s=10))
    adm = Admission(fleet, RouterMetrics(), PrefixIndex(), PickConfig(), outliers=o, clock=lambda: t[0])
    svc = fleet.service(("ns", "svc"))
    assert len(o.record(key("a"), FAILURE, 0.0, PEERS)) == 1
    picked = {adm.try_pick(svc, route_key("m", "", None, prompt=f"p{i}"))[0].name for i in range(30)}
    assert picked == {"b", "c"}
    t[0] = 10.0  # a is due: a first pick may be its probe, a retry never
    retry = {adm.try_pick(svc, route_key("m", "", None, prompt=f"p{i}"), exclude=frozenset({"b"}))[0].name
             for i in range(30)}
    assert retry == {"c"}
    # only a set-aside pod left for a retry: none (the failed pod's own answer goes to the client)
    assert adm.try_pick(svc, route_key("m", "", None, prompt="z"), exclude=frozenset({"b", "c"})) is None
