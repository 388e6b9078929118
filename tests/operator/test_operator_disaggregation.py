"""spec.disaggregation: the prefill pool's Deployment beside the workers' (decode) one, each pool's
engine settings over spec.engine, the pods' roles and labels, what the status says of each pool."""

import pytest

from goodput.api import crd
from goodput.api.crd import InferenceServiceSpec
from goodput.operator import resources as r
from goodput.operator.status import compute_status

T0 = "2026-01-01T00:00:00Z"

SPEC = {
    "replicas": 3,
    "engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 256, "enablePrefixCaching": False},
    "disaggregation": {
        "enabled": True,
        "prefill": {"replicas": 2, "engine": {"maxNumBatchedTokens": 4096, "enablePrefixCaching": True}},
        "decode": {"engine": {"maxNumSeqs": 64}},
    },
}


def _deployments(spec=SPEC):
    out = r.children("tiny", "ns1", "uid-1", InferenceServiceSpec.model_validate(spec))
    return {d["metadata"]["name"]: d for d in out if d["kind"] == "Deployment"}


def _parsed(deployment):
    from goodput.worker.cli import build_parser, engine_args_from
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return engine_args_from(build_parser().parse_args(args))


def test_off_by_default_one_deployment_no_role():
    deps = _deployments({"replicas": 2})
    assert list(deps) == ["tiny"]
    a = _parsed(deps["tiny"])
    assert a.role == "both"
    assert crd.LABEL_ROLE not in deps["tiny"]["spec"]["template"]["metadata"]["labels"]
    with pytest.raises(ValueError, match="disaggregation is off"):
        r.prefill_deployment("tiny", "ns1", InferenceServiceSpec())


def test_two_pools_each_with_its_role_replicas_and_settings():
    deps = _deployments()
    assert sorted(deps) == ["tiny", "tiny-prefill"]
    decode, prefill = deps["tiny"], deps["tiny-prefill"]
    assert decode["spec"]["replicas"] == 3 and prefill["spec"]["replicas"] == 2
    d, p = _parsed(decode), _parsed(prefill)
    # decode: its own maxNumSeqs over the service's; the rest of spec.engine as given
    assert (d.role, d.max_num_seqs, d.max_num_batched_tokens, d.enable_prefix_caching) == ("decode", 64, 256, False)
    # prefill: a bigger token budget and the prefix cache back on; maxNumSeqs from spec.engine
    assert (p.role, p.max_num_seqs, p.max_num_batched_tokens, p.enable_prefix_caching) == ("prefill", 8, 4096, True)


