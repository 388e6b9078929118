"""Incremental detokenization with stop strings, for streaming.

Two problems make "decode each new token and send it" wrong:

1. A token does not always decode to whole characters. Byte-level BPE can split one UTF-8
   character (an emoji, a CJK character) across several tokens; decoding a prefix then ends in
   U+FFFD (the replacement character). We hold such a tail back until the next token completes it.
   Decoding the new tokens in isolation is also wrong for tokenizers whose pieces depend on their
   left neighbour (SentencePiece's leading-space rule), so we decode a short window that starts a
   few tokens earlier and emit only the part past the window's already-emitted prefix (the same
   window technique as Hugging Face's ``TextStreamer`` and vLLM's ``detokenize_incrementally``).
2. Stop strings are matched on text, and a stop string may arrive across several tokens. Text
   that could still become the start of a stop string is held back, so no prefix of a stop string
   is ever sent to a client that then learns the request stopped; the stop string itself is never
   emitted. When the request ends for another reason (length, EOS, abort) the held-back text is
   flushed, so the concatenation of all deltas always equals the final text.

Invariant (tested): ``"".join(deltas) == final text``, for streamed and non-streamed requests alike.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the first output token, so a context-dependent first piece
# (e.g. SentencePiece's "▁word" after a prompt) decodes as it would in the full text.
_CONTEXT_TOKENS = 5


class SupportsDecode(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class DetokenizerDelta:
    """What one call to :meth:`IncrementalDetokenizer.add_tokens` produced.

    text: new text safe to send (may be ``""``).
    stopped: a stop string was found; the request must finish with reason ``stop`` and no more
        text follows (the stop string and anything after it are cut).
    stop_string: the stop string that matched, when ``stopped``.
    """

    text: str
    stopped: bool = False
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, honouring stop strings.

    tokenizer: anything with ``decode(ids, skip_special_tokens=...) -> str``.
    prompt_token_ids: the request's prompt (only its last few tokens are used, as left context).
    stop: stop strings; an empty string is rejected (it would match everywhere).
    skip_special_tokens: passed to ``decode`` (True: EOS/chat markers never appear in text).
    min_tokens: the text of the first ``min_tokens`` output tokens is released as it comes and
        never searched for stop strings (nothing is held back for them); stop strings are looked
        for only in the text of later tokens ("minimum tokens before EOS, stop token ids or stop
        strings can end the request"). A match must start in text not yet released, so
        released text is never taken back.

    Cost per token: one decode of a window of a few tokens (not of the whole output).
    """

    def __init__(self, tokenizer: SupportsDecode, prompt_token_ids: Sequence[int] = (),
                 stop: Sequence[str] = (), skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        ctx = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # ids = context + output; [prefix_offset, read_offset) is the window already turned into
        # text, read_offset.. are tokens not yet turned into text.
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._num_context = len(ctx)
        self.text = ""            # all decoded output text so far (before stop-string cutting)
        self._sent = 0            # chars of self.text already released to the client
        self._min_tokens = min_tokens
        self._num_output = 0
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    @property
    def released_text(self) -> str:
        """Text released to the client so far (the final text once the request has finished)."""
        return self.text[:self._sent]

    def _decode_new(self, final: bool) -> str:
        """Decode tokens past read_offset; '' while they end in an incomplete UTF-8 character."""
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset],
                                  skip_special_tokens=self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset:], skip_special_tokens=self._skip)
        if not final and full.endswith(REPLACEMENT_CHAR):
            return ""  # wait for the rest of the character
        if len(full) <= len(prefix) or not full.startswith(prefix):
            # Nothing new (e.g. a skipped special token) or the window re-decoded differently;
            # in the latter case fall back to the suffix after the common length.
            new = full[len(prefix):] if len(full) > len(prefix) else ""
        else:
            new = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new

    def add_tokens(self, token_ids: Sequence[int], final: bool = False) -> DetokenizerDelta:
        """Append newly generated token ids; return the text that may be sent now.

        final: the request finishes with this call (for a reason other than a stop string found
            here): incomplete characters and held-back stop-string prefixes are flushed.
        After a stop string has been found, further calls return empty deltas.
        """
        if self.stopped:
            return DetokenizerDelta("", True, self.stop_string)
        self._ids.extend(token_ids)
        self._num_output += len(token_ids)
        if token_ids or final:
            self.text += self._decode_new(final)
        if self._num_output <= self._min_tokens:
            # the first min_tokens tokens' text is never searched for stop strings: release it
            final = True
        elif self._stop:
            # Released text never holds a possible stop-string start (see _held_back_len), so a
            # new match can only start in the unreleased tail.
            start = self._sent
            hit_pos, hit = -1, None
            for s in self._stop:
                i = self.text.find(s, start)
                if i != -1 and (hit_pos == -1 or i < hit_pos):
                    hit_pos, hit = i, s
            if hit is not None:
                self.text = self.text[:hit_pos]
                self.stopped, self.stop_string = True, hit
                delta = self.text[self._sent:]
                self._sent = len(self.text)
                return DetokenizerDelta(delta, True, hit)
        release = len(self.text) if final else len(self.text) - self._held_back_len()
        release = max(release, self._sent)
        delta = self.text[self._sent:release]
        self._sent = release
        return DetokenizerDelta(delta)

    def flush(self) -> DetokenizerDelta:
        """Release everything held back (the request finished by length, EOS or abort)."""
        return self.add_tokens((), final=True)

    def _held_back_len(self) -> int:
        """Length of the longest tail of the unreleased text that is a proper prefix of a stop string."""
        tail = self.text[self._sent:]
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best
