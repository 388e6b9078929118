"""Kubernetes helpers shared by the operator, the autoscaler and the router (``goodput.kube``, beside
the contract package ``goodput.api``; the only shared code that may use a Kubernetes client): one copy
each.

- :func:`rfc3339` / :func:`parse_time`: the API's time format (RFC 3339, UTC, seconds,
  ``2027-01-15T08:00:00Z``; ``metav1.Time``), from and to Unix seconds.
- :func:`load_config`: in-cluster ServiceAccount, else ``KUBECONFIG`` / ``~/.kube/config``
  (the kubernetes client's own loaders); returns an ``ApiClient``.
- :func:`event_body` and :class:`EventRecorder`: core/v1 Events about an object, with the
  aggregation client-go's ``EventCorrelator`` does (k8s.io/client-go/tools/record): an Event
  identical to one posted before (same object, type, reason and *series key*) is not created
  again; the existing one gets ``count`` + 1, a new ``lastTimestamp`` and the latest message
  (``kubectl describe`` shows "(x5 over 2m)"). :func:`series_step` is that rule as a pure function.

The I/O (the kubernetes client) is imported inside the functions that use it, so importing this
module is cheap; the pure parts (times, bodies, the series rule) need no cluster to test.
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("goodput.kube")

MAX_EVENT_MESSAGE = 1024


def rfc3339(t: float) -> str:
    """Unix seconds -> ``YYYY-MM-DDTHH:MM:SSZ`` (UTC, whole seconds: the ``metav1.Time`` format)."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> float | None:
    """``metav1.Time`` (RFC 3339, ``Z`` or an offset, fractions allowed) -> Unix seconds; None for
    None or ""."""
    if not s:
        return None
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def load_config(pool_maxsize: int | None = None) -> Any:
    """A ``kubernetes.client.ApiClient``: in-cluster ServiceAccount first, else ``KUBECONFIG`` /
    ``~/.kube/config``. ``pool_maxsize``: at least this many pooled connections (one per thread
    that calls the API concurrently avoids a TLS handshake per request). Raises the client's
    ``ConfigException`` when neither is available."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    cfg = kubernetes.client.Configuration.get_default_copy()
    if pool_maxsize is not None:
        cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0, pool_maxsize)
    return kubernetes.client.ApiClient(cfg)


def instance_name() -> str:
    """This process's name for Events' ``reportingInstance`` and Lease holders: ``$POD_NAME`` (the
    downward API) or the host name."""
    return os.environ.get("POD_NAME") or os.uname().nodename


def event_body(obj: Mapping[str, Any], etype: str, reason: str, message: str, *, component: str,
               now: float, name: str | None = None, count: int = 1, first: float | None = None) -> dict[str, Any]:
    """A core/v1 Event about ``obj`` (a dict with apiVersion, kind, metadata name/namespace/uid).

    ``etype``: Normal or Warning; ``reason``: CamelCase; ``message``: cut to 1024 characters.
    ``name``: a fixed Event name (series), else ``generateName`` ``<obj name>.``; ``count``,
    ``first``: the series' count and first time (Unix seconds; default ``now``).
    """
    meta = obj["metadata"]
    ts, first_ts = rfc3339(now), rfc3339(first if first is not None else now)
    md: dict[str, Any] = {"namespace": meta["namespace"]}
    if name:
        md["name"] = name
    else:
        md["generateName"] = f"{meta['name']}."
    involved = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta["name"],
                "namespace": meta["namespace"], "uid": meta.get("uid")}
    if meta.get("resourceVersion"):
        involved["resourceVersion"] = meta["resourceVersion"]
    return {
        "apiVersion": "v1", "kind": "Event", "metadata": md,
        "involvedObject": {k: v for k, v in involved.items() if v is not None},
        "type": etype, "reason": reason, "message": message[:MAX_EVENT_MESSAGE],
        "source": {"component": component}, "reportingComponent": component,
        "reportingInstance": instance_name(),
        "firstTimestamp": first_ts, "lastTimestamp": ts, "count": count,
    }


def series_name(obj: Mapping[str, Any], etype: str, reason: str, key: str) -> str:
    """The Event name of one series: ``<obj name>.<16 hex digits>`` of (uid, type, reason, key),
    stable across processes (a restarted or standby instance continues the same series)."""
    meta = obj["metadata"]
    digest = hashlib.sha256("\x00".join((str(meta.get("uid")), etype, reason, key)).encode()).hexdigest()
    return f"{meta['name']}.{digest[:16]}"


@dataclass(frozen=True)
class SeriesEntry:
    """What the recorder remembers of one series: its Event's name, count and first time."""

    name: str
    count: int
    first: float


