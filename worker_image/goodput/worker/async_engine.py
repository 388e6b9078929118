"""The asyncio front of the engine: a background step loop and one :class:`RequestStream` per
request.

:class:`AsyncLLMEngine` runs :meth:`LLMEngine.step` on one background thread while there is work
and hands each request's deltas to its stream on the asyncio loop (``call_soon_threadsafe``).
A client that goes away aborts its request (KV blocks freed at the next step boundary, i.e.
within one step). ``/health`` is the loop's heartbeat. A runner error fails only that step's
requests (see ``LLMEngine``); an error outside the runner marks the engine dead (the pod
restarts) and every open stream gets a final delta with the error.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

from goodput.worker.engine.outputs import KvImport
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.scheduler import AdmissionError
from goodput.worker.llm_engine import LLMEngine, RequestDelta

log = logging.getLogger("goodput.worker.engine")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an error; the worker must be restarted."""


class RequestStream:
    """The deltas of one admitted request, as an async iterator (one delta per generated token).

    ``abort()`` (idempotent, a no-op once finished) aborts the request: used when the client
    disconnects. The iterator ends after the delta with ``finished=True``. ``on_close`` is
    called once with the request id when the stream ends either way (the engine forgets it).
    """

    def __init__(self, request_id: str, on_abort: Callable[[str], None],
                 on_close: Callable[[str], None]):
        self.request_id = request_id
        self._on_abort = on_abort
        self._on_close = on_close
        self._queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.finished = False

    def put(self, delta: RequestDelta) -> None:
        """Hand one delta to the consumer (called on the event loop's thread)."""
        self._queue.put_nowait(delta)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        d = await self._queue.get()
        if d.finished:
            self._close()
        return d

    def _close(self) -> None:
        if not self.finished:
            self.finished = True
            self._on_close(self.request_id)

    def abort(self) -> None:
        if not self.finished:
            self._close()
            self._on_abort(self.request_id)


class AsyncLLMEngine:
    """Runs :meth:`LLMEngine.step` on one background thread; ``generate()`` streams deltas.

    heartbeat: ``time.monotonic()`` of the loop's last iteration (also ticks while idle, every
    ``idle_tick_s``); :meth:`is_healthy` is "thread alive, no fatal error, heartbeat younger than
    ``health_timeout_s``".
    """

    def __init__(self, engine: LLMEngine, idle_tick_s: float = 1.0, health_timeout_s: float = 60.0):
        self.engine = engine
        self.idle_tick_s = idle_tick_s
        self.health_timeout_s = health_timeout_s
        self.heartbeat = time.monotonic()
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="goodput-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def is_healthy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self.error is None
                and time.monotonic() - self.heartbeat < self.health_timeout_s)

    @property
    def num_open_streams(self) -> int:
        """Streams not yet finished or aborted (tests check that none leak)."""
        return len(self._streams)

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            if not eng.has_unfinished():
                try:
                    eng.expire_leases()  # remote prefills' KV nobody pulled (schedule() does it too)
                except Exception:
                    log.exception("expiring KV leases failed")
                self._wake.wait(self.idle_tick_s)
                self._wake.clear()
                continue
            try:
                deltas = eng.step()
            except BaseException as exc:
                log.exception("engine step failed; the engine is now dead")
                self.error = exc
                self._deliver(eng.fail_all(f"engine error: {exc!r}"))
                return
            if deltas:
                self._deliver(deltas)
            elif eng.has_unfinished():
                time.sleep(0.002)  # nothing schedulable right now (e.g. static cohort): don't spin

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, deltas)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            s = self._streams.get(d.request_id)
            if s is not None:
                s.put(d)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    *, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> RequestStream:
        """Admit a request now (raises :class:`AdmissionError` at once: never_fits, queue_full,
        invalid; :class:`EngineDeadError` when the loop has died) and return its
        :class:`RequestStream`. Call from the event loop's thread."""
        return self.add_request_group(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                      priority=priority, cache_salt=cache_salt)[0]

    def check_room(self, num_requests: int, slo_rank: int = 0) -> None:
        """Raise :class:`AdmissionError` unless ``num_requests`` requests added now all fit the
        waiting queue (never_fits: they never can under the limits in force; queue_full: not now).
        Only the event loop's thread adds requests, so room seen here is still there for them."""
        if self.error is not None:
            raise EngineDeadError(f"engine is dead: {self.error!r}")
        self.engine.check_room(num_requests, slo_rank)

    def add_request_group(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                          *, arrival_time: float | None = None, priority: int = 0,
                          slo_rank: int = 0, cache_salt: str | None = None,
                          forks: Sequence[tuple[str, SamplingParams]] = (), hold_kv: bool = False,
                          kv_import: KvImport | None = None) -> list[RequestStream]:
        """:meth:`add_request` plus ``forks`` (id, params) sharing the prompt's KV (``n > 1``):
        all admitted or none; one stream per id, the request's first. ``hold_kv`` / ``kv_import``:
        a remote prefill / an imported prompt (``LLMEngine.add_request``)."""
        if self.error is not None:
            raise EngineDeadError(f"engine is dead: {self.error!r}")
        ids = [request_id] + [cid for cid, _ in forks]
        streams = [RequestStream(i, self.abort, self._forget) for i in ids]
        if any(i in self._streams for i in ids):
            raise AdmissionError("invalid", f"a request id of {ids} is already in use")
        self._streams.update(zip(ids, streams))
        try:
            self.engine.add_request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                    priority=priority, slo_rank=slo_rank, cache_salt=cache_salt, forks=forks,
                                    hold_kv=hold_kv, kv_import=kv_import)
        except BaseException:
            for i in ids:
                self._streams.pop(i, None)
            raise
        self._wake.set()
        return streams

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       *, arrival_time: float | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestDelta]:
        """``add_request`` then iterate its deltas; closing the iterator early aborts the request."""
        stream = self.add_request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                  priority=priority, cache_salt=cache_salt)
        try:
            async for d in stream:
                yield d
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._wake.set()
