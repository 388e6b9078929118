"""spec.slo.classes: the schema refuses what it can express (names, times, count), the semantic
checks the rest (a reserved or repeated name: Degraded InvalidSLO naming the field); the policy
spec and the worker flag read the same declaration."""
from __future__ import annotations

import pydantic
import pytest

from goodput.api.crd import InferenceServiceSpec, semantic_problems
from goodput.api.policy import PolicySpec, SloClass, class_of, parse_slo_class, rank_of, slo_ranks


def _spec(classes):
    return {"slo": {"ttftMs": 500, "tpotMs": 50, "classes": classes}}


@pytest.mark.parametrize("classes,where", [
    ([{"name": "Batch", "ttftMs": 1, "tpotMs": 1}], "name"),             # not a DNS label
    ([{"name": "b" * 64, "ttftMs": 1, "tpotMs": 1}], "name"),            # too long
    ([{"name": "batch", "ttftMs": 0, "tpotMs": 1}], "ttftMs"),           # not > 0
    ([{"name": "batch", "ttftMs": 1}], "tpotMs"),                        # missing
    ([{"name": "batch", "ttftMs": 1, "tpotMs": 1, "extra": 1}], "extra"),  # unknown field
    ([{"name": f"c{i}", "ttftMs": 1, "tpotMs": 1} for i in range(9)], "classes"),   # more than 8
])
def test_the_schema_refuses_bad_classes(classes, where):
    with pytest.raises(pydantic.ValidationError) as e:
        InferenceServiceSpec.model_validate(_spec(classes))
    assert where in str(e.value)


@pytest.mark.parametrize("classes,message", [
    ([{"name": "default", "ttftMs": 1, "tpotMs": 1}], "slo.classes name 'default' is reserved"),
    ([{"name": "a", "ttftMs": 1, "tpotMs": 1}, {"name": "a", "ttftMs": 2, "tpotMs": 2}],
     "slo.classes names must be unique, repeated: a"),
])
def test_reserved_or_repeated_names_are_degraded_naming_the_field(classes, message):
    problems = semantic_problems(InferenceServiceSpec.model_validate(_spec(classes)))
    assert [(p.reason, p.message[:len(message)]) for p in problems] == [("InvalidSLO", message)]


def test_good_classes_reach_the_policy_spec_and_the_worker_flag():
    spec = InferenceServiceSpec.model_validate(_spec([{"name": "batch", "ttftMs": 5000, "tpotMs": 200.5}]))
    assert semantic_problems(spec) == []
    p = PolicySpec.from_crd(spec.model_dump(by_alias=True))   # as the autoscaler's loop reads it
    assert p.slo_classes == (SloClass("batch", 5.0, 0.2005),)
    assert spec.slo.classes[0].flag() == "batch:5000:200.5"
    assert parse_slo_class(spec.slo.classes[0].flag()) == SloClass("batch", 5.0, 0.2005)
    assert PolicySpec.from_crd(InferenceServiceSpec().model_dump(by_alias=True)).slo_classes == ()


def test_an_unknown_class_is_the_default_one():
    known = (SloClass("batch", 5.0, 0.2),)
    assert [class_of(n, known) for n in ("batch", "nope", "", None)] == ["batch", "default", "default", "default"]


@pytest.mark.parametrize("bad,error", [
    ({"slo": {"classes": "batch"}}, "slo.classes must be a list"),
    ({"slo": {"classes": [{"name": "batch", "ttftMs": "x", "tpotMs": 1}]}}, "slo.classes[batch]: ttftMs and tpotMs"),
    ({"slo": {"classes": [{"name": "batch", "tpotMs": 1}]}}, "slo.classes[batch].ttftMs must be set"),
])
def test_policy_spec_from_a_raw_crd_names_the_field(bad, error):
    with pytest.raises(ValueError) as e:
        PolicySpec.from_crd(bad)
    assert str(e.value).startswith(error)


I, B = SloClass("interactive", 0.5, 0.05), SloClass("batch", 5.0, 0.2)


@pytest.mark.parametrize("default_ttft, classes, want", [
    # no named class: everything is rank 0 (first-come first-served, as before classes)
    (0.5, (), {"default": 0}),
    (None, (), {"default": 0}),
    # the simulator's two-class service: default at the strictest TTFT
    (0.5, (I, B), {"default": 0, "interactive": 0, "batch": 1}),
    # a default looser than both: distinct TTFTs 0.5 < 2 < 5
    (2.0, (I, B), {"default": 1, "interactive": 0, "batch": 2}),
    # no default TTFT: unlabelled requests are never put behind a named class
    (None, (I, B), {"default": 0, "interactive": 0, "batch": 1}),
    # equal TTFTs share a band whatever their TPOT
    (1.0, (SloClass("a", 1.0, 0.05), SloClass("b", 1.0, 0.5), SloClass("c", 3.0, 0.1)),
     {"default": 0, "a": 0, "b": 0, "c": 1}),
])
def test_slo_ranks_order_classes_by_ttft(default_ttft, classes, want):
    assert slo_ranks(default_ttft, classes) == want


def test_rank_of_an_unknown_or_missing_class_is_the_default_one():
    ranks = slo_ranks(2.0, (I, B))
    assert [rank_of(n, ranks) for n in ("batch", "interactive", None, "", "nope", "default")] == [2, 0, 1, 1, 1, 1]
