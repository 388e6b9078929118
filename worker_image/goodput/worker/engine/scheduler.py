"""Iteration-level scheduler: continuous batching, chunked prefill, preemption, admission.

Sources: iteration-level scheduling of Orca (Yu et al., OSDI 2022); paged KV and preemption by
recompute of PagedAttention/vLLM (Kwon et al., SOSP 2023); chunked prefills mixed with decodes
under one token budget of Sarathi-Serve (Agrawal et al., OSDI 2024).

There is no separate prefill phase: each request has ``num_tokens`` (prompt + output) and
``num_computed_tokens`` (KV in the cache); a step gives every chosen request
``num_tokens - num_computed_tokens`` new tokens, cut to the step's token budget. One engine step:

1. ``schedule()``: retire finished requests -> defer what cannot fit (reject happens at admission)
   -> choose decodes (running requests first), then prefill chunks, within
   ``max_num_batched_tokens`` and ``max_num_seqs`` -> reserve every KV block, preempting by
   recompute when blocks run out.
2. the model runner executes the ``SchedulerOutput``.
3. ``update_from_output()`` commits tokens and timestamps and applies the stop rules.

Calls must come from one thread (the engine serialises add/abort/step). A ``SchedulerOutput`` that
is never committed is simply recomputed by the next ``schedule()`` (progress is committed only in
``update_from_output``), so a failed runner step can be retried.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

from goodput.worker.engine.block_manager import BlockManager
from goodput.worker.engine.config import EngineConfig
from goodput.worker.engine.outputs import (
    KvImportChunk,
    RequestOutput,
    RunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
)
from goodput.worker.engine.request import Request, RequestStatus
from goodput.worker.engine.speculative import draft_budget, next_skip, propose_ngram
from goodput.api.states import EngineState, FinishReason, PrefillWhere, RejectReason


class AdmissionError(Exception):
    """A request refused at admission (by ``Scheduler.add_request`` or the server's own checks).

    reason: a :class:`RejectReason`: ``invalid`` (bad input, HTTP 400), ``never_fits`` (can never
        be served by this engine's max_model_len or KV pool, HTTP 400), ``queue_full`` (try again
        later, HTTP 429).
    message: human-readable, names the numbers involved.
    retry_after: seconds to wait before retrying (only for ``queue_full``).
    param: the request field at fault (``"prompt"``, ``"max_tokens"``) or None; the server puts
        it in the OpenAI error body.
    """

    def __init__(self, reason: RejectReason | str, message: str, retry_after: float | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.reason = RejectReason(reason)
        self.message = message
        self.retry_after = retry_after
        self.param = param


PREFILL_WHERE = tuple(w.value for w in PrefillWhere)


def waiting_band(slo_rank: int, waited_s: float, aging_s: float) -> int:
    """The band a waiting request is admitted in (smaller first): its ``slo_rank``, one less for
    every whole ``aging_s`` seconds it has waited since it arrived, never below 0.

    Why aging: a request of rank r > 0 yields to tighter classes only for its first
    ``r * aging_s`` seconds; from then on it is in band 0, where requests go by queue position
    (arrival order, preempted ones first), so every request that arrives after it waits behind it.
    """
    if slo_rank <= 0:
        return 0
    return max(0, slo_rank - int(waited_s // aging_s))


def next_waiting(queue: Sequence[tuple[int, float]], aging_s: float) -> int:
    """Which waiting request is admitted next: the index, in the queue's order, of the first one
    in the smallest :func:`waiting_band` (``queue``: (slo_rank, waited seconds) per request; not
    empty). With every rank 0 this is 0, the head (first-come first-served)."""
    best, best_band = 0, None
    for i, (rank, waited) in enumerate(queue):
        band = waiting_band(rank, waited, aging_s)
        if best_band is None or band < best_band:
            best, best_band = i, band
            if band == 0:
                break
    return best


@dataclass(frozen=True)
class SchedulerStats:
    """A consistent snapshot of the engine core: what ``/metrics`` and ``/admin/state`` export.

    Gauges: engine_state, num_running, num_waiting (preempted ones included, and the ``n > 1``
    forks whose parent's prompt has not run yet), KV blocks
    (``num_used_blocks`` have a reference; cached-but-free blocks count as free), the admission
    limits in force. Counters are totals since start: ``rejected_total`` by
    :class:`RejectReason` value (the server's own refusals included), ``finished_total`` by
    :class:`FinishReason` value; tokens in tokens (``prefix_cache_*``: prompt tokens looked up at
    admission / found); ``steps_total``: steps that ran at least one chunk;
    ``batched_tokens_total``: tokens those steps computed (prefill chunks + decode inputs, draft
    tokens included); ``spec_decode_*``: speculative decodes, their draft tokens and the draft
    tokens accepted (mean accepted length = accepted / drafts; tokens per speculative step = that + 1).
    Disaggregated prefill: ``prefills_total`` by where the prompt's KV was computed (``local``:
    by this engine, ``remote``: imported from a prefill worker), counted once per request when it
    first runs; ``kv_lease_expiries_total``: leases freed because nobody pulled them in time, or
    reclaimed early because KV blocks ran out (before any running request is preempted);
    gauges ``num_leases`` / ``num_leased_blocks``: leases open now and the blocks they hold.

    kv_usage_ratio: num_used_blocks / num_blocks, in [0, 1].

    Invariant: ``admitted_total == sum(finished_total.values()) + num_running + num_waiting``
    (every choice of an ``n > 1`` request counts once, from its admission), so "in flight" =
    admitted - finished is never negative.

    Every field ending in ``_total`` is a counter the :class:`Scheduler` keeps under the same
    name; ``goodput.api.worker_metrics.SCHEDULER_COUNTERS`` names its metric (a test checks
    that none is left unexported).
    """

    engine_state: EngineState
    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    kv_usage_ratio: float
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    block_size: int
    enable_prefix_caching: bool
    max_num_seqs: int
    max_waiting: int
    max_waiting_tokens: int
    admitted_total: int
    rejected_total: dict[str, int]
    finished_total: dict[str, int]
    preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    steps_total: int
    batched_tokens_total: int
    spec_decode_drafts_total: int
    spec_decode_draft_tokens_total: int
    spec_decode_accepted_tokens_total: int
    prefills_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREFILL_WHERE, 0))
    kv_lease_expiries_total: int = 0
    num_leases: int = 0
    num_leased_blocks: int = 0

    def counters(self) -> dict[str, Any]:
        """The counters by name without ``_total`` (``{"admitted": 3, "rejected": {...}, ...}``)."""
        return {name.removesuffix("_total"): getattr(self, name) for name in _COUNTER_FIELDS}


_COUNTER_FIELDS = tuple(f.name for f in fields(SchedulerStats) if f.name.endswith("_total"))


@dataclass
class Lease:
    """A finished remote prefill's prompt KV, kept for a decode worker to pull.

    request: the finished request (its block table still registered in the block manager).
    expires_at: scheduler-clock seconds after which the blocks are freed unless released first.
    """

    request: Request
    expires_at: float

    @property
    def num_tokens(self) -> int:
        """Prompt tokens whose KV the lease holds."""
        return self.request.num_prompt_tokens

    @property
    def first_token_id(self) -> int:
        return self.request.output_token_ids[0]


@dataclass
class _StepPlan:
    budget: int
    scheduled: dict[str, int] = field(default_factory=dict)  # request_id -> new tokens (in order)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request_id -> its n-gram draft
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    """Continuous-batching scheduler over a paged KV ``BlockManager``.

    config: the ``EngineConfig`` (limits, policy, EOS ids, identity).
    block_manager: the KV allocator (built from ``config`` when None); must match its
        num_blocks and block_size.
    clock: monotonic time source in seconds (tests pass a fake one).

    Queues: ``waiting`` (a deque in arrival order; preempted requests re-enter at the front) and
    ``running`` (admission order). Waiting requests are admitted by band (:func:`next_waiting`:
    a request's ``slo_rank``, aged by ``config.slo_class_aging_seconds``), by queue position within a
    band; with every request at rank 0 (one SLO class) that is first-come first-served.
    ``priority`` (smaller = more important), then the band, chooses preemption victims.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_manager is None:
            block_manager = BlockManager.from_config(config)
        if (block_manager.num_blocks, block_manager.block_size) != (config.num_blocks, config.block_size):
            raise ValueError(
                f"block manager has {block_manager.num_blocks} blocks of {block_manager.block_size} "
                f"tokens, config says {config.num_blocks} of {config.block_size}")
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.max_num_seqs = config.max_num_seqs
        self.max_waiting = config.max_waiting
        self.max_waiting_tokens = config.max_waiting_tokens
        self._eos = frozenset(config.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self._rank_counts: dict[int, int] = {}   # slo_rank -> waiting requests of that rank
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self._admit_seq: dict[str, int] = {}
        self._next_seq = 0
        self._finished_ids: list[str] = []
        # parent request id -> children forked from it when its prompt's KV is computed (n > 1)
        self._pending_forks: dict[str, list[Request]] = {}
        # What limited the waiting queue in the last step (for engine_state()).
        self._kv_blocked = False
        self._last_queue_full: float | None = None
        # Counters.
        self.admitted_total = 0
        self.rejected_total = dict.fromkeys((r.value for r in RejectReason), 0)
        self.finished_total = dict.fromkeys((r.value for r in FinishReason), 0)
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps_total = 0
        self.batched_tokens_total = 0
        self.spec_decode_drafts_total = 0
        self.spec_decode_draft_tokens_total = 0
        self.spec_decode_accepted_tokens_total = 0
        # Disaggregated prefill: open leases by handle (the request id), and their counters.
        self.leases: dict[str, Lease] = {}
        self.prefills_total = dict.fromkeys(PREFILL_WHERE, 0)
        self.kv_lease_expiries_total = 0
        # imports scheduled and not committed yet: request id -> (computed tokens before, first token)
        self._import_tokens: dict[str, tuple[int, int]] = {}

    # ---- admission -----------------------------------------------------------------------------
    def count_rejection(self, reason: RejectReason | str) -> None:
        """Count one refused request. ``add_request`` counts its own; the server calls this for
        requests it refuses before they reach the scheduler (validation, over-long text)."""
        reason = RejectReason(reason)
        self.rejected_total[reason.value] += 1
        if reason is RejectReason.QUEUE_FULL:
            self._last_queue_full = self.clock()

    def _reject(self, reason: RejectReason, message: str, retry_after: float | None = None,
                param: str | None = None) -> AdmissionError:
        self.count_rejection(reason)
        return AdmissionError(reason, message, retry_after, param)

    def add_request(self, req: Request, forks: Sequence[Request] = ()) -> None:
        """Admit ``req`` to the waiting queue, or raise ``AdmissionError`` at once.

        forks: children with the same prompt (OpenAI's ``n > 1``), admitted or refused together
        with ``req``. When ``req``'s prompt KV has been computed they share its full KV blocks
        (``BlockManager.fork``) and join the running set directly (beyond ``max_num_seqs``:
        they are part of an admitted request); each then samples on its own.

        invalid: empty prompt, token id out of range, duplicate id, a request already used, a
            ``kv_import`` that does not cover the prompt's blocks.
        never_fits: prompt + max_tokens > max_model_len, or its KV (prompt + max_tokens - 1
            tokens) needs more blocks than the whole pool (it could never run even alone).
        queue_full: ``max_waiting`` requests wait that ``req`` would queue behind
            (:meth:`queued_ahead`: of its ``slo_rank`` or a smaller one; with one rank, the
            whole queue); or, with ``max_waiting_tokens`` > 0, prompt tokens are still to be
            prefilled ahead of it (:meth:`prompt_tokens_ahead`) and they plus its own prompt
            exceed ``max_waiting_tokens`` (an imported prompt needs no prefill and is not
            counted; a prompt counts in full even where the prefix cache holds its start, so
            the bound errs toward refusing; with nothing ahead a prompt is always admitted);
            retry_after is set. A request of a looser class is refused first.
        """
        if not isinstance(req, Request):
            raise TypeError(f"add_request takes a Request, got {type(req).__name__}")
        cfg = self.config
        rid = req.request_id
        ids = [rid] + [c.request_id for c in forks]
        for i in ids:
            if i in self.requests or i in self._pending_forks or ids.count(i) > 1:
                raise self._reject(RejectReason.INVALID, f"request id {i!r} is already in use")
        for c in forks:
            if tuple(c.prompt_token_ids) != tuple(req.prompt_token_ids) or c.cache_salt != req.cache_salt \
                    or c.sampling_params.max_tokens != req.sampling_params.max_tokens or c.output_token_ids:
                raise self._reject(RejectReason.INVALID, f"fork {c.request_id!r} must have its parent's "
                                                         "prompt, cache_salt and max_tokens")
        if req.status is not RequestStatus.WAITING or req.output_token_ids or req.block_ids:
            raise self._reject(RejectReason.INVALID, f"request {rid!r} was already scheduled once")
        n = req.num_prompt_tokens
        if n == 0:
            raise self._reject(RejectReason.INVALID,
                               "the prompt is empty (0 tokens); at least 1 token is needed", param="prompt")
        lo, hi = min(req.prompt_token_ids), max(req.prompt_token_ids)
        if lo < 0 or (cfg.vocab_size is not None and hi >= cfg.vocab_size):
            bad = lo if lo < 0 else hi
            raise self._reject(RejectReason.INVALID, f"prompt token id {bad} is outside the vocabulary "
                               f"[0, {cfg.vocab_size if cfg.vocab_size else 'inf'})", param="prompt")
        imp = req.kv_import
        if imp is not None and (imp.num_tokens != n or imp.first_block < 0
                                or imp.first_block + len(imp.blocks) != cfg.blocks_for_tokens(n)
                                or (forks or req.sampling_params.prompt_logprobs is not None)):
            raise self._reject(RejectReason.INVALID, f"request {rid!r}: its imported KV covers {imp.num_tokens} "
                               f"tokens from block {imp.first_block} in {len(imp.blocks)} blocks, not the prompt's "
                               f"{n} tokens (or it has forks or prompt log-probabilities)")
        max_tokens = req.sampling_params.max_tokens
        # The field at fault: the prompt when it cannot fit even alone, else max_tokens.
        culprit = ("prompt" if n >= cfg.max_model_len or cfg.blocks_for_tokens(n) > cfg.num_blocks
                   else "max_tokens")
        if n + max_tokens > cfg.max_model_len:
            raise self._reject(
                RejectReason.NEVER_FITS,
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} "
                f"tokens exceeds max_model_len ({cfg.max_model_len})", param=culprit)
        need = cfg.blocks_for_tokens(req.max_num_kv_tokens)
        if need > cfg.num_blocks:
            raise self._reject(
                RejectReason.NEVER_FITS,
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks "
                f"of {cfg.block_size} tokens but the whole pool has {cfg.num_blocks} "
                f"blocks ({cfg.kv_capacity_tokens} tokens)", param=culprit)
        ahead = self.queued_ahead(req.slo_rank)
        if ahead >= self.max_waiting:
            raise self._reject(  # not now: a batch that can never fit is refused by check_room
                RejectReason.QUEUE_FULL, f"the waiting queue is full ({ahead} requests of rank <= "
                                         f"{req.slo_rank} waiting, max_waiting={self.max_waiting})",
                cfg.queue_full_retry_after_s)
        if self.max_waiting_tokens > 0 and imp is None:
            tokens_ahead = self.prompt_tokens_ahead(req.slo_rank)
            if tokens_ahead > 0 and tokens_ahead + n > self.max_waiting_tokens:
                raise self._reject(
                    RejectReason.QUEUE_FULL, f"{tokens_ahead} prompt tokens wait to be prefilled ahead of this "
                                             f"prompt's {n} (max_waiting_tokens={self.max_waiting_tokens})",
                    cfg.queue_full_retry_after_s)
        for r in (req, *forks):
            sp = r.sampling_params
            r.stop_token_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else self._eos)
        if forks:
            self._pending_forks[rid] = list(forks)
        now = self.clock()
        if req.arrival_time is None:
            req.arrival_time = now
        req.queued_time = now
        self.requests[rid] = req
        self._admit_seq[rid] = self._next_seq
        self._next_seq += 1
        self.waiting.append(req)
        self._count_rank(req, 1)
        self.admitted_total += 1 + len(forks)  # forks count from admission (finished/waiting too)

    def check_room(self, num_requests: int, slo_rank: int = 0) -> None:
        """Raise ``AdmissionError`` unless ``num_requests`` requests of ``slo_rank`` added now (a
        batch, admitted whole into the waiting queue) all fit it; counts the refusal.

        never_fits: ``0 < max_waiting < num_requests``: under the limits in force the queue can
            never hold the batch at once (400; ``max_waiting == 0`` is a drain: "not now").
        queue_full: ``queued_ahead(slo_rank) + num_requests > max_waiting`` (429 with
            retry_after; ``len(waiting)`` with one rank).
        """
        if 0 < self.max_waiting < num_requests:
            raise self._reject(
                RejectReason.NEVER_FITS,
                f"a batch of {num_requests} prompts can never be admitted: a batch enters the waiting "
                f"queue whole and it holds at most max_waiting={self.max_waiting} requests "
                f"(--max-waiting, or PUT /admin/limits); send at most {self.max_waiting} prompts per request",
                param="prompt")
        ahead = self.queued_ahead(slo_rank)
        if ahead + num_requests > self.max_waiting:
            raise self._reject(
                RejectReason.QUEUE_FULL,
                f"the waiting queue has room for {max(0, self.max_waiting - ahead)} of "
                f"{num_requests} requests ({ahead} waiting, max_waiting={self.max_waiting})",
                self.config.queue_full_retry_after_s)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step; every chunk's KV blocks are reserved before it is returned.

        Order: retire finished -> decodes of running requests -> prefill chunks of running
        requests -> new (or preempted) waiting requests, while the token budget, ``max_num_seqs``
        and the KV pool allow. When a running request cannot get a block, the running request
        with the largest ``priority`` value, then the newest, is preempted by recompute (blocks
        freed, ``num_computed_tokens = 0``, back to the front of the waiting queue); no waiting
        request is admitted in a step that preempted. Admission guarantees any single request
        fits the pool alone, so this always makes progress. When the token budget is smaller than
        the number of running decodes, the oldest running requests go first.

        Cost: O(running + scheduled blocks) per step plus hashing of newly admitted prompts; no
        scan of the pool.
        """
        now = self.clock()
        out = SchedulerOutput()
        self.expire_leases(now)
        # 1. retire what finished since the last step (blocks were freed when it finished).
        out.finished_ids, self._finished_ids = self._finished_ids, []
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        kv_blocked = False

        # 2. running requests: decodes first, then chunks of partially prefilled prompts.
        for want_decode in (True, False):
            for req in list(self.running):
                if plan.budget <= 0:
                    break
                if req.status is not RequestStatus.RUNNING or req.request_id in plan.scheduled:
                    continue
                remaining = req.num_tokens - req.num_computed_tokens
                if remaining <= 0 or (remaining == 1) != want_decode:
                    continue
                n = min(remaining, plan.budget)
                if want_decode and self._schedule_draft(req, plan):
                    continue
                while not self.block_manager.allocate_slots(req, n):
                    if self._reclaim_lease():
                        continue
                    kv_blocked = True
                    victim = self._pick_victim(now)
                    self._preempt(victim, now, plan)
                    if victim is req:
                        break
                else:
                    plan.scheduled[req.request_id] = n
                    plan.budget -= n

        # 3. waiting requests (by band, then position; the one chosen blocks the rest, and aging
        #    brings every request to band 0, so nobody is starved).
        admit = not plan.preempted and not (
            self.config.scheduling_policy == "static" and self.running)
        while admit and self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            k = self._next_waiting(now)
            req = self.waiting[k]
            # prompt log-probabilities need the logits of every prompt position: no cache hits
            hit_blocks, num_hit = ([], 0) if req.sampling_params.prompt_logprobs is not None \
                else self.block_manager.get_computed_blocks(req)
            imp = req.kv_import
            if imp is not None and len(hit_blocks) < imp.first_block:
                # blocks this worker held when the KV was pulled were evicted since: the payload
                # does not cover them, so the prompt is computed here after all
                req.kv_import = imp = None
            n = req.num_tokens - num_hit if imp is not None else min(req.num_tokens - num_hit, plan.budget)
            if not self.block_manager.allocate_slots(req, n, hit_blocks):
                if self._reclaim_lease():
                    continue  # look the head up again: its hits may be fewer now
                kv_blocked = True
                break
            self._take_waiting(k)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self.prompt_tokens_total += req.num_prompt_tokens
                self.prefills_total["remote" if imp is not None else "local"] += 1
            self.running.append(req)
            if imp is not None:
                # nothing to compute: the runner writes the payload's blocks after the ones this
                # worker holds; the commit emits the prefill worker's first token
                req.kv_import = None
                skip = len(hit_blocks) - imp.first_block
                first = len(hit_blocks)
                out.kv_imports.append(KvImportChunk(
                    req.request_id, first, tuple(req.block_ids[first:]), imp.blocks[skip:], imp.num_tokens))
                self._import_tokens[req.request_id] = (first * self.block_manager.block_size, imp.first_token_id)
                continue
            plan.scheduled[req.request_id] = n
            plan.budget -= n

        self._kv_blocked = kv_blocked
        # 4. build the chunks (block tables are final now).
        for rid, n in plan.scheduled.items():
            req = self.requests[rid]
            start = req.num_computed_tokens
            draft = tuple(plan.drafts.get(rid, ()))
            known = n - len(draft)  # tokens the request has; the draft's follow them
            sp = req.sampling_params
            history = sp.has_penalties or sp.json_schema is not None
            out.chunks.append(ScheduledChunk(
                request_id=rid,
                token_ids=tuple(req.all_token_ids[start:start + known]) + draft,
                start_pos=start,
                block_table=tuple(req.block_ids),
                sample=start + known == req.num_tokens,
                sampling_params=req.sampling_params,
                num_output_tokens=req.num_output_tokens,
                stop_token_ids=req.stop_token_ids,
                prompt_token_ids=req.prompt_token_ids if history or sp.prompt_logprobs is not None else (),
                output_token_ids=tuple(req.output_token_ids) if history else (),
                draft_token_ids=draft,
            ))
            out.num_batched_tokens += n
        out.preempted_ids = plan.preempted
        if out.chunks:
            self.steps_total += 1
            self.batched_tokens_total += out.num_batched_tokens
        return out

    def _schedule_draft(self, req: Request, plan: _StepPlan) -> bool:
        """Schedule ``req``'s decode with an n-gram draft, if it drafts this step and the budget
        and the pool have room for ``1 + len(draft)`` tokens (a draft never preempts anyone:
        without room the decode runs alone). Returns whether it was scheduled."""
        draft = self._propose(req, plan.budget - 1)
        if not draft or not self.block_manager.allocate_slots(req, 1 + len(draft)):
            return False
        plan.scheduled[req.request_id] = 1 + len(draft)
        plan.drafts[req.request_id] = draft
        plan.budget -= 1 + len(draft)
        return True

    def _propose(self, req: Request, room: int) -> list[int]:
        """The n-gram draft of a decoding request (``engine.speculative``), or [] when it does not
        speculate this step: mode off (engine or request), a request that cannot
        (:attr:`SamplingParams.can_speculate`), more running requests than
        ``speculative_max_running``, an adaptive back-off, or no room."""
        cfg, sp = self.config, req.sampling_params
        mode = cfg.speculative_mode if sp.speculative is None else (
            "off" if not sp.speculative else "adaptive" if cfg.speculative_mode == "adaptive" else "on")
        if mode == "off" or not sp.can_speculate or 0 < cfg.speculative_max_running < len(self.running):
            return []
        if req.spec_skip_steps > 0:
            req.spec_skip_steps -= 1
            return []
        k = min(room, draft_budget(cfg.num_speculative_tokens, req.num_output_tokens, sp.max_tokens,
                                   req.num_tokens, cfg.max_model_len))
        return propose_ngram(req.token_array(), k, cfg.prompt_lookup_max, cfg.prompt_lookup_min)

    def _next_waiting(self, now: float) -> int:
        """The index in ``waiting`` of the request to admit next (:func:`next_waiting`); the head
        without a scan while no waiting request has a rank."""
        if len(self._rank_counts) <= 1:
            return 0
        return next_waiting([(r.slo_rank, now - r.arrival_time) for r in self.waiting],
                            self.config.slo_class_aging_seconds)

    def _take_waiting(self, k: int) -> None:
        req = self.waiting[k]
        if k == 0:
            self.waiting.popleft()
        else:
            del self.waiting[k]
        self._count_rank(req, -1)

    def _count_rank(self, req: Request, delta: int) -> None:
        n = self._rank_counts.get(req.slo_rank, 0) + delta
        if n:
            self._rank_counts[req.slo_rank] = n
        else:
            del self._rank_counts[req.slo_rank]

    def queued_ahead(self, slo_rank: int) -> int:
        """Waiting requests a new request of ``slo_rank`` would queue behind: those of its rank
        or a smaller one (the bands admitted before its own; ``len(waiting)`` with one rank).
        Admission holds this, not the whole queue, to ``max_waiting``."""
        if len(self._rank_counts) <= 1:
            return len(self.waiting) if slo_rank >= max(self._rank_counts, default=0) else 0
        return sum(n for r, n in self._rank_counts.items() if r <= slo_rank)

    def prompt_tokens_ahead(self, slo_rank: int) -> int:
        """Prompt tokens still to be prefilled before a new request of ``slo_rank`` starts its own:
        the uncomputed prompt tokens of the running requests (their remaining prefill chunks) and
        of the waiting requests it would queue behind (:meth:`queued_ahead`'s: its rank or a
        smaller one). A prefill-bound queue drains at the step's token budget, so this over the
        replica's prefill rate (tokens/s) is the time the new prompt waits before its own prefill.
        Admission holds it plus the new prompt to ``max_waiting_tokens``. O(running + waiting)."""
        def left(r: Request) -> int:
            return max(0, r.num_prompt_tokens - r.num_computed_tokens)
        return sum(left(r) for r in self.running) + sum(left(r) for r in self.waiting if r.slo_rank <= slo_rank)

    def _pick_victim(self, now: float) -> Request:
        """The running request preempted when blocks run out: the largest ``priority``, then the
        largest :func:`waiting_band` (a looser class before it has aged), then the newest. Aged
        requests are band 0, so a request of a looser class is not preempted again and again
        once it has waited its aging: the newest goes, as with one class."""
        seq, aging = self._admit_seq, self.config.slo_class_aging_seconds
        return max(self.running, key=lambda r: (r.priority, waiting_band(r.slo_rank, now - r.arrival_time, aging),
                                                seq[r.request_id]))

    def _preempt(self, req: Request, now: float, plan: _StepPlan) -> None:
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.preempted_times.append(now)
        self.running.remove(req)
        self.waiting.appendleft(req)
        self._count_rank(req, 1)
        n = plan.scheduled.pop(req.request_id, 0)
        plan.drafts.pop(req.request_id, None)
        plan.budget += n
        plan.preempted.append(req.request_id)
        self.preemptions_total += 1

    # ---- commit ---------------------------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: RunnerOutput) -> list[RequestOutput]:
        """Commit a step: advance ``num_computed_tokens``, append sampled tokens with their time,
        offer newly full blocks to the prefix cache, and finish requests that hit a stop rule:

        - a token in the request's resolved ``stop_token_ids`` (EOS unless ``ignore_eos``, plus
          the request's own stop ids) -> "stop", only once more than ``min_tokens`` tokens exist
          (the sampler masks them before that);
        - ``max_tokens`` tokens generated -> "length";
        - prompt + output reached ``max_model_len`` -> "length".

        Chunks of requests aborted/finished since ``schedule()`` are skipped. Returns one
        ``RequestOutput`` per request that got a token (finished ones have their blocks freed).
        Raises RuntimeError (before changing anything) if the runner omitted a sampled token.
        """
        imported = self._commit_imports(sched_out)
        live: list[tuple[ScheduledChunk, Request]] = []
        for chunk in sched_out.chunks:
            req = self.requests.get(chunk.request_id)
            if (req is None or req.status is not RequestStatus.RUNNING
                    or req.num_computed_tokens != chunk.start_pos):
                continue  # aborted, finished or preempted since it was scheduled
            if chunk.sample and chunk.request_id not in runner_out.sampled_token_ids:
                raise RuntimeError(f"runner returned no sampled token for request {chunk.request_id!r}")
            if chunk.draft_token_ids:
                self._check_verified(chunk, runner_out)
            live.append((chunk, req))
        now = self.clock()
        outputs: list[RequestOutput] = []
        bm = self.block_manager
        for req, tok in imported:
            emitted, reason = self._emit(req, [tok], now)
            if reason is not None:
                self._finish(req, reason, now)
            outputs.append(RequestOutput(req.request_id, emitted, reason is not None, reason, req))
        for chunk, req in live:
            draft = chunk.draft_token_ids
            if not draft:
                req.num_computed_tokens += chunk.num_tokens
                bm.cache_full_blocks(req)
            if not chunk.sample:
                continue
            if req.request_id in self._pending_forks:
                self._fork(req, now)
            toks = runner_out.spec_token_ids[req.request_id] if draft \
                else [runner_out.sampled_token_ids[req.request_id]]
            emitted, reason = self._emit(req, toks, now)
            if draft:
                self._count_draft(req, len(draft), len(toks) - 1)
                # KV is valid for the fed-back token and the accepted drafts kept; the rejected
                # positions' slots are rewritten by later steps
                req.num_computed_tokens = chunk.start_pos + len(emitted)
                bm.cache_full_blocks(req)
            if reason is not None:
                self._finish(req, reason, now)
            lp = runner_out.logprobs.get(req.request_id)
            outputs.append(RequestOutput(req.request_id, emitted, reason is not None, reason, req,
                                         None if lp is None else [lp]))
        return outputs

    def _commit_imports(self, sched_out: SchedulerOutput) -> list[tuple[Request, int]]:
        """The imported prompts of a step whose KV the runner wrote: their KV is computed now
        (blocks offered to the prefix cache). Returns (request, first token) to emit. An import
        whose request ended or was preempted since is skipped; one whose step never commits
        (the runner raised) is computed here by the next steps, as any prompt."""
        done = []
        bm = self.block_manager
        for imp in sched_out.kv_imports:
            start_tok = self._import_tokens.pop(imp.request_id, None)
            req = self.requests.get(imp.request_id)
            if (start_tok is None or req is None or req.status is not RequestStatus.RUNNING
                    or req.num_computed_tokens != start_tok[0]):
                continue
            req.num_computed_tokens = imp.num_tokens
            bm.cache_full_blocks(req)
            done.append((req, start_tok[1]))
        return done

    # ---- leases (disaggregated prefill) ------------------------------------------------------
    def lease(self, handle: str) -> Lease | None:
        """The open lease ``handle`` (None when unknown, released or expired)."""
        return self.leases.get(handle)

    def release_lease(self, handle: str) -> bool:
        """Free a lease's blocks now (pulled, or its request cancelled). Returns whether it was
        open."""
        lease = self.leases.pop(handle, None)
        if lease is None:
            return False
        self.block_manager.free(lease.request)
        return True

    def expire_leases(self, now: float | None = None) -> int:
        """Free every lease whose ``expires_at`` has passed; returns how many (counted in
        ``kv_lease_expiries_total``). O(open leases)."""
        now = self.clock() if now is None else now
        gone = [h for h, lease in self.leases.items() if lease.expires_at <= now]
        for h in gone:
            self.block_manager.free(self.leases.pop(h).request)
        self.kv_lease_expiries_total += len(gone)
        return len(gone)

    def _reclaim_lease(self) -> bool:
        """KV pressure: free the lease that would expire first (counted as an expiry) rather
        than preempt a running request or keep a waiting one out; whether there was one. Its
        decode worker, if it still pulls, gets a 404 and prefills locally."""
        if not self.leases:
            return False
        h = min(self.leases, key=lambda k: self.leases[k].expires_at)
        self.block_manager.free(self.leases.pop(h).request)
        self.kv_lease_expiries_total += 1
        return True

    @staticmethod
    def _check_verified(chunk: ScheduledChunk, runner_out: RunnerOutput) -> None:
        """Raise RuntimeError unless the runner's tokens for a drafted chunk are a verification of
        its draft: 1 to len(draft) + 1 tokens, all but the last equal to the draft's."""
        rid, draft = chunk.request_id, list(chunk.draft_token_ids)
        toks = runner_out.spec_token_ids.get(rid)
        if (not toks or len(toks) > len(draft) + 1 or toks[:-1] != draft[:len(toks) - 1]
                or toks[0] != runner_out.sampled_token_ids[rid]):
            raise RuntimeError(f"runner returned {toks!r} for request {rid!r}, not a verification of "
                               f"its draft {draft}")

    def _emit(self, req: Request, toks: list[int], now: float) -> tuple[list[int], FinishReason | None]:
        """Append a step's tokens (one, or a speculative step's accepted drafts and bonus token)
        up to the first that finishes the request; returns (tokens appended, finish reason)."""
        emitted: list[int] = []
        reason = None
        for tok in toks:
            req.append_output_token(tok, now)
            emitted.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                break
        self.generation_tokens_total += len(emitted)
        return emitted, reason

    def _count_draft(self, req: Request, proposed: int, accepted: int) -> None:
        """Count a verified draft, and move the request's adaptive back-off."""
        self.spec_decode_drafts_total += 1
        self.spec_decode_draft_tokens_total += proposed
        self.spec_decode_accepted_tokens_total += accepted
        if self.config.speculative_mode == "adaptive":
            req.spec_skip_steps, req.spec_misses = next_skip(accepted, proposed, req.spec_misses)

    def _fork(self, parent: Request, now: float) -> None:
        """Children share the parent's computed prompt blocks and start running."""
        for child in self._pending_forks.pop(parent.request_id):
            self.block_manager.fork(parent, child)
            child.arrival_time = parent.arrival_time
            child.queued_time = parent.queued_time
            child.first_scheduled_time = now
            child.status = RequestStatus.RUNNING
            self.requests[child.request_id] = child
            self._admit_seq[child.request_id] = self._next_seq
            self._next_seq += 1
            self.running.append(child)

    def _stop_reason(self, req: Request, tok: int) -> FinishReason | None:
        sp = req.sampling_params
        n_out = req.num_output_tokens
        if n_out > sp.min_tokens:
            if tok in req.stop_token_ids:
                return FinishReason.STOP
        if n_out >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason, now: float) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self._take_waiting(self.waiting.index(req))
        req.kv_import = None
        self._import_tokens.pop(req.request_id, None)
        if (req.hold_kv and reason is not FinishReason.ABORT and req.block_ids
                and req.num_computed_tokens >= req.num_prompt_tokens):
            # a remote prefill: its prompt's blocks wait for the decode worker's pull
            self.leases[req.request_id] = Lease(req, now + self.config.kv_lease_s)
        else:
            self.block_manager.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = now
        del self.requests[req.request_id]
        del self._admit_seq[req.request_id]
        for child in self._pending_forks.pop(req.request_id, ()):
            # the parent ended before its prompt was computed (abort): so do its children
            child.status, child.finish_reason, child.finished_time = RequestStatus.FINISHED, reason, now
            self.finished_total[reason.value] += 1
            self._finished_ids.append(child.request_id)
        self._finished_ids.append(req.request_id)
        self.finished_total[reason.value] += 1

    def finish_request(self, request_id: str, reason: FinishReason | str) -> Request | None:
        """Finish a request now (e.g. a stop string found by the detokenizer: reason "stop"),
        freeing its blocks at once. Returns the Request, or None if it is unknown/finished."""
        reason = FinishReason(reason)
        req = self.requests.get(request_id)
        if req is None:
            return self._drop_pending_fork(request_id, reason)
        self._finish(req, reason, self.clock())
        return req

    def _drop_pending_fork(self, request_id: str, reason: FinishReason) -> Request | None:
        for parent_id, children in self._pending_forks.items():
            for c in children:
                if c.request_id == request_id:
                    children.remove(c)
                    if not children:
                        del self._pending_forks[parent_id]
                    c.status, c.finish_reason, c.finished_time = RequestStatus.FINISHED, reason, self.clock()
                    self.finished_total[reason.value] += 1
                    return c
        return None

    def restate_finish_reason(self, req: Request, reason: FinishReason | str) -> None:
        """Change the reason of a request that finished this step, keeping the counters true.

        The engine finds stop strings in detokenized text after ``update_from_output``; when the
        token that hit a length limit also completed a stop string, the client is told "stop"
        (as OpenAI does) and ``finished_total`` must say the same.
        """
        reason = FinishReason(reason)
        if req.status is not RequestStatus.FINISHED or req.finish_reason is None:
            raise ValueError(f"request {req.request_id!r} has not finished")
        if req.finish_reason is not reason:
            self.finished_total[req.finish_reason.value] -= 1
            self.finished_total[reason.value] += 1
            req.finish_reason = reason

    def drop_output_tokens(self, req: Request, n: int) -> None:
        """Take back the last ``n`` output tokens of a request that finished this step (a stop
        string ended its text before the last token a speculative step emitted), so its output
        and ``generation_tokens_total`` hold only the tokens the client gets. Raises ValueError
        for a request that has not finished or an ``n`` outside [0, num_output_tokens)."""
        if req.status is not RequestStatus.FINISHED:
            raise ValueError(f"request {req.request_id!r} has not finished")
        if not 0 <= n < req.num_output_tokens:
            raise ValueError(f"cannot drop {n} of {req.num_output_tokens} output tokens")
        if n:
            del req.output_token_ids[-n:], req.all_token_ids[-n:], req.token_times[-n:]
            self.generation_tokens_total -= n

    def abort_request(self, request_id: str) -> Request | None:
        """Abort (client disconnect): finish with reason "abort" and free its blocks at once."""
        return self.finish_request(request_id, FinishReason.ABORT)

    # ---- limits, state, stats ------------------------------------------------------------------
    def set_limits(self, max_num_seqs: int | None = None, max_waiting: int | None = None,
                   max_waiting_tokens: int | None = None) -> dict:
        """Change runtime admission limits (None = unchanged); returns the limits now in force.

        Lowering ``max_num_seqs`` below the running count preempts nothing: it only stops
        admitting until the running set shrinks. Lowering ``max_waiting`` below the queue length
        (or ``max_waiting_tokens`` below the prompt tokens queued; 0 = no token bound) rejects new
        requests until the queue drains. Raises ValueError on a bad value (max_num_seqs >= 1,
        max_waiting >= 0, max_waiting_tokens >= 0).
        """
        for name, value, lo in (("max_num_seqs", max_num_seqs, 1), ("max_waiting", max_waiting, 0),
                                ("max_waiting_tokens", max_waiting_tokens, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
                raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
        if max_num_seqs is not None:
            self.max_num_seqs = max_num_seqs
        if max_waiting is not None:
            self.max_waiting = max_waiting
        if max_waiting_tokens is not None:
            self.max_waiting_tokens = max_waiting_tokens
        return {"max_num_seqs": self.max_num_seqs, "max_waiting": self.max_waiting,
                "max_waiting_tokens": self.max_waiting_tokens}

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def engine_state(self) -> EngineState:
        """Exactly one of, checked in this order:

        - "rejecting": the waiting queue is at ``max_waiting``, or a request was rejected with
          queue_full within the last ``rejecting_window_s`` seconds (load shedding; invalid and
          never_fits rejections are client errors and do not count);
        - "blocked": requests are waiting and the last step could not admit the head of the queue
          (or preempted a running request) because KV blocks ran out;
        - "waiting": requests are waiting, limited by max_num_seqs, the token budget or the static
          policy's cohort, not by KV;
        - "running": nothing is waiting (including idle).
        """
        if len(self.waiting) >= self.max_waiting or (
                self._last_queue_full is not None
                and self.clock() - self._last_queue_full <= self.config.rejecting_window_s):
            return EngineState.REJECTING
        if self.waiting:
            return EngineState.BLOCKED if self._kv_blocked else EngineState.WAITING
        return EngineState.RUNNING

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            engine_state=self.engine_state(),
            num_running=len(self.running),
            num_waiting=len(self.waiting) + self.num_pending_forks,
            num_preempted_waiting=sum(1 for r in self.waiting if r.status is RequestStatus.PREEMPTED),
            kv_usage_ratio=bm.usage,
            num_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            block_size=bm.block_size,
            enable_prefix_caching=bm.enable_prefix_caching,
            max_num_seqs=self.max_num_seqs,
            max_waiting=self.max_waiting,
            max_waiting_tokens=self.max_waiting_tokens,
            num_leases=len(self.leases),
            num_leased_blocks=sum(len(lease.request.block_ids) for lease in self.leases.values()),
            # Counters: the scheduler's attributes of the same names (copies of the dicts).
            **{name: (dict(v) if isinstance(v, dict) else v)
               for name in _COUNTER_FIELDS for v in (getattr(self, name),)},
        )

    @property
    def num_pending_forks(self) -> int:
        """``n > 1`` forks admitted with a parent whose prompt has not run yet (not queued: they
        start running when it has; counted as waiting in :meth:`stats`)."""
        return sum(map(len, self._pending_forks.values()))

    @property
    def prefix_cache_queries_total(self) -> int:
        """Prompt tokens looked up in the prefix cache (kept by the block manager)."""
        return self.block_manager.prefix_cache_queries

    @property
    def prefix_cache_hits_total(self) -> int:
        """Prompt tokens found in the prefix cache (kept by the block manager)."""
        return self.block_manager.prefix_cache_hits

    def check_invariants(self) -> None:
        """Block-manager invariants plus queue consistency (tests; O(pool))."""
        self.block_manager.check_invariants(self.running)
        for h, lease in self.leases.items():
            r = lease.request
            assert r.is_finished and r.block_ids and h not in self.requests, f"lease {h} is not a finished request's"
            assert len(r.block_ids) * self.block_manager.block_size >= r.num_prompt_tokens, f"lease {h} lost blocks"
        assert len(self.running) + len(self.waiting) == len(self.requests)
        ranks: dict[int, int] = {}
        for r in self.waiting:
            ranks[r.slo_rank] = ranks.get(r.slo_rank, 0) + 1
        assert self._rank_counts == ranks, f"rank counts {self._rank_counts} != {ranks}"
        assert self.admitted_total == sum(self.finished_total.values()) + len(self.running) \
            + len(self.waiting) + self.num_pending_forks, "admitted != finished + running + waiting"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING and self.requests[r.request_id] is r
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not r.block_ids and r.num_computed_tokens == 0, f"waiting {r.request_id} holds KV"
