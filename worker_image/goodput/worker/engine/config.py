"""Engine configuration (torch-free): KV pool shape, batching limits, admission limits.

The knobs follow the usual names of continuous-batching servers (vLLM's ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--max-model-len``, ``--block-size``) so operators can carry their
intuition over. Every field is validated at construction; a bad value raises ``ValueError`` naming
the field and the value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULING_POLICIES = ("continuous", "static")


@dataclass(frozen=True)
class EngineConfig:
    """Static configuration of one engine (scheduler + block manager).

    num_blocks: KV blocks in the pool (capacity in tokens = num_blocks * block_size). The model
        side derives it from a memory budget (m = 2·L·n_kv·d_head·bytes·T).
    max_model_len: longest sequence (prompt + generated tokens) a request may reach, in tokens.
    block_size: tokens per KV block (PagedAttention, Kwon et al. SOSP 2023; default 16).
    max_num_seqs: most requests in the running set (iteration-level batching, Orca OSDI 2022).
        It is also the initial runtime admission limit (``Scheduler.set_limits`` changes that).
    max_num_batched_tokens: token budget of one step: decodes (1 token each) plus prefill chunks
        (chunked prefill, Sarathi-Serve OSDI 2024).
    max_waiting: most requests in the waiting queue (preempted ones included) before new ones are
        rejected with ``queue_full``; 0 rejects every new request (drain).
    enable_prefix_caching: reuse full KV blocks whose tokens and identity match (hash chain).
    scheduling_policy: "continuous" (admit whenever a slot and blocks are free) or "static"
        (admit a new cohort only when the whole running batch has finished; a baseline for
        benchmarks).
    eos_token_ids: token ids that finish a request with reason "stop" (unless ``ignore_eos``).
    model_name, revision: the cache identity; blocks are only shared between requests whose
        identity (plus per-request ``cache_salt``) is equal, so a new model revision never reads
        an old revision's KV.
    vocab_size: when set, prompts with token ids outside ``[0, vocab_size)`` are rejected as
        ``invalid`` at admission (they would crash the embedding lookup).
    queue_full_retry_after_s: the ``retry_after`` (seconds) suggested with a ``queue_full``
        rejection (HTTP Retry-After).
    rejecting_window_s: how long after a ``queue_full`` rejection the engine reports the state
        "rejecting" (seconds).
    """

    num_blocks: int
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    enable_prefix_caching: bool = True
    scheduling_policy: str = "continuous"
    eos_token_ids: tuple[int, ...] = ()
    model_name: str = ""
    revision: str = ""
    vocab_size: int | None = None
    queue_full_retry_after_s: float = 1.0
    rejecting_window_s: float = 5.0

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("num_blocks", "max_model_len", "block_size", "max_num_seqs",
                     "max_num_batched_tokens"):
            positive(name)
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) \
                or self.max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if isinstance(self.eos_token_ids, int):
            object.__setattr__(self, "eos_token_ids", (self.eos_token_ids,))
        eos = tuple(self.eos_token_ids)
        for t in eos:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"eos_token_ids must be non-negative integers, got {eos!r}")
        object.__setattr__(self, "eos_token_ids", eos)
        if self.vocab_size is not None:
            positive("vocab_size")
        for name in ("queue_full_retry_after_s", "rejecting_window_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")

    @property
    def cache_identity(self) -> str:
        """Identity mixed into every prefix-cache block hash: ``"<model_name>@<revision>"``."""
        return f"{self.model_name}@{self.revision}"

    @property
    def kv_capacity_tokens(self) -> int:
        """KV capacity of the pool in tokens (num_blocks * block_size)."""
        return self.num_blocks * self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` KV entries: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)
