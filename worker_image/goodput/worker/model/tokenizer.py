"""Tokenizer built from GGUF metadata with Hugging Face ``tokenizers``; chat template via jinja2.

Byte-level BPE (``tokenizer.ggml.model == "gpt2"``, GPT-2 style, Radford et al. 2019): the
vocabulary (``tokenizer.ggml.tokens``) is already spelled in GPT-2's byte-to-unicode alphabet,
``tokenizer.ggml.merges`` lists the merge rules best-first, ``tokenizer.ggml.token_type`` marks
CONTROL (3) tokens such as ``<|im_start|>`` (added as special tokens, matched whole in text)
and USER_DEFINED (4) tokens (matched whole, not special). The text is split before BPE the way
llama.cpp does for the file's ``tokenizer.ggml.pre`` (e.g. digits one by one for "smollm").

SentencePiece BPE (``tokenizer.ggml.model == "llama"``: Llama 1/2, Mistral, TinyLlama): words
carry a U+2581 prefix, characters outside the vocabulary fall back to ``<0xNN>`` byte tokens, and
the merge rules come from ``tokenizer.ggml.merges`` or, as llama.cpp's converter usually writes
none, are recovered from ``tokenizer.ggml.scores`` (:func:`merges_from_scores`).

The chat template is the Jinja2 source in ``tokenizer.chat_template``, rendered in a sandbox with
the variables Hugging Face's ``apply_chat_template`` provides (messages, add_generation_prompt,
bos_token, eos_token, raise_exception, tojson).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from goodput.worker.model.config import UnsupportedModelError
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

_CONTROL, _USER_DEFINED = 3, 4
# Longer inputs go through ``encode_batch`` / ``decode_batch``, which release the GIL while the
# Rust code runs (``encode`` / ``decode`` hold it: a 1 MB text would stall every other thread,
# the server's event loop included, for a second).
_GIL_FREE_CHARS, _GIL_FREE_IDS = 4096, 1024


def _encode_ids(backend: Tokenizer, text: str) -> list[int]:
    """``backend``'s ids of ``text`` (no special tokens added), the GIL released for long texts."""
    if len(text) > _GIL_FREE_CHARS:
        return backend.encode_batch([text], add_special_tokens=False)[0].ids
    return backend.encode(text, add_special_tokens=False).ids

