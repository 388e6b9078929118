"""Engine features against the real model (float32, CPU), checked with HF transformers' logits:
sampled-token and prompt log-probabilities, n > 1 forks sharing the prompt's KV blocks, JSON-schema
output, and seeded sampling across preemption by recompute (a reported recipe)."""
from __future__ import annotations

import json

import pytest
import torch
from goodput.worker.engine.config import EngineArgs
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.engine_args import build_engine

pytestmark = pytest.mark.slow


def engine(**kw):
    args = dict(model="smollm2", dtype="float32", device="cpu", attention_backend="torch",
                kv_cache_memory=64 << 20, max_num_batched_tokens=256)
    args.update(kw)
    return build_engine(EngineArgs(**args))


@pytest.fixture(scope="module")
def eng():
    return engine()


def run(e, rid, prompt, params, forks=()):
    """Step until every id finished; returns {id: [deltas]}."""
    e.add_request(rid, prompt, params, forks=forks)
    ids = [rid] + [f for f, _ in forks]
    out = {i: [] for i in ids}
    while any(not (out[i] and out[i][-1].finished) for i in ids):
        for d in e.step():
            if d.request_id in out:
                out[d.request_id].append(d)
    return out


def hf_log_softmax(ids):
    from reference_hf import hf_logits
    return torch.log_softmax(hf_logits(ids), dim=-1)


def test_sampled_token_logprobs_match_hf(eng):
    prompt = eng.tokenizer.encode("The capital of France is")
    deltas = run(eng, "lp", prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))["lp"]
    gen = [t for d in deltas for t in d.token_ids]
    lps = [lp for d in deltas for lp in d.logprobs]
    ref = hf_log_softmax(prompt + gen[:-1])
    for i, (tok, lp) in enumerate(zip(gen, lps)):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == tok and lp.logprob == pytest.approx(row[tok].item(), abs=2e-3)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(row.topk(3).values.tolist(), abs=2e-3)
    assert eng.stats().num_used_blocks == 0


def test_prompt_logprobs_match_hf_across_prefill_chunks_and_skip_the_prefix_cache():
    e = engine(max_num_batched_tokens=8)  # a 20-token prompt is prefilled in 3 chunks
    prompt = e.tokenizer.encode("Paged attention stores the KV cache in fixed-size blocks, like virtual memory.")
    ref = hf_log_softmax(prompt)
    for rid in ("a", "b"):  # "b" would hit a's cached blocks; prompt logprobs need them all
        d0 = run(e, rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[rid][0]
        plp = d0.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for p in range(1, len(prompt)):
            assert plp[p].token_id == prompt[p]
            assert plp[p].logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=2e-3)
            assert [t for t, _ in plp[p].top] == ref[p - 1].topk(2).indices.tolist()


def test_n_forks_share_the_prompt_blocks_and_each_samples(eng):
    from reference_hf import hf_greedy
    prompt = eng.tokenizer.encode("Write one sentence about the sea. " * 4)  # > 2 full blocks of 16
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    eng.add_request("p", prompt, greedy, forks=[("p-1", greedy), ("p-2", greedy)])
    sched, bm = eng.scheduler, eng.scheduler.block_manager
    out = {"p": [], "p-1": [], "p-2": []}
    shared_seen = False
    while not all(v and v[-1].finished for v in out.values()):
        for d in eng.step():
            out[d.request_id].append(d)
        kids = [sched.requests.get(i) for i in ("p-1", "p-2")]
        if all(k is not None and k.block_ids for k in kids) and "p" in sched.requests:
            n_full = (len(prompt) - 1) // bm.block_size
            parent = sched.requests["p"].block_ids
            assert all(k.block_ids[:n_full] == parent[:n_full] for k in kids)
            assert all(bm.block_ref_count(b) == 3 for b in parent[:n_full])
            shared_seen = True
    assert shared_seen
    ref = hf_greedy(prompt, 5, stop_at_eos=False)
    for v in out.values():
        assert [t for d in v for t in d.token_ids] == ref
    assert eng.stats().num_used_blocks == 0


def test_n_forks_with_a_seed_give_different_samples(eng):
    prompt = eng.tokenizer.encode("Name a color:")
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    forks = [(f"s-{i}", SamplingParams(temperature=1.0, max_tokens=8, seed=3 + i, ignore_eos=True))
             for i in (1, 2, 3)]
    out = run(eng, "s", prompt, p, forks)
    texts = {i: tuple(t for d in v for t in d.token_ids) for i, v in out.items()}
    assert len(set(texts.values())) > 1
    # a seeded fork draws as the same seed alone would
    alone = run(eng, "s1-alone", prompt, forks[0][1])["s1-alone"]
    assert tuple(t for d in alone for t in d.token_ids) == texts["s-1"]


def test_json_schema_output_follows_the_schema(eng):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    prompt = eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give the largest city of France and its population as JSON."}],
        add_generation_prompt=True, tokenize=True)
    deltas = run(eng, "js", prompt, SamplingParams(temperature=0.0, max_tokens=60,
                                                   json_schema=json.dumps(schema)))["js"]
    text = "".join(d.text for d in deltas)
    doc = json.loads(text)
    assert set(doc) == {"city", "population"} and isinstance(doc["population"], int)
    assert deltas[-1].finish_reason == "stop"  # the grammar completed, then only EOS was allowed
    eng.step()  # the finished request's matcher is dropped at the next step
    assert eng.runner.structured.num_matchers == 0


@pytest.mark.parametrize("dtype", ["float32"])
def test_seeded_request_survives_preemption_by_recompute(dtype):
    """The reported recipe: --kv-cache-memory 6MiB --max-num-batched-tokens 32; a seeded request
    (seed 1234, T=0.9, 60 tokens) alone, then beside 4 concurrent ignore_eos 60-token requests
    that force preemption by recompute: the same tokens."""
    e = engine(kv_cache_memory=6 << 20, max_num_batched_tokens=32, dtype=dtype)
    prompt = e.tokenizer.encode("Tell me a story about a dragon.")
    mine = SamplingParams(temperature=0.9, seed=1234, max_tokens=60, ignore_eos=True)
    alone = run(e, "alone", prompt, mine)["alone"]
    others = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(4):
        e.add_request(f"o{i}", e.tokenizer.encode(f"Count to {i + 5}:"), others)
    req = e.add_request("crowded", prompt, mine)
    crowded = []
    while e.has_unfinished():
        crowded += [d for d in e.step() if d.request_id == "crowded"]
    assert req.num_preemptions > 0  # the newest request is the preemption victim
    assert [t for d in crowded for t in d.token_ids] == [t for d in alone for t in d.token_ids]
    assert e.stats().num_used_blocks == 0
