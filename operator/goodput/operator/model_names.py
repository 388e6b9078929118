"""Pure: one served model name, one InferenceService (the rule when several claim the same name).

Clients pick a service by the request's ``model``, the service's served model name
(``spec.model.servedModelName``, else ``spec.model.name``'s file name without ``.gguf``: the
worker's own ``EngineArgs.model_name``). Several InferenceServices may claim one name (two
namespaces, or no ``servedModelName`` on services of the same file). The rule: **the earliest
created service owns the name** (``metadata.creationTimestamp``; equal times: namespace, then
name); every later one is refused by the router (no request reaches it; the router lists the name
once in ``/v1/models``, with the refused services: ``goodput.router.fleet.Fleet``, same order) and
says so in its status: condition :data:`CONDITION` False, reason :data:`REASON`, the message naming
the owner (``kubectl get gisvc``: column ModelName), with a Warning Event. Its workers are still
rolled out (so deleting the owner hands the name over at once). Deleting the owner, or giving the
later service its own ``servedModelName``, clears it (at the next reconcile or resync).

Scope: what one operator watches (a namespaced release sees only its namespaces; services in
namespaces of two different releases are not compared by either operator, but still by a router
that watches both).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from goodput.operator import status as status_mod
from goodput.api.crd import Problem
from goodput.worker.engine.config import EngineArgs

REASON = "ModelNameTaken"
CONDITION = "ModelNameAccepted"
ACCEPTED = "Accepted"
Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Claim:
    """A service's claim: its served model name and creationTimestamp (RFC 3339, ``""`` unknown)."""

    model: str
    created: str = ""


def served_name(spec: Mapping[str, Any]) -> str | None:
    """The served model name of a spec (camelCase dict); None without ``model.name``."""
    model = spec.get("model") or {}
    name = model.get("name")
    if not isinstance(name, str) or not name:
        return None
    return EngineArgs(model=name, served_model_name=model.get("servedModelName") or None).model_name


def claim_of(obj: Mapping[str, Any]) -> Claim | None:
    """An InferenceService (dict) → its :class:`Claim`; None when it names no model or is being
    deleted."""
    meta = obj.get("metadata") or {}
    name = served_name(obj.get("spec") or {})
    if name is None or meta.get("deletionTimestamp"):
        return None
    return Claim(name, meta.get("creationTimestamp") or "")


def order(key: Key, claim: Claim) -> tuple[str, str, str]:
    """The owner is the claimant with the smallest order: created first (unknown: last), then key."""
    return (claim.created or "\uffff", *key)


def owner(claims: Mapping[Key, Claim], model: str) -> Key | None:
    """The service owning ``model`` among ``claims``; None when nobody claims it."""
    keys = [k for k, c in claims.items() if c.model == model]
    return min(keys, key=lambda k: order(k, claims[k])) if keys else None


def problems(key: Key, claims: Mapping[Key, Claim]) -> list[Problem]:
    """``[Problem(REASON, ...)]`` when ``key``'s claim is not the owner of its name, else ``[]``."""
    mine = claims.get(key)
    if mine is None:
        return []
    first = owner(claims, mine.model)
    if first is None or first == key:
        return []
    return [Problem(reason=REASON, message=(
        f"the served model name {mine.model!r} is already served by InferenceService {first[0]}/{first[1]} "
        f"(created first); requests for {mine.model!r} go there and this service is not rolled out: set "
        "spec.model.servedModelName to a name no other InferenceService serves"))]


def condition(problems_: list[Problem], generation: int | None, previous: list[dict[str, Any]], now: str
              ) -> dict[str, Any]:
    """The :data:`CONDITION` condition: False with the problem (reason :data:`REASON`), else True
    (reason :data:`ACCEPTED`); ``lastTransitionTime`` kept while the status stays."""
    if problems_:
        return status_mod._make(CONDITION, False, REASON, problems_[0].message, generation, previous, now)
    return status_mod._make(CONDITION, True, ACCEPTED, "", generation, previous, now)


def event(before: dict[str, Any] | None, after: dict[str, Any]) -> tuple[str, str, str] | None:
    """The Event for a change of the :data:`CONDITION` condition, as (type, reason, message), or None:
    a Warning when it turns False or its message changes, a Normal one when it turns True again."""
    before = before or {}
    if after["status"] == "False" and (before.get("status") != "False" or before.get("message") != after.get("message")):
        return ("Warning", REASON, after.get("message") or REASON)
    if after["status"] == "True" and before.get("status") == "False":
        return ("Normal", ACCEPTED, "the served model name is no longer claimed by an earlier InferenceService")
    return None
