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
