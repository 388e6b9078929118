"""n-gram speculative decoding through the live server: greedy output token for token equal to
Hugging Face transformers (the independent reference, fp32), alone and four at once, with drafts
accepted on text that copies its prompt; a stop string inside a speculative step ends the text and
the usage exactly where plain decoding does; seeded sampling with speculation draws the tokens plain
decoding draws. ``server_main`` runs with speculation off; each
request turns it on with goodput's ``speculative`` field (the per-request override)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from goodput.bench.prompts import COPYING_PROMPTS, FIXED_PROMPTS
from server_utils import completion, metric, metrics
from reference_hf import hf_ids as ids_of
from reference_hf import hf_reference as reference

pytestmark = pytest.mark.slow

N = 40


def spec_served(url: str, prompt_ids, n: int = N, speculative: bool = True, **kw) -> dict:
    kw.setdefault("temperature", 0)
    return completion(url, prompt=list(prompt_ids), max_tokens=n, return_token_ids=True,
                      speculative=speculative, **kw)


def test_speculative_greedy_equals_hf_and_drafts_are_accepted_on_copying_text(server_main):
    before = metrics(server_main.url)
    for text in COPYING_PROMPTS[:2] + FIXED_PROMPTS[:2]:
        p = ids_of(text)
        body = spec_served(server_main.url, p)
        ids = body["choices"][0]["token_ids"]
        assert ids == reference(p, N), text
        assert body["usage"]["completion_tokens"] == len(ids)
    after = metrics(server_main.url)
    drafts = metric(after, "goodput_spec_decode_drafts_total") - metric(before, "goodput_spec_decode_drafts_total")
    accepted = metric(after, "goodput_spec_decode_accepted_tokens_total") - \
        metric(before, "goodput_spec_decode_accepted_tokens_total")
    generated = metric(after, "goodput_generation_tokens_total") - metric(before, "goodput_generation_tokens_total")
    steps = metric(after, "goodput_engine_steps_total") - metric(before, "goodput_engine_steps_total")
    assert drafts > 0 and accepted > 0
    assert steps < generated  # accepted drafts: fewer forward passes than tokens


def test_speculative_four_at_once_equal_hf(server_main):
    prompts = [ids_of(t) for t in COPYING_PROMPTS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: spec_served(server_main.url, p, 24)["choices"][0]["token_ids"], prompts))
    for text, p, g in zip(COPYING_PROMPTS, prompts, got):
        assert g == reference(p, 24), text


def test_stop_string_inside_a_speculative_step_cuts_text_and_usage_like_plain_decoding(server_main):
    p = ids_of(COPYING_PROMPTS[0])
    plain = spec_served(server_main.url, p, speculative=False)["choices"][0]["text"]
    words = plain.split()
    assert len(words) > 8, plain
    stop = " " + words[6]  # inside the copied text: a drafted step emits it and a token after it (seen in-process)
    a = spec_served(server_main.url, p, speculative=False, stop=[stop])
    b = spec_served(server_main.url, p, speculative=True, stop=[stop])
    assert b["choices"][0]["text"] == a["choices"][0]["text"] and stop not in b["choices"][0]["text"]
    assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"] == "stop"
    assert b["usage"] == a["usage"]
    assert b["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]


def test_seeded_sampling_with_speculation_draws_the_same_tokens(server_main):
    # Each drafted position is sampled with the request's own noise for that output index, so a
    # seeded request gets what plain decoding draws from the same logits (fp32: equal up to ulps).
    before = metrics(server_main.url)
    for i, text in enumerate(COPYING_PROMPTS[:2] + FIXED_PROMPTS[:1]):
        p = ids_of(text)
        kw = dict(temperature=0.7, seed=100 + i)
        plain = spec_served(server_main.url, p, speculative=False, **kw)["choices"][0]["token_ids"]
        spec = spec_served(server_main.url, p, speculative=True, **kw)["choices"][0]["token_ids"]
        assert spec == plain, text
    after = metrics(server_main.url)
    assert metric(after, "goodput_spec_decode_accepted_tokens_total") > \
        metric(before, "goodput_spec_decode_accepted_tokens_total")
