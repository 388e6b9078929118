"""goodput.api.pods.pod_state: the one reading of a pod's Ready / terminating / draining / finished
state (table: a pod as the API returns it -> the state, worked out from the Kubernetes rules)."""
import pytest

from goodput.api.crd import DRAINING_ANNOTATION
from goodput.api.pods import pod_state


def pod(ready=None, ip="10.0.0.1", deleting=False, draining=None, phase="Running"):
    meta = {"name": "p", "creationTimestamp": "2027-01-15T08:00:00Z"}
    if deleting:
        meta["deletionTimestamp"] = "2027-01-15T08:05:00Z"
    if draining is not None:
        meta["annotations"] = {DRAINING_ANNOTATION: draining}
    st = {"phase": phase}
    if ip:
        st["podIP"] = ip
    if ready is not None:
        st["conditions"] = [{"type": "PodScheduled", "status": "True"},
                            {"type": "Ready", "status": ready, "lastTransitionTime": "2027-01-15T08:01:00Z"}]
    return {"metadata": meta, "status": st}


# (pod, ready, terminating, draining, finished, serving)
CASES = [
    (pod("True"), True, False, False, False, True),
    (pod("False"), False, False, False, False, False),                  # loading its model
    (pod(None), False, False, False, False, False),                     # no conditions yet
    (pod("True", ip=None), True, False, False, False, False),           # no IP: cannot take a request
    (pod("True", deleting=True), True, True, False, False, False),      # still Ready while it drains out
    (pod("True", draining="true"), True, False, True, False, False),    # the autoscaler marked it
    (pod("True", draining="false"), True, False, False, False, True),   # only "true" drains
    (pod("False", phase="Succeeded"), False, False, False, True, False),
    (pod("True", phase="Failed"), True, False, False, True, False),
]


@pytest.mark.parametrize("p, ready, terminating, draining, finished, serving", CASES)
def test_pod_state(p, ready, terminating, draining, finished, serving):
    s = pod_state(p)
    assert (s.ready, s.terminating, s.draining, s.finished, s.serving) == (ready, terminating, draining, finished,
                                                                          serving)
    assert s.going == (terminating or draining or finished)


def test_pod_state_keeps_the_times_and_reads_an_empty_pod():
    s = pod_state(pod("True"))
    assert (s.name, s.ip, s.ready_since, s.created) == ("p", "10.0.0.1", "2027-01-15T08:01:00Z",
                                                        "2027-01-15T08:00:00Z")
    empty = pod_state({})
    assert (empty.name, empty.ip, empty.ready, empty.serving, empty.ready_since) == ("", None, False, False, None)
