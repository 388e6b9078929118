"""Greedy output through the live server is token-identical to Hugging Face transformers (fp32).

The reference (tests/reference_hf.py) loads the same GGUF with transformers' own dequantizer,
model and KV cache; prompts are tokenized by transformers' tokenizer and sent as token ids, and
the server returns its generated ids (``return_token_ids``), so the comparison is exact.
Cases: one request at a time; 8 at once; a token budget smaller than the prompt
(chunked prefill); a warm prefix cache; a pool so small that requests are preempted.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import TINY_POOL_BLOCKS
from goodput.bench.prompts import FIXED_PROMPTS
from server_utils import completion, metric, metrics

pytestmark = pytest.mark.slow

PROMPTS = FIXED_PROMPTS[:8]

# 9..24 tokens each: longer than the 8-token budget, short enough for max_model_len 32.
CHUNKED_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Photosynthesis is the process by which green plants",
]


def ids_of(text: str) -> tuple[int, ...]:
    from reference_hf import hf_ids
    return hf_ids(text)


def reference(prompt_ids: tuple[int, ...], n: int, ignore_eos: bool = False) -> list[int]:
    from reference_hf import hf_reference
    return hf_reference(prompt_ids, n, ignore_eos)


def served(url: str, prompt_ids, n: int, ignore_eos: bool = False) -> list[int]:
    body = completion(url, prompt=list(prompt_ids), max_tokens=n, temperature=0,
                      return_token_ids=True, ignore_eos=ignore_eos)
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
    return choice["token_ids"]


def served_concurrently(url: str, prompts, n: int, ignore_eos: bool = False) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: served(url, p, n, ignore_eos), prompts))


def test_one_at_a_time(server_main):
    for text in PROMPTS[:4]:
        p = ids_of(text)
        assert served(server_main.url, p, 10) == reference(p, 10), text


def test_eight_at_once(server_main):
    prompts = [ids_of(t) for t in PROMPTS]
    got = served_concurrently(server_main.url, prompts, 8)
    for text, p, g in zip(PROMPTS, prompts, got):
        assert g == reference(p, 8), text


def test_chunked_prefill_budget_smaller_than_prompt(server_chunked):
    # server_chunked: --max-num-batched-tokens 8, --max-model-len 32
    prompts = [ids_of(t) for t in CHUNKED_PROMPTS]
    assert all(8 < len(p) <= 24 for p in prompts), [len(p) for p in prompts]
    got = served_concurrently(server_chunked.url, prompts, 8)
    for p, g in zip(prompts, got):
        assert g == reference(p, 8)


def test_warm_prefix_cache(server_main):
    system = ("You are a helpful assistant that answers questions about geography, history and "
              "science with short, precise sentences and no speculation. When you do not know "
              "an answer, say so plainly and suggest where it could be found. ")
    a, b = ids_of(system + "Question: Where is Lyon?"), ids_of(system + "Question: Who was Ada?")
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= 32, "the shared prefix must cover at least two full 16-token blocks"
    assert served(server_main.url, a, 8) == reference(a, 8)
    mid = metric(metrics(server_main.url), "goodput_prefix_cache_hits_total")
    assert served(server_main.url, b, 8) == reference(b, 8)      # hits a's full blocks
    assert served(server_main.url, a, 8) == reference(a, 8)      # a again: fully warm
    after = metric(metrics(server_main.url), "goodput_prefix_cache_hits_total")
    assert after - mid >= (common // 16) * 16 + (len(a) - 1) // 16 * 16


def test_preemption_with_a_tiny_pool(server_tiny):
    # 4 blocks x 16 tokens: four ~10-token prompts growing by 16 tokens cannot all keep their
    # blocks (each needs 2 at the end), so the scheduler must preempt by recompute.
    prompts = [ids_of(t) for t in PROMPTS[:4]]
    assert all(len(p) + 16 - 1 <= 2 * 16 for p in prompts)
    before = metric(metrics(server_tiny.url), "goodput_preemptions_total")
    got = served_concurrently(server_tiny.url, prompts, 16, ignore_eos=True)
    m = metrics(server_tiny.url)
    assert metric(m, "goodput_preemptions_total") > before
    assert metric(m, "goodput_kv_cache_blocks") == TINY_POOL_BLOCKS
    # server_tiny runs with --vllm-metric-aliases: vLLM's names carry the same values
    assert metric(m, "vllm:num_preemptions_total") == metric(m, "goodput_preemptions_total")
    assert metric(m, "vllm:generation_tokens_total") == metric(m, "goodput_generation_tokens_total")
    assert metric(m, "vllm:request_success_total", finished_reason="length") == \
        metric(m, "goodput_requests_finished_total", finished_reason="length")
    for p, g in zip(prompts, got):
        assert g == reference(p, 16, ignore_eos=True)
