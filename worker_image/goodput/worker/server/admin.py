"""Admin routes: runtime admission limits, drain and engine state (used by the autoscaler).

``GET /admin/limits``, ``GET /admin/drain`` and ``GET /admin/state`` are read-only and open (the
same facts as ``/metrics`` and ``/ready``). ``PUT /admin/limits``, ``POST /admin/drain`` and
``DELETE /admin/drain`` need ``Authorization: Bearer <GOODPUT_ADMIN_TOKEN>``: 401 without it or with
a wrong token; when the worker was started without ``GOODPUT_ADMIN_TOKEN`` all admin writes are
refused with 403 (there is no way to authenticate them).

Drain (docs/router-autoscaler-contract.md, "Scale-in"): ``POST /admin/drain`` turns ``/ready``
503 ``draining`` (the Service, the router and the ReplicaSet see the pod unready), answers new
generate requests 503 (code ``draining``, ``Retry-After``) and lets in-flight requests and streams
finish; the process keeps running. Both verbs are idempotent and answer
``{"draining": bool, "shutting_down": bool, "inflight": int}``. ``DELETE`` undoes an admin drain;
after SIGTERM it answers 409 (a shutdown cannot be undone).
"""
from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from goodput.api.admin import DRAIN_PATH, LIMITS_PATH, STATE_PATH
from goodput.worker.server.errors import APIError
from goodput.api.errors import ErrorResponse
from goodput.worker.server.protocol import AdminLimits
from pydantic import ValidationError

router = APIRouter()  # paths from goodput.api.admin (the contract callers use)

_ERR = {400: "invalid limits", 401: "missing or wrong admin bearer token",
        403: "admin writes disabled (no GOODPUT_ADMIN_TOKEN)", 409: "shutting down (SIGTERM): cannot undo",
        503: "model loading or engine dead"}


def _errors(*codes: int) -> dict:
    return {c: {"model": ErrorResponse, "description": _ERR[c]} for c in codes}


def _require_admin(request: Request) -> None:
    st = request.app.state.server
    if st.admin_token is None:
        raise APIError(403, "admin writes are disabled: start the worker with GOODPUT_ADMIN_TOKEN set "
                            "and send it as 'Authorization: Bearer <token>'")
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), st.admin_token.encode()):
        raise APIError(401, "missing or wrong admin bearer token", headers={"WWW-Authenticate": "Bearer"})


def _limits(st) -> dict[str, int]:
    s = st.llm.stats()
    return {"max_num_seqs": s.max_num_seqs, "max_waiting": s.max_waiting, "max_waiting_tokens": s.max_waiting_tokens}


@router.get(LIMITS_PATH, responses=_errors(503))
async def get_limits(request: Request) -> dict[str, int]:
    st = request.app.state.server
    st.require_engine()
    return _limits(st)


@router.put(LIMITS_PATH, responses=_errors(400, 401, 403, 503), openapi_extra={"requestBody": {
    "required": True, "content": {"application/json": {"schema": AdminLimits.model_json_schema()}}}})
async def put_limits(request: Request) -> dict[str, int]:
    """Set ``max_num_seqs``, ``max_waiting`` and/or ``max_waiting_tokens`` (omitted = unchanged);
    returns the limits in force.
    Lowering ``max_num_seqs`` preempts nothing: it only stops admitting until the running set shrinks.
    Authentication is checked before the body is read (401/403 never leak validation details)."""
    _require_admin(request)
    st = request.app.state.server
    try:
        body = AdminLimits.model_validate_json(await request.body())
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    st.require_engine()
    try:
        st.llm.set_limits(max_num_seqs=body.max_num_seqs, max_waiting=body.max_waiting,
                          max_waiting_tokens=body.max_waiting_tokens)
    except ValueError as e:
        raise APIError(400, str(e))
    return _limits(st)


def _drain(st) -> dict[str, bool | int]:
    return {"draining": not st.admitting, "shutting_down": st.draining, "inflight": st.inflight}


@router.get(DRAIN_PATH)
async def get_drain(request: Request) -> dict[str, bool | int]:
    """Whether the worker admits new generate requests; ``inflight`` = generate requests whose
    response (stream included) is not finished."""
    return _drain(request.app.state.server)


@router.post(DRAIN_PATH, responses=_errors(401, 403))
async def post_drain(request: Request) -> dict[str, bool | int]:
    """Stop admitting (``/ready`` 503 ``draining``, new generate requests 503); in-flight requests
    finish; the process stays. Idempotent; works while the model loads too."""
    _require_admin(request)
    st = request.app.state.server
    st.set_admin_drain(True)
    return _drain(st)


@router.delete(DRAIN_PATH, responses=_errors(401, 403, 409))
async def delete_drain(request: Request) -> dict[str, bool | int]:
    """Undo ``POST /admin/drain``: admit again (``/ready`` back to 200 once the engine is up).
    Idempotent; 409 after SIGTERM (the process is shutting down)."""
    _require_admin(request)
    st = request.app.state.server
    if st.draining:
        raise APIError(409, "the worker is shutting down (SIGTERM drain); a shutdown cannot be undone",
                       code="shutting_down")
    st.set_admin_drain(False)
    return _drain(st)


@router.get(STATE_PATH, responses=_errors(503))
async def get_state(request: Request) -> dict:
    """Engine state (running | waiting | rejecting | blocked), queue sizes, KV blocks, limits, counters."""
    st = request.app.state.server
    st.require_engine()
    s = st.llm.stats()
    return {
        "model": st.model_name,
        "engine_state": s.engine_state.value,
        "running": s.num_running,
        "waiting": s.num_waiting,
        "kv_blocks_used": s.num_used_blocks,
        "kv_blocks_total": s.num_blocks,
        "kv_cache_usage_ratio": s.kv_usage_ratio,
        "block_size": s.block_size,
        "max_model_len": st.llm.config.max_model_len,
        "limits": {"max_num_seqs": s.max_num_seqs, "max_waiting": s.max_waiting,
                   "max_waiting_tokens": s.max_waiting_tokens},
        "counters": s.counters(),  # admitted, rejected, finished, preemptions, tokens, steps ...
    }
