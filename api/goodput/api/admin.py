"""The worker's admin API as its callers see it: paths, the bearer-token variable, the bodies.

Standard library only, no side effects: the worker's routes (``server/admin.py``), the operator
(which puts the token in the pod's environment) and the autoscaler (which calls the routes) take
these names from here, so the contract is declared once.

- ``GET /admin/limits`` (open): the limits in force, ``{"max_num_seqs": int, "max_waiting": int,
  "max_waiting_tokens": int}`` (the last: prompt tokens queued for prefill; 0 = no token bound).
- ``PUT /admin/limits`` (bearer token): the same body, any field omitted = unchanged.
- ``POST /admin/drain`` / ``DELETE /admin/drain`` (bearer token): start / undo a drain
  (docs/router-autoscaler-contract.md, "Scale-in").
The token is the value of the environment variable :data:`ADMIN_TOKEN_ENV` in the worker; the
operator keeps it in the Secret ``<InferenceService>-admin`` under the key :data:`ADMIN_TOKEN_KEY`.
"""
from __future__ import annotations

ADMIN_TOKEN_ENV = "GOODPUT_ADMIN_TOKEN"
ADMIN_TOKEN_KEY = "token"
LIMITS_PATH = "/admin/limits"
STATE_PATH = "/admin/state"
DRAIN_PATH = "/admin/drain"


def limits_body(max_num_seqs: int | None = None, max_waiting: int | None = None,
                max_waiting_tokens: int | None = None) -> dict[str, int]:
    """The ``PUT /admin/limits`` JSON body (fields left None are omitted: unchanged)."""
    fields = {"max_num_seqs": max_num_seqs, "max_waiting": max_waiting, "max_waiting_tokens": max_waiting_tokens}
    return {k: int(v) for k, v in fields.items() if v is not None}


def bearer(token: str) -> dict[str, str]:
    """The ``Authorization`` header of an admin write."""
    return {"Authorization": f"Bearer {token}"}
