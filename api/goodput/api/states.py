"""The engine's named outcomes: why a request finished, why it was refused, what state the engine
is in. Plain ``str`` enums (standard library only), so a value is its own label in JSON, logs and
Prometheus, and :mod:`goodput.api.worker_metrics` derives its label values from them.
"""
from __future__ import annotations

import enum


class _Name(str, enum.Enum):
    def __str__(self) -> str:  # "stop", not "FinishReason.STOP" (labels, JSON, logs)
        return self.value


class FinishReason(_Name):
    """OpenAI ``finish_reason`` values: EOS / stop token / stop string, token limit, abort."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RejectReason(_Name):
    """Why admission refused a request (HTTP status in brackets).

    INVALID: bad input (400). NEVER_FITS: prompt + max_tokens exceeds max_model_len or the whole
    KV pool, so it could never run (400). QUEUE_FULL: the waiting queue is at its limit; retry
    later (429 with Retry-After).
    """

    QUEUE_FULL = "queue_full"
    NEVER_FITS = "never_fits"
    INVALID = "invalid"


class EngineState(_Name):
    """What limits the engine now (``Scheduler.engine_state`` gives the rules)."""

    RUNNING = "running"
    WAITING = "waiting"
    REJECTING = "rejecting"
    BLOCKED = "blocked"


class WorkerRole(_Name):
    """A worker's part in disaggregated serving (``--role``; docs/disaggregation.md).

    BOTH: serves requests end to end (today's colocated serving) and either side of a KV transfer.
    PREFILL: also computes prompts for decode workers; never imports KV. DECODE: also imports a
    prompt's KV from a prefill worker; never leases KV to others.
    """

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class PrefillWhere(_Name):
    """Where a request's prompt KV was computed: by this engine, or imported from a prefill worker."""

    LOCAL = "local"
    REMOTE = "remote"
