"""The synchronous engine: scheduler + model runner + detokenizer; one step, its outputs.

:class:`LLMEngine` is synchronous; one :meth:`LLMEngine.step` is one iteration of
iteration-level (continuous) batching (Orca, OSDI 2022):

    schedule (decodes first, then prefill chunks, within the token budget; KV blocks reserved,
    preemption by recompute when they run out)  ->  runner.execute (one flat mixed batch)
    ->  scheduler.update_from_output (commit tokens, timestamps, EOS/stop-token/length stops)
    ->  incremental detokenization + stop strings (a stop string finishes the request through
        ``scheduler.finish_request(id, "stop")``, freeing its blocks at once)  ->  deltas.

The asyncio front (background loop, per-request streams) is ``async_engine.py``; arguments and
the model-loading factory are ``engine_args.py``. A runner error fails only that step's
requests; repeated failures raise (the async loop then marks the engine dead).

Thread safety: the scheduler is only touched under ``LLMEngine._lock``; the model runs outside it,
so admission (``add_request`` from the HTTP handlers) never waits for a forward pass. Aborts are
queued and applied by the loop thread before the next ``schedule()``, so the runner never writes
into blocks freed under it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from goodput.worker.detokenizer import IncrementalDetokenizer, SupportsDecode
from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import KvImport, RequestOutput, RunnerOutput, SchedulerOutput, TokenLogprobs
from goodput.worker.engine.request import Request
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine.scheduler import Scheduler, SchedulerStats
from goodput.api.disagg import KV_LAYOUT, KvLayout
from goodput.api.states import FinishReason, RejectReason
from goodput.worker.metrics import WorkerMetrics

log = logging.getLogger("goodput.worker.engine")

# Runner failures in a row before the engine gives up (one bad request must not kill the pod).
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class RequestDelta:
    """What one step produced for one request.

    text: new text to send (may be empty while characters or stop-string prefixes are held back;
        every step that generated tokens produces exactly one delta: one token, or several after a
        speculative step; streamers count ``token_ids``).
    token_ids: token ids generated this step (``usage.completion_tokens`` counts these, never
        re-tokenized text).
    finished / finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens or
        max_model_len) or "abort".
    num_prompt_tokens, num_output_tokens: running totals for ``usage``.
    error: set when the engine failed; the request is finished with reason "abort".
    logprobs: one :class:`TokenLogprobs` per id in ``token_ids`` when the request asked
        (``SamplingParams.logprobs``), else None.
    prompt_logprobs: on a request's first delta when it asked (``SamplingParams.prompt_logprobs``):
        one entry per prompt token, None for the first (nothing predicts it).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    num_tokens_seen: int = 0
    done: bool = False
    children: tuple[str, ...] = ()  # forks (n > 1) that end with this request if it never ran
    is_fork: bool = False  # one of another request's forks (its n is counted with that request)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class ModelExecutor(Protocol):
    """What the engine needs of a model runner (``model.runner.ModelRunner`` in production)."""

    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput: ...


