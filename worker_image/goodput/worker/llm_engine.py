"""The engine loop: scheduler + model runner + detokenizer, and an asyncio front for the server.

:class:`LLMEngine` is synchronous; one :meth:`LLMEngine.step` is one iteration of
iteration-level (continuous) batching (Orca, OSDI 2022):

    schedule (decodes first, then prefill chunks, within the token budget; KV blocks reserved,
    preemption by recompute when they run out)  ->  runner.execute (one flat mixed batch)
    ->  scheduler.update_from_output (commit tokens, timestamps, EOS/stop-token/length stops)
    ->  incremental detokenization + stop strings (a stop string finishes the request through
        ``scheduler.finish_request(id, "stop")``, freeing its blocks at once)  ->  deltas.

:class:`AsyncLLMEngine` runs ``step()`` on one background thread while there is work and hands
each request's deltas to its ``generate()`` async iterator on the asyncio loop. A client that
goes away aborts its request (blocks freed at the next step boundary, i.e. within one step).
``/health`` is the loop's heartbeat. A runner error fails only that step's requests; repeated
failures (or an error outside the runner) mark the engine dead (the pod restarts).

Thread safety: the scheduler is only touched under ``LLMEngine._lock``; the model runs outside it,
so admission (``add_request`` from the HTTP handlers) never waits for a forward pass. Aborts are
queued and applied by the loop thread before the next ``schedule()``, so the runner never writes
into blocks freed under it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from goodput.worker.detokenizer import IncrementalDetokenizer
from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import RunnerOutput, SchedulerOutput
from goodput.worker.engine.request import Request
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.scheduler import Scheduler, SchedulerStats
from goodput.worker.engine.states import FinishReason, RejectReason
from goodput.worker.metrics import WorkerMetrics

log = logging.getLogger("goodput.worker.engine")

# Runner failures in a row before the engine gives up (one bad request must not kill the pod).
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class RequestDelta:
    """What one step produced for one request.

    text: new text to send (may be empty while characters or stop-string prefixes are held back;
        every generated token produces exactly one delta, so streamers can count tokens).
    token_ids: token ids generated this step (``usage.completion_tokens`` counts these, never
        re-tokenized text).
    finished / finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens or
        max_model_len) or "abort".
    num_prompt_tokens, num_output_tokens: running totals for ``usage``.
    error: set when the engine failed; the request is finished with reason "abort".
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    stop_ids: frozenset[int]
    num_tokens_seen: int = 0
    done: bool = False


