"""The router's HTTP server side: uvicorn's HTTP protocol with a deadline on the request head.

uvicorn bounds the idle wait between requests on a keep-alive connection, but not the wait for a
request's head: a connection that sends nothing, or part of its headers and then nothing, is held
open forever (one file descriptor and buffer each; enough of them and the router stops accepting).
:func:`protocol_class` gives uvicorn's own protocol (httptools when installed, else h11) with one
timer per connection: armed when the connection opens and again when a response completes, it
closes the connection unless the next request's head was complete (the app was called) within
``header_timeout_s`` seconds. The body's own deadline is the router's ``--body-timeout`` (408).
"""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("goodput.router")


def protocol_class(header_timeout_s: float, base: type = AutoHTTPProtocol) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``base`` closing a connection whose request head is not complete
    ``header_timeout_s`` seconds (> 0) after it opened or after its last response ended. Pass the
    result as uvicorn's ``http=``."""
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")

    class HeadDeadlineProtocol(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            inner = self.app

            async def app(scope, receive, send):  # the head is complete: the request runs
                self._disarm_head()
                return await inner(scope, receive, send)

            self.app = app

        def _arm_head(self) -> None:
            self._disarm_head()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_expired)

        def _disarm_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                log.info("closing a connection from %s: no complete request head within %g s "
                         "(--header-timeout)", self.client, header_timeout_s)
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head()

        def connection_lost(self, exc) -> None:
            self._disarm_head()
            super().connection_lost(exc)

    HeadDeadlineProtocol.__name__ = HeadDeadlineProtocol.__qualname__ = f"HeadDeadline{base.__name__}"
    return HeadDeadlineProtocol
