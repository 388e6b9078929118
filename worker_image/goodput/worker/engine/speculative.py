"""n-gram (prompt-lookup) speculative decoding: propose, verify, back off (torch-free, pure).

Speculative decoding (Leviathan et al., ICML 2023; Chen et al., 2023) lets one forward pass check
several future tokens at once. The draft here needs no draft model: prompt lookup (Saxena, 2023;
vLLM's ``ngram`` method, llama.cpp's lookup decoding) looks for the last ``n`` tokens of the
request's own text (prompt + output) earlier in that text and proposes the tokens that followed
them there. Where the output copies its input (summaries, edits of a given text, code edits) the
proposals are often right, and one step emits several tokens.

One speculative step of a decoding request feeds ``[last sampled token] + draft`` (``1 + k``
positions) through the model; the logits at position ``i`` give the target's token ``t_i``. The
first ``a`` draft tokens with ``draft[i] == t_i`` are accepted and ``t_a`` follows them (the
"bonus" token), so a step emits ``a + 1`` tokens, exactly the tokens decoding one step at a time
would have produced from the same logits. The KV written for rejected positions is simply overwritten later
(the request's ``num_computed_tokens`` stops before them).

Requests with penalties, a grammar or log-probabilities do not speculate. For the others the
runner samples every position as plain decoding samples that output index (greedy: the argmax;
random: the request's own noise for that index) and ``accept_greedy`` compares: with a one-token
(deterministic) draft that is Leviathan et al.'s rule — a draft token is kept with probability
p(token), a rejected one replaced by a draw from p without it — so sampled output has the same
distribution, and a seeded request gets the tokens plain decoding draws from the same logits.

Adaptive mode (:func:`next_skip`): after a step whose draft was rejected at its first token a
request skips proposing for ``2**misses - 1`` steps (capped), so a request whose text does not
repeat itself soon costs nothing, and one that starts copying later is found again.
"""
from __future__ import annotations

from array import array
from typing import Sequence

# Adaptive back-off: at most this many steps skipped after consecutive misses.
MAX_SKIP_STEPS = 32


def propose_ngram(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Draft up to ``k`` tokens by prompt lookup.

    tokens: the request's text so far (prompt + output token ids), last token included; an
        ``array("i")`` (``Request.token_array``) saves packing it again at every step.
    k: most tokens to propose (>= 0). n_max >= n_min >= 1: n-gram sizes tried, longest first.

    For n from ``n_max`` down to ``n_min``: find the most recent earlier occurrence of the last
    ``n`` tokens (an occurrence ending before the last token) and return the up to ``k`` tokens
    that followed it. Returns [] when no n-gram recurs. Cost: one C-level search per n over the
    packed text (``bytes.rfind``), O(len(tokens)) (8k tokens: ~150 us packing a list, ~3 us from
    an array).
    """
    if k <= 0 or n_min < 1 or n_max < n_min:
        return []
    L = len(tokens)
    if L < n_min + 1:
        return []
    packed = (tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)).tobytes()
    w = array("i").itemsize
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = packed[(L - n) * w:]
        end = (L - 1) * w  # the occurrence must end before the last token
        while True:
            pos = packed.rfind(pattern, 0, end)
            if pos < 0:
                break
            if pos % w == 0:
                start = pos // w + n
                return [int(t) for t in tokens[start:start + k]]
            end = pos + len(pattern) - 1  # misaligned match: look further left
    return []


def accept_greedy(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens one speculative step emits.

    draft: the ``k`` proposed tokens. target: the target model's token at each of the ``k + 1``
    positions (position i predicts the token after ``draft[:i]``), its argmax or its sample. Returns ``draft[:a] +
    [target[a]]`` where ``a`` is the length of the longest prefix with ``draft[i] == target[i]``:
    1 to k + 1 tokens. Raises ValueError when ``len(target) != len(draft) + 1``.
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} target tokens, got {len(target)}")
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return [*draft[:a], target[a]]


def draft_budget(k: int, num_output_tokens: int, max_tokens: int, num_tokens: int,
                 max_model_len: int) -> int:
    """Most draft tokens a step may carry without overrunning the request's limits.

    A step with ``d`` drafts may emit ``d + 1`` tokens, so ``d <= max_tokens - num_output_tokens
    - 1`` (the KV reserved never exceeds prompt + max_tokens - 1 tokens, the admission bound)
    and ``d <= max_model_len - num_tokens - 1``. Returns a value in [0, k].
    """
    return max(0, min(k, max_tokens - num_output_tokens - 1, max_model_len - num_tokens - 1))


def next_skip(accepted: int, proposed: int, misses: int) -> tuple[int, int]:
    """Adaptive back-off after one verify step: returns (steps to skip, consecutive misses).

    A step that accepted at least one of its ``proposed`` tokens resets the misses; one that
    accepted none adds a miss and skips ``2**misses - 1`` steps (at most ``MAX_SKIP_STEPS``):
    1, 3, 7, 15, 31, 32, ... steps after 1, 2, 3, 4, 5, 6 misses in a row.
    """
    if proposed <= 0 or accepted > 0:
        return 0, 0
    misses += 1
    return min(2 ** misses - 1, MAX_SKIP_STEPS), misses