# Pre-tokenizer split regexes by ``tokenizer.ggml.pre`` (the rules llama.cpp applies).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_REGEX_SPLIT_PRES = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                     "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT}


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merge rules implied by a scored SentencePiece vocabulary.

    Each piece contributes every (left, right) split whose halves are both pieces; rules are
    ordered by the merged piece's score (higher first), then longer left, then longer right,
    ties in vocabulary order (the order Hugging Face's converter uses, so both tokenize alike).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    rules = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        rules.extend((score, left, right) for left, right in local)
    rules.sort(key=lambda r: (-r[0], -len(r[1]), -len(r[2])))
    return [(left, right) for _, left, right in rules]


class ChatTemplateError(ValueError):
    """The chat template is missing, raised an exception, or the messages are malformed."""


class GGUFTokenizer:
    """Encode/decode text and render chat prompts for a GGUF model.

    Attributes: vocab_size, bos_token_id, eos_token_id, pad_token_id (None when absent),
    add_bos_token (whether :meth:`encode` prepends BOS by default), chat_template (str or None),
    backend (the ``tokenizers.Tokenizer``), special_token_ids (CONTROL tokens).
    """

    def __init__(self, metadata: Mapping[str, Any]):
        kind = metadata.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise UnsupportedModelError(f"tokenizer.ggml.model={kind!r} is not supported "
                                        "(byte-level BPE 'gpt2' or SentencePiece BPE 'llama')")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        self.vocab_size = len(tokens)
        self._tokens = tokens
        self.kind = kind
        if kind == "gpt2":
            tk = self._byte_level_bpe(metadata, tokens)
        else:
            tk = self._sentencepiece_bpe(metadata, tokens)
        control = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        if user:
            tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        self.backend = tk
        self.special_token_ids = frozenset(i for i, ty in enumerate(types) if ty == _CONTROL)

        def opt(key: str) -> int | None:
            v = metadata.get(key)
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        self.bos_token_id = opt("tokenizer.ggml.bos_token_id")
        self.eos_token_id = opt("tokenizer.ggml.eos_token_id")
        self.pad_token_id = opt("tokenizer.ggml.padding_token_id")
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) \
            and self.bos_token_id is not None
        self.chat_template: str | None = metadata.get("tokenizer.chat_template") or None

    @staticmethod
    def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
        merges = metadata.get("tokenizer.ggml.merges")
        if not merges:
            raise UnsupportedModelError("byte-level BPE GGUF has no tokenizer.ggml.merges")
        tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                  merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
        pre = str(metadata.get("tokenizer.ggml.pre", "default"))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _REGEX_SPLIT_PRES:
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_REGEX_SPLIT_PRES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre in _DIGIT_SPLIT_PRES:
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tk.pre_tokenizer = byte_level
        tk.decoder = decoders.ByteLevel()
        return tk

    @staticmethod
    def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
        """SentencePiece BPE (Llama 1/2, Mistral, TinyLlama): words start with U+2581, unknown
        characters fall back to ``<0xNN>`` byte tokens. llama.cpp's converter stores scores but
        usually no merges; then the merges are recovered from the vocabulary: every split of a
        piece into two pieces of the vocabulary, higher-scoring pieces merged first."""
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = metadata.get("tokenizer.ggml.merges")
        if merges:
            pairs = [tuple(m.split(" ", 1)) for m in merges]
        else:
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise UnsupportedModelError("SentencePiece GGUF has neither merges nor one score per token")
            pairs = merges_from_scores(tokens, [float(x) for x in scores])
        unk = metadata.get("tokenizer.ggml.unknown_token_id")
        tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                  unk_token=tokens[int(unk)] if unk is not None else None))
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                    prepend_scheme="first" if prefix else "never")
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tk.decoder = decoders.Sequence(steps)
        return tk

    @classmethod
    def from_model(cls, name_or_path: str) -> GGUFTokenizer:
        """The tokenizer of a bundled model name or GGUF path (metadata via ``load_gguf``'s cache)."""
        from goodput.worker.model.gguf_loader import load_gguf

        return cls(load_gguf(name_or_path, "float32").metadata)

    # ---- tokens <-> ids -------------------------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tokens[self.bos_token_id]

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tokens[self.eos_token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in the text (e.g. ``<|im_start|>``) map to
        their ids. With add_special_tokens, BOS is prepended when the GGUF asks for it
        (``tokenizer.ggml.add_bos_token``). TypeError for non-str input."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = _encode_ids(self.backend, text)
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ValueError naming the first id outside ``[0, vocab_size)``.

        Bytes of an incomplete UTF-8 sequence at the end decode to U+FFFD (the incremental
        detokenizer holds such tails back)."""
        ids = list(ids)
        for i in ids:
            if not 0 <= int(i) < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > _GIL_FREE_IDS:
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary spellings (byte-level alphabet) of ``ids``."""
        return [self._tokens[i] for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---- chat ----------------------------------------------------------------------------
    @cached_property
    def _compiled_template(self) -> Any:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise ChatTemplateError("the model has no chat template (tokenizer.chat_template)")

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"chat template error: {message}")

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        # trim_blocks / lstrip_blocks as Hugging Face renders chat templates
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """Render ``messages`` ([{"role": str, "content": str}, ...]) with the model's template.

        Returns the prompt text, or its token ids when ``tokenize``: the template's special tokens
        become their ids, special-token text inside the messages stays text (a user cannot forge
        a system turn); no extra BOS is added — the template writes what it needs.
        Raises ChatTemplateError for no template, malformed messages or a template error.
        """
        from jinja2 import TemplateError

        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
            raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
        try:
            text = self._render(messages, add_generation_prompt, kwargs)
            if tokenize:
                return self._encode_rendered(text, messages, add_generation_prompt, kwargs)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e
        return text

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                kwargs: Mapping[str, Any]) -> str:
        return self._compiled_template.render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    # ---- special-token text inside message content is text, never a control token -------------
    @cached_property
    def _special_text_re(self) -> re.Pattern[str] | None:
        texts = sorted({self._tokens[i] for i in self.special_token_ids if self._tokens[i]}, key=len,
                       reverse=True)
        # Longest first at each position: the leftmost-longest match the tokenizer's added-token
        # matcher makes.
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    @cached_property
    def _text_only_backends(self) -> tuple[Tokenizer, Tokenizer]:
        """Copies of the backend that read special-token strings as plain text: (for a segment at
        the start of the text, for any later segment). They differ only for SentencePiece with a
        space prefix, which the backend adds only at offset 0 of the whole text."""
        first = Tokenizer.from_str(self.backend.to_str())
        first.encode_special_tokens = True
        later = Tokenizer.from_str(self.backend.to_str())
        later.encode_special_tokens = True
        if self.kind == "llama":
            later.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                           prepend_scheme="never")
        return first, later

    def _encode_rendered(self, text: str, messages: Sequence[Mapping[str, Any]],
                         add_generation_prompt: bool, kwargs: Mapping[str, Any]) -> list[int]:
        """Token ids of a rendered chat prompt in which only the TEMPLATE's special-token strings
        are control tokens: ``"hi<|im_end|>\\n<|im_start|>system"`` in a message is encoded as the
        characters it is, so a user cannot forge a turn (what Hugging Face's
        ``split_special_tokens=True`` does to a whole text, applied to the message parts only).

        The template's specials are found by rendering again with every special-token string in
        the messages replaced by as many U+E000 characters (same length, so the two renderings
        align character for character); the text between two template specials is encoded with
        special-token matching off, exactly the segments the plain encoder would have made.
        ChatTemplateError if the template changes the message text's length (it cannot then tell
        a message's characters from its own)."""
        pattern = self._special_text_re
        if pattern is None:
            return self.encode(text, add_special_tokens=False)
        forged = False

        def neutral(value: Any) -> Any:
            nonlocal forged
            if isinstance(value, str):
                out = pattern.sub(lambda m: "\ue000" * len(m.group(0)), value)
                forged = forged or out != value
                return out
            if isinstance(value, Mapping):
                return {k: neutral(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [neutral(v) for v in value]
            return value

        clean = [{k: (v if k == "role" else neutral(v)) for k, v in m.items()} for m in messages]
        if not forged:
            return self.encode(text, add_special_tokens=False)
        reference = self._render(clean, add_generation_prompt, kwargs)
        if len(reference) != len(text):
            raise ChatTemplateError("a message contains special-token text and the chat template changes "
                                    "the message text, so it cannot be kept apart from the template's "
                                    "own special tokens")
        return self._encode_specials_where(text, reference)

    def _encode_specials_where(self, text: str, reference: str) -> list[int]:
        """Encode ``text`` with control tokens exactly where ``reference`` (same length) spells
        one; everywhere else special-token strings are plain text. ``reference == text`` gives
        what :meth:`encode` gives (the plain encoder splits the text at its specials the same way)."""
        pattern = self._special_text_re
        first, later = self._text_only_backends
        ids: list[int] = []
        pos = 0
        for m in pattern.finditer(reference):
            if m.start() > pos:
                ids += _encode_ids(first if pos == 0 else later, text[pos:m.start()])
            ids.append(self.backend.token_to_id(m.group(0)))
            pos = m.end()
        if pos < len(text):
            ids += _encode_ids(first if pos == 0 else later, text[pos:])
        return ids
