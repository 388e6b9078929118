"""The engine's :class:`TokenLogprobs` in the OpenAI response shapes.

Completions (legacy): ``{tokens, token_logprobs, top_logprobs, text_offset}``; a token's text is
the token decoded alone (special tokens spelled out), ``top_logprobs`` maps the k most likely
tokens' texts to their log-probabilities and always includes the chosen token (as OpenAI and
vLLM do), ``text_offset`` is the character offset of the token in the choice's text (tokens'
texts laid end to end). Chat: ``content[i] = {token, logprob, bytes, top_logprobs[{token,
logprob, bytes}]}``. A log-probability of -inf (a token the distribution excluded) is reported
as -9999.0, as JSON has no infinity.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from goodput.worker.engine.outputs import TokenLogprobs
from goodput.worker.server.protocol import (
    LOGPROB_FLOOR,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class TokenText:
    """Per-token text, cached (a vocabulary entry decodes the same every time)."""

    def __init__(self, tokenizer: _Decodes):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s


def completion_logprobs(text_of: TokenText, entries: Sequence[TokenLogprobs | None],
                        token_ids: Sequence[int], offset: int = 0) -> tuple[CompletionLogprobs, int]:
    """Legacy logprobs for ``token_ids`` (entry None: no log-probability, e.g. the first prompt
    token). ``offset``: characters before the first token. Returns (logprobs, offset after)."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for tid, e in zip(token_ids, entries):
        s = text_of(tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if e is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(e.logprob))
        top = {text_of(t): _finite(v) for t, v in e.top}
        top.setdefault(s, _finite(e.logprob))
        out.top_logprobs.append(top)
    return out, offset


def merge_completion_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


def chat_logprobs(text_of: TokenText, entries: Sequence[TokenLogprobs], top_k: int) -> ChatLogprobs:
    """Chat logprobs of generated tokens, ``top_k`` alternatives each."""
    content = []
    for e in entries:
        s = text_of(e.token_id)
        content.append(ChatTokenLogprob(
            token=s, logprob=_finite(e.logprob), bytes=list(s.encode("utf-8")),
            top_logprobs=[TopLogprob(token=text_of(t), logprob=_finite(v), bytes=list(text_of(t).encode("utf-8")))
                          for t, v in e.top[:top_k]]))
    return ChatLogprobs(content=content)