class LLMEngine:
    """Synchronous engine: ``add_request`` then ``step()`` until ``has_unfinished()`` is False.

    scheduler: the engine core's :class:`Scheduler` (owns the block manager and admission).
    runner: a :class:`ModelExecutor` (``execute(SchedulerOutput) -> RunnerOutput``).
    tokenizer: anything with ``decode(ids, skip_special_tokens=...)`` (the server also uses its
        ``encode`` and ``apply_chat_template``).
    metrics: optional :class:`WorkerMetrics`; latency histograms are observed here.
    """

    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: ModelExecutor,
                 tokenizer: SupportsDecode,
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
        self.num_steps = 0
        self.kv_bytes_per_token: int | None = None

    # ------------------------------------------------------------------------------ admission
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    *, arrival_time: float | None = None, priority: int = 0,
                    slo_rank: int = 0, cache_salt: str | None = None,
                    forks: Sequence[tuple[str, SamplingParams]] = (), hold_kv: bool = False,
                    kv_import: KvImport | None = None) -> Request:
        """Admit a request (or raise :class:`AdmissionError`: never_fits / queue_full / invalid).

        forks: (request id, params) of further samples of the same prompt (OpenAI's ``n > 1``):
        admitted or refused together, they share the prompt's KV blocks once it is computed
        (``Scheduler.add_request``) and produce deltas under their own ids. Their params must
        have the same ``max_tokens``; prompt log-probabilities come only with the first.

        hold_kv: a remote prefill (its prompt's KV is leased when it finishes, under its id);
        kv_import: the prompt's KV from a prefill worker (docs/disaggregation.md). Neither goes
        with forks (ValueError)."""
        if (hold_kv or kv_import is not None) and forks:
            raise ValueError("a remote prefill or a KV import carries one choice (n = 1)")
        req = Request(request_id, list(prompt_token_ids), params, arrival_time=arrival_time,
                      priority=priority, slo_rank=slo_rank, cache_salt=cache_salt, hold_kv=hold_kv,
                      kv_import=kv_import)
        children = [Request(cid, req.prompt_token_ids, cp, arrival_time=arrival_time, priority=priority,
                            slo_rank=slo_rank, cache_salt=cache_salt) for cid, cp in forks]
        with self._lock:
            self.scheduler.add_request(req, children)  # duplicate ids are refused there ("invalid")
            for r in (req, *children):
                sp = r.sampling_params
                detok = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, stop=sp.stop,
                                               min_tokens=sp.min_tokens)
                self._tracked[r.request_id] = _Tracked(
                    r, detok, children=tuple(c.request_id for c in children) if r is req else (),
                    is_fork=r is not req,
                    prompt_logprobs=[None] * r.num_prompt_tokens if sp.prompt_logprobs is not None else None)
        return req

    def check_room(self, num_requests: int, slo_rank: int = 0) -> None:
        """Raise :class:`AdmissionError` unless a batch of ``num_requests`` of queue band
        ``slo_rank`` fits the waiting queue now (``Scheduler.check_room``: never_fits when it
        never can, else queue_full)."""
        with self._lock:
            self.scheduler.check_room(num_requests, slo_rank)

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

    def set_limits(self, max_num_seqs: int | None = None, max_waiting: int | None = None,
                   max_waiting_tokens: int | None = None) -> None:
        with self._lock:
            self.scheduler.set_limits(max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                                      max_waiting_tokens=max_waiting_tokens)

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
            if sched_out.kv_imports:  # prompts computed by a prefill worker: bytes into blocks
                self.runner.import_kv(sched_out.kv_imports)
            # an empty step still tells the runner which requests finished (it drops their state)
            runner_out = self.runner.execute(sched_out) \
                if not sched_out.is_empty or sched_out.finished_ids else RunnerOutput()
        except Exception as exc:
            return deltas + self._fail_step(sched_out, exc)
        self._consecutive_step_failures = 0
        with self._lock:
            outputs = self.scheduler.update_from_output(sched_out, runner_out)
            if self.metrics is not None and not sched_out.is_empty:
                self.metrics.observe_iteration(
                    sched_out.num_prefill_tokens + sum(len(o.new_token_ids) for o in outputs))
            for rid, (first, entries) in runner_out.prompt_logprobs.items():
                t = self._tracked.get(rid)
                if t is not None and t.prompt_logprobs is not None:
                    # by position: a recompute after preemption writes the same entries again
                    t.prompt_logprobs[first:first + len(entries)] = entries
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
                    deltas += self._end_unstarted_children(t, f"engine error: {exc!r}")
        return deltas

    def _end_unstarted_children(self, parent: _Tracked, error: str | None = None) -> list[RequestDelta]:
        """Forks whose parent ended before its prompt was computed ended with it (scheduler)."""
        deltas = []
        for cid in parent.children:
            ct = self._tracked.get(cid)
            if ct is not None and not ct.done and ct.request.is_finished:
                deltas.append(self._finish(ct, "abort", "", [], error))
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
            deltas += self._end_unstarted_children(t)
        return deltas

    def _process(self, out: RequestOutput) -> RequestDelta | None:
        t = self._tracked.get(out.request_id)
        if t is None or t.done:
            return None
        req = t.request
        new_ids = list(out.new_token_ids)
        text_ids = new_ids
        if out.finished and out.finish_reason == "stop" and new_ids and new_ids[-1] in req.stop_token_ids:
            text_ids = new_ids[:-1]  # a stop token (EOS or stop_token_ids) is never part of the text
        text, stopped, used = self._detokenize(t, text_ids, final=out.finished)
        reason = str(out.finish_reason) if out.finished else None
        if stopped and reason != FinishReason.STOP:
            if out.finished:
                self.scheduler.restate_finish_reason(req, FinishReason.STOP)
            else:
                self.scheduler.finish_request(req.request_id, FinishReason.STOP)
            reason = FinishReason.STOP.value
        if used < len(text_ids):  # a stop string ended a speculative step's text early
            self.scheduler.drop_output_tokens(req, len(new_ids) - used)
            new_ids = new_ids[:used]
        if self.metrics is not None and new_ids:
            self._observe_tokens(t)
        extra = {"logprobs": out.logprobs if req.sampling_params.logprobs is not None else None,
                 "prompt_logprobs": t.prompt_logprobs if req.num_output_tokens == len(new_ids) else None}
        if reason is not None:
            return self._finish(t, reason, text, new_ids, **extra)
        return RequestDelta(req.request_id, text, new_ids, False, None,
                            req.num_prompt_tokens, req.num_output_tokens, **extra)

    @staticmethod
    def _detokenize(t: _Tracked, ids: list[int], final: bool) -> tuple[str, bool, int]:
        """Text of this step's tokens: (text, a stop string matched, tokens used). A speculative
        step's tokens go in one at a time, so a stop string ends the text at its own token."""
        if len(ids) <= 1:
            d = t.detok.add_tokens(ids, final=final)
            return d.text, d.stopped, len(ids)
        text = []
        for j, tok in enumerate(ids):
            d = t.detok.add_tokens([tok], final=final and j == len(ids) - 1)
            text.append(d.text)
            if d.stopped:
                return "".join(text), True, j + 1
        return "".join(text), False, len(ids)

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
                error: str | None = None, logprobs: list[TokenLogprobs] | None = None,
                prompt_logprobs: list[TokenLogprobs | None] | None = None) -> RequestDelta:
        t.done = True
        req = t.request
        self._tracked.pop(req.request_id, None)
        if self.metrics is not None:
            self.metrics.observe_finished(reason, req, n=None if t.is_fork else 1 + len(t.children))
        return RequestDelta(req.request_id, text, new_ids, True, reason, req.num_prompt_tokens,
                            req.num_output_tokens, error, logprobs, prompt_logprobs)

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

    # ------------------------------------------------------------- disaggregated prefill (leases)
    def kv_layout(self) -> KvLayout:
        """What this engine's KV blocks hold (:class:`goodput.api.disagg.KvLayout`): the model
        revision, the runner's dtype, block size and dimensions."""
        r = self.runner
        mc = r.model_config
        return KvLayout(revision=self.config.revision, dtype=str(r.dtype).removeprefix("torch."),
                        block_size=self.config.block_size, layout=KV_LAYOUT, num_layers=mc.num_layers,
                        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)

    def cached_prompt_blocks(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading blocks of this prompt held by the prefix cache now (a hint: they may be
        evicted before the request is admitted; the scheduler then computes the prompt)."""
        probe = Request("kv-probe", list(prompt_token_ids), cache_salt=cache_salt)
        with self._lock:
            blocks, _ = self.scheduler.block_manager.get_computed_blocks(probe)
        return len(blocks)

    def lease_info(self, handle: str) -> tuple[int, int, tuple[int, ...]] | None:
        """(prompt tokens, first token id, prompt token ids) of the open lease ``handle``, or None."""
        with self._lock:
            lease = self.scheduler.lease(handle)
            if lease is None:
                return None
            return lease.num_tokens, lease.first_token_id, tuple(lease.request.prompt_token_ids)

    def read_lease_blocks(self, handle: str, first: int, count: int) -> list[bytes] | None:
        """The raw K/V bytes of prompt blocks ``first .. first + count - 1`` of lease ``handle``
        (``KV_LAYOUT``; fewer at the prompt's end), or None when the lease is no longer open.
        Copied under the engine lock: a lease's blocks are freed (and may be reused) only under
        it, and nobody writes a leased block. ValueError for a block outside the lease."""
        with self._lock:
            lease = self.scheduler.lease(handle)
            if lease is None:
                return None
            bs, n = self.config.block_size, lease.num_tokens
            nblocks = -(-n // bs)
            if not 0 <= first < nblocks or count < 1:
                raise ValueError(f"blocks {first}+{count} outside lease {handle!r} ({nblocks} blocks)")
            blocks = range(first, min(first + count, nblocks))
            return self.runner.export_kv_blocks([lease.request.block_ids[b] for b in blocks],
                                                [min(bs, n - b * bs) for b in blocks])

    def release_lease(self, handle: str) -> bool:
        """Free a lease's blocks now (pulled or cancelled); whether it was open."""
        with self._lock:
            return self.scheduler.release_lease(handle)

    def expire_leases(self) -> int:
        """Free the leases past their time (the loop calls it while idle, ``schedule`` each step)."""
        with self._lock:
            return self.scheduler.expire_leases()

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
