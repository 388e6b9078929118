"""The router's per-request decision for disaggregated prefill (pure, no I/O; docs/disaggregation.md).

Once admission has picked the request's pod (by load and prefix, as for any request: that pod
decodes), :func:`decide` says whether a prefill pod computes the prompt first:

- never when the threshold is 0 (``--pd-min-uncached-chunks``, the default: off), or when the
  picked pod's role is ``prefill`` (it cannot import KV: it serves the request colocated);
- never when the picked pod lacks at most ``min_uncached_chunks`` of the prompt's chunks (by the
  router's prefix index: the chunks it was sent before): moving KV costs more than computing a
  short uncached part (a chunk is ``--picker-chunk-size`` characters, ~64 tokens at 256);
- otherwise the prefill pod is picked among the other Ready pods whose role is ``both`` or
  ``prefill`` by the same picker (prefix affinity first, then load under the bound, pods at their
  limits skipped); none with room: the decode pod prefills locally.

Reasons (``goodput_router_pd_decisions_total{decision}``): ``remote``, ``off``, ``short``,
``decode_pod_is_prefill``, ``no_prefill_pod``; and ``prefill_failed`` (counted by the router when
the prefill pod's call fails; the decode pod then prefills locally: a retry before the first byte).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from goodput.api.router_metrics import PD_DECISIONS_VALUES as DECISIONS
from goodput.router.picker import Endpoint, PickConfig, PrefixIndex, RouteKey, pick

PREFILL_ROLES = ("both", "prefill")
__all__ = ["DECISIONS", "PDDecision", "PREFILL_ROLES", "decide"]


@dataclass(frozen=True)
class PDDecision:
    """``prefill``: the prefill pod's name (None: the decode pod prefills locally); ``reason``:
    one of :data:`DECISIONS`; ``uncached``: prompt chunks the decode pod lacks (by the index)."""

    prefill: str | None
    reason: str
    uncached: int = 0


def decide(key: RouteKey, decode_pod: str, decode_held: int, endpoints: Sequence[Endpoint],
           roles: Mapping[str, str], index: PrefixIndex, cfg: PickConfig, min_uncached_chunks: int) -> PDDecision:
    """Whether a prefill pod computes ``key``'s prompt before ``decode_pod`` decodes it (module
    doc). ``decode_held``: leading chunks of the prompt the decode pod holds (its ``Pick.matched_chunks``,
    scored before admission counted this request's own chunks as held there); ``endpoints``: the
    service's routable pods; ``roles``: pod name -> role (missing: ``both``); ``min_uncached_chunks``:
    the threshold (0: off)."""
    if min_uncached_chunks <= 0:
        return PDDecision(None, "off")
    if roles.get(decode_pod, "both") == "prefill":
        return PDDecision(None, "decode_pod_is_prefill")
    n = len(key.chunks)
    uncached = n - min(n, decode_held)
    if uncached <= min_uncached_chunks:
        return PDDecision(None, "short", uncached)
    candidates = [e for e in endpoints if e.name != decode_pod and roles.get(e.name, "both") in PREFILL_ROLES]
    choice = pick(key, candidates, index, cfg) if candidates else None
    if choice is None or choice.pod is None:
        return PDDecision(None, "no_prefill_pod", uncached)
    return PDDecision(choice.pod, "remote", uncached)
