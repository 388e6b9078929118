"""Incremental detokenizer: UTF-8 characters split across tokens, stop strings with hold-back.

The byte tokenizer below (one token per UTF-8 byte, special id 256 = EOS) makes every multi-byte
character arrive split, the hardest case for streaming; the expected texts are plain Python
string operations on the source text, independent of the code under test.
"""
from __future__ import annotations

import pytest
from goodput.worker.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

EOS = 256


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        text = ""
        for i in ids:
            if i == EOS:
                if not skip_special_tokens:
                    text += out.decode("utf-8", errors="replace") + "<eos>"
                    out = bytearray()
                continue
            out.append(i)
        return text + out.decode("utf-8", errors="replace")


TOK = ByteTokenizer()


def stream(text: str, stop=(), final=True, prompt="") -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(TOK, TOK.encode(prompt), stop=stop)
    deltas = []
    for b in TOK.encode(text):
        out = d.add_tokens([b])
        deltas.append(out.text)
        if out.stopped:
            return deltas, d
    if final:
        deltas.append(d.flush().text)
    return deltas, d


def test_multibyte_characters_never_stream_a_replacement_char():
    text = "héllo 😀 世界 ok"
    deltas, d = stream(text, final=False)
    assert all(REPLACEMENT_CHAR not in x for x in deltas)
    assert "".join(deltas) == text
    # the 4-byte emoji arrives as 4 tokens: 3 empty deltas, then the whole character
    i = len("héllo ".encode())
    assert deltas[i:i + 4] == ["", "", "", "😀"]


def test_truncated_character_is_flushed_on_finish():
    d = IncrementalDetokenizer(TOK)
    assert d.add_tokens([ord("a")]).text == "a"
    assert d.add_tokens(list("😀".encode())[:2]).text == ""
    assert d.flush().text == REPLACEMENT_CHAR  # what a full decode of these ids gives


def test_stop_string_prefix_never_reaches_the_client():
    deltas, d = stream("ABCDEFGHIJKLMNOP", stop=["DEFGHIJ"])
    assert d.stopped and d.stop_string == "DEFGHIJ"
    assert "".join(deltas) == "ABC"
    assert all("D" not in x for x in deltas)


def test_finish_by_length_flushes_held_back_text():
    deltas, d = stream("ABCDEF", stop=["DEFGHIJ"])
    assert not d.stopped
    assert deltas[:-1] == ["A", "B", "C", "", "", ""]
    assert deltas[-1] == "DEF"
    assert "".join(deltas) == "ABCDEF"


def test_false_start_is_released_when_it_stops_matching():
    deltas, _ = stream("xDEFxy", stop=["DEFG"], final=False)
    assert deltas == ["x", "", "", "", "DEFx", "y"]


def test_earliest_of_several_stop_strings_wins():
    deltas, d = stream("hello world. bye", stop=["bye", "."])
    assert "".join(deltas) == "hello world" and d.stop_string == "."


def test_special_tokens_skipped_and_no_text_after_stop():
    d = IncrementalDetokenizer(TOK, stop=["Z"])
    assert d.add_tokens([ord("a"), EOS, ord("b")]).text == "ab"
    out = d.add_tokens([ord("Z"), ord("c")])
    assert out.stopped and out.text == ""
    assert d.add_tokens([ord("d")]).text == "" and d.released_text == "ab"


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        IncrementalDetokenizer(TOK, stop=[""])


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abcé😀 ", max_size=30),
       stop=st.text(alphabet="abcé😀 ", min_size=1, max_size=4),
       use_stop=st.booleans())
def test_stream_equals_batch_text(text, stop, use_stop):
    stops = [stop] if use_stop else []
    deltas, d = stream(text, stop=stops)
    i = text.find(stop) if use_stop else -1
    expected = text if i == -1 else text[:i]
    assert "".join(deltas) == expected == d.released_text
    # every released prefix is a prefix of the final text: nothing is ever taken back
    acc = ""
    for x in deltas:
        acc += x
        assert expected.startswith(acc)
        assert REPLACEMENT_CHAR not in x


@pytest.fixture(scope="module")
def real_tokenizer():
    from goodput.worker.model.gguf_loader import read_metadata, resolve_model_path
    from goodput.worker.model.tokenizer import GGUFTokenizer

    meta, _ = read_metadata(resolve_model_path("smollm2"))
    return GGUFTokenizer(meta)


@pytest.mark.parametrize("text", [
    "naïve café — déjà vu",
    "emoji 😀🎉 and 世界 and Ελληνικά",
    "tabs\tand\nnewlines  and   spaces",
])
def test_real_tokenizer_stream_equals_full_decode(real_tokenizer, text):
    ids = real_tokenizer.encode(text, add_special_tokens=False)
    prompt = real_tokenizer.encode("Say:", add_special_tokens=False)
    d = IncrementalDetokenizer(real_tokenizer, prompt)
    deltas = [d.add_tokens([i]).text for i in ids] + [d.flush().text]
    assert all(REPLACEMENT_CHAR not in x for x in deltas)
    assert "".join(deltas) == real_tokenizer.decode(ids) == text


def test_real_tokenizer_stop_string_across_tokens(real_tokenizer):
    ids = real_tokenizer.encode("The answer is 42. END OF ANSWER and more", add_special_tokens=False)
    d = IncrementalDetokenizer(real_tokenizer, stop=["END OF ANSWER"])
    out = ""
    for i in ids:
        r = d.add_tokens([i])
        out += r.text
        assert "The answer is 42. ".startswith(out)  # never any of "END OF ANSWER"
        if r.stopped:
            break
    assert out == "The answer is 42. " and d.stopped


def test_min_tokens_holds_off_stop_strings():
    # "ab" in the first min_tokens=3 tokens is released, not searched; the later "ab" stops.
    d = IncrementalDetokenizer(TOK, stop=["ab"], min_tokens=3)
    deltas = [d.add_tokens([ord(c)]) for c in "abxab"]
    assert [x.text for x in deltas[:3]] == ["a", "b", "x"]
    assert deltas[3].text == "" and deltas[4].stopped
    assert d.released_text == "abx"


class PieceTokenizer:
    """Multi-character tokens: id i is PIECES[i]."""

    PIECES = [" r", " red", ",", " green", " blue", "e"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids)


def test_min_tokens_protects_the_whole_text_of_its_tokens():
    """A reported case: min_tokens=1 and stop "e"; the first token is " red". Its "e" must not
    stop the request (it did: the answer was " r"); the search starts after that token."""
    d = IncrementalDetokenizer(PieceTokenizer(), stop=["e"], min_tokens=1)
    out = [d.add_tokens([i]) for i in (1, 2, 3)]  # " red" "," " green"
    assert [x.text for x in out[:2]] == [" red", ","]
    assert out[2].stopped and d.released_text == " red, gr"
    # without min_tokens the first token's "e" stops at once
    d0 = IncrementalDetokenizer(PieceTokenizer(), stop=["e"])
    assert d0.add_tokens([1]).stopped and d0.released_text == " r"
