"""The discovery interface (Fleet) and static discovery's flag parsing."""
import pytest
from goodput.router.discovery_static import StaticDiscovery, parse_static
from goodput.router.fleet import Fleet, PodInfo, ServiceInfo


def _fleet():
    f = Fleet()
    f.set_service(ServiceInfo("ns", "svc", "m", router_max_queued=None))
    return f


def test_routable_excludes_unready_terminating_draining():
    f = _fleet()
    f.replace_pods("ns", "svc", [PodInfo("a", "http://a:1"), PodInfo("b", "http://b:1", ready=False),
                                 PodInfo("c", "http://c:1", terminating=True),
                                 PodInfo("d", "http://d:1", draining=True), PodInfo("e", "http://e:1")])
    assert [p.name for p in f.for_model("m").routable_pods()] == ["a", "e"]


def test_updates_keep_runtime_view_and_notify():
    f = _fleet()
    seen = []
    f.add_listener(seen.append)
    f.set_pod("ns", "svc", PodInfo("a", "http://a:1"))
    pod = f.service(("ns", "svc")).pods["a"]
    pod.in_flight, pod.max_waiting = 3, 7
    f.set_pod("ns", "svc", PodInfo("a", "http://a:1", draining=True))
    kept = f.service(("ns", "svc")).pods["a"]
    assert (kept.in_flight, kept.max_waiting, kept.routable) == (3, 7, False)
    # a new URL under the same name is a new pod: its count starts at 0
    f.set_pod("ns", "svc", PodInfo("a", "http://a:2"))
    assert f.service(("ns", "svc")).pods["a"].in_flight == 0
    f.replace_pods("ns", "svc", [PodInfo("b", "http://b:1")])
    assert list(f.service(("ns", "svc")).pods) == ["b"]
    f.remove_service("ns", "svc")
    assert f.for_model("m") is None
    assert seen == [("ns", "svc")] * 5


def test_queue_bound_router_max_queued_or_sum_of_max_waiting():
    f = _fleet()
    f.replace_pods("ns", "svc", [PodInfo("a", "http://a:1"), PodInfo("b", "http://b:1"),
                                 PodInfo("c", "http://c:1", ready=False)])
    svc = f.for_model("m")
    svc.pods["a"].max_waiting, svc.pods["b"].max_waiting, svc.pods["c"].max_waiting = 4, 6, 100
    assert svc.queue_bound() == 4 + 6  # the unready pod's room does not count
    f.set_service(ServiceInfo("ns", "svc", "m", router_max_queued=2))
    assert svc.queue_bound() == 2


def test_at_limits_rule():
    f = _fleet()
    f.set_pod("ns", "svc", PodInfo("a", "http://a:1"))
    pod = f.for_model("m").pods["a"]
    pod.in_flight = 10
    assert not pod.at_limits  # limits unknown: never at its limits
    pod.max_num_seqs, pod.max_waiting = 8, 2
    assert pod.at_limits
    pod.in_flight = 9
    assert not pod.at_limits


def test_parse_static():
    assert parse_static("m=http://127.0.0.1:1/, http://127.0.0.1:2") == (
        "m", ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    for bad in ["nourl", "=http://x:1", "m=", "m=ftp://x:1", "m=127.0.0.1:1"]:
        with pytest.raises(ValueError):
            parse_static(bad)
    with pytest.raises(ValueError, match="twice"):
        StaticDiscovery(["m=http://a:1", "m=http://b:1"]).services()
    f = Fleet()
    StaticDiscovery(["m=http://127.0.0.1:1,http://127.0.0.1:2"], startup_timeout_s=5).fill(f)
    svc = f.for_model("m")
    assert (svc.key, svc.info.startup_timeout_s, sorted(svc.pods)) == (
        ("", "m"), 5, ["127.0.0.1:1", "127.0.0.1:2"])
    assert svc.routable_pods() == []  # not Ready until the first /ready probe


def test_for_model_follows_renames_and_removals():
    f = Fleet()
    f.set_service(ServiceInfo("ns", "b", "m"))
    f.set_service(ServiceInfo("ns", "a", "m"))  # two services claim one name: the first by key wins
    assert f.for_model("m").key == ("ns", "a")
    f.set_service(ServiceInfo("ns", "a", "other"))
    assert (f.for_model("m").key, f.for_model("other").key) == (("ns", "b"), ("ns", "a"))
    f.remove_service("ns", "b")
    assert f.for_model("m") is None
