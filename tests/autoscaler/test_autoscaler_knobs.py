"""Autoscaling knobs are declared once (goodput.api.policy.PolicySpec): the CRD's fields,
their defaults and PolicySpec.from_crd all derive from that declaration."""
from __future__ import annotations

import pytest

from goodput.api.policy import PolicySpec, knobs
from goodput.api import crd as api
from goodput.operator import crdgen


def _schema_at(path: tuple[str, ...]) -> dict:
    props = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for key in path:
        props = props["properties"][key]
    return props


def test_every_knob_is_a_crd_field_with_its_default_and_bounds():
    ks = knobs()
    # every field is a knob but the SLO classes (a list of objects, spec.slo.classes) and the
    # prefill pool's mark (set by the loop's pool_policy, not by the spec)
    assert len(ks) == len([f for f in PolicySpec.__dataclass_fields__ if f not in ("slo_classes", "prefill_pool")])
    for k in ks:
        field = _schema_at(k.path)
        assert field["default"] == k.crd_default, k.name
        assert field["type"] == ("integer" if k.crd_type is int else "number"), k.name
        assert field["description"] == k.meta.help
        if k.meta.ge is not None:
            assert field["minimum"] == k.meta.ge


def test_crd_defaults_give_the_policy_defaults():
    # an InferenceService with nothing set, as the API server returns it (defaults filled in)
    spec = api.InferenceServiceSpec().model_dump(by_alias=True)
    assert PolicySpec.from_crd(spec) == PolicySpec()
    assert PolicySpec.from_crd({}) == PolicySpec()


@pytest.mark.parametrize("crd,field,value", [
    ({"slo": {"ttftMs": 500}}, "slo_ttft_s", 0.5),                       # ms -> s
    ({"autoscaling": {"scaleToZeroIdleSeconds": 120}}, "scale_to_zero_idle_s", 120.0),
    ({"autoscaling": {"targets": {"queueDepth": 7}}}, "queue_target", 7),
    ({"autoscaling": {"tuning": {"modelLoadSeconds": 145}}}, "model_load_s", 145.0),
    ({"autoscaling": {"tuning": {"exploreRatio": 2.5}}}, "explore_ratio", 2.5),
    ({"autoscaling": {"tuning": {"maxNumSeqs": 100}}, "engine": {"maxNumSeqs": 300}}, "max_num_seqs", 300),
])
def test_from_crd_reads_each_knob_where_the_crd_holds_it(crd, field, value):
    assert getattr(PolicySpec.from_crd(crd), field) == value


@pytest.mark.parametrize("crd", [
    {"autoscaling": {"tuning": {"targetUtilization": 0}}},              # gt 0
    {"autoscaling": {"tuning": {"minNumSeqs": 10, "maxNumSeqs": 5}}},   # min > max
    {"slo": {"attainmentTarget": 1.5}},                                  # le 1
    {"autoscaling": {"tuning": {"tolerance": "a lot"}}},
])
def test_out_of_bounds_knobs_are_refused(crd):
    with pytest.raises(ValueError):
        PolicySpec.from_crd(crd)


def test_inconsistent_tuning_is_a_semantic_problem():
    spec = api.InferenceServiceSpec.model_validate(
        {"autoscaling": {"tuning": {"minNumSeqs": 10, "maxNumSeqs": 5}}})
    problems = api.semantic_problems(spec)
    assert [p.reason for p in problems] == ["InvalidAutoscaling"]
    assert "min_num_seqs <= max_num_seqs" in problems[0].message
