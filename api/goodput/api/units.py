"""Byte sizes, parsed in one place for the worker's flags and the operator's CRD (standard
library only).

Accepted: a whole number of bytes, or a number with a unit, case-insensitive: decimal ``K``/``KB``,
``M``/``MB``, ``G``/``GB``, ``T``/``TB`` (powers of 1000) and binary ``Ki``/``KiB``, ``Mi``/``MiB``,
``Gi``/``GiB``, ``Ti``/``TiB`` (powers of 1024); so both Kubernetes quantities (``512Mi``) and the
usual spelling (``512MiB``) work, as do fractions (``1.5Gi``).
"""
from __future__ import annotations

import re

_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"512Mi"``, ``"512MiB"``, ``"1GiB"``, ``"1.5G"`` -> whole bytes (>= 0).

    Raises ``ValueError`` naming the value for anything else (negative numbers, unknown units,
    booleans, a unit without a number).
    """
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.fullmatch(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {value!r} (use bytes or a number with a unit such as "
                         "512Mi, 512MiB, 1GiB, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
