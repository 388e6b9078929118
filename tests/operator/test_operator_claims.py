"""Overlapping releases: the Lease rule of goodput.api.claims, case by case (times by hand)."""

import datetime

import pytest

from goodput.api import claims

UTC = datetime.timezone.utc
T = datetime.datetime(2026, 12, 1, 15, 0, 0, tzinfo=UTC)


def lease(holder="op-a/1", renew="2026-12-01T14:59:50.000000Z", duration=15, acquire="2026-12-01T14:00:00.000000Z",
          transitions=2):
    return {"metadata": {"name": "goodput-operator", "resourceVersion": "7"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration, "renewTime": renew,
                     "acquireTime": acquire, "leaseTransitions": transitions}}


LIVE = {
    "absent": (None, None),
    "renewed-10s-ago-for-15s": (lease(), "op-a/1"),                                # 14:59:50 + 15 s > 15:00:00
    "expired-exactly-now": (lease(renew="2026-12-01T14:59:45.000000Z"), None),   # 14:59:45 + 15 s = now
    "expired": (lease(renew="2026-12-01T14:58:00.000000Z"), None),
    "released": (lease(holder=None), None),
    "time-without-fraction": (lease(renew="2026-12-01T14:59:59Z"), "op-a/1"),
    "no-renew-time": ({"spec": {"holderIdentity": "x", "leaseDurationSeconds": 15}}, None),
}


@pytest.mark.parametrize("case", LIVE)
def test_live_holder(case):
    obj, want = LIVE[case]
    assert claims.live_holder(obj, T) == want


def test_claim_a_new_namespace():
    assert claims.claim(None, "me/1", T) == {
        "holderIdentity": "me/1", "leaseDurationSeconds": 15, "acquireTime": "2026-12-01T15:00:00.000000Z",
        "renewTime": "2026-12-01T15:00:00.000000Z", "leaseTransitions": 0}


def test_renew_keeps_acquire_time_and_transitions():
    got = claims.claim(lease(holder="me/1"), "me/1", T)
    assert got["acquireTime"] == "2026-12-01T14:00:00.000000Z" and got["leaseTransitions"] == 2
    assert got["renewTime"] == "2026-12-01T15:00:00.000000Z"


def test_a_live_holder_keeps_it_and_an_expired_one_is_taken_over():
    assert claims.claim(lease(), "me/1", T) is None
    got = claims.claim(lease(renew="2026-12-01T14:58:00.000000Z"), "me/1", T)
    assert got["holderIdentity"] == "me/1" and got["leaseTransitions"] == 3
    assert got["acquireTime"] == "2026-12-01T15:00:00.000000Z"
    got = claims.claim(lease(holder=None), "me/1", T)  # released by a stopping operator: taken at once
    assert got["holderIdentity"] == "me/1" and got["leaseTransitions"] == 3


def test_release_only_what_we_hold():
    assert claims.release(lease(holder="other/2"), "me/1") is None
    assert claims.release(None, "me/1") is None
    got = claims.release(lease(holder="me/1"), "me/1")
    assert got["holderIdentity"] is None and claims.live_holder({"spec": got}, T) is None


OWNS = {
    # name: (namespaced, claimed, other live holder, owns)
    "namespaced-holds-it": (True, {"ml"}, None, True),
    "namespaced-standing-by": (True, set(), None, False),
    "all-namespaces-unclaimed": (False, set(), None, True),
    "all-namespaces-yields-to-a-namespaced-release": (False, set(), "op-ns/1", False),
}


@pytest.mark.parametrize("case", OWNS)
def test_who_reconciles_a_namespace(case):
    namespaced, held, other, want = OWNS[case]
    assert claims.owns("ml", namespaced=namespaced, claimed=frozenset(held), other_holder=other) is want


