"""goodput.api.settings: one declaration gives the flag (type, bounds, choices, default, repeatable,
environment default), the check at construction and the CRD units' bounds."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from goodput.api.settings import add_flags, bounds, check, from_flags, setting, settings, validate


@dataclass(frozen=True)
class Demo:
    port: int = setting(8080, "listen port", ge=0, le=65535, metavar="PORT")
    period_s: float = setting(2.0, "seconds between passes", gt=0, flag="--period")
    eps: float | None = setting(0.25, "slack (none: no bound)", ge=0)
    mode: str = setting("a", "one of a, b", choices=("a", "b"))
    urls: list[str] = setting([], "repeatable", metavar="URL")
    on: bool = setting(True, "a switch")
    where: str = setting("default-ns", "namespace ($DEMO_NS when set)", env="DEMO_NS")
    slo_s: float = setting(1.0, "target, milliseconds", unit=0.001, gt=0, le=10000, crd="slo.ttftMs")

    def __post_init__(self) -> None:
        validate(self)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo")
    add_flags(p, settings(Demo))
    return p


def test_defaults_and_every_flag():
    assert from_flags(parser().parse_args([]), Demo) == Demo()
    ns = parser().parse_args(["--port", "0", "--period", "0.5", "--eps", "none", "--mode", "b", "--urls", "x",
                              "--urls", "y", "--no-on", "--where", "w", "--slo-s", "0.5"])
    assert from_flags(ns, Demo) == Demo(port=0, period_s=0.5, eps=None, mode="b", urls=["x", "y"], on=False,
                                        where="w", slo_s=0.5)
    assert Demo().urls is not Demo().urls       # a list default is copied per instance


def test_environment_default(monkeypatch):
    monkeypatch.setenv("DEMO_NS", "from-env")
    assert parser().parse_args([]).where == "from-env"
    monkeypatch.setenv("DEMO_NS", "")           # empty: the declared default
    assert parser().parse_args([]).where == "default-ns"


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "expected a port in 0-65535, got '70000'"),
    (["--period", "0"], "expected a number > 0, got '0'"),
    (["--period", "soon"], "expected a number, got 'soon'"),
    (["--eps", "-1"], "expected a number >= 0, got '-1'"),
    (["--mode", "c"], "invalid choice: 'c'"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("kw, message", [
    ({"port": 65536}, "port must be in 0-65535, got 65536"),
    ({"port": True}, "port must be a int, got True"),
    ({"period_s": float("nan")}, "period_s must be a finite number, got nan"),
    ({"mode": "c"}, "mode must be one of ('a', 'b'), got 'c'"),
    ({"slo_s": 11.0}, "slo_s must be in (0, 10000] (CRD units), got 11.0"),   # 11 s = 11000 ms > 10000
])
def test_construction_checks_every_setting(kw, message):
    with pytest.raises(ValueError) as e:
        Demo(**kw)
    assert str(e.value) == message


@dataclass(frozen=True)
class Floor:
    t_s: float = setting(0.7, "at least 700 ms", unit=0.001, ge=700, crd="slo.floorMs")


def test_bounds_in_crd_units_tolerate_the_unit_rounding():
    s = settings(Floor)[0]
    check(s, 0.7)             # 0.7 / 0.001 = 699.9999999999999 ms: at the bound, not below it
    with pytest.raises(ValueError, match=r"t_s must be >= 700 \(CRD units\), got 0.69"):
        check(s, 0.69)
    assert bounds(s) == ">= 700 (CRD units)"
    assert (s.flag, s.meta.crd, s.meta.unit) == ("--t-s", "slo.floorMs", 0.001)
