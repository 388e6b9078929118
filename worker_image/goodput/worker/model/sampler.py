"""Batched token sampling: greedy, temperature, top-k, top-p (nucleus), per-request seeds.

Temperature 0 (and any temperature below 1e-5, its limit) is greedy: the argmax.
Order of operations (as in Hugging Face's and vLLM's samplers): min_tokens masking of EOS and
stop token ids, temperature scaling, top-k (keep the k highest logits), top-p (keep the smallest
set of highest-probability tokens whose total probability is >= top_p; Holtzman et al. 2020,
"The Curious Case of Neural Text Degeneration"), then one draw by inverse CDF.

Reproducibility: a request with a seed draws its uniform number from a generator seeded with
``mix(seed, output_index)`` (splitmix64 of both), so its tokens depend only on its own logits,
seed and how many tokens it has produced — not on which other requests share the batch, and
not on preemption by recompute. Requests without a seed use the sampler's own generator.

Log-probabilities are those of the sampled token under the model's raw distribution
(``log_softmax`` of the unmodified logits), in nats.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from goodput.worker.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Temperatures below this are the T -> 0 limit, greedy: logits / T would overflow float32 to inf
# (vLLM uses the same threshold).
GREEDY_TEMPERATURE = 1e-5


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, output_index: int) -> int:
    """63-bit generator seed for draw number ``output_index`` of a request seeded with ``seed``."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ int(output_index)) >> 1


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask logits outside top-k / top-p, in descending-sorted order.

    logits: float32 [B, V] (temperature already applied); top_k: int64 [B] (<= 0 = off);
    top_p: float32 [B] in (0, 1]. Returns (sorted logits with removed entries = -inf,
    the sorted-to-vocab index [B, V]). The highest logit is always kept.
    """
    # stable: equal logits (common in bf16) keep vocabulary order, whatever the batch
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    V = logits.shape[-1]
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # drop a token when the tokens ranked above it already hold top_p of the mass
    drop = (mass_before >= top_p[:, None]) & (rank > 0)
    return sorted_logits.masked_fill(drop, float("-inf")), order


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i of each row with cdf[i-1] <= u · total < cdf[i] under softmax(logits); never an
    index whose logit is -inf. logits: float32 [B, V]; u: float32 [B] in [0, 1)."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp(max=logits.shape[-1] - 1)
    # float rounding can land the target on a zero-probability tail: step back to a kept token
    bad = ~torch.isfinite(logits.gather(1, pick[:, None]).squeeze(1))
    if bool(bad.any()):
        last_kept = (torch.isfinite(logits) * torch.arange(1, logits.shape[-1] + 1, device=logits.device)).argmax(-1)
        pick = torch.where(bad, last_kept, pick)
    return pick


class Sampler:
    """Samples one token per row of a logits matrix, each row with its own SamplingParams.

    eos_token_id: the model's EOS, masked while a request has fewer than ``min_tokens`` outputs
    (together with its ``stop_token_ids``), unless ``ignore_eos``.
    seed: seed of the generator used by requests without their own seed.
    """

    def __init__(self, eos_token_id: int | None = None, seed: int | None = None,
                 device: str | torch.device = "cpu"):
        self.eos_token_id = eos_token_id
        self.device = torch.device(device)
        self._generator = torch.Generator(device="cpu")
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()

    def _min_tokens_ban(self, p: SamplingParams, num_output: int) -> list[int]:
        if p.min_tokens <= num_output:
            return []
        ban = list(p.stop_token_ids)
        if self.eos_token_id is not None and not p.ignore_eos:
            ban.append(self.eos_token_id)
        return ban

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               num_output_tokens: Sequence[int]) -> tuple[list[int], list[float]]:
        """Sample one token per row.

        logits: float [B, V]; params, num_output_tokens: length B (the latter = tokens the
        request has already produced; it indexes the seeded draw). Returns (token ids, logprobs)
        as Python lists of length B. ValueError when the lengths disagree.
        """
        B, V = logits.shape
        if len(params) != B or len(num_output_tokens) != B:
            raise ValueError(f"{B} logit rows but {len(params)} params / {len(num_output_tokens)} counts")
        if B == 0:
            return [], []
        logits = raw = logits.float()
        log_z = torch.logsumexp(logits, dim=-1)  # raw-distribution normaliser, before any masking

        bans = [(i, self._min_tokens_ban(p, n)) for i, (p, n) in enumerate(zip(params, num_output_tokens))]
        bans = [(i, b) for i, b in bans if b]
        if bans:
            logits = logits.clone()
            for i, b in bans:
                logits[i, [t for t in b if 0 <= t < V]] = float("-inf")

        tokens = logits.argmax(dim=-1)
        rand_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE and p.top_k != 1]
        if rand_rows:
            idx = torch.tensor(rand_rows, dtype=torch.long, device=logits.device)
            temp = torch.tensor([params[i].temperature for i in rand_rows], dtype=torch.float32,
                                device=logits.device)
            top_k = torch.tensor([params[i].top_k for i in rand_rows], dtype=torch.long, device=logits.device)
            top_p = torch.tensor([params[i].top_p for i in rand_rows], dtype=torch.float32,
                                 device=logits.device)
            scaled = logits.index_select(0, idx) / temp[:, None]
            u = torch.empty(len(rand_rows), dtype=torch.float32)
            for j, i in enumerate(rand_rows):
                seed = params[i].seed
                gen = self._generator if seed is None else \
                    torch.Generator(device="cpu").manual_seed(mix_seed(seed, num_output_tokens[i]))
                u[j] = torch.rand((), generator=gen)
            u = u.to(logits.device)
            # rows without top-k/top-p draw in vocabulary order (no O(V log V) sort)
            trunc = [(0 < params[i].top_k < V) or params[i].top_p < 1.0 for i in rand_rows]
            for want_trunc in (False, True):
                sel = [j for j, t in enumerate(trunc) if t == want_trunc]
                if not sel:
                    continue
                js = torch.tensor(sel, dtype=torch.long, device=logits.device)
                rows = scaled.index_select(0, js)
                if want_trunc:
                    rows, order = apply_top_k_top_p(rows, top_k.index_select(0, js), top_p.index_select(0, js))
                pick = _inverse_cdf(rows, u.index_select(0, js))
                if want_trunc:
                    pick = order.gather(1, pick[:, None]).squeeze(1)
                tokens[idx.index_select(0, js)] = pick

        lp = raw.gather(1, tokens[:, None]).squeeze(1) - log_z
        return tokens.tolist(), lp.tolist()
