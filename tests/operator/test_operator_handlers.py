"""The handlers' pure decisions: which Degraded transitions post an Event; kopf bodies to plain dicts."""

import pytest

from goodput.operator import handlers

BODY = {"metadata": {"name": "a", "namespace": "n", "uid": "u"}}


def _deg(status, message="m", reason="InvalidModel"):
    return [{"type": "Degraded", "status": status, "reason": reason, "message": message,
             "lastTransitionTime": "2026-01-01T00:00:00Z"}]


EVENT_CASES = {
    "turns-degraded": ([], _deg("True"), [("Warning", "InvalidModel")]),
    "stays-degraded-same-message": (_deg("True"), _deg("True"), []),
    "degraded-new-message": (_deg("True", "old"), _deg("True", "new"), [("Warning", "InvalidModel")]),
    "recovers": (_deg("True"), _deg("False", reason="AsExpected"), [("Normal", "Recovered")]),
    "healthy-stays-healthy": (_deg("False", reason="AsExpected"), _deg("False", reason="AsExpected"), []),
    "first-status-healthy": ([], _deg("False", reason="AsExpected"), []),
}


@pytest.mark.parametrize("case", EVENT_CASES)
def test_events_only_on_degraded_transitions(case, monkeypatch):
    before, after, want = EVENT_CASES[case]
    posted = []
    monkeypatch.setattr(handlers, "post_event", lambda body, t, reason, msg: posted.append((t, reason)))
    handlers._post_events(BODY, before, after)
    assert posted == want


def test_plain_copies_nested_mappings():
    class View:  # a read-only mapping like kopf's Body
        def __init__(self, d):
            self._d = d

        def keys(self):
            return self._d.keys()

        def items(self):
            return self._d.items()

    out = handlers._plain(View({"a": View({"b": [View({"c": 1}), 2]}), "s": "x"}))
    assert out == {"a": {"b": [{"c": 1}, 2]}, "s": "x"}


def _api_error(status, body):
    from kubernetes.client.exceptions import ApiException

    e = ApiException(status=status, reason="Unprocessable Entity" if status == 422 else "x")
    e.body = body
    return e


# a Status body as kube-apiserver 1.20 answers a Secret whose label value is too long
STATUS_422 = ('{"kind":"Status","apiVersion":"v1","status":"Failure","message":"Secret \\"x-admin\\" is invalid: '
              'metadata.labels: Invalid value: \\"x-admin\\": must be no more than 63 characters",'
              '"reason":"Invalid","code":422}')


def test_api_message_is_the_servers_message():
    assert handlers.api_message(_api_error(422, STATUS_422)) == (
        'Secret "x-admin" is invalid: metadata.labels: Invalid value: "x-admin": must be no more than 63 characters')
    assert handlers.api_message(_api_error(422, "not json")) == "Unprocessable Entity"
    assert handlers.api_message(_api_error(422, None)) == "Unprocessable Entity"


@pytest.mark.parametrize("status, refusal", [(400, True), (403, True), (422, True), (404, False), (408, False),
                                             (409, False), (429, False), (500, False), (503, False)])
def test_which_answers_are_refusals(status, refusal):
    assert handlers.is_refusal(_api_error(status, None)) is refusal


def test_child_refused_names_the_child_and_keeps_the_message():
    e = handlers.ChildRefused("Secret", "ns", "x-admin", _api_error(422, STATUS_422))
    assert e.problem.reason == "ChildRefused"
    assert e.problem.message.startswith('the API server refused Secret ns/x-admin (422): Secret "x-admin" is invalid')


def _pod(name, crashed, restarts=1, owner="svc", component="worker"):
    cs = {"name": "worker", "ready": not crashed, "restartCount": restarts, "state": {"running": {}}}
    if crashed:
        cs["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
        cs["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error", "message": f"boom in {name}\n"}}
    return {"metadata": {"name": name, "labels": {"serving.goodput.dev/inferenceservice": owner,
                                                  "app.kubernetes.io/component": component}},
            "status": {"containerStatuses": [cs]}}


def test_pod_events_reconcile_the_owner_only_when_its_reported_failure_changes(monkeypatch):
    import logging

    calls = []
    monkeypatch.setattr(handlers, "reconcile", lambda ns, name, logger=None, **kw: calls.append((ns, name)))
    monkeypatch.setattr(handlers, "state", handlers.OperatorState())
    log = logging.getLogger("t")

    def event(pod, etype="MODIFIED"):
        handlers.on_worker_pod_event(type=etype, body=pod, namespace="ns", logger=log)
        return len(calls)

    assert event(_pod("p-b", crashed=False)) == 0                # healthy: nothing to report
    assert event(_pod("p-b", crashed=True)) == 1                 # crash: Degraded now
    assert handlers._worker_problem("ns", "svc").message.startswith("boom in p-b")
    assert event(_pod("p-b", crashed=True, restarts=5)) == 1     # another restart, same message
    assert event(_pod("p-c", crashed=True)) == 1                 # reported pod is still p-b (first by name)
    assert event(_pod("p-a", crashed=True)) == 2                 # p-a comes first now
    assert event(_pod("p-a", crashed=True), "DELETED") == 3      # back to p-b
    assert handlers._worker_problem("ns", "svc").message.startswith("boom in p-b")
    assert event(_pod("p-b", crashed=False)) == 4                # p-b ready again: p-c is reported
    assert handlers._worker_problem("ns", "svc").message.startswith("boom in p-c")
    assert event(_pod("p-c", crashed=False)) == 5 and handlers._worker_problem("ns", "svc") is None
    assert event(_pod("p-c", crashed=False)) == 5
    assert calls == [("ns", "svc")] * 5
