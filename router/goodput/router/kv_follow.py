"""Follow every pod's KV events into the router's exact index (the I/O edge of ``kv_index.py``).

With ``--kv-events on`` each router replica keeps one task per pod of the fleet: it installs the
pod's ``GET /kv/snapshot`` in the :class:`~goodput.router.kv_index.ExactIndex`, then reads
``GET /kv/events?since=SEQ&instance=ID`` (NDJSON, ``goodput.api.kv_events``) and merges each
line. A stream that ends (the worker closes it after a while) is resumed from the last sequence
applied; a gap or a new instance id (``ExactIndex.apply``), or a 410 from the worker, drops the
pod and installs a fresh snapshot; a connection error or a bad answer drops it too (the history
index answers for it meanwhile) and retries after 1 s, doubling to 30 s. A stream silent for
three heartbeats (``HEARTBEAT_S``) is taken as broken, and one that ends without a line (a
worker closing at once) is retried with the same backoff. A snapshot cut in another chunk size than
the router's ``--picker-chunk-size`` is never installed (the keys could not match). Pods that leave
the fleet, or change address, lose their task and their entry.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import suppress

import aiohttp

from goodput.api.kv_events import EVENTS_PATH, HEARTBEAT_S, SNAPSHOT_PATH, parse_event, parse_snapshot
from goodput.router.fleet import Fleet
from goodput.router.kv_index import OK, ExactIndex
from goodput.router.metrics import RouterMetrics
from goodput.router.upstream import ERRORS, Upstream

log = logging.getLogger(__name__)

__all__ = ["KvFollower"]


class _Gone(Exception):
    """The worker answered 410: resync from the snapshot."""


class KvFollower:
    """One follow task per pod of ``fleet`` (reconciled every ``period_s``), into ``index``."""

    def __init__(self, fleet: Fleet, upstream: Upstream, index: ExactIndex, metrics: RouterMetrics,
                 chunk_size: int, period_s: float, retry_s: float = 1.0, max_retry_s: float = 30.0) -> None:
        self.fleet, self.upstream, self.index, self.metrics = fleet, upstream, index, metrics
        self.chunk_size, self.period_s = chunk_size, period_s
        self.retry_s, self.max_retry_s = retry_s, max_retry_s
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}  # pod name -> (url, task)

    async def run(self) -> None:
        try:
            while True:
                self.reconcile()
                await asyncio.sleep(self.period_s)
        finally:
            for _, t in self._tasks.values():
                t.cancel()
            for _, t in list(self._tasks.values()):
                with suppress(asyncio.CancelledError, Exception):
                    await t
            self._tasks.clear()

    def reconcile(self) -> None:
        """Start a task for each new pod (or new address), stop those of pods gone."""
        want = {name: (svc.key, pod.url) for svc in self.fleet.services() for name, pod in svc.pods.items()}
        for name, (url, task) in list(self._tasks.items()):
            if name not in want or want[name][1] != url or task.done():
                task.cancel()
                del self._tasks[name]
                self.index.drop(name)
        for name, (key, url) in want.items():
            if name not in self._tasks:
                self._tasks[name] = (url, asyncio.create_task(self._follow(key, name, url), name=f"kv:{name}"))

    async def _follow(self, key: tuple[str, str], name: str, url: str) -> None:
        delay, reason = self.retry_s, "start"
        while True:
            try:
                if not self.index.synced(name):
                    snap = parse_snapshot(await self._get(url + SNAPSHOT_PATH))
                    if snap.chunk_size != self.chunk_size:
                        raise ValueError(f"keys cut in chunks of {snap.chunk_size}, the router's are {self.chunk_size}")
                    self.index.reset(name, snap.instance, snap.seq, snap.keys)
                    self.metrics.kv_resyncs.labels(*key, name, reason).inc()
                reason, lines = await self._stream(key, name, url)
                if lines:
                    delay = self.retry_s
                else:  # an empty stream (a worker closing at once): do not reconnect in a loop
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, self.max_retry_s)
            except asyncio.CancelledError:
                raise
            except _Gone:
                self.index.drop(name)
                reason = "gap"
            except (*ERRORS, ValueError) as e:
                self.index.drop(name)
                reason = "error"
                log.debug("kv events of %s (%s): %r; retry in %.0f s", name, url, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.max_retry_s)

    async def _get(self, url: str) -> bytes:
        r = await self.upstream.get(url)
        if r.status != 200:
            raise ValueError(f"GET {url}: {r.status}")
        return r.body

    async def _stream(self, key: tuple[str, str], name: str, url: str) -> tuple[str, int]:
        """Read the pod's events from its last sequence applied. Returns the reason of the next
        resync (``gap`` or ``instance`` when the index dropped the pod; ``gap`` too when the
        stream just ended: the pod stays in sync and the stream is resumed) and the lines read."""
        st = self.index.state(name)
        assert st is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.upstream.timeouts.connect_s,
                                        sock_read=3 * HEARTBEAT_S)
        counter = self.metrics.kv_events.labels(*key, name)
        async with self.upstream.session.get(url + EVENTS_PATH, params={"since": str(st.seq), "instance": st.instance},
                                             timeout=timeout) as r:
            if r.status == 410:
                raise _Gone()
            if r.status != 200:
                raise ValueError(f"GET {EVENTS_PATH}: {r.status}")
            buf, n = b"", 0
            async for data in r.content.iter_any():  # lines of any length (a long prompt's keys)
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    ev = parse_event(line)
                    n += 1
                    verdict = self.index.apply(name, ev)
                    if verdict != OK:
                        return verdict, n
                    if ev.kind != "heartbeat":
                        counter.inc()
        return "gap", n
