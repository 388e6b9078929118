"""One way to declare a setting, for every deployable (standard library only).

A setting is a dataclass field made by :func:`setting`: its default, one line of help, and how it is
spelled and checked outside Python (a :class:`Setting` in the field's metadata). Everything else
derives from that one declaration:

- the command line: :func:`add_flags` builds one ``argparse`` flag per setting (``--max-num-seqs``,
  ``--scrape-period``: type, bounds, choices, default and help from the declaration) and
  :func:`from_flags` reads them back into the dataclass;
- the CRD: ``goodput.api.crd`` builds ``spec.engine`` from the worker's settings and ``spec.slo`` /
  ``spec.autoscaling`` from the policy's (:mod:`goodput.api.policy`), with the same bounds;
- validation at construction: :func:`validate` in ``__post_init__`` raises ``ValueError`` naming
  the setting and the value.

The worker's engine (``goodput.worker.engine.config``), the autoscaler's policy and CLI, and the
router's settings and picker all declare their settings with it, so a new setting is one new field.
"""
from __future__ import annotations

import argparse
import math
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

_META = "goodput.setting"


@dataclass(frozen=True)
class Setting:
    """How one setting is spelled and checked outside Python.

    help: one line for ``--help`` and the CRD's description.
    choices: the allowed values (CLI choices, CRD enum).
    ge, gt, le: numeric bounds in CRD units (``value / unit``), checked by the CLI, the CRD schema
        and at construction.
    parse: text -> value for a setting with units (sizes: ``goodput.api.units.parse_bytes``); the
        CRD then accepts a number or a string such as ``512Mi``.
    crd: where an ``InferenceService`` spec holds the value: ``"engine"`` (``spec.engine``, the
        field's name in camelCase), a camelCase path under ``.spec`` such as ``"model.name"`` or
        ``"autoscaling.tuning.tpotMargin"``, or None (the default: not in the CRD; set by the
        operator itself, or a setting of a process the CRD does not describe).
    unit: value = CRD value * unit (``slo.ttftMs`` in milliseconds -> ``slo_ttft_s``: 0.001).
    crd_type: the CRD's type when it differs from the field's (whole seconds: int).
    flag: the command-line flag (default: ``--`` + the name with dashes).
    alias: a second, short spelling of the flag (``-n``).
    env: an environment variable whose value, when set and not empty, replaces the default.
    metavar: the value's name in ``--help`` and in the CLI's messages (``PORT``: "expected a port").
    """

    help: str
    choices: tuple[str, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    parse: Callable[[str], Any] | None = None
    crd: str | None = None
    unit: float = 1.0
    crd_type: type | None = None
    flag: str | None = None
    alias: str | None = None
    env: str | None = None
    metavar: str | None = None


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field declaring one setting (``kw``: the other :class:`Setting` fields). A list
    default (a repeatable flag) is copied for each instance."""
    meta = {_META: Setting(help, **kw)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class SettingField:
    """One declared setting: its Python ``name``, ``flag`` (``--max-num-seqs``), value ``type``
    (int, float, str, bool or list: a repeatable string flag), whether None is allowed, its
    default and its :class:`Setting`."""

    name: str
    flag: str
    type: type
    optional: bool
    default: Any
    meta: Setting


def settings(cls: type) -> list[SettingField]:
    """The settings of a dataclass, in declaration order (fields made without :func:`setting`
    are left out)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        meta = f.metadata.get(_META)
        if meta is None:
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hint
        base = typing.get_origin(base) or base
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        out.append(SettingField(f.name, meta.flag or "--" + f.name.replace("_", "-"), base, optional,
                                default, meta))
    return out


def check(s: SettingField, value: Any, name: str | None = None) -> None:
    """Raise ``ValueError`` naming the setting (``name``, default ``s.name``) when ``value`` is not
    allowed: the wrong type (a bool is never a number; a float must be finite), not one of the
    choices, or out of the bounds (compared in CRD units, ``value / unit``)."""
    name = name or s.name
    if value is None:
        if not s.optional:
            raise ValueError(f"{name} must be set")
        return
    m = s.meta
    if s.type is bool:
        ok = isinstance(value, bool)
    elif s.type is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif s.type is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, s.type)
    if not ok:
        raise ValueError(f"{name} must be {'a finite number' if s.type is float else 'a ' + s.type.__name__}, "
                         f"got {value!r}")
    if m.choices is not None and value not in m.choices:
        raise ValueError(f"{name} must be {'one of' if s.type is not list else 'in'} {m.choices}, got {value!r}")
    if s.type in (int, float):
        v = value / m.unit
        tol = 0.0 if m.unit == 1.0 else 1e-12   # value / unit rounds: 0.7 s / 0.001 = 699.9999999999999 ms
        if (m.ge is not None and v < m.ge - tol) or (m.gt is not None and v <= m.gt) \
                or (m.le is not None and v > m.le + tol):
            raise ValueError(f"{name} must be {bounds(s)}, got {value!r}")


