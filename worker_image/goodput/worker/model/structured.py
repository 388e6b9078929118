"""Structured output: JSON-schema grammars as a token mask, with llguidance.

llguidance (Microsoft's Low-level Guidance, the engine behind vLLM's and SGLang's ``guidance``
backend) compiles a JSON schema into a grammar over the model's own tokenizer and, given the
tokens so far, computes the set of next tokens that can still lead to a valid document (a
bitmask over the vocabulary). The sampler sets every other logit to -inf. Once the document is
complete, only EOS is allowed, so the request ends with reason "stop".

One matcher per request, kept here (the model layer) between steps: it follows the request's
output tokens (``ScheduledChunk.output_token_ids``), so a step that was not committed or a
preemption by recompute never leaves it out of step; it is dropped when the request finishes
(``SchedulerOutput.finished_ids``).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import llguidance
import llguidance.torch as llg_torch
import torch
from goodput.worker.engine.outputs import ScheduledChunk

log = logging.getLogger(__name__)


def schema_grammar(schema_json: str) -> str:
    """The llguidance grammar for a JSON schema (JSON text). ValueError for a schema that is
    not JSON or that llguidance cannot compile, with llguidance's message."""
    try:
        json.loads(schema_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"the JSON schema cannot be used: {'; '.join(messages)}")
    return grammar


@dataclass
class _Matcher:
    matcher: llguidance.LLMatcher
    consumed: int = 0


class StructuredOutputs:
    """Per-request grammar matchers and the step's allowed-token mask.

    tokenizer: the model's tokenizer (its Hugging Face ``tokenizers`` backend is handed to
    llguidance once, on first use: ~0.5 s). vocab_size: the logits' width. eos_token_id: the
    token allowed once the document is complete.
    """

    def __init__(self, backend_json: str, vocab_size: int, eos_token_id: int | None):
        self._backend_json = backend_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._lltok: llguidance.LLTokenizer | None = None
        self._matchers: dict[str, _Matcher] = {}

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._lltok is None:
            self._lltok = llguidance.LLTokenizer(self._backend_json, n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_id)
        return self._lltok

    def _matcher(self, chunk: ScheduledChunk) -> _Matcher:
        m = self._matchers.get(chunk.request_id)
        outputs = chunk.output_token_ids
        if m is None or m.consumed > len(outputs):
            schema = chunk.sampling_params.json_schema
            assert schema is not None
            m = _Matcher(llguidance.LLMatcher(self.lltokenizer, schema_grammar(schema)))
            self._matchers[chunk.request_id] = m
        if m.consumed < len(outputs):
            m.matcher.consume_tokens(list(outputs[m.consumed:]))
            m.consumed = len(outputs)
        return m

    def allowed_mask(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """bool [B, V]: True where a token is allowed (rows without a schema: all True);
        None when no row has a schema."""
        rows = [i for i, c in enumerate(chunks) if c.sampling_params.json_schema is not None]
        if not rows:
            return None
        bits = llg_torch.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            m = self._matcher(chunks[i])
            if m.matcher.is_error():
                log.warning("grammar of request %s is in error: %s", chunks[i].request_id,
                            m.matcher.get_error())
                continue  # bitmask row stays all ones: unconstrained
            llg_torch.fill_next_token_bitmask(m.matcher, bits, j)
        shifts = torch.arange(32, dtype=torch.int32)
        unpacked = ((bits[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, :self.vocab_size].bool()
        mask = torch.ones(len(chunks), self.vocab_size, dtype=torch.bool)
        mask[rows] = unpacked
        return mask

    def advance(self, chunks: Sequence[ScheduledChunk], token_ids: Sequence[int]) -> None:
        """Feed each schema row its sampled token."""
        for c, t in zip(chunks, token_ids):
            m = self._matchers.get(c.request_id)
            if m is not None and c.sampling_params.json_schema is not None:
                m.matcher.consume_token(t)
                m.consumed += 1

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)
