"""The router's per-request decision for disaggregated prefill (pure, no I/O; docs/disaggregation.md).

Once admission has picked the request's pod (by load and prefix, as for any request: that pod
decodes), :func:`decide` says whether a prefill pod computes the prompt first:

- never when the service is not disaggregated (no threshold: ``spec.disaggregation`` off and no
  ``--pd-remote-prefill-min-tokens``), or when the picked pod's role is ``prefill`` (it cannot
  import KV: it serves the request colocated);
- never when the picked pod lacks at most the threshold of the prompt's chunks (by the router's
  prefix index: the chunks it was sent before): moving KV costs more than computing a short
  uncached part. The threshold is set in tokens (``remotePrefillMinTokens``) and compared in
  chunks: :func:`min_chunks` (a chunk is ``--picker-chunk-size`` characters, ~4 per token);
- otherwise the prefill pod is picked among the other Ready pods whose role is ``both`` or
  ``prefill`` by the same picker (prefix affinity first, then load under the bound, pods at their
  limits skipped); none with room: the decode pod prefills locally, except while the prefill pool
  is growing (:func:`defer_when_full`).

Reasons (``goodput_router_pd_decisions_total{decision}``): ``remote``, ``off``, ``short``,
``decode_pod_is_prefill``, ``no_prefill_pod``, ``prefill_deferred``; and ``prefill_failed``
(counted by the router when the prefill pod's call fails; the decode pod then prefills locally: a
retry before the first byte).

When the prefill pool is full, a long prompt prefilled on its decode pod costs more than that one
request: every step that carries one of its chunks stretches the inter-token latency of every
stream the pod decodes (what disaggregation exists to avoid). That is the only way to serve it
while no prefill capacity is coming. But when the autoscaler has ordered prefill pods that are
not Ready yet (``ServiceInfo.prefill_coming``: ``status.pools.prefill`` desired minus ready), the
shortage is a scale-up in flight. The router then refuses the prompt (429 with ``Retry-After``,
before any byte, reason ``prefill_deferred``), as the full prefill pods themselves do, and the
decode pods keep decoding at their TPOT. With no Ready prefill pod at all (a pool scaled to zero,
or every prefill pod down) the decode pods still prefill: refusing then would refuse every long
prompt until a pod is up.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from goodput.api.router_metrics import PD_DECISIONS_VALUES as DECISIONS
from goodput.router.picker import Endpoint, PickConfig, PrefixIndex, RouteKey, pick

PREFILL_ROLES = ("both", "prefill")
DEFERRED = "prefill_deferred"
__all__ = ["CHARS_PER_TOKEN", "DECISIONS", "DEFERRED", "PDDecision", "PREFILL_ROLES", "decide", "defer_when_full",
           "min_chunks"]


@dataclass(frozen=True)
class PDDecision:
    """``prefill``: the prefill pod's name (None: the decode pod prefills locally); ``reason``:
    one of :data:`DECISIONS`; ``uncached``: prompt chunks the decode pod lacks (by the index)."""

    prefill: str | None
    reason: str
    uncached: int = 0


CHARS_PER_TOKEN = 4  # English text; a request of token ids counts chunk_size ids per chunk instead


def min_chunks(min_tokens: int | None, chunk_size: int) -> int | None:
    """A threshold in prompt tokens as prefix chunks of ``chunk_size`` characters:
    ``ceil(min_tokens * CHARS_PER_TOKEN / chunk_size)`` (None stays None: off)."""
    if min_tokens is None:
        return None
    return -(-min_tokens * CHARS_PER_TOKEN // chunk_size)


def defer_when_full(prefill_ready: int, prefill_coming: int) -> bool:
    """Whether the router refuses (429) a prompt that no prefill pod has room for, rather than
    have its decode pod prefill it (module doc): only while the prefill pool both serves
    (``prefill_ready``: its Ready pods, at least one, all full) and grows (``prefill_coming``:
    pods ordered and not Ready yet, at least one)."""
    return prefill_ready > 0 and prefill_coming > 0


def decide(key: RouteKey, decode_pod: str, decode_held: int, endpoints: Sequence[Endpoint],
           roles: Mapping[str, str], index: PrefixIndex, cfg: PickConfig,
           min_uncached_chunks: int | None, prefill_coming: int = 0) -> PDDecision:
    """Whether a prefill pod computes ``key``'s prompt before ``decode_pod`` decodes it (module
    doc). ``decode_held``: leading chunks of the prompt the decode pod holds (its ``Pick.matched_chunks``,
    scored before admission counted this request's own chunks as held there); ``endpoints``: the
    service's routable pods; ``roles``: pod name -> role (missing: ``both``); ``min_uncached_chunks``:
    the threshold (None: off; 0: any uncached chunk goes to a prefill pod); ``prefill_coming``:
    prefill pods ordered and not Ready (:func:`defer_when_full`; reason ``prefill_deferred``: the
    caller refuses the request)."""
    if min_uncached_chunks is None:
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
        if defer_when_full(len(candidates), prefill_coming):
            return PDDecision(None, DEFERRED, uncached)
        return PDDecision(None, "no_prefill_pod", uncached)
    return PDDecision(choice.pod, "remote", uncached)
