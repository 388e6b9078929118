"""From a request body to the picker's inputs (pure): the ``RouteKey`` (the picker's
``route_key``: chat ``messages`` + ``tools`` rendered canonically by ``picker.render_messages``,
a completions ``prompt`` string, or its token ids) and the ``Endpoint`` records of pods.

Completions batches (a list of prompts) key on their first prompt. A body with no usable
content keys on the empty content (no chunks: the rendezvous order of the bare model).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["content_of", "request_key", "endpoints"]

from goodput.api.prefix import content_of
from goodput.router.fleet import Pod, Service
from goodput.router.picker import Endpoint, PickConfig, RouteKey, route_key


def request_key(svc: Service, path: str, body: dict[str, Any], cfg: PickConfig) -> RouteKey:
    """The picker's key: the service's model and revision, the body's ``cache_salt`` (tenants
    never share an index entry) and the chunk chain of the request's content."""
    salt = body.get("cache_salt")
    return route_key(svc.info.model, svc.info.revision, salt if isinstance(salt, str) else None, cfg,
                     **content_of(path, body))


def endpoints(pods: Sequence[Pod]) -> list[Endpoint]:
    """The picker's view of ``pods`` (the router's in-flight counts and the last scrape)."""
    return [Endpoint(name=p.name, url=p.url, in_flight=p.in_flight, max_num_seqs=p.max_num_seqs,
                     max_waiting=p.max_waiting, running=p.running, waiting=p.waiting, kv_usage=p.kv_usage,
                     work=p.work)
            for p in pods]