def bounds(s: SettingField) -> str:
    """The numeric bounds as text: ``">= 1"``, ``"in 1-65535"``, ``"> 0"``; bounds of a setting
    with a unit say so (``"> 0 (CRD units)"``)."""
    m = s.meta
    lo = m.ge if m.ge is not None else m.gt
    if lo is not None and m.le is not None:
        text = f"in {_num(lo)}-{_num(m.le)}" if m.ge is not None else f"in ({_num(lo)}, {_num(m.le)}]"
    elif lo is not None:
        text = f"{'>=' if m.ge is not None else '>'} {_num(lo)}"
    else:
        text = f"<= {_num(m.le)}" if m.le is not None else "any value"
    return text if m.unit == 1.0 else f"{text} (CRD units)"


def _num(x: float) -> str:
    """A number as a flag value: ``1000.0`` -> ``"1000"``, ``250.5`` -> ``"250.5"``."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def flag_value(s: SettingField, value: Any) -> str:
    """``value`` spelled as the flag's argument (``1000.0`` -> ``"1000"``)."""
    return _num(value) if s.type is float else str(value)


def validate(obj: Any) -> None:
    """Check every setting of a dataclass instance (:func:`check`); call it from ``__post_init__``."""
    for s in settings(type(obj)):
        check(s, getattr(obj, s.name))


# -------------------------------------------------------------------------------------------- CLI
def _converter(s: SettingField) -> Callable[[str], Any]:
    """An argparse ``type`` for one setting: parse the text (``none`` is None for an optional
    setting), then check it (a usage error, exit 2, names the flag and the allowed range)."""
    what = ("a " + s.meta.metavar.lower() if s.meta.metavar else "a size" if s.meta.parse is not None
            else {int: "an integer", float: "a number"}.get(s.type, "a value"))

    def convert(text: str) -> Any:
        if s.optional and text.strip().lower() == "none":
            return None
        try:
            value = s.meta.parse(text) if s.meta.parse is not None else s.type(text)
        except ValueError as e:  # the units parser says what it accepts
            raise argparse.ArgumentTypeError(str(e) if s.meta.parse else f"expected {what}, got {text!r}") from None
        try:
            check(s, value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} {bounds(s)}, got {text!r}") from None
        return value

    convert.__name__ = s.name  # argparse names the type in some messages
    return convert


def default_of(s: SettingField) -> Any:
    """The setting's default: ``$env`` when the declaration names a variable that is set (parsed
    as the flag's text is), else the declared one."""
    text = os.environ.get(s.meta.env) if s.meta.env else None
    if not text:
        return s.default
    return _converter(s)(text) if s.type not in (str, bool, list) else text


def add_flags(p: argparse.ArgumentParser | Any, ss: list[SettingField], prefix: str = "") -> None:
    """One flag per setting on ``p`` (a parser or an argument group): ``--<prefix><flag>`` with
    destination ``<prefix_>name``; help, choices, bounds and default from the declaration. A bool
    is ``--flag`` / ``--no-flag``; a list is a repeatable flag; a number is parsed and checked."""
    for s in ss:
        flag = "--" + prefix + s.flag[2:]
        default = default_of(s)
        shown = "" if default in (None, [], "") else f" (default: {default})"
        kw: dict[str, Any] = {"default": default, "help": s.meta.help + shown,
                              "dest": prefix.replace("-", "_") + s.name}
        if s.meta.metavar:
            kw["metavar"] = s.meta.metavar
        if s.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif s.type is list:
            kw["action"] = "append"
            kw["default"] = list(default)
        elif s.meta.choices is not None:
            kw["choices"] = s.meta.choices
        elif s.type is not str:
            kw["type"] = _converter(s)
        p.add_argument(*([s.meta.alias] if s.meta.alias else []), flag, **kw)


def from_flags(ns: argparse.Namespace | Mapping[str, Any], cls: type, prefix: str = "") -> Any:
    """The dataclass ``cls`` from the flags :func:`add_flags` added (same ``prefix``). Raises
    ValueError when the values together are refused (``__post_init__``)."""
    get = ns.get if isinstance(ns, Mapping) else lambda k: getattr(ns, k)
    dest = prefix.replace("-", "_")
    return cls(**{s.name: get(dest + s.name) for s in settings(cls)})


__all__ = ["Setting", "SettingField", "add_flags", "bounds", "check", "default_of", "flag_value", "from_flags",
           "setting", "settings", "validate"]
