"""Cases from public bug reports against OpenAI-compatible servers; each must hold.

1. an empty prompt gets 400 (or a valid completion) and the server stays healthy;
2. a prompt longer than --max-model-len gets 400 and the next request still works;
3. a prompt needing more KV than the whole pool is rejected at once, no hang;
4. a streamed stop string never leaks a prefix to the client; streamed == non-streamed text;
   a finish by length flushes the held-back characters;
5. streamed max_tokens=1 gives exactly one token and finish_reason "length".
"""
from __future__ import annotations


import httpx
import pytest
from server_utils import completion, post, stream

pytestmark = pytest.mark.slow


def test_1_empty_prompt_is_400_and_server_stays_healthy(server_main):
    r = post(server_main.url, "/v1/completions", {"prompt": "", "max_tokens": 20})
    if r.status_code == 400:
        err = r.json()["error"]
        assert "empty" in err["message"] and err["type"] == "invalid_request_error"
    else:  # a valid completion is acceptable too
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(server_main.url + "/health").status_code == 200
    assert completion(server_main.url, prompt="Hello", max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_2_prompt_longer_than_max_model_len(server_chunked):
    # server_chunked runs with --max-model-len 32
    r = post(server_chunked.url, "/v1/completions", {"prompt": list(range(100, 140)), "max_tokens": 4})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "40" in msg and "32" in msg  # names the numbers: prompt tokens and max_model_len
    ok = completion(server_chunked.url, prompt="Hello there", max_tokens=3, temperature=0)
    assert ok["choices"][0]["finish_reason"] in ("stop", "length")
    assert ok["usage"]["completion_tokens"] >= 1


def test_3_prompt_larger_than_the_whole_pool_is_rejected_at_once(server_tiny):
    # server_tiny: 4 blocks x 16 tokens = 64 tokens of KV, --max-model-len 128
    # Refused at admission (a 400 naming the pool), not queued until capacity frees up.
    r = post(server_tiny.url, "/v1/completions", {"prompt": list(range(1000, 1100)), "max_tokens": 8})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "4 blocks" in msg and "100 tokens" in msg
    for prompt in ("Hi", "Good morning"):
        ok = completion(server_tiny.url, prompt=prompt, max_tokens=3)
        assert ok["choices"][0]["finish_reason"] in ("stop", "length")


ALPHABET = "Alphabet: ABCDEFGHIJKLMNOPQRSTUVWXYZ\nAlphabet: ABCDEFGHIJKLMNOPQRSTUVWXYZ\nAlphabet:"
LEAD = " ABC"  # greedy continuation: " ABC" "DEF" "GH" "I" "J" ...: the stop string spans 4 tokens
STOP = "DEFGHIJ"


def _streamed_text(url: str, body: dict) -> tuple[list[str], str | None]:
    events = stream(url, "/v1/completions", body)
    return [e["choices"][0]["text"] for e in events], events[-1]["choices"][0]["finish_reason"]


def test_4_stop_string_never_leaks_and_length_flushes(server_main):
    url = server_main.url
    free = completion(url, prompt=ALPHABET, max_tokens=8, temperature=0, return_token_ids=True)
    free_text = free["choices"][0]["text"]
    assert free_text.startswith(LEAD + STOP), f"model no longer spells the alphabet: {free_text!r}"

    body = {"prompt": ALPHABET, "max_tokens": 12, "temperature": 0, "stop": [STOP]}
    plain = completion(url, **body)["choices"][0]
    assert plain["text"] == LEAD and plain["finish_reason"] == "stop"
    deltas, reason = _streamed_text(url, body)
    assert "".join(deltas) == plain["text"] and reason == "stop"
    seen = ""
    for d in deltas:  # at no point did the client hold text that was later cut
        seen += d
        assert plain["text"].startswith(seen)

    # Finish by length in the middle of a possible stop string: the held-back text is flushed.
    # Per-token texts without a stop string tell after how many tokens the text ends inside STOP.
    pieces, _ = _streamed_text(url, {"prompt": ALPHABET, "max_tokens": 8, "temperature": 0})
    acc, k = "", None
    for i, piece in enumerate(pieces, 1):
        acc += piece
        if len(acc) > len(LEAD) and STOP.startswith(acc[len(LEAD):]) and acc[len(LEAD):] != STOP:
            k, partial = i, acc
            break
    assert k is not None, f"no token boundary inside the stop string: {pieces!r}"
    body = {"prompt": ALPHABET, "max_tokens": k, "temperature": 0, "stop": [STOP]}
    plain = completion(url, **body)["choices"][0]
    assert plain["text"] == partial and plain["finish_reason"] == "length"
    deltas, reason = _streamed_text(url, body)
    assert "".join(deltas) == partial and reason == "length"
    assert deltas[-1].endswith(partial[len(LEAD):]), "the held-back prefix arrives with the final event"


def test_5_streamed_max_tokens_1(server_main):
    events = stream(server_main.url, "/v1/completions",
                    {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
                     "stream_options": {"include_usage": True}, "return_token_ids": True})
    token_events = [e for e in events if e["choices"]]
    assert len(token_events) == 1
    assert len(token_events[0]["choices"][0]["token_ids"]) == 1
    assert token_events[0]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 1