def test_the_lease_an_operator_writes_carries_its_release():
    spec = claims.claim(None, "me/1", T)
    assert claims.lease_body("team-a", spec, "team-a/gp1") == {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": spec,
        "metadata": {"name": "goodput-operator", "namespace": "team-a",
                     "annotations": {"serving.goodput.dev/release": "team-a/gp1"}}}
    body = claims.lease_body("team-a", spec, None, "42")  # an operator started without a release
    assert body["metadata"] == {"name": "goodput-operator", "namespace": "team-a", "resourceVersion": "42"}
    assert claims.release_of(body) is None
    assert claims.release_of(claims.lease_body("team-a", spec, "x/y")) == "x/y"
    assert claims.release_of(None) is None


RELEASES = {
    # (holder's release, whether its Lease is live, the autoscaler's release) -> decides
    "absent": (None, None, "a/gp2", True),
    "own-release": ("a/gp1", True, "a/gp1", True),
    "other-release-live": ("a/gp1", True, "a/gp2", False),
    "other-release-expired": ("a/gp1", False, "a/gp2", True),
    "holder-without-release": ("", True, "a/gp2", True),
    "autoscaler-without-release": ("a/gp1", True, None, True),
}


@pytest.mark.parametrize("case", RELEASES)
def test_which_namespaced_autoscaler_decides(case):
    theirs, live, mine, want = RELEASES[case]
    if live is None:
        obj = None
    else:
        # renewed 10 s ago for 15 s (live) or 20 s ago (expired at 15:00:00)
        renew = "2026-12-01T14:59:50.000000Z" if live else "2026-12-01T14:59:40.000000Z"
        obj = lease(renew=renew)
        obj["metadata"]["annotations"] = {claims.RELEASE_ANNOTATION: theirs}
    assert claims.release_decides(obj, mine, T) is want


class _Resource:
    """A fake dynamic-client resource: objects by (namespace, name); writes recorded."""

    def __init__(self, objs=None):
        self.objs, self.writes = dict(objs or {}), []

    def get(self, name, namespace):
        from kubernetes.client.exceptions import ApiException

        if (namespace, name) not in self.objs:
            raise ApiException(status=404, reason="Not Found")

        class _Obj(dict):
            def to_dict(self):
                return dict(self)
        return _Obj(self.objs[(namespace, name)])

    def create(self, body, namespace):
        self.writes.append(("create", body))
        self.objs[(namespace, body["metadata"].get("name"))] = body

    def replace(self, body, namespace):
        self.writes.append(("replace", body))
        self.objs[(namespace, body["metadata"]["name"])] = body


def _two_operators(monkeypatch, leases: _Resource, events: _Resource):
    from goodput.operator import handlers

    monkeypatch.setattr(handlers.cluster, "resource",
                        lambda api_version, kind: {"Lease": leases, "Event": events}[kind])
    return handlers


def test_the_operator_writes_its_release_and_the_second_release_stands_by_with_an_event(monkeypatch):
    """Two namespaced releases for team-a: the first operator's claim carries its release; the
    second one's pass finds that live claim, holds nothing and posts one Warning Event on the Lease
    naming both releases (a second pass posts no other)."""
    leases, events = _Resource(), _Resource()
    handlers = _two_operators(monkeypatch, leases, events)
    monkeypatch.setenv(claims.RELEASE_ENV, "team-a/gp1")
    first = handlers._Claims()
    assert first.renew(("team-a",)) == ["team-a"]
    ((verb, body),) = leases.writes
    assert verb == "create" and claims.release_of(body) == "team-a/gp1"
    assert body["spec"]["holderIdentity"] == first.identity
    leases.objs[("team-a", "goodput-operator")]["metadata"].update(resourceVersion="1", uid="lease-uid")

    monkeypatch.setenv(claims.RELEASE_ENV, "team-a/gp2")
    second = handlers._Claims()
    second.identity = "gp2-operator-pod/1"  # another process
    assert second.renew(("team-a",)) == [] and second.renew(("team-a",)) == []
    assert len(leases.writes) == 1  # it wrote nothing
    ((_, event),) = events.writes
    assert (event["type"], event["reason"]) == ("Warning", "StandingBy")
    assert event["involvedObject"]["kind"] == "Lease" and event["involvedObject"]["name"] == "goodput-operator"
    assert "release team-a/gp2" in event["message"] and "release team-a/gp1" in event["message"]
    assert "team-a" in second._standing_by and "team-a" not in second.held
