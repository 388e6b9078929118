"""Batched token sampling: prepare the batch's per-row tensors once, then ``sample(logits, batch)``.

:meth:`Sampler.prepare` turns one step's rows (anything shaped like ``SamplingRow``; the
runner passes its ``ScheduledChunk`` objects) into a :class:`SamplingBatch` of tensors; it is
the only place with per-row Python loops and the only place that touches the sampler's random
state. :func:`sample` is a pure function of (logits, batch): whole-batch tensor operations.

Order of operations (vLLM v1's order): the ``min_tokens`` mask (the request's resolved stop ids,
EOS included unless ``ignore_eos``) and the grammar mask (tokens the JSON schema does not allow)
set logits to -inf; ``logit_bias`` is added; repetition penalty (logit / r when positive,
* r when negative, for tokens seen in prompt or output; Keskar et al. 2019), then frequency and
presence penalties (``logit -= f * count + p * [count > 0]`` over the output; OpenAI's
definition); temperature scaling; top-k, then top-p (the smallest set of most likely tokens
whose mass reaches top_p; Holtzman et al. 2020). Temperature 0 (and anything below 1e-5, its
limit) is greedy: the argmax of the processed logits.

Random draws use the Gumbel-max trick: token = argmax_i(logit_i / T + g_i) with
g_i = -log(-log u_i), which samples exactly from softmax(logit / T) (Gumbel 1954; Maddison
et al. 2014). ``prepare`` makes the noise: for a seeded request each u_i is a counter-based
hash (splitmix64, Steele et al. 2014) of ``mix_seed(seed, output index)`` and the token id i;
unseeded requests take theirs from the sampler's generator.

What is guaranteed for a seeded request:

- Same logits -> same token, whatever else shares the batch, and after preemption by
  recompute (the noise depends only on seed, output index and token id).
- Different logits: recomputing after preemption, or another batch shape, can change logits
  by float rounding (~1e-5 in float32, ~1e-2 in bfloat16). With Gumbel-max, two distributions
  p, q give different tokens with probability at most 2·TV(p, q) / (1 + TV(p, q)) (Daliri,
  Musco, Suresh 2024, "Coupling without communication"), and a change of at most d in every
  logit gives TV <= exp(2d / T) - 1. So at T = 0.9 and d = 1e-5 a token differs with
  probability below 5e-5 (once per ~20,000 tokens); inverse-CDF sampling (used before) has no
  such bound. Bit-identical tokens across batch shapes would need batch-invariant kernels,
  which this engine does not have.
- Greedy rows do not depend on randomness at all (only on the argmax of their logits).

Log-probabilities (natural log): by default ("processed") those of the distribution the token
was drawn from, after masks, bias, penalties, temperature and top-k/top-p (greedy rows: T = 1,
no truncation); with ``logprobs_mode="raw"``, ``log_softmax`` of the model's logits. Computed
only for rows whose request asked (``SamplingParams.logprobs``). Tokens the distribution
excludes have logprob -inf.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from goodput.worker.engine.outputs import TokenLogprobs
from goodput.worker.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Temperatures below this are the T -> 0 limit, greedy: logits / T would overflow float32 to inf
# (vLLM uses the same threshold).
GREEDY_TEMPERATURE = 1e-5
LOGPROBS_MODES = ("processed", "raw")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, output_index: int) -> int:
    """63-bit noise key for draw number ``output_index`` of a request seeded with ``seed``."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ int(output_index)) >> 1


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _C1, _C2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hash_uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[b, i] in (0, 1), float64 [B, V]: splitmix64(keys[b] + (i + 1) · golden) >> 11, scaled.

    The same (key, i) gives the same u on every device and in every batch (integer arithmetic
    wraps mod 2^64). keys: int64 [B]."""
    i = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device)
    z = keys[:, None] + i[None, :] * _GOLDEN
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    z = z ^ _srl(z, 31)
    return (_srl(z, 11).double() + 0.5) * (2.0 ** -53)


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


class SamplingRow(Protocol):
    """What :meth:`Sampler.prepare` reads of one row (``ScheduledChunk`` has all of it)."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def stop_token_ids(self) -> frozenset[int]: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class Row:
    """A plain :class:`SamplingRow` (tests, offline use)."""

    sampling_params: SamplingParams
    num_output_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()