def series_step(entry: SeriesEntry | None, name: str, now: float) -> tuple[str, SeriesEntry]:
    """The write for one more occurrence of a series: ``("create", entry)`` the first time (count 1),
    else ``("patch", entry)`` with count + 1 and the first time kept."""
    if entry is None:
        return "create", SeriesEntry(name, 1, now)
    return "patch", SeriesEntry(entry.name, entry.count + 1, entry.first)


class EventRecorder:
    """Posts Events (thread-safe); best effort: an API error is logged, never raised.

    ``record(obj, etype, reason, message, series_key=None)``: without ``series_key`` one Event per
    call with ``generateName``; with it, the occurrences of (object, type, reason, series_key) are
    one Event whose count grows (:func:`series_step`). After a restart the existing Event is found
    by its name (:func:`series_name`; a create answered 409 reads it and continues its count).
    """

    def __init__(self, events: Any, component: str, clock=None):
        """``events``: the core/v1 Event resource of a ``kubernetes.dynamic.DynamicClient`` (or
        anything with its ``create``/``get``/``patch``); ``component``: the ``source.component``."""
        import time

        self.events = events
        self.component = component
        self.clock = clock or time.time
        self._series: dict[str, SeriesEntry] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_client(cls, api_client: Any, component: str) -> "EventRecorder":
        from kubernetes.dynamic import DynamicClient

        return cls(DynamicClient(api_client).resources.get(api_version="v1", kind="Event"), component)

    def record(self, obj: Mapping[str, Any], etype: str, reason: str, message: str,
               series_key: str | None = None) -> None:
        from kubernetes.client.exceptions import ApiException

        ns, now = obj["metadata"]["namespace"], self.clock()
        try:
            if series_key is None:
                self.events.create(namespace=ns, body=event_body(obj, etype, reason, message,
                                                                 component=self.component, now=now))
                return
            name = series_name(obj, etype, reason, series_key)
            with self._lock:
                action, entry = series_step(self._series.get(name), name, now)
                self._series[name] = entry
            if action == "patch":
                try:
                    self._patch(ns, entry, message, now)
                    return
                except ApiException as e:
                    if e.status != 404:
                        raise
                    entry = SeriesEntry(name, 1, now)  # expired (events live an hour): start over
            try:
                self.events.create(namespace=ns, body=event_body(
                    obj, etype, reason, message, component=self.component, now=now, name=name,
                    count=entry.count, first=entry.first))
            except ApiException as e:
                if e.status != 409:
                    raise
                old = self.events.get(name=name, namespace=ns).to_dict()
                entry = SeriesEntry(name, int(old.get("count") or 1) + 1,
                                    parse_time(old.get("firstTimestamp")) or now)
                self._patch(ns, entry, message, now)
            with self._lock:
                self._series[name] = entry
        except ApiException as e:
            log.warning("could not post Event %s for %s/%s: %s %s", reason, ns, obj["metadata"]["name"],
                        e.status, e.reason)

    def _patch(self, ns: str, entry: SeriesEntry, message: str, now: float) -> None:
        self.events.patch(name=entry.name, namespace=ns, content_type="application/merge-patch+json",
                          body={"count": entry.count, "lastTimestamp": rfc3339(now),
                                "message": message[:MAX_EVENT_MESSAGE]})
