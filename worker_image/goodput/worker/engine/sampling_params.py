"""Per-request sampling parameters (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters of one request (OpenAI semantics).

    temperature: 0 means greedy (argmax). top_p in (0, 1], top_k: 0 or -1 = disabled.
    seed: per-request seed; the sampler derives the generator from (seed, output index) so the
        same request gives the same tokens however it is batched.
    max_tokens: number of tokens to generate (the request finishes with reason "length").
    stop: stop strings (matched on detokenized text; never included in the output).
    stop_token_ids: extra token ids that finish the request with reason "stop".
    ignore_eos: keep generating past the model's EOS token.
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