def test_selectors_are_disjoint_so_the_service_and_pdb_see_only_decode_pods():
    deps = _deployments()
    decode, prefill = deps["tiny"], deps["tiny-prefill"]
    d_labels = decode["spec"]["template"]["metadata"]["labels"]
    p_labels = prefill["spec"]["template"]["metadata"]["labels"]
    assert decode["spec"]["selector"]["matchLabels"] == crd.selector_labels("tiny")
    assert prefill["spec"]["selector"]["matchLabels"] == crd.prefill_selector_labels("tiny")

    def selects(selector, labels):
        return all(labels.get(k) == v for k, v in selector.items())

    service = r.service("tiny", "ns1")
    pdb = r.pod_disruption_budget("tiny", "ns1")
    for selector in (decode["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selects(selector, d_labels) and not selects(selector, p_labels)
    assert selects(prefill["spec"]["selector"]["matchLabels"], p_labels)
    assert not selects(prefill["spec"]["selector"]["matchLabels"], d_labels)
    assert (d_labels[crd.LABEL_ROLE], p_labels[crd.LABEL_ROLE]) == ("decode", "prefill")
    assert p_labels[crd.LABEL_ISVC] == "tiny"  # the operator's pod events find the owner by it
    assert prefill["metadata"]["ownerReferences"][0]["name"] == "tiny"


def test_prefill_name_is_shortened_like_every_child():
    long = "a" * 63
    assert crd.prefill_deployment_name("tiny") == "tiny-prefill"
    name = crd.prefill_deployment_name(long)
    assert len(name) == 63 and name.endswith("-prefill")


def test_turning_it_off_makes_the_prefill_deployment_obsolete():
    off = InferenceServiceSpec.model_validate({"disaggregation": {"enabled": False}})
    on = InferenceServiceSpec.model_validate(SPEC)
    assert r.obsolete_children("tiny", off) == [("apps/v1", "Deployment", "tiny-prefill")]
    assert r.obsolete_children("tiny", on) == []


@pytest.mark.parametrize("spec, want", [
    ({"disaggregation": {"enabled": True, "prefill": {"minReplicas": 3, "maxReplicas": 2}}},
     ["disaggregation.prefill.minReplicas (3) > disaggregation.prefill.maxReplicas (2)"]),
    # a pool's own override conflicting with the service's block size: named by the pool's path
    ({"engine": {"blockSize": 32}, "disaggregation": {"enabled": True, "decode": {"engine": {
        "maxNumBatchedTokens": 16}}}},
     ["disaggregation.decode.engine.maxNumBatchedTokens (16) is smaller than "
      "disaggregation.decode.engine.blockSize (32)"]),
    # a problem of spec.engine that both pools inherit is said once, under engine
    ({"engine": {"maxNumBatchedTokens": 8}, "disaggregation": {"enabled": True}},
     ["engine.maxNumBatchedTokens (8) is smaller than engine.blockSize (16)"]),
    # off: the pools' settings are not checked (nothing runs them)
    ({"disaggregation": {"prefill": {"minReplicas": 3, "maxReplicas": 2}}}, []),
])
def test_semantic_problems(spec, want):
    assert [p.message for p in crd.semantic_problems(InferenceServiceSpec.model_validate(spec))] == want


def test_schema_refuses_unknown_pool_fields():
    with pytest.raises(Exception, match="extra"):
        InferenceServiceSpec.model_validate({"disaggregation": {"prefill": {"engine": {"nope": 1}}}})


def _dep(replicas, ready, gen=2):
    return {"metadata": {"generation": gen},
            "status": {"observedGeneration": gen, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": replicas, "conditions": []}}


def _status(prefill_desired, prefill, decode=None):
    return compute_status(name="tiny", namespace="ns1", generation=4, desired_replicas=2,
                          deployment=decode or _dep(2, 2), service_exists=True, now=T0,
                          prefill_desired=prefill_desired, prefill_deployment=prefill)


def _cond(st, ctype):
    return next(c for c in st["conditions"] if c["type"] == ctype)


def test_status_pools_and_conditions():
    off = _status(None, None)
    assert off["pools"] is None  # a merge patch of null removes pools once it is turned off
    assert _cond(off, "Progressing")["reason"] == "Complete"

    both = _status(1, _dep(1, 1))
    assert both["pools"] == {"decode": {"desiredReplicas": 2, "replicas": 2, "readyReplicas": 2},
                             "prefill": {"desiredReplicas": 1, "replicas": 1, "readyReplicas": 1}}
    assert _cond(both, "Progressing")["reason"] == "Complete"
    assert _cond(both, "Ready")["message"] == "2/2 replicas ready; prefill pool 1/1 ready"

    starting = _status(2, _dep(2, 0))
    assert _cond(starting, "Progressing")["status"] == "True"
    assert _cond(starting, "Progressing")["reason"] == "WaitingForPrefillReplicas"
    ready = _cond(starting, "Ready")
    # the decode pool serves on its own (local prefill): Ready, and it says so
    assert (ready["status"], ready["reason"]) == ("True", "AllReplicasReady")
    assert ready["message"].endswith("prefill pool 0/2 ready (the decode pods prefill every prompt locally)")

    no_deployment_yet = _status(1, None)
    assert no_deployment_yet["pools"]["prefill"] == {"desiredReplicas": 1, "replicas": 0, "readyReplicas": 0}
    # the decode pool's own rollout state wins over the prefill pool's
    rolling = _status(1, _dep(1, 0), decode=_dep(2, 1))
    assert _cond(rolling, "Progressing")["reason"] == "WaitingForReplicas"


def test_crd_prints_the_prefill_pool_column():
    from goodput.operator.crdgen import build_crd
    cols = build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    assert {"name": "Prefill", "type": "integer", "jsonPath": ".status.pools.prefill.readyReplicas",
            "priority": 1} in cols  # -o wide only: the default table of every other service is unchanged


def test_pod_events_of_both_pools_count_and_others_do_not(monkeypatch):
    import logging

    from goodput.operator import handlers
    from test_operator_handlers import _pod

    calls = []
    monkeypatch.setattr(handlers, "reconcile", lambda ns, name, logger=None, **kw: calls.append((ns, name)))
    monkeypatch.setattr(handlers, "state", handlers.OperatorState())

    def event(pod):
        handlers.on_worker_pod_event(type="MODIFIED", body=pod, namespace="ns", logger=logging.getLogger("t"))
        return len(calls)

    assert event(_pod("p-x", crashed=True, component="router")) == 0   # not a worker of either pool
    assert event(_pod("p-p", crashed=True, component=crd.PREFILL_COMPONENT)) == 1
    assert handlers._worker_problem("ns", "svc").message.startswith("boom in p-p")