@dataclass
class SamplingBatch:
    """One step's per-row sampling tensors (B rows, vocabulary V), built by :meth:`Sampler.prepare`.

    temperature: float32 [B] (1.0 on greedy rows); random: bool [B] (rows drawn at random);
    random_rows: int64 [R] their indices; gumbel: float32 [R, V] their Gumbel noise;
    top_k: int64 [B]; top_p: float32 [B]; truncate: whether any random row uses top-k/top-p.
    ban: (rows, token ids) int64 pair set to -inf (min_tokens), or None.
    allowed: bool [B, V] grammar mask (all True on rows without one), or None.
    bias: (rows, token ids, values) added to the logits, or None.
    penalties: (repetition [B], frequency [B], presence [B], output counts float32 [B, V],
        seen-in-prompt-or-output bool [B, V]) or None when no row has a penalty.
    logprob_rows: int64 [R] rows that want log-probabilities; num_logprobs: the largest k.
    logprobs_k: the k of each row in ``logprob_rows`` (Python list).
    """

    num_rows: int
    temperature: torch.Tensor
    random: torch.Tensor
    random_rows: torch.Tensor
    gumbel: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    truncate: bool
    ban: tuple[torch.Tensor, torch.Tensor] | None
    allowed: torch.Tensor | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    logprob_rows: torch.Tensor
    logprobs_k: list[int]
    raw_logprobs: bool = False


