"""SLO classes in the worker's metrics: each finished request judged by its own class's TTFT/TPOT
(``--slo-class``), counted per class under a bounded ``slo_class`` label; an unknown class is the
default class. Values computed by hand from the requests' timestamps."""
from __future__ import annotations

import pytest
from goodput.api.policy import SloClass
from goodput.worker.engine.config import EngineArgs
from goodput.worker.metrics import WorkerMetrics

from test_metrics import STATS, finished_request, parse, value


def _req(rid: str, ttft: float, tpot: float):
    r = finished_request(ttft, tpot, n_out=3)
    r.request_id = rid
    return r


def test_each_request_is_judged_by_its_own_class():
    # default class: TTFT 0.5 s, TPOT 50 ms; batch: TTFT 5 s, TPOT 200 ms
    m = WorkerMetrics("m", lambda: STATS, slo_ttft_s=0.5, slo_tpot_s=0.05,
                      slo_classes=(SloClass("batch", 5.0, 0.2),))
    assert m.assign_class(["b1", "b2", "b3"], "batch") == "batch"
    assert m.assign_class(["u1"], "no-such-class") == "default"
    assert m.assign_class(["n1"], None) == "default"
    m.observe_finished("stop", _req("b1", 2.0, 0.1))     # batch: 2 <= 5, 0.1 <= 0.2 -> met
    m.observe_finished("length", _req("b2", 6.0, 0.1))   # batch: TTFT 6 > 5 -> missed; TPOT met
    m.observe_finished("abort", _req("b3", 1.0, 0.1))    # aborted: neither met nor missed
    m.observe_finished("stop", _req("n1", 0.2, 0.1))     # default: TPOT 0.1 > 0.05 -> missed
    m.observe_finished("stop", _req("u1", 0.2, 0.01))    # unknown class -> default: met
    fams = parse(m)
    assert value(fams, "goodput_requests_slo_met_total") == 2        # b1, u1
    want = {"batch": (2, 1, 2), "default": (2, 1, 1)}                # finished, slo met, tpot met
    for cls, (fin, met, tpot) in want.items():
        assert value(fams, "goodput_requests_finished_by_class_total", slo_class=cls) == fin, cls
        assert value(fams, "goodput_requests_slo_met_by_class_total", slo_class=cls) == met, cls
        assert value(fams, "goodput_requests_tpot_met_by_class_total", slo_class=cls) == tpot, cls
    labels = {s.labels["slo_class"] for s in fams["goodput_requests_finished_by_class"].samples}
    assert labels == {"default", "batch"}                            # bounded: never "no-such-class"
    assert m._request_class == {}                                    # every finished request forgotten


def test_without_classes_only_the_default_class_is_exported_at_zero():
    m = WorkerMetrics("m", lambda: STATS, slo_ttft_s=None, slo_tpot_s=None)
    fams = parse(m)
    assert [s.labels["slo_class"] for s in fams["goodput_requests_finished_by_class"].samples] == ["default"]
    assert value(fams, "goodput_requests_finished_by_class_total", slo_class="default") == 0
    m.forget(["never-admitted"])   # nothing to forget: no error


def test_a_refused_request_is_forgotten():
    m = WorkerMetrics("m", lambda: STATS, slo_classes=(SloClass("batch", 5.0, 0.2),))
    m.assign_class(["a", "a-n1"], "batch")
    m.forget(["a", "a-n1"])
    assert m._request_class == {}


@pytest.mark.parametrize("flags,error", [
    (["batch:5000:200", "batch:1:1"], "--slo-class: slo.classes names must be unique, repeated: batch"),
    (["batch:5000"], "--slo-class: an SLO class is NAME:TTFT_MS:TPOT_MS"),
    (["batch:soon:200"], "--slo-class: an SLO class is NAME:TTFT_MS:TPOT_MS with numbers"),
    (["batch:0:200"], "--slo-class: slo.classes[batch].ttftMs must be a number > 0"),
    (["Batch:1:1"], "--slo-class: slo.classes name 'Batch' must be a DNS label"),
    (["default:1:1"], "--slo-class: slo.classes name 'default' is reserved"),
    ([f"c{i}:1:1" for i in range(9)], "--slo-class: slo.classes holds at most 8 classes, got 9"),
])
def test_bad_slo_class_flags_are_refused_naming_the_flag(flags, error):
    with pytest.raises(ValueError) as e:
        EngineArgs(slo_classes=flags)
    assert str(e.value).startswith(error)


def test_slo_class_flags_parse():
    a = EngineArgs(slo_classes=["batch:5000:200", "chat:300.5:40"])
    assert a.slo_class_list() == (SloClass("batch", 5.0, 0.2), SloClass("chat", 0.3005, 0.04))
