"""Leader election (pure rule and the elector with a fake Lease API and a hand-moved clock):
acquire, renew, expiry by the candidate's own clock, takeover, conflicts, release, step-down."""
from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from goodput.autoscaler import lease
from goodput.autoscaler.lease import LeaseRecord, Seen, lease_step

D = 15.0
A = LeaseRecord("a", D, 100.0, 100.0, 0)

# (current record, seen, me, now, expected action, expected record written)
STEP_CASES = {
    "no lease: create": (None, None, "b", 50.0, "create", LeaseRecord("b", D, 50.0, 50.0, 0)),
    "ours: renew, acquire time kept": (A, Seen(A, 100.0), "a", 102.0, "renew", LeaseRecord("a", D, 100.0, 102.0, 0)),
    "theirs, fresh: wait": (A, Seen(A, 100.0), "b", 114.9, "wait", None),
    "theirs, unchanged a whole duration: takeover": (
        A, Seen(A, 100.0), "b", 115.0, "takeover", LeaseRecord("b", D, 115.0, 115.0, 1)),
    # first seen late (a candidate that just started): its own clock starts then, whatever renewTime says
    "theirs, old renewTime but first seen now: wait": (A, None, "b", 500.0, "wait", None),
    "theirs, renewed since we looked: wait again": (
        LeaseRecord("a", D, 100.0, 130.0, 0), Seen(A, 100.0), "b", 131.0, "wait", None),
    "released (empty holder): takeover at once": (
        LeaseRecord(None, D, 100.0, 100.0, 3), Seen(LeaseRecord(None, D, 100.0, 100.0, 3), 100.0), "b", 101.0,
        "takeover", LeaseRecord("b", D, 101.0, 101.0, 4)),
}


@pytest.mark.parametrize("case", STEP_CASES)
def test_lease_step(case):
    current, seen, me, now, action, record = STEP_CASES[case]
    got_action, got_record, _ = lease_step(current, seen, me, now, D)
    assert (got_action, got_record) == (action, record)


def test_seen_moves_only_when_the_record_changes():
    _, _, seen = lease_step(A, Seen(A, 100.0), "b", 110.0, D)
    assert seen == Seen(A, 100.0)
    renewed = LeaseRecord("a", D, 100.0, 112.0, 0)
    _, _, seen = lease_step(renewed, seen, "b", 113.0, D)
    assert seen == Seen(renewed, 113.0)


def test_spec_round_trip():
    r = LeaseRecord("a_1", 15.0, 1_800_000_000.25, 1_800_000_002.5, 2)
    spec = lease.to_spec(r)
    assert spec["renewTime"] == "2027-01-15T08:00:02.500000Z" and spec["leaseDurationSeconds"] == 15
    assert lease.from_spec(spec) == r


class FakeLeases:
    """One namespace's Leases with resourceVersions, as the API server answers these calls."""

    def __init__(self):
        self.items = {}   # name -> (record, rv)
        self.rv = 0
        self.down = False

    def _check(self):
        if self.down:
            raise ApiException(status=503, reason="Service Unavailable")

    def get(self, namespace, name):
        self._check()
        return self.items.get(name)

    def create(self, namespace, name, record):
        self._check()
        if name in self.items:
            raise ApiException(status=409, reason="AlreadyExists")
        self.rv += 1
        self.items[name] = (record, str(self.rv))

    def write(self, namespace, name, record, rv):
        self._check()
        if self.items[name][1] != rv:
            raise ApiException(status=409, reason="Conflict")
        self.rv += 1
        self.items[name] = (record, str(self.rv))


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_two_electors_one_leader_then_takeover_after_the_holder_dies():
    api, clock = FakeLeases(), Clock()
    a = lease.LeaderElector(api, "ns", "l", "a", clock=clock)
    b = lease.LeaderElector(api, "ns", "l", "b", clock=clock)
    assert a.try_once() and not b.try_once()
    for _ in range(10):                 # a renews every retry period; b never gets it
        clock.t += 2.0
        assert a.try_once() and not b.try_once()
    assert api.items["l"][0].holder == "a"
    # a dies (stops renewing): b takes over once the record stood still a lease duration on b's clock
    last_change = clock.t
    while clock.t < last_change + 15.0 - 2.0:
        clock.t += 2.0
        assert not b.try_once()
    clock.t = last_change + 15.0
    assert b.try_once() and api.items["l"][0] == LeaseRecord("b", 15.0, clock.t, clock.t, 1)
    # a comes back (it was paused, not dead): its deadline passed, it is no leader and cannot renew
    assert not a.is_leader() and not a.try_once() and api.items["l"][0].holder == "b"


def test_holder_steps_down_when_it_cannot_renew_before_the_deadline():
    api, clock = FakeLeases(), Clock()
    a = lease.LeaderElector(api, "ns", "l", "a", clock=clock)
    assert a.try_once()
    api.down = True
    clock.t += 9.9
    a.try_once()
    assert a.is_leader()    # 9.9 s < renew deadline 10 s: still leading
    clock.t += 0.1
    assert not a.try_once()
    # a standby cannot have taken over yet: the deadline (10 s) comes before the lease expiry (15 s)


def test_conflicting_takeover_leaves_one_leader():
    api, clock = FakeLeases(), Clock()
    a = lease.LeaderElector(api, "ns", "l", "a", clock=clock)
    b = lease.LeaderElector(api, "ns", "l", "b", clock=clock)
    c = lease.LeaderElector(api, "ns", "l", "c", clock=clock)
    assert a.try_once()
    b.try_once(), c.try_once()
    clock.t += 15.0
    # b and c both read the same expired record; b writes first, c's write carries a stale version
    got = api.get("ns", "l")
    api.get = lambda ns, name, got=got: got
    assert b.try_once()
    assert not c.try_once()
    assert api.items["l"][0].holder == "b"


def test_release_lets_a_standby_take_over_at_its_next_try():
    api, clock = FakeLeases(), Clock()
    a = lease.LeaderElector(api, "ns", "l", "a", clock=clock)
    b = lease.LeaderElector(api, "ns", "l", "b", clock=clock)
    assert a.try_once() and not b.try_once()
    a.release()
    assert not a.is_leader() and api.items["l"][0].holder is None
    clock.t += 2.0
    assert b.try_once() and api.items["l"][0].transitions == 1


def test_timings_must_be_ordered():
    with pytest.raises(ValueError, match="retry period"):
        lease.LeaderElector(FakeLeases(), "ns", "l", "a", lease_duration_s=10, renew_deadline_s=10)
