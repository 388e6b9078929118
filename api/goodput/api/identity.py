"""A worker's engine identity, as its callers see it (standard library only, no side effects).

Each engine gets an instance id when it starts (:func:`new_instance_id`); a restart in place (same
pod name, same address: a container the kubelet restarted, a process started again on its port)
gets a new one. The worker says it on every response (header :data:`INSTANCE_HEADER`) and on
``/metrics`` (``goodput_engine_instance_info{instance_id=...} 1``, label :data:`INSTANCE_LABEL`).
The router forgets what it knew of a pod's prefix cache the moment the id it sees changes: a new
engine starts with an empty cache.
"""
from __future__ import annotations

import uuid

INSTANCE_HEADER = "x-goodput-instance"
INSTANCE_LABEL = "instance_id"


def new_instance_id() -> str:
    """A fresh random id: 16 lowercase hex characters (64 bits)."""
    return uuid.uuid4().hex[:16]
