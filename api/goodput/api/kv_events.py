"""KV cache events: what a worker's prefix cache holds, as the router's chunk keys (pure, stdlib only).

The worker's engine keys its KV blocks by a token hash chain; the router, which has no tokenizer,
keys a request by the chunk chain of its canonical text (:mod:`goodput.api.prefix`). The worker
sees both, so it publishes the router's keys: a chunk key is *stored* once every full KV block
of the tokens up to the chunk's end is in its prefix cache, *evicted* when one of them leaves
it, and everything is *cleared* when the cache empties (an engine reset). The router keeps one
exact set of keys per pod from these events instead of guessing from the requests it sent. The
idea is the one of llm-d's KV events and precise prefix-cache scorer, made simpler because both
ends are ours: the keys are already the router's.

Wire format, one engine (one instance id) at a time:

- ``GET /kv/snapshot`` -> 200 JSON ``{"instance": ID, "seq": N, "chunk_size": C, "keys": [KEY, ...]}``:
  every key held after event ``N`` (0: no event yet); ``C``: the chunk size the keys were cut
  with (a router cutting other chunks cannot use them). 503 while the model loads.
- ``GET /kv/events?since=N[&instance=ID]`` -> 200 NDJSON (``application/x-ndjson``), one JSON
  object a line, as they happen: ``{"instance": ID, "seq": S, "kind": "stored"|"evicted"|"cleared",
  "keys": [KEY, ...]}`` for ``S = N + 1, N + 2, ...`` (``cleared`` has no keys), and every
  :data:`HEARTBEAT_S` seconds a ``{"instance": ID, "seq": S, "kind": "heartbeat", "keys": []}``
  line carrying the last sequence (no state change). 410 Gone when event ``N + 1`` is no longer
  retained (the worker keeps a bounded ring), when ``instance`` is not the engine's, or when
  ``N`` is ahead of the engine: the client resyncs from the snapshot. 400 for a ``since`` that
  is not an integer >= 0 or an ``instance`` that is not 1-64 characters of ``[0-9a-z]``.

KEY: a chunk key (64-bit unsigned) as 16 lowercase hex digits (JSON numbers past 2**53 are not
safe in every client). ID: ``goodput.api.identity`` instance id. ``seq`` starts at 1 and grows by
one per event of an engine; a new engine (a restart in place) starts again with a new id.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["EVENTS_PATH", "SNAPSHOT_PATH", "STORED", "EVICTED", "CLEARED", "HEARTBEAT", "KINDS",
           "HEARTBEAT_S", "KvEvent", "KvSnapshot", "key_hex", "key_int", "encode_event", "parse_event",
           "encode_snapshot", "parse_snapshot", "check_since", "check_instance"]

EVENTS_PATH = "/kv/events"
SNAPSHOT_PATH = "/kv/snapshot"
STORED, EVICTED, CLEARED, HEARTBEAT = "stored", "evicted", "cleared", "heartbeat"
KINDS = (STORED, EVICTED, CLEARED, HEARTBEAT)
HEARTBEAT_S = 5.0
_INSTANCE_RE = re.compile(r"[0-9a-z]{1,64}")
_KEY_RE = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class KvEvent:
    """One event of one engine: ``seq`` (>= 1; a heartbeat repeats the last one, 0 before any),
    ``kind`` (one of :data:`KINDS`), ``keys`` (chunk keys, ints in [0, 2**64); empty for
    cleared and heartbeat), ``instance`` (the engine's id)."""

    instance: str
    seq: int
    kind: str
    keys: tuple[int, ...] = ()


@dataclass(frozen=True)
class KvSnapshot:
    """Every chunk key an engine holds after its event ``seq``, cut in chunks of ``chunk_size``."""

    instance: str
    seq: int
    keys: frozenset[int]
    chunk_size: int


def key_hex(key: int) -> str:
    """A 64-bit key as 16 lowercase hex digits."""
    return f"{key:016x}"


def key_int(text: Any) -> int:
    """The key of 16 lowercase hex digits; ValueError otherwise."""
    if not isinstance(text, str) or not _KEY_RE.fullmatch(text):
        raise ValueError(f"a key is 16 lowercase hex digits, got {text!r}")
    return int(text, 16)


def check_instance(text: Any) -> str:
    """An instance id as sent (1-64 of ``[0-9a-z]``); ValueError otherwise."""
    if not isinstance(text, str) or not _INSTANCE_RE.fullmatch(text):
        raise ValueError("instance must be 1-64 characters of [0-9a-z]")
    return text


def check_since(text: Any) -> int:
    """The ``since`` query parameter: an integer >= 0 (decimal, at most 19 digits); ValueError
    otherwise."""
    if not isinstance(text, str) or not text.isdigit() or len(text) > 19:
        raise ValueError("since must be an integer >= 0")
    return int(text)


def encode_event(ev: KvEvent) -> bytes:
    """One NDJSON line (with its newline) for ``ev``."""
    return (json.dumps({"instance": ev.instance, "seq": ev.seq, "kind": ev.kind,
                        "keys": [key_hex(k) for k in ev.keys]}, separators=(",", ":")) + "\n").encode()


def _obj(raw: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def _seq(obj: dict[str, Any]) -> int:
    seq = obj.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise ValueError(f"seq must be an integer >= 0, got {seq!r}")
    return seq


def _keys(obj: dict[str, Any]) -> tuple[int, ...]:
    keys = obj.get("keys", [])
    if not isinstance(keys, list):
        raise ValueError("keys must be a list")
    return tuple(key_int(k) for k in keys)


def parse_event(line: bytes | str) -> KvEvent:
    """The event of one NDJSON line; ValueError naming what is wrong."""
    obj = _obj(line)
    kind = obj.get("kind")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return KvEvent(check_instance(obj.get("instance")), _seq(obj), kind, _keys(obj))


def encode_snapshot(instance: str, seq: int, keys: Iterable[int], chunk_size: int) -> bytes:
    """The snapshot body (keys sorted, so equal states give equal bodies)."""
    return json.dumps({"instance": instance, "seq": seq, "chunk_size": chunk_size,
                       "keys": [key_hex(k) for k in sorted(keys)]}, separators=(",", ":")).encode()


def parse_snapshot(body: bytes | str) -> KvSnapshot:
    """The snapshot of a ``/kv/snapshot`` body; ValueError naming what is wrong."""
    obj = _obj(body)
    size = obj.get("chunk_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {size!r}")
    return KvSnapshot(check_instance(obj.get("instance")), _seq(obj), frozenset(_keys(obj)), size)
