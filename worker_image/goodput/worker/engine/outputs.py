"""Data passed between the scheduler (torch-free) and the model runner (torch).

This module is the contract between ``goodput.worker.engine`` and ``goodput.worker.model``:
the scheduler produces a :class:`SchedulerOutput` per step, the runner executes it and returns a
:class:`RunnerOutput`, and the scheduler commits that output (tokens and timestamps).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from goodput.worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from goodput.worker.engine.request import FinishReason, Request


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (natural log) at one position.

    token_id, logprob: the token at this position (sampled, or the prompt's) and its
        log-probability; ``-inf`` when the distribution gave it probability 0.
    top: the ``k`` most likely tokens as (token id, logprob), most likely first (empty for k=0).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's slice of a step: a prefill chunk or a single decode token.

    token_ids: the tokens whose KV is computed this step (len >= 1). For a decode this is the
        one most recently sampled token; for a prefill chunk, prompt (or, after preemption by
        recompute, prompt + output) tokens ``[start_pos, start_pos + len)``.
    start_pos: absolute position of ``token_ids[0]`` == the request's ``num_computed_tokens``
        before the step (tokens already in the paged KV cache, prefix-cache hits included).
    block_table: physical block ids covering every position in ``[0, start_pos + len)``;
        position p lives in block ``block_table[p // block_size]`` at offset ``p % block_size``.
        Every block is reserved before the step runs (nothing runs without its next state).
    sample: True when this chunk reaches the end of the request's known tokens, so the runner
        samples one new token from the last position's logits. False for a non-final
        prefill chunk.
    sampling_params: the request's sampling parameters.
    num_output_tokens: output tokens already generated (seeded sampling uses
        (seed, num_output_tokens) so results do not depend on batching or preemption).
    stop_token_ids: the request's resolved stop ids (``Request.stop_token_ids``); the sampler
        masks them while ``num_output_tokens < min_tokens``.
    prompt_token_ids, output_token_ids: the request's history, filled only when the sampler or
        the runner needs it (penalties, a grammar, prompt log-probabilities), else empty.
    draft_token_ids: a speculative decode's n-gram draft (``engine.speculative``): the last
        ``len(draft_token_ids)`` entries of ``token_ids``, after the last sampled token. The runner
        verifies them with the logits of every position of the chunk.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step (cached + new tokens)."""
        return self.start_pos + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One token fed back after it was sampled (the request's last output token), with its
        draft tokens when the step speculates."""
        return (self.sample and self.num_output_tokens > 0
                and len(self.token_ids) == 1 + len(self.draft_token_ids))


@dataclass(frozen=True)
class KvImport:
    """A prompt's KV computed by another worker (disaggregated prefill), staged in host memory
    until the scheduler admits its request (``docs/disaggregation.md``).

    num_tokens: the prompt's length; its KV fills positions ``[0, num_tokens)``.
    first_block: the first prompt block the payload covers (the blocks before it were in this
        worker's prefix cache when the KV was pulled).
    blocks: one payload per block from ``first_block`` on, each the block's raw K/V bytes in
        ``goodput.api.disagg.KV_LAYOUT`` order (opaque here: the runner writes them).
    first_token_id: the token the prefill worker sampled after the prompt (output token 0).
    """

    num_tokens: int
    first_block: int
    blocks: tuple[bytes, ...]
    first_token_id: int


@dataclass(frozen=True)
class KvImportChunk:
    """One imported prompt's blocks to write this step (``SchedulerOutput.kv_imports``).

    block_ids: physical blocks of prompt blocks ``first_block ..`` (one per payload).
    payloads: the :class:`KvImport` payloads for those blocks. num_tokens: the prompt's length
        (the last block holds ``num_tokens - block * block_size`` tokens when that is fewer).
    """

    request_id: str
    first_block: int
    block_ids: tuple[int, ...]
    payloads: tuple[bytes, ...]
    num_tokens: int


@dataclass
class SchedulerOutput:
    """Everything one engine step runs. ``chunks`` holds decodes first, then prefill chunks.

    num_batched_tokens: sum of chunk lengths (<= max_num_batched_tokens).
    preempted_ids: requests preempted (by recompute) while scheduling this step.
    finished_ids: requests retired at the start of this step (their blocks were freed).
    kv_imports: prompts whose KV another worker computed: the runner writes their bytes into
        the listed blocks before the step's forward pass; nothing is computed for them.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    kv_imports: list[KvImportChunk] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the step's prefill chunks (prompt, or prompt + output after a preemption by
        recompute); the rest of ``num_batched_tokens`` are decode inputs."""
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)


@dataclass
class RunnerOutput:
    """What the model runner returns: one sampled token per chunk with ``sample=True``.

    sampled_token_ids: request_id -> new token id.
    logprobs: request_id -> the sampled token's :class:`TokenLogprobs`, only for requests with
        ``sampling_params.logprobs`` set.
    prompt_logprobs: request_id -> (first prompt position, entries): entry i is the
        log-probability of prompt token ``first + i`` given the tokens before it, only for
        requests with ``sampling_params.prompt_logprobs`` set (one run per prefill chunk).
    spec_token_ids: request_id -> every token a chunk with draft tokens emits: its accepted drafts
        then the target's next token (1 to ``len(draft) + 1`` tokens, ``accept_greedy``);
        ``sampled_token_ids`` holds the first of them.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """One request's result of a committed step (``Scheduler.update_from_output``).

    new_token_ids: tokens emitted this step: one, or several after a speculative step (a
        non-final prefill chunk produces no RequestOutput at all).
    finished: the request finished this step (EOS / stop token -> "stop"; max_tokens or
        max_model_len -> "length"); its KV blocks are already freed.
    finish_reason: a ``FinishReason`` (a ``str`` enum: "stop", "length", "abort") or None.
    request: the engine's Request (token lists and timestamps: TTFT, ITL, TPOT, E2E).
    logprobs: the runner's log-probabilities for each new token, when the request asked.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: "FinishReason | None"
    request: "Request"
    logprobs: list[TokenLogprobs] | None = None
