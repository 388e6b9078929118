"""The autoscaler under overlap and failover: one owner per service when an
all-namespaces release and a namespaced one overlap, or two namespaced releases list the same
namespace (the operators' namespace Lease rule, goodput.autoscaler.claims), and a new leader's
first pass (no rates yet) moves no idle clock."""
from __future__ import annotations

import asyncio
import datetime
from dataclasses import replace

import pytest
from goodput.autoscaler import claims as ac
from goodput.autoscaler import loop
from goodput.autoscaler.policy import Observation, PolicyState, RouterObservation, decide
from goodput.api.claims import micro_time

from test_autoscaler_phases import SPEC, idle

UTC = datetime.timezone.utc
NOW = datetime.datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)


def lease(holder: str | None, renewed_s_ago: float, duration_s: int = 15) -> dict:
    return {"metadata": {"name": "goodput-operator"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration_s,
                     "renewTime": micro_time(NOW - datetime.timedelta(seconds=renewed_s_ago))}}


@pytest.mark.parametrize("the_lease,owned", [
    (None, True),                          # no namespaced release there
    (lease("op-team-a/1", 3), False),      # a namespaced release's operator holds it: its autoscaler decides
    (lease("op-team-a/1", 15), True),      # lapsed (renewTime + 15 s <= now): taken back
    (lease(None, 1), True),                # released
])
def test_owned_follows_the_operator_rule(the_lease, owned):
    assert ac.owned("team-a", the_lease, NOW) is owned


def test_namespace_claims_cache_and_unreadable_lease():
    reads, t = [], [0.0]
    leases = {"team-a": lease("op/1", 1), "team-b": None}

    def read(ns):
        reads.append(ns)
        if ns == "team-c":
            raise PermissionError("403 forbidden")
        return leases[ns]

    c = ac.NamespaceClaims(read, cache_s=5.0, clock=lambda: t[0], now=lambda: NOW)
    assert (c.owns("team-a"), c.owns("team-b"), c.owns("team-c")) == (False, True, True)
    assert c.owns("team-a") is False and reads.count("team-a") == 1   # cached
    t[0] = 5.0
    leases["team-a"] = lease(None, 0)   # the namespaced release stopped: released its Lease
    assert c.owns("team-a") is True and reads.count("team-a") == 2


class _Kube:
    def __init__(self, objs):
        self.objs = objs

    def list_isvcs(self, namespace):
        return [o for o in self.objs if namespace is None or o["metadata"]["namespace"] == namespace]


def _isvc(ns: str, name: str) -> dict:
    return {"metadata": {"namespace": ns, "name": name, "uid": f"{ns}-{name}"},
            "spec": {"replicas": 1, "autoscaling": {"enabled": True}}}


def test_two_overlapping_installs_one_decides_each_service():
    """The cluster-wide autoscaler and the one of a release for team-a: team-a's service gets
    decisions from exactly one of them (today: from both, 1 s apart)."""
    objs = [_isvc("team-a", "svc"), _isvc("team-b", "svc")]
    leases = {"team-a": lease("op-team-a/7", 2), "team-b": None}  # the team-a release's operator claims team-a
    decided: dict[str, list] = {"cluster": [], "team-a": []}

    def scaler(who: str, namespace: str | None) -> loop.Autoscaler:
        claims = None if namespace else ac.NamespaceClaims(lambda ns: leases[ns], now=lambda: NOW)
        s = loop.Autoscaler(_Kube(objs), None, None, namespace=namespace, claims=claims)

        async def reconcile(obj):
            decided[who].append((obj["metadata"]["namespace"], obj["metadata"]["name"]))
        s.reconcile = reconcile
        return s

    asyncio.run(scaler("cluster", None).tick())
    asyncio.run(scaler("team-a", "team-a").tick())
    assert decided == {"cluster": [("team-b", "svc")], "team-a": [("team-a", "svc")]}


# ------------------------------------------------------------- two namespaced releases, one namespace


def released_lease(holder: str | None, renewed_s_ago: float, release: str | None) -> dict:
    out = lease(holder, renewed_s_ago)
    out["metadata"].update(namespace="team-a", uid="lease-uid")
    if release:
        out["metadata"]["annotations"] = {"serving.goodput.dev/release": release}
    return out


