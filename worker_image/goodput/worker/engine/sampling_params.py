"""Per-request sampling parameters (torch-free)."""
from __future__ import annotations

import math
from dataclasses import dataclass

# OpenAI's limit on top log-probabilities per position (completions ``logprobs``, chat
# ``top_logprobs``); vLLM's default ``--max-logprobs`` is the same.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters of one request (OpenAI semantics, vLLM's extensions).

    temperature: 0 means greedy (argmax). top_p in (0, 1], top_k: 0 or -1 = disabled.
    seed: per-request seed; the sampler derives each draw's noise from (seed, output index) so
        the same logits give the same token however the request is batched or preempted.
    max_tokens: number of tokens to generate (the request finishes with reason "length").
    stop: stop strings (matched on detokenized text; never included in the output).
    stop_token_ids: extra token ids that finish the request with reason "stop".
    ignore_eos: keep generating past the model's EOS token.
    min_tokens: EOS, stop token ids and stop strings cannot end the request before this many
        output tokens exist.
    presence_penalty, frequency_penalty: in [-2, 2]; subtract ``presence * [count > 0] +
        frequency * count`` from a token's logit, count = occurrences in the output so far
        (OpenAI's definition).
    repetition_penalty: > 0, 1 = off; a token seen in the prompt or the output has its logit
        divided by it when positive, multiplied when negative (CTRL, Keskar et al. 2019; vLLM).
    logit_bias: (token id, bias) pairs added to the logits (OpenAI: bias in [-100, 100]).
    logprobs: None = no log-probabilities; k in [0, 20] = the sampled token's log-probability
        plus the k most likely tokens at each generated position.
    prompt_logprobs: None, or k in [0, 20]: the same for every prompt position after the first
        (completions' ``echo`` with ``logprobs``). Such a request bypasses the prefix cache.
    json_schema: None, or a JSON schema (as JSON text) the output must follow; the sampler masks
        every token the grammar does not allow (``'{"type": "object"}'`` for any JSON object).
    speculative: None = the engine's ``speculative_mode``; False = never draft; True = draft
        (with the engine's back-off when its mode is "adaptive"). Requests with penalties, a
        grammar or log-probabilities never draft (:attr:`can_speculate`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: str | None = None
    speculative: bool | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias:
            if tok < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {tok}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def can_speculate(self) -> bool:
        """Nothing that depends on the tokens before a position inside the step (penalties count
        the output, a grammar follows it) and no log-probabilities: each drafted position is then
        sampled as plain decoding would sample it (``model.runner.ModelRunner._verify_drafts``)."""
        return (not self.has_penalties and self.json_schema is None and self.logprobs is None
                and self.prompt_logprobs is None)

    @property
    def has_penalties(self) -> bool:
        """The sampler needs the request's token history (penalties look at it)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
