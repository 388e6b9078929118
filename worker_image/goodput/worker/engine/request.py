"""One inference request as the engine sees it: tokens, progress, KV blocks and timestamps.

Latency definitions (the one place they are computed; all times from one monotonic clock, seconds):

- TTFT  = first_token_time - arrival_time
- ITL   = the gaps between consecutive output-token times (n_out - 1 values)
- E2E   = finished_time - arrival_time
- TPOT  = (E2E - TTFT) / (n_out - 1), undefined (None) for n_out <= 1
- queue time = first_scheduled_time - arrival_time
- prefill time = first_token_time - first_scheduled_time
- decode time = finished_time - first_token_time
- inference time = finished_time - first_scheduled_time (prefill + decode)
"""
from __future__ import annotations

import enum
import operator
from array import array
from dataclasses import dataclass, field
from typing import Sequence

from goodput.worker.engine.outputs import KvImport
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.api.states import FinishReason

__all__ = ["FinishReason", "Request", "RequestStatus"]


class RequestStatus(str, enum.Enum):
    """Life cycle: WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"

    def __str__(self) -> str:  # "running", not "RequestStatus.RUNNING" (labels, JSON, logs)
        return self.value


@dataclass(eq=False)
class Request:
    """A request's tokens, progress through the KV cache, block table and timestamps.

    request_id: unique among the engine's unfinished requests.
    prompt_token_ids: the prompt (stored as a tuple of ints; must be non-empty to be admitted).
    arrival_time: monotonic time the request reached the server (seconds); ``None`` = set by
        ``Scheduler.add_request`` from the scheduler's clock.
    priority: smaller value = more important (vLLM's convention); preemption picks the victim
        with the largest value, then the largest band (``slo_rank`` until it has aged), then the
        newest.
    slo_rank: the queue band of the request's SLO class (``goodput.api.policy.slo_ranks``: 0 =
        the tightest TTFT the worker serves, the default for every request); the scheduler admits
        waiting requests by band (:func:`~goodput.worker.engine.scheduler.waiting_band`).
    cache_salt: optional per-tenant salt; prefix-cache blocks are shared only between requests
        with the same salt (and the same model identity).
    hold_kv: a remote prefill: when it finishes (not aborted) its blocks stay allocated under a
        lease (``Scheduler.leases``) until pulled, deleted or expired.
    kv_import: a :class:`KvImport` (the prompt's KV from a prefill worker): admission writes it
        into the request's blocks instead of computing the prompt.

    State kept by the scheduler and block manager (do not set by hand):
    output_token_ids: generated tokens (EOS included when it was sampled).
    num_computed_tokens: leading tokens of ``all_token_ids`` whose KV is in the cache.
    block_ids: the block table; position p lives in ``block_ids[p // block_size]``.
    block_hashes: prefix-cache hashes of the request's full blocks (a chain, grows lazily).
    num_cached_blocks: how many of the request's full blocks were offered to the prefix cache.
    spec_skip_steps, spec_misses: speculative decoding's back-off state (``engine.speculative``).
    stop_token_ids: the one resolved set of ids that finish the request with reason "stop"
        (``sampling_params.stop_token_ids`` plus the engine's EOS ids unless ``ignore_eos``), set
        by ``Scheduler.add_request``; the scheduler's stop rule, the engine's text cut and the
        sampler's ``min_tokens`` mask all read this set.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float | None = None
    priority: int = 0
    slo_rank: int = 0
    cache_salt: str | None = None
    # Disaggregated prefill (docs/disaggregation.md): hold_kv = keep the prompt's blocks under a
    # lease when the request finishes (a remote prefill); kv_import = the prompt's KV computed
    # elsewhere, written into this worker's blocks at admission (cleared once used or dropped).
    hold_kv: bool = False
    kv_import: "KvImport | None" = field(default=None, repr=False)

    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(default_factory=list, init=False, repr=False)
    num_computed_tokens: int = field(default=0, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    block_ids: list[int] = field(default_factory=list, init=False, repr=False)
    block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)
    num_cached_blocks: int = field(default=0, init=False, repr=False)
    stop_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)
    # Speculative decoding's adaptive back-off (``speculative.next_skip``): decode steps left to
    # run without a draft, and verify steps in a row that accepted nothing.
    spec_skip_steps: int = field(default=0, init=False, repr=False)
    spec_misses: int = field(default=0, init=False, repr=False)
    _token_array: array = field(default_factory=lambda: array("i"), init=False, repr=False)

    # Timestamps (monotonic seconds).
    queued_time: float | None = field(default=None, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    token_times: list[float] = field(default_factory=list, init=False, repr=False)
    preempted_times: list[float] = field(default_factory=list, init=False, repr=False)
    finished_time: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.sampling_params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams, "
                            f"got {type(self.sampling_params).__name__}")
        if isinstance(self.prompt_token_ids, (str, bytes)):
            raise TypeError("prompt_token_ids must be a sequence of token ids, not text")
        # operator.index refuses floats and other non-integers instead of truncating them.
        self.prompt_token_ids = tuple(operator.index(t) for t in self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(f"cache_salt must be a string or None, got {self.cache_salt!r}")
        self.priority = operator.index(self.priority)
        self.slo_rank = operator.index(self.slo_rank)
        if self.slo_rank < 0:
            raise ValueError(f"slo_rank must be >= 0, got {self.slo_rank}")

    def token_array(self) -> array:
        """``all_token_ids`` as a packed int32 array for prompt lookup, brought up to date here:
        the list only grows at its end or is cut back at it (``Scheduler.drop_output_tokens``),
        so this appends or truncates the difference instead of packing the whole text."""
        arr, n = self._token_array, len(self.all_token_ids)
        if len(arr) > n:
            del arr[n:]
        elif len(arr) < n:
            arr.extend(self.all_token_ids[len(arr):])
        return arr

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens (the last one has no KV yet while the request runs)."""
        return len(self.all_token_ids)

    @property
    def max_num_kv_tokens(self) -> int:
        """Most KV entries this request can ever need: prompt + max_tokens - 1 (the last sampled
        token finishes the request and is never fed back)."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted_times)

    def append_output_token(self, token_id: int, now: float) -> None:
        """Record one sampled token and its time (first token time on the first one)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    # ---- derived latencies (seconds; None while undefined) -----------------------------------
    @property
    def ttft(self) -> float | None:
        """Time to first token: first_token_time - arrival_time."""
        if self.first_token_time is None or self.arrival_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output-token times (n_out - 1)."""
        t = self.token_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: finished_time - arrival_time (None until finished)."""
        if self.finished_time is None or self.arrival_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (n_out - 1); None if n_out <= 1
        or the request has not finished."""
        n_out = len(self.token_times)
        e2e, ttft = self.e2e, self.ttft
        if n_out <= 1 or e2e is None or ttft is None:
            return None
        return (e2e - ttft) / (n_out - 1)

    @property
    def queue_time(self) -> float | None:
        """Queueing delay: first_scheduled_time - arrival_time."""
        if self.first_scheduled_time is None or self.arrival_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to first token: first_token_time - first_scheduled_time."""
        return _gap(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        """First token to finish: finished_time - first_token_time (None until finished)."""
        return _gap(self.first_token_time, self.finished_time)

    @property
    def inference_time(self) -> float | None:
        """First scheduled to finish: finished_time - first_scheduled_time (prefill + decode)."""
        return _gap(self.first_scheduled_time, self.finished_time)


def _gap(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