@dataclass
class SamplerOutput:
    """token_ids: one per row; logprobs: one per row (None where the row did not ask)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Prepares batches (:meth:`prepare`) and samples them (:meth:`sample`, pure).

    seed: seed of the generator that gives unseeded requests their noise keys.
    device: where the batch tensors live (the logits' device).
    logprobs_mode: "processed" (default; the distribution sampled from) or "raw" (the model's).
    """

    def __init__(self, seed: int | None = None, device: str | torch.device = "cpu",
                 logprobs_mode: str = "processed"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.device = torch.device(device)
        self.logprobs_mode = logprobs_mode
        self._generator = torch.Generator(device="cpu")
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()

    def prepare(self, rows: Sequence[SamplingRow], vocab_size: int,
                allowed: torch.Tensor | None = None) -> SamplingBatch:
        """Build the per-row tensors of one step. ``allowed``: optional bool [B, V] grammar mask.

        Token ids outside ``[0, vocab_size)`` in stop ids or logit_bias are ignored (the server
        refuses them earlier)."""
        B, V, dev = len(rows), vocab_size, self.device
        params = [r.sampling_params for r in rows]
        rand = [p.temperature >= GREEDY_TEMPERATURE and p.top_k != 1 for p in params]
        temp = [p.temperature if r else 1.0 for p, r in zip(params, rand)]
        rand_rows = [i for i, r in enumerate(rand) if r]
        seeded = [j for j, i in enumerate(rand_rows) if params[i].seed is not None]
        unseeded = [j for j, i in enumerate(rand_rows) if params[i].seed is None]
        gumbel = torch.empty(len(rand_rows), V, dtype=torch.float32)
        if unseeded:  # Gumbel = -log(Exp(1))
            gumbel[unseeded] = -torch.empty(len(unseeded), V).exponential_(generator=self._generator).log()
        if seeded:
            keys = torch.tensor([mix_seed(params[rand_rows[j]].seed, rows[rand_rows[j]].num_output_tokens)
                                 for j in seeded], dtype=torch.int64)
            gumbel[seeded] = (-torch.log(-torch.log(hash_uniform(keys, V)))).float()
        trunc = any(r and ((0 < p.top_k < V) or p.top_p < 1.0) for p, r in zip(params, rand))

        ban_r: list[int] = []
        ban_t: list[int] = []
        bias_r: list[int] = []
        bias_t: list[int] = []
        bias_v: list[float] = []
        for i, (p, row) in enumerate(zip(params, rows)):
            if row.num_output_tokens < p.min_tokens:
                ids = [t for t in row.stop_token_ids if 0 <= t < V]
                ban_r += [i] * len(ids)
                ban_t += ids
            for t, b in p.logit_bias:
                if 0 <= t < V:
                    bias_r.append(i)
                    bias_t.append(t)
                    bias_v.append(b)

        penalties = None
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        if pen_rows:
            counts = torch.zeros(B, V, dtype=torch.float32)
            seen = torch.zeros(B, V, dtype=torch.bool)
            for i in pen_rows:
                out = torch.tensor([t for t in rows[i].output_token_ids if 0 <= t < V], dtype=torch.int64)
                counts[i].index_add_(0, out, torch.ones(len(out)))
                seen[i, out] = True
                if params[i].repetition_penalty != 1.0:
                    prompt = torch.tensor([t for t in rows[i].prompt_token_ids if 0 <= t < V], dtype=torch.int64)
                    seen[i, prompt] = True
            penalties = tuple(t.to(dev) for t in (
                torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
                torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
                torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
                counts, seen))

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        i64 = torch.int64

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=dev)

        return SamplingBatch(
            num_rows=B, temperature=t(temp, torch.float32), random=t(rand, torch.bool),
            random_rows=t(rand_rows, i64), gumbel=gumbel.to(dev), top_k=t([p.top_k for p in params], i64),
            top_p=t([p.top_p for p in params], torch.float32), truncate=trunc,
            ban=(t(ban_r, i64), t(ban_t, i64)) if ban_r else None,
            allowed=None if allowed is None else allowed.to(dev),
            bias=(t(bias_r, i64), t(bias_t, i64), t(bias_v, torch.float32)) if bias_r else None,
            penalties=penalties, logprob_rows=t(lp_rows, i64),
            logprobs_k=[params[i].logprobs for i in lp_rows],
            raw_logprobs=self.logprobs_mode == "raw")

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row: see :func:`sample`."""
        return sample(logits, batch)

    @staticmethod
    def all_plain_greedy(rows: Sequence[SamplingRow], vocab_size: int) -> bool:
        """True when every row is greedy with nothing that changes its logits or output: no
        log-probabilities, logit_bias, penalties, or min_tokens ban in force (a grammar is the
        caller's to check). Then :func:`greedy_tokens` gives exactly what :func:`sample` would."""
        for r in rows:
            p = r.sampling_params
            if ((p.temperature >= GREEDY_TEMPERATURE and p.top_k != 1) or p.logprobs is not None
                    or p.logit_bias or p.has_penalties
                    or (r.num_output_tokens < p.min_tokens
                        and any(0 <= t < vocab_size for t in r.stop_token_ids))):
                return False
        return True


@torch.inference_mode()
def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of float logits [B, V] (the first index among equal maxima, as
    ``argmax``), without the general path's copies; ``max`` is the faster CPU reduction."""
    return logits.max(dim=-1).indices.tolist()


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Masks, logit_bias and penalties applied to float32 logits [B, V] (a new tensor)."""
    x = logits.float().clone()
    if batch.ban is not None:
        x[batch.ban] = float("-inf")
    if batch.allowed is not None:
        x = x.masked_fill(~batch.allowed, float("-inf"))
    if batch.bias is not None:
        rows, toks, vals = batch.bias
        x.index_put_((rows, toks), vals, accumulate=True)
    if batch.penalties is not None:
        rep, freq, pres, counts, seen = batch.penalties
        r = rep[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - freq[:, None] * counts - pres[:, None] * (counts > 0).float()
    return x


@torch.inference_mode()
def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pure: the same (logits, batch) always gives the same output.

    logits: float [B, V] (B == batch.num_rows, else ValueError). Returns a token id per row and,
    for rows that asked, :class:`TokenLogprobs` (sampled token + the k most likely)."""
    B, V = logits.shape
    if B != batch.num_rows:
        raise ValueError(f"{B} logit rows but a batch of {batch.num_rows}")
    if B == 0:
        return SamplerOutput([], [])
    x = process_logits(logits, batch)
    scaled = x / batch.temperature[:, None]
    if batch.truncate:
        # top-k/top-p only on random rows (greedy rows keep their argmax)
        sorted_masked, order = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
        truncated = torch.empty_like(scaled).scatter_(1, order, sorted_masked)
        scaled = torch.where(batch.random[:, None], truncated, scaled)
    tokens = scaled.argmax(dim=-1)
    if len(batch.random_rows):
        idx = batch.random_rows
        tokens[idx] = (scaled.index_select(0, idx) + batch.gumbel).argmax(dim=-1)

    token_list = tokens.tolist()
    out: list[TokenLogprobs | None] = [None] * B
    if len(batch.logprobs_k):
        rows = batch.logprob_rows
        dist = logits.float().index_select(0, rows) if batch.raw_logprobs else scaled.index_select(0, rows)
        lp = torch.log_softmax(dist, dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, rows)[:, None]).squeeze(1).tolist()
        kmax = max(batch.logprobs_k)
        top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, (r, k) in enumerate(zip(rows.tolist(), batch.logprobs_k)):
            out[r] = TokenLogprobs(token_list[r], chosen[j], tuple(zip(top_i[j][:k], top_v[j][:k])))
    return SamplerOutput(token_list, out)


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Raw log-probabilities of ``next_token_ids`` (row r predicts ``next_token_ids[r]``).

    logits: float [N, V] with N >= len(next_token_ids); k: top entries per position (0-20)."""
    n = len(next_token_ids)
    if n == 0:
        return []
    lp = torch.log_softmax(logits[:n].float(), dim=-1)
    ids = torch.tensor(list(next_token_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()
    if k:
        tv, ti = lp.topk(k, dim=-1)
        tops = [tuple(zip(a, b)) for a, b in zip(ti.tolist(), tv.tolist())]
    else:
        tops = [()] * n
    return [TokenLogprobs(t, c, top) for t, c, top in zip(next_token_ids, chosen, tops)]
