"""Our GGUF tokenizer and chat template vs transformers' tokenizer built from the same GGUF."""
from __future__ import annotations

import pytest
from goodput.worker.model.tokenizer import ChatTemplateError, GGUFTokenizer
from reference_hf import hf_tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "Hello, world! How's it going?  Double  spaces\tand tabs\nand newlines\n\n",
    "Numbers 1234567 and 3.14159, dates 2024-05-06.",
    "naïve café, Grüße aus Köln — “quotes” … 日本語のテキスト, 中文, 한국어, emoji 🤖🎉👍🏽",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    " leading space and trailing space ",
    "",
]


@pytest.fixture(scope="module")
def tok() -> GGUFTokenizer:
    return GGUFTokenizer.from_model("smollm2")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tok, text):
    hf = hf_tokenizer()
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_from_metadata(tok):
    hf = hf_tokenizer()
    assert tok.vocab_size == len(hf.get_vocab())
    assert tok.eos_token_id == hf.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.encode("<|im_start|>") == [tok.token_to_id("<|im_start|>")]
    # special tokens vanish with skip_special_tokens, ordinary text stays
    ids = tok.encode("<|im_start|>assistant\nParis<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nParis"


def test_split_multibyte_character_decodes_to_replacement_char(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1  # one emoji = several byte-level tokens
    assert tok.decode(ids[:1]).endswith("\ufffd")
    assert tok.decode(ids) == "🤖"


def test_decode_rejects_ids_outside_vocab(tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(ValueError):
        tok.decode([-1])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and times 3 — ünïcödé?"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, messages, add_generation_prompt):
    hf = hf_tokenizer()
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True) \
        == hf.encode(ref, add_special_tokens=False)


def test_chat_template_errors_are_clear(tok):
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="render"):
        tok.apply_chat_template([{"role": "user", "content": None}])
    no_template = GGUFTokenizer.__new__(GGUFTokenizer)
    no_template.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_cannot_escape_the_sandbox(tok):
    evil = GGUFTokenizer.__new__(GGUFTokenizer)
    evil.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    evil.bos_token_id = evil.eos_token_id = None
    with pytest.raises(ChatTemplateError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