def test_two_namespaced_releases_for_one_namespace_one_autoscaler_decides():
    """The chart installed twice for team-a (releases gp1 and gp2, both namespaced): gp1's operator
    holds the Lease, so gp1's autoscaler decides and gp2's stands down, with one Warning Event on the
    Lease naming both releases; when gp1 stops (its Lease released), gp2's takes over and says so."""
    objs = [_isvc("team-a", "svc")]
    leases = {"team-a": released_lease("gp1-goodput-operator-x/1", 2, "team-a/gp1")}
    decided: dict[str, list] = {"team-a/gp1": [], "team-a/gp2": []}
    events: dict[str, list] = {"team-a/gp1": [], "team-a/gp2": []}
    clock = [0.0]

    def scaler(release: str) -> loop.Autoscaler:
        c = ac.NamespaceClaims(lambda ns: leases[ns], clock=lambda: clock[0], now=lambda: NOW, namespaced=True,
                               release=release, notify=lambda obj, *e: events[release].append((obj["metadata"]["name"],
                                                                                                *e)))
        s = loop.Autoscaler(_Kube(objs), None, None, namespace=["team-a"], claims=c)

        async def reconcile(obj):
            decided[release].append(obj["metadata"]["name"])
        s.reconcile = reconcile
        return s

    gp1, gp2 = scaler("team-a/gp1"), scaler("team-a/gp2")
    for _ in range(2):  # a second pass changes nothing and posts nothing
        asyncio.run(gp1.tick())
        asyncio.run(gp2.tick())
        clock[0] += 10.0  # past the read cache
    assert decided == {"team-a/gp1": ["svc", "svc"], "team-a/gp2": []}
    assert events["team-a/gp1"] == []
    ((name, etype, reason, message),) = events["team-a/gp2"]
    assert (name, etype, reason) == ("goodput-operator", "Warning", "StandingDown")
    assert "release team-a/gp2 stands down in namespace team-a" in message and "release team-a/gp1" in message

    leases["team-a"] = released_lease(None, 0, "team-a/gp1")  # gp1 uninstalled: its operator released the Lease
    asyncio.run(gp2.tick())
    assert decided["team-a/gp2"] == ["svc"]
    assert [e[1:3] for e in events["team-a/gp2"]] == [("Warning", "StandingDown"), ("Normal", "Deciding")]


@pytest.mark.parametrize("the_lease,release,decides", [
    (None, "ns/gp2", True),                                               # nobody claims it
    (released_lease("op/1", 3, "ns/gp1"), "ns/gp2", False),               # another release's live operator
    (released_lease("op/1", 3, "ns/gp2"), "ns/gp2", True),                # its own release's operator
    (released_lease("op/1", 15, "ns/gp1"), "ns/gp2", True),               # lapsed: nobody's
    (released_lease("op/1", 3, None), "ns/gp2", True),                    # an operator without a release: as before
    (released_lease("op/1", 3, "ns/gp1"), None, True),                    # an autoscaler without one: as before
])
def test_a_namespaced_autoscaler_follows_its_releases_operator(the_lease, release, decides):
    c = ac.NamespaceClaims(lambda ns: the_lease, now=lambda: NOW, namespaced=True, release=release)
    assert c.owns("team-a") is decides


def test_a_namespaced_autoscaler_lists_every_namespace_it_is_given():
    objs = [_isvc("a", "x"), _isvc("b", "y"), _isvc("c", "z")]
    s = loop.Autoscaler(_Kube(objs), None, None, namespace=["a", "b"])
    seen = []

    async def reconcile(obj):
        seen.append((obj["metadata"]["namespace"], obj["metadata"]["name"]))
    s.reconcile = reconcile
    asyncio.run(s.tick())
    assert seen == [("a", "x"), ("b", "y")]


# ---------------------------------------------------------------------------------- failover clock


def test_a_first_pass_without_rates_moves_no_idle_clock():
    """A new leader (or a restarted autoscaler) forgets its previous samples: its first pass has
    no rates. It must not restart the scale-to-zero idle clock (today: every failover does)."""
    spec = replace(SPEC, min_replicas=0, scale_to_zero_idle_s=600.0)
    router = RouterObservation(held=0, queued=0, refused=0)
    st = PolicyState(since=-1000.0, last_busy=-500.0, proven_work=1.0)
    first = idle(interval_s=0.0)  # a first scrape: gauges only, no deltas
    d = decide(0.0, Observation((first,), (), (), 1, router), spec, st)
    assert d.state.last_busy == -500.0
    # the next pass has rates, idle: 600 s after the last busy pass, to zero
    d = decide(100.0, Observation((idle(),), (), (), 1, router), spec, d.state)
    assert (d.replicas, d.reason) == (0, "ScaleToZeroIdle")


@pytest.mark.parametrize("obs,busy", [
    (Observation((replace(idle(interval_s=0.0), running=3),), (), (), 1, RouterObservation(0, 0, 0)), True),  # in flight
    (Observation((idle(interval_s=0.0),), (), (), 1, RouterObservation(held=2, queued=0, refused=0)), True),
    (Observation((idle(interval_s=0.0),), (), ("b",), 2, RouterObservation(0, 0, 0)), True),  # cannot see pod b
    (Observation((idle(interval_s=0.0),), (), (), 1, RouterObservation(0, 0, 0)), False),
])
def test_what_restarts_the_idle_clock(obs, busy):
    spec = replace(SPEC, min_replicas=0)
    d = decide(10.0, obs, spec, PolicyState(since=-1000.0, last_busy=-500.0, proven_work=1.0))
    assert (d.state.last_busy == 10.0) is busy
