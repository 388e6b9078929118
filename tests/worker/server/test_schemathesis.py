"""schemathesis against the live worker's ``/openapi.json``: no 5xx, no undeclared
status, declared content types, bodies and SSE events matching their declared models, schema-
forbidden input refused; afterwards the worker is idle with 0 KV blocks in use.

The cheap run of scripts/schemathesis_worker.py (generated ``max_tokens`` capped at 4, every
phase, 5 examples per operation); the script's default run without the cap is documented there.
"""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

sys.path.insert(0, str(REPO / "scripts"))


def test_schemathesis_finds_nothing_and_no_block_leaks(capsys):
    import schemathesis_worker

    rc = schemathesis_worker.main(["--cheap", "--max-examples", "5", "--seed", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out[-6000:]
    assert "kv_blocks_used=0" in out and "running=0" in out
