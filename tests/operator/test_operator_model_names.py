"""One served model name, one InferenceService (goodput.operator.model_names): the earliest created
owns the name, later ones are refused (Degraded ModelNameTaken); the router orders claims the same
way (goodput.router.fleet)."""
from __future__ import annotations

import pytest
from goodput.operator import handlers, model_names as mn
from goodput.router.fleet import Fleet, ServiceInfo


def isvc(ns: str, name: str, model: str, created: str = "", served: str | None = None, deleting=False) -> dict:
    meta = {"namespace": ns, "name": name, "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    spec = {"model": {"name": model, **({"servedModelName": served} if served else {})}}
    return {"metadata": meta, "spec": spec}


@pytest.mark.parametrize("spec,name", [
    ({"model": {"name": "models/smollm2.gguf"}}, "smollm2"),
    ({"model": {"name": "models/smollm2.gguf", "servedModelName": "chat"}}, "chat"),
    ({"model": {}}, None), ({}, None),
])
def test_served_name(spec, name):
    assert mn.served_name(spec) == name


T1, T2, T3 = "2026-12-01T10:00:00Z", "2026-12-01T11:00:00Z", "2026-12-01T12:00:00Z"


@pytest.mark.parametrize("objs,refused", [
    # three services, two namespaces, no servedModelName: the first created owns "smollm2"
    ([isvc("b", "x", "m/smollm2.gguf", T2), isvc("a", "y", "other/smollm2.gguf", T1), isvc("a", "z", "smollm2", T3)],
     {("b", "x"), ("a", "z")}),
    # a servedModelName of its own: no conflict
    ([isvc("b", "x", "m/smollm2.gguf", T2), isvc("a", "y", "smollm2", T1, served="chat")], set()),
    # same creation time: namespace, then name
    ([isvc("b", "x", "smollm2", T1), isvc("a", "y", "smollm2", T1)], {("b", "x")}),
    # unknown creation time sorts last
    ([isvc("a", "x", "smollm2", ""), isvc("b", "y", "smollm2", T3)], {("a", "x")}),
    # a service being deleted claims nothing
    ([isvc("a", "x", "smollm2", T1, deleting=True), isvc("b", "y", "smollm2", T3)], set()),
])
def test_the_earliest_created_owns_the_name(objs, refused):
    claims = {(o["metadata"]["namespace"], o["metadata"]["name"]): c for o in objs if (c := mn.claim_of(o))}
    got = {k for k in claims if mn.problems(k, claims)}
    assert got == refused
    for k in refused:
        (p,) = mn.problems(k, claims)
        owner = mn.owner(claims, claims[k].model)
        assert p.reason == "ModelNameTaken" and f"{owner[0]}/{owner[1]}" in p.message
        assert "servedModelName" in p.message
    # the router routes each name to the same owner
    fleet = Fleet()
    for o in objs:
        c = mn.claim_of(o)
        if c is not None:
            fleet.set_service(ServiceInfo(o["metadata"]["namespace"], o["metadata"]["name"], c.model, created=c.created))
    for model in {c.model for c in claims.values()}:
        assert fleet.for_model(model).key == mn.owner(claims, model)
        assert {s.key for s in fleet.shadowed(model)} == {k for k in refused if claims[k].model == model}


def test_the_watch_feeds_the_claims_and_a_deleted_owner_frees_the_name(monkeypatch):
    st = handlers.OperatorState()
    monkeypatch.setattr(handlers, "state", st)
    handlers.track(type=None, namespace="a", name="first", body=isvc("a", "first", "smollm2", T1))
    handlers.track(type=None, namespace="b", name="later", body=isvc("b", "later", "smollm2", T2))
    assert [p.reason for p in st.set_claim(("b", "later"), isvc("b", "later", "smollm2", T2))] == ["ModelNameTaken"]
    assert st.set_claim(("a", "first"), isvc("a", "first", "smollm2", T1)) == []
    handlers.track(type="DELETED", namespace="a", name="first")
    assert st.set_claim(("b", "later"), isvc("b", "later", "smollm2", T2)) == []


def test_the_condition_and_its_events():
    claims = {("a", "first"): mn.Claim("smollm2", T1), ("b", "later"): mn.Claim("smollm2", T2)}
    taken = mn.condition(mn.problems(("b", "later"), claims), 3, [], "2026-12-02T00:00:00Z")
    assert (taken["type"], taken["status"], taken["reason"]) == ("ModelNameAccepted", "False", "ModelNameTaken")
    assert "a/first" in taken["message"] and taken["observedGeneration"] == 3
    ok = mn.condition(mn.problems(("a", "first"), claims), 3, [], "2026-12-02T00:00:00Z")
    assert (ok["status"], ok["reason"]) == ("True", "Accepted")
    # the transition time stays while the status stays
    again = mn.condition(mn.problems(("b", "later"), claims), 4, [taken], "2026-12-02T01:00:00Z")
    assert again["lastTransitionTime"] == "2026-12-02T00:00:00Z"
    assert mn.event(None, taken)[:2] == ("Warning", "ModelNameTaken")
    assert mn.event(taken, again) is None
    assert mn.event(taken, ok)[:2] == ("Normal", "Accepted")
    assert mn.event(None, ok) is None
    # the CRD lets the API server store it (conditions' type is an enum there)
    from goodput.api import crd
    crd.Condition.model_validate({"type": "ModelNameAccepted", "status": "False", "reason": "ModelNameTaken",
                                  "lastTransitionTime": "2026-12-02T00:00:00Z"})