@dataclass
class EngineArgs:
    """Everything the CLI configures (units: bytes, tokens, milliseconds)."""

    model: str = "smollm2"
    served_model_name: str | None = None
    revision: str | None = None
    dtype: str = "bfloat16"
    device: str = "auto"
    kv_cache_memory: int = 1 << 30
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    max_waiting: int = 256
    enable_prefix_caching: bool = True
    scheduling_policy: str = "continuous"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    vllm_metric_aliases: bool = False
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch intra-op CPU threads (None: torch's default)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        import os
        base = os.path.basename(self.model)
        return base.removesuffix(".gguf")


class LLMEngine:
    """Synchronous engine: ``add_request`` then ``step()`` until ``has_unfinished()`` is False.

    scheduler: the engine core's :class:`Scheduler` (owns the block manager and admission).
    runner: object with ``execute(SchedulerOutput) -> RunnerOutput``.
    tokenizer: object with ``decode(ids, skip_special_tokens=...)``.
    metrics: optional :class:`WorkerMetrics`; latency histograms are observed here.
    """

    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: Any, tokenizer: Any,
                 metrics: WorkerMetrics | None = None, model_name: str = "model") -> None:
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model_name = model_name
        self._lock = threading.RLock()
        self._tracked: dict[str, _Tracked] = {}
        self._pending_aborts: list[str] = []
        self._consecutive_step_failures = 0
        self._eos = frozenset(config.eos_token_ids)
        self.num_steps = 0
        self.kv_bytes_per_token: int | None = None

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        """Load the model (GGUF), size the KV pool from ``args.kv_cache_memory`` and wire the
        scheduler, runner, tokenizer and metrics together. Logs the KV capacity."""
        from goodput.worker.model.runner import ModelRunner

        if args.num_threads is not None:
            import torch
            torch.set_num_threads(args.num_threads)
        runner = ModelRunner(args.model, dtype=args.dtype, device=args.device,
                             kv_cache_memory_bytes=args.kv_cache_memory, block_size=args.block_size,
                             attention_backend=args.attention_backend)
        mc = runner.model_config
        tok = runner.tokenizer
        max_model_len = args.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context length "
                             f"{mc.max_position_embeddings} (GGUF context_length); positions past it "
                             "have no meaning for this model")
        revision = args.revision or runner.revision
        eos = {i for i in (getattr(tok, "eos_token_id", None), mc.eos_token_id) if i is not None}
        config = EngineConfig(
            num_blocks=runner.num_blocks, max_model_len=max_model_len, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting, enable_prefix_caching=args.enable_prefix_caching,
            scheduling_policy=args.scheduling_policy, eos_token_ids=tuple(sorted(eos)),
            model_name=args.model_name, revision=revision, vocab_size=mc.vocab_size)
        per_token = runner.kv_bytes_per_token
        dtype_bytes = per_token // (2 * mc.num_layers * mc.num_kv_heads * mc.head_dim)
        log.info("KV cache: %d blocks x %d tokens = %d tokens of capacity; %d bytes/token "
                 "(2 * L=%d * n_kv=%d * d_head=%d * %d bytes); budget %d bytes; max_model_len %d",
                 config.num_blocks, config.block_size, config.kv_capacity_tokens, per_token,
                 mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype_bytes, args.kv_cache_memory,
                 max_model_len)
        if config.kv_capacity_tokens < max_model_len:
            log.warning("the KV pool holds %d tokens, fewer than max_model_len %d: longer requests are "
                        "refused with 400, and chat requests without max_tokens get at most what the "
                        "pool holds", config.kv_capacity_tokens, max_model_len)
        engine = cls(config, Scheduler(config), runner, tok, model_name=args.model_name)
        engine.metrics = WorkerMetrics(
            args.model_name, engine.stats,
            slo_ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000.0,
            slo_tpot_s=None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000.0,
            vllm_aliases=args.vllm_metric_aliases, max_model_len=max_model_len)
        engine.kv_bytes_per_token = per_token
        return engine

    # ------------------------------------------------------------------------------ admission
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    *, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> Request:
        """Admit a request (or raise :class:`AdmissionError`: never_fits / queue_full / invalid)."""
        req = Request(request_id, list(prompt_token_ids), params, arrival_time=arrival_time,
                      priority=priority, cache_salt=cache_salt)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, stop=params.stop,
                                       min_tokens=params.min_tokens)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos)
        with self._lock:
            self.scheduler.add_request(req)  # duplicate ids are refused there ("invalid")
            self._tracked[request_id] = _Tracked(req, detok, stop_ids)
        return req

    def count_invalid(self) -> None:
        """Count a request refused by the server's own validation (reason ``invalid``)."""
        self.count_rejected(RejectReason.INVALID)

    def count_rejected(self, reason: RejectReason | str) -> None:
        """Count a request the server refused before admission, in the scheduler's counters."""
        with self._lock:
            self.scheduler.count_rejection(reason)

    def abort_request(self, request_id: str) -> None:
        """Abort at the next step boundary (frees the request's KV blocks then)."""
        with self._lock:
            if request_id in self._tracked:
                self._pending_aborts.append(request_id)

    def set_limits(self, max_num_seqs: int | None = None, max_waiting: int | None = None) -> None:
        with self._lock:
            self.scheduler.set_limits(max_num_seqs=max_num_seqs, max_waiting=max_waiting)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._tracked) or self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------------------- step
    def step(self) -> list[RequestDelta]:
        """One iteration: schedule -> execute -> commit -> detokenize. Returns per-request deltas."""
        deltas: list[RequestDelta] = []
        with self._lock:
            deltas.extend(self._apply_aborts())
            sched_out: SchedulerOutput = self.scheduler.schedule()
        try:
            runner_out = self.runner.execute(sched_out) if not sched_out.is_empty else RunnerOutput()
        except Exception as exc:
            return deltas + self._fail_step(sched_out, exc)
        self._consecutive_step_failures = 0
        with self._lock:
            outputs = self.scheduler.update_from_output(sched_out, runner_out)
            if self.metrics is not None and not sched_out.is_empty:
                self.metrics.observe_iteration(
                    sched_out.num_prefill_tokens + sum(len(o.new_token_ids) for o in outputs))
            for out in outputs:
                d = self._process(out)
                if d is not None:
                    deltas.append(d)
            self.num_steps += 1
        return deltas

    def _fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> list[RequestDelta]:
        """The runner raised: fail only the requests of this step and keep serving the rest.

        Safe because the scheduler commits progress only in ``update_from_output`` and caches a
        block only after a committed step: the failed step's KV writes belong to requests that are
        aborted here (their blocks are freed), so nothing half-written is ever reused. Raises (the
        engine then dies and the pod restarts) after ``MAX_CONSECUTIVE_STEP_FAILURES`` in a row,
        which points at a broken runner rather than one bad request.
        """
        self._consecutive_step_failures += 1
        if self._consecutive_step_failures > MAX_CONSECUTIVE_STEP_FAILURES:
            raise exc
        log.exception("engine step failed; aborting its %d request(s)", len(sched_out.chunks))
        deltas = []
        with self._lock:
            for chunk in sched_out.chunks:
                t = self._tracked.get(chunk.request_id)
                self.scheduler.abort_request(chunk.request_id)
                if t is not None and not t.done:
                    deltas.append(self._finish(t, "abort", t.detok.flush().text, [],
                                               f"engine error: {exc!r}"))
        return deltas

    def _apply_aborts(self) -> list[RequestDelta]:
        deltas = []
        pending, self._pending_aborts = self._pending_aborts, []
        for rid in pending:
            t = self._tracked.get(rid)
            if t is None or t.done:
                continue
            self.scheduler.abort_request(rid)
            deltas.append(self._finish(t, "abort", t.detok.flush().text, []))
        return deltas

    def _process(self, out: Any) -> RequestDelta | None:
        t = self._tracked.get(out.request_id)
        if t is None or t.done:
            return None
        req = t.request
        new_ids = list(out.new_token_ids)
        if self.metrics is not None and new_ids:
            self._observe_tokens(t)
        text_ids = new_ids
        if out.finished and out.finish_reason == "stop" and new_ids and new_ids[-1] in t.stop_ids:
            text_ids = new_ids[:-1]  # a stop token (EOS or stop_token_ids) is never part of the text
        if out.finished:
            reason = str(getattr(out.finish_reason, "value", out.finish_reason))
            delta = t.detok.add_tokens(text_ids, final=True)
            if delta.stopped and reason != FinishReason.STOP:
                reason = FinishReason.STOP.value
                self.scheduler.restate_finish_reason(req, FinishReason.STOP)
            return self._finish(t, reason, delta.text, new_ids)
        delta = t.detok.add_tokens(text_ids)
        if delta.stopped:
            self.scheduler.finish_request(req.request_id, "stop")
            return self._finish(t, "stop", delta.text, new_ids)
        return RequestDelta(req.request_id, delta.text, new_ids, False, None,
                            req.num_prompt_tokens, req.num_output_tokens)

    def _observe_tokens(self, t: _Tracked) -> None:
        req = t.request
        times = req.token_times
        start = t.num_tokens_seen
        if start == 0 and times:
            self.metrics.observe_first_token(req.ttft, req.queue_time)
        if len(times) > 1:
            self.metrics.observe_itl(times[i] - times[i - 1] for i in range(max(start, 1), len(times)))
        t.num_tokens_seen = len(times)

    def _finish(self, t: _Tracked, reason: str, text: str, new_ids: list[int],
                error: str | None = None) -> RequestDelta:
        t.done = True
        req = t.request
        self._tracked.pop(req.request_id, None)
        if self.metrics is not None:
            self.metrics.observe_finished(reason, req)
        return RequestDelta(req.request_id, text, new_ids, True, reason, req.num_prompt_tokens,
                            req.num_output_tokens, error)

    def fail_all(self, error: str) -> list[RequestDelta]:
        """Abort every unfinished request with an error (used when a step raised)."""
        with self._lock:
            deltas = []
            for t in list(self._tracked.values()):
                try:
                    self.scheduler.abort_request(t.request.request_id)
                except Exception:  # the scheduler may be in a bad state; still answer the clients
                    log.exception("abort after engine failure")
                deltas.append(self._finish(t, "abort", "", [], error))
            return deltas

    # ------------------------------------------------------------------------------ introspection
    def stats(self) -> SchedulerStats:
        """The scheduler's consistent snapshot, for /metrics and /admin/state."""
        with self._lock:
            return self.scheduler.stats()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[tuple[list[int], str, str]]:
        """Run prompts to completion (offline use and tests): [(token_ids, text, finish_reason)]."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            rid = f"offline-{self.num_steps}-{i}"
            self.add_request(rid, p, sp)
            ids.append(rid)
        results: dict[str, list] = {rid: [[], "", None] for rid in ids}
        while any(results[r][2] is None for r in ids):
            for d in self.step():
                if d.request_id in results:
                    r = results[d.request_id]
                    r[0].extend(d.token_ids)
                    r[1] += d.text
                    if d.finished:
                        r[2] = d.finish_reason
        return [(results[r][0], results[r][1], results[r][2]) for r in ids]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an error; the worker must be restarted."""


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
        self._queues: dict[str, asyncio.Queue] = {}
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

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            if not eng.has_unfinished():
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
            q = self._queues.get(d.request_id)
            if q is not None:
                q.put_nowait(d)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    *, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> RequestStream:
        """Admit a request now (raises :class:`AdmissionError` at once: never_fits, queue_full,
        invalid) and return its :class:`RequestStream`. Call from the event loop's thread."""
        if self.error is not None:
            raise EngineDeadError(f"engine is dead: {self.error!r}")
        stream = RequestStream(self, request_id)
        self._queues[request_id] = stream._queue
        try:
            self.engine.add_request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                    priority=priority, cache_salt=cache_salt)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return stream

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       **kwargs: Any) -> AsyncIterator[RequestDelta]:
        """``add_request`` then iterate its deltas; closing the iterator early aborts the request."""
        stream = self.add_request(request_id, prompt_token_ids, params, **kwargs)
        try:
            async for d in stream:
                yield d
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._wake.set()


class RequestStream:
    """The deltas of one admitted request, as an async iterator (one delta per generated token).

    ``abort()`` (idempotent, a no-op once finished) aborts the request: used when the client
    disconnects. The iterator ends after the delta with ``finished=True``.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str):
        self._engine = engine
        self.request_id = request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        d: RequestDelta = await self._queue.get()
        if d.finished:
            self.finished = True
            self._engine._queues.pop(self.request_id, None)
        return d

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine._queues.pop(self.request_id, None)
            self._engine.abort(self.request_id)
