"""Our GGUF loader + Llama + paged attention vs Hugging Face transformers on the same GGUF (fp32).

The reference (tests/reference_hf.py) dequantizes the file with transformers' own converter and
runs its own LlamaForCausalLM with a contiguous KV cache, so agreement checks the Q/K
un-permutation, tied embeddings, RoPE, GQA, RMSNorm and our paged KV handling.
"""
from __future__ import annotations

import pytest
import torch
from goodput.worker.engine.outputs import ScheduledChunk, SchedulerOutput
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.model.runner import ModelRunner
from reference_hf import hf_greedy, hf_logits, hf_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
BS = 4  # small blocks: chunks and decodes cross block boundaries often


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner("smollm2", dtype="float32", device="cpu", block_size=BS, num_blocks=96,
                       attention_backend="torch", seed=0)


def blocks_for(n_tokens: int, first: int, stride: int = 1) -> tuple[int, ...]:
    """A deliberately non-contiguous block table: first, first+stride, ..."""
    return tuple(first + stride * i for i in range(-(-n_tokens // BS)))


def test_config_matches_transformers_reading_of_the_gguf(runner):
    hf = hf_model().config
    c = runner.model_config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.intermediate_size, hf.vocab_size)
    assert c.head_dim == hf.head_dim
    assert c.max_position_embeddings == hf.max_position_embeddings
    assert c.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert c.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert c.tie_word_embeddings is bool(hf.tie_word_embeddings)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_logits_match_hf(runner, prompt):
    ids = runner.tokenizer.encode(prompt)
    ours = runner.forward_logits(SchedulerOutput([
        ScheduledChunk("p", tuple(ids), 0, blocks_for(len(ids), 40, 2), False, GREEDY)]))["p"]
    ref = hf_logits(ids)
    assert ours.shape == ref.shape == (len(ids), runner.model_config.vocab_size)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)
    assert ours[-1].argmax() == ref[-1].argmax()


def greedy_paged(runner: ModelRunner, ids: list[int], n: int, table: tuple[int, ...]) -> list[int]:
    """Prefill in one chunk, then n-1 single-token decode steps through execute()."""
    out = runner.execute(SchedulerOutput([ScheduledChunk("g", tuple(ids), 0, table, True, GREEDY)]))
    toks = [out.sampled_token_ids["g"]]
    while len(toks) < n:
        pos = len(ids) + len(toks) - 1
        out = runner.execute(SchedulerOutput([
            ScheduledChunk("g", (toks[-1],), pos, table, True, GREEDY, len(toks))]))
        toks.append(out.sampled_token_ids["g"])
    return toks


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_paged_decode_greedy_matches_hf(runner, prompt):
    ids = runner.tokenizer.encode(prompt)
    n = 8
    table = tuple(reversed(blocks_for(len(ids) + n, 10)))  # descending physical ids
    assert greedy_paged(runner, ids, n, table) == hf_greedy(ids, n, stop_at_eos=False)


def test_chunked_prefill_in_three_calls_equals_one_shot(runner):
    ids = runner.tokenizer.encode("In the beginning the Universe was created. This has made a lot "
                                  "of people very angry and been widely regarded as a bad move.")
    n = len(ids)
    assert n > 12
    cut1, cut2 = 5, 11  # both mid-block for block_size 4
    assert cut1 % BS and cut2 % BS
    one = runner.forward_logits(SchedulerOutput([
        ScheduledChunk("one", tuple(ids), 0, blocks_for(n, 0), False, GREEDY)]))["one"]
    table = blocks_for(n, 50, 1)[::-1]
    pieces = [(0, cut1), (cut1, cut2), (cut2, n)]
    chunked = []
    for s, e in pieces:
        chunked.append(runner.forward_logits(SchedulerOutput([
            ScheduledChunk("ch", tuple(ids[s:e]), s, table[:-(-e // BS)], False, GREEDY)]))["ch"])
    torch.testing.assert_close(torch.cat(chunked), one, atol=1e-4, rtol=1e-5)
    # and execute() on the same chunking samples the one-shot argmax
    table2 = blocks_for(n, 1, 1)
    for s, e in pieces:
        out = runner.execute(SchedulerOutput([
            ScheduledChunk("ch2", tuple(ids[s:e]), s, table2[:-(-e // BS)], e == n, GREEDY)]))
        assert bool(out.sampled_token_ids) == (e == n)
    assert out.sampled_token_ids["ch2"] == int(one[-1].argmax())


def test_mixed_batch_equals_separate_runs(runner):
    """Two decodes (different context lengths) + one prefill chunk in one step == each alone."""
    tok = runner.tokenizer
    a_ids, b_ids = tok.encode("The quick brown fox"), tok.encode("Paris is the capital of")
    c_ids = tok.encode("Water boils at a temperature of one hundred")

    def prefill(rid, ids, table):
        out = runner.execute(SchedulerOutput([ScheduledChunk(rid, tuple(ids), 0, table, True, GREEDY)]))
        return out.sampled_token_ids[rid]

    def chunks(a_tab, b_tab, c_tab, a_next, b_next):
        return [
            ScheduledChunk("a", (a_next,), len(a_ids), a_tab, True, GREEDY, 1),
            ScheduledChunk("b", (b_next,), len(b_ids), b_tab, True, GREEDY, 1),
            ScheduledChunk("c", tuple(c_ids[:7]), 0, c_tab[:2], False, GREEDY),
        ]

    # separately, in blocks 0..29
    sep_tabs = blocks_for(len(a_ids) + 1, 0), blocks_for(len(b_ids) + 1, 10), blocks_for(len(c_ids), 20)
    a1, b1 = prefill("a", a_ids, sep_tabs[0]), prefill("b", b_ids, sep_tabs[1])
    separate = {}
    for ch in chunks(*sep_tabs, a1, b1):
        separate.update(runner.forward_logits(SchedulerOutput([ch])))
    # together, in fresh blocks 30..59
    mix_tabs = blocks_for(len(a_ids) + 1, 30), blocks_for(len(b_ids) + 1, 40), blocks_for(len(c_ids), 50)
    assert (prefill("a", a_ids, mix_tabs[0]), prefill("b", b_ids, mix_tabs[1])) == (a1, b1)
    mixed = runner.forward_logits(SchedulerOutput(chunks(*mix_tabs, a1, b1)))
    for rid in "abc":
        torch.testing.assert_close(mixed[rid], separate[rid], atol=1e-4, rtol=1e-5)
    # and execute() samples the same tokens as HF's greedy continuation
    out = runner.execute(SchedulerOutput(chunks(*mix_tabs, a1, b1)[:2]))
    assert [a1, out.sampled_token_ids["a"]] == hf_greedy(a_ids, 2, stop_at_eos=False)
    assert [b1, out.sampled_token_ids["b"]] == hf_greedy(b_ids, 2, stop_at_eos=False)


def _bf16_runner(backend: str, num_blocks: int = 16) -> ModelRunner:
    try:
        return ModelRunner("smollm2", dtype="bfloat16", block_size=BS, num_blocks=num_blocks,
                           attention_backend=backend)
    except (RuntimeError, ValueError) as e:  # the cpu backend where its C++ kernels cannot build
        pytest.skip(f"{backend} attention backend unavailable: {e}")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bfloat16_model_agrees_with_fp32_reference_on_top1(backend):
    """bf16 serving dtype: logits within bf16 rounding of HF fp32, same top-1 almost everywhere
    (cpu: bf16 prefill chunks through the C++ paged prefill kernel where this CPU has it)."""
    r16 = _bf16_runner(backend)
    agree = total = 0
    for prompt in PROMPTS:
        ids = r16.tokenizer.encode(prompt)
        ours = r16.forward_logits(SchedulerOutput([
            ScheduledChunk("p", tuple(ids), 0, blocks_for(len(ids), 0), False, GREEDY)]))["p"]
        ref = hf_logits(ids)
        assert (ours - ref).abs().max() < 2.5  # logits span ~[-20, 30]; bf16 keeps 8 mantissa bits
        assert ours[-1].argmax() == ref[-1].argmax()
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.9
    ids = r16.tokenizer.encode(PROMPTS[0])
    out = r16.execute(SchedulerOutput([ScheduledChunk("q", tuple(ids), 0, blocks_for(len(ids), 0), True,
                                                      GREEDY)]))
    assert r16.tokenizer.decode([out.sampled_token_ids["q"]]).strip() == "Paris"


def test_bfloat16_chunked_prefill_cpu_backend_agrees_with_fp32_reference():
    """A ~200-token prompt prefilled in chunks of 47 tokens (each after a cached, mid-block
    prefix) on the cpu backend in bf16 (its C++ paged prefill kernel where available): logits of
    every position within bf16 rounding of HF fp32, same top-1 almost everywhere, and the same
    greedy next token as HF."""
    r16 = _bf16_runner("cpu", num_blocks=80)
    sentence = ("In the beginning the Universe was created. This has made a lot of people "
                "very angry and been widely regarded as a bad move.")
    text = " ".join(PROMPTS[:2] + [sentence] * 7)
    ids = r16.tokenizer.encode(text)
    n = len(ids)
    assert n > 150
    table = blocks_for(n, 75, -1)  # descending, non-contiguous order
    ours = []
    for s in range(0, n, 47):
        e = min(n, s + 47)
        ours.append(r16.forward_logits(SchedulerOutput([
            ScheduledChunk("long", tuple(ids[s:e]), s, table[:-(-e // BS)], False, GREEDY)]))["long"])
    ours = torch.cat(ours)
    ref = hf_logits(ids)
    assert (ours - ref).abs().max() < 2.5
    assert ours[-1].argmax() == ref[-1].argmax()
    assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9
