"""The router's one HTTP client stack: every request it makes to a pod goes through one pooled
``aiohttp.ClientSession`` (keep-alive), with its timeouts declared once, here.

Two kinds of request, two timeouts (seconds, from the router's settings):

- **the data path** (generate, ``/tokenize``, ``/detokenize``): connect within ``connect_s``
  (``--connect-timeout``; a connection error is retried on another pod), then no bound on the
  answer: a long generation takes what it takes, and a client that goes away closes the upstream
  connection (:meth:`Timeouts.data`, the session's default);
- **the router's own calls** (the scrape of ``/metrics``, static discovery's ``/ready`` probe, a
  pod's ``/v1/models`` card): connect within ``connect_s`` and the whole answer within
  ``probe_s`` (``--probe-timeout``), so a pod that accepts and never answers cannot stall a scrape
  round.

aiohttp serves the data path because httpx's pool rescans every pooled connection per request
(~4 ms of CPU per request at a few hundred connections: bench/results/*-router-latency.md); the
low-rate calls use the same session, so there is one pool, one set of timeouts and one error type
(:data:`ERRORS`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

# What a request to a pod may raise: no answer (refused, reset, closed, a timeout) or a bad one.
ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# The errors before an answer that another pod may retry: refused, reset, closed, connect timeout.
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, asyncio.TimeoutError)
# Idle pooled connections are closed after this many seconds.
KEEPALIVE_S = 60.0


@dataclass(frozen=True)
class Timeouts:
    """The router's upstream timeouts in seconds: ``connect_s`` for every connection, ``probe_s``
    for the whole of one of the router's own calls. ValueError unless both are > 0."""

    connect_s: float
    probe_s: float

    def __post_init__(self) -> None:
        if not (self.connect_s > 0 and self.probe_s > 0):
            raise ValueError(f"upstream timeouts must be > 0 seconds: {self}")

    def data(self) -> aiohttp.ClientTimeout:
        """The data path's: connect only; the answer is unbounded."""
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_s)

    def probe(self) -> aiohttp.ClientTimeout:
        """The router's own calls': connect, and the whole answer within ``probe_s``."""
        return aiohttp.ClientTimeout(total=self.probe_s, sock_connect=self.connect_s)


@dataclass(frozen=True)
class Answer:
    """A pod's whole answer: HTTP ``status``, ``headers`` (case-insensitive lookups), ``body`` bytes."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class Upstream:
    """The session and its timeouts. :meth:`open` before use (inside the event loop), :meth:`close`
    after; ``session`` is the data path's (default timeout: :meth:`Timeouts.data`)."""

    def __init__(self, timeouts: Timeouts, max_connections: int):
        self.timeouts, self.max_connections = timeouts, max_connections
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> Upstream:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_S),
                timeout=self.timeouts.data(), skip_auto_headers=("User-Agent",))
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled session; RuntimeError before :meth:`open`."""
        if self._session is None:
            raise RuntimeError("the router's upstream session is not open")
        return self._session

    async def get(self, url: str) -> Answer:
        """``GET url`` as one of the router's own calls (:meth:`Timeouts.probe`); raises
        :data:`ERRORS`."""
        async with self.session.get(url, timeout=self.timeouts.probe()) as r:
            return Answer(r.status, r.headers, await r.read())

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        """``POST url`` on the data path (:meth:`Timeouts.data`), the whole answer read; raises
        :data:`ERRORS`."""
        async with self.session.post(url, data=body, headers=headers) as r:
            return Answer(r.status, r.headers, await r.read())
