"""Sampler: greedy, top-k, top-p mass rule, temperature, seeds independent of batching, min_tokens,
penalties, logit_bias, log-probabilities (processed and raw), robustness to tiny logit changes."""
from __future__ import annotations

import math

import pytest
import torch
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.model.sampler import Row, Sampler, apply_top_k_top_p, greedy_tokens, mix_seed, prompt_logprobs


class S:
    """prepare + sample for rows given as (params, output counts); ``eos`` joins each row's
    resolved stop ids unless ignore_eos (as Scheduler.add_request resolves them)."""

    def __init__(self, seed=None, eos=None, **kw):
        self.sampler = Sampler(seed=seed, **kw)
        self.eos = eos

    def sample(self, logits, params, counts, history=None):
        if len(params) != len(counts):
            raise ValueError("params and counts differ in length")
        hist = history or [((), ())] * len(params)
        rows = [Row(p, n, frozenset(p.stop_token_ids) | (
            frozenset() if self.eos is None or p.ignore_eos else {self.eos}), tuple(pr), tuple(out))
            for p, n, (pr, out) in zip(params, counts, hist)]
        out = self.sampler.sample(logits, self.sampler.prepare(rows, logits.shape[-1]))
        return out.token_ids, out.logprobs

PROBS = [0.5, 0.3, 0.15, 0.05]  # a hand-made next-token distribution over a 4-token vocabulary
LOGITS = torch.tensor([PROBS]).log()


def test_greedy_is_argmax_and_logprob_is_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 100, generator=g) * 3
    tokens, lps = S(seed=0).sample(logits, [SamplingParams(temperature=0.0, logprobs=3)] * 5, [0] * 5)
    assert tokens == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        assert lp.token_id == t and lp.logprob == pytest.approx(ref[i, t].item(), abs=1e-6)
        top_v, top_i = ref[i].topk(3)
        assert [tid for tid, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-6)
    # logprobs are computed only for rows that ask
    _, lps = S(seed=0).sample(logits, [SamplingParams(temperature=0.0)] * 5, [0] * 5)
    assert lps == [None] * 5


def test_greedy_fast_path_gives_the_general_paths_tokens_and_applies_only_when_exact():
    """greedy_tokens == sample() on all-greedy batches, ties included (bf16 logits repeat
    values: the first maximal index wins on both paths); anything that changes a greedy row's
    logits or output (logprobs, bias, penalties, a min_tokens ban, a random row) opts out."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(33, 300, generator=g) * 2).bfloat16().float()
    logits[0, [5, 17, 250]] = logits[0].max() + 1  # an exact three-way tie
    logits[1] = 0.0                                 # all equal
    greedy = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1, seed=4),
              SamplingParams(temperature=1e-6)] * 11
    rows = [Row(p, 3, frozenset({2})) for p in greedy]
    assert Sampler.all_plain_greedy(rows, 300)
    general = Sampler(seed=0).sample(logits, Sampler(seed=0).prepare(rows, 300)).token_ids
    assert greedy_tokens(logits) == general == logits.argmax(-1).tolist()
    assert general[0] == 5 and general[1] == 0
    for p, n_out in [(SamplingParams(temperature=0.0, logprobs=1), 3),
                     (SamplingParams(temperature=0.0, logit_bias=((7, 5.0),)), 3),
                     (SamplingParams(temperature=0.0, presence_penalty=0.5), 3),
                     (SamplingParams(temperature=0.0, repetition_penalty=1.2), 3),
                     (SamplingParams(temperature=0.0, min_tokens=4), 3),
                     (SamplingParams(temperature=0.8), 3)]:
        assert not Sampler.all_plain_greedy(rows[:2] + [Row(p, n_out, frozenset({2}))], 300), p
    # min_tokens already reached, or no stop id in the vocabulary: nothing is banned
    assert Sampler.all_plain_greedy([Row(SamplingParams(temperature=0.0, min_tokens=4), 4, frozenset({2}))], 300)
    assert Sampler.all_plain_greedy([Row(SamplingParams(temperature=0.0, min_tokens=4), 0, frozenset({900}))], 300)


def test_top_k_1_is_greedy_at_any_temperature():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 50, generator=g)
    params = [SamplingParams(temperature=t, top_k=1, seed=i) for i, t in enumerate([0.3, 1.0, 1.7, 5.0] * 2)]
    tokens, _ = S(seed=0).sample(logits, params, list(range(8)))
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p, kept", [(1.0, 4), (0.81, 3), (0.8, 2), (0.79, 2), (0.5, 1), (0.2, 1)])
def test_top_p_keeps_smallest_prefix_reaching_the_mass(top_p, kept):
    # 0.5 + 0.3 = 0.8 >= 0.8 keeps two tokens; 0.81 needs the third (0.95)
    masked, order = apply_top_k_top_p(LOGITS.clone(), torch.tensor([0]), torch.tensor([top_p]))
    assert order[0].tolist() == [0, 1, 2, 3]
    assert torch.isfinite(masked[0]).tolist() == [True] * kept + [False] * (4 - kept)


@pytest.mark.parametrize("top_k, top_p, kept", [(2, 1.0, 2), (3, 0.6, 2), (1, 1.0, 1), (10, 1.0, 4)])
def test_top_k_and_combination(top_k, top_p, kept):
    masked, _ = apply_top_k_top_p(LOGITS.clone(), torch.tensor([top_k]), torch.tensor([top_p]))
    assert int(torch.isfinite(masked).sum()) == kept


def draws(params_for_seed, n=2000, logits=LOGITS):
    """One draw per seed 0..n-1, all rows in one batch."""
    params = [params_for_seed(s) for s in range(n)]
    tokens, _ = S(seed=0).sample(logits.expand(n, -1), params, [0] * n)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / n


def test_sampling_frequencies_follow_the_distribution_and_temperature():
    freq = draws(lambda s: SamplingParams(temperature=1.0, seed=s))
    assert freq.tolist() == pytest.approx(PROBS, abs=0.035)
    # temperature 0.5 squares the probabilities (renormalised)
    sq = [p * p for p in PROBS]
    freq = draws(lambda s: SamplingParams(temperature=0.5, seed=s))
    assert freq.tolist() == pytest.approx([p / sum(sq) for p in sq], abs=0.035)


def test_top_p_sampling_never_draws_a_removed_token():
    freq = draws(lambda s: SamplingParams(temperature=1.0, top_p=0.8, seed=s), n=1000)
    assert freq[2] == 0 and freq[3] == 0
    assert freq[0].item() == pytest.approx(0.5 / 0.8, abs=0.05)


def test_seeded_draw_is_independent_of_batch_composition():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g)
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = [S(seed=s).sample(logits[2:3], [mine], [5])[0][0] for s in (0, 1)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, seed=99), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.5)]
    for pos in (0, 2, 5):  # our row at different places in differently composed batches
        rows = list(range(6))
        rows.remove(2)
        rows.insert(pos, 2)
        params = others[:pos] + [mine] + others[pos:]
        tokens, _ = S(seed=pos).sample(logits[rows], params, [0, 7, 1, 3, 9, 2][:pos] + [5]
                                             + [0, 7, 1, 3, 9, 2][pos:5])
        assert tokens[pos] == alone[0] == alone[1]


def test_seeded_draws_depend_on_output_index_and_seed():
    logits = torch.zeros(1, 1000)  # uniform: any two independent draws almost surely differ
    p = SamplingParams(temperature=1.0, seed=7)
    by_index = [S().sample(logits, [p], [i])[0][0] for i in range(20)]
    assert len(set(by_index)) > 15
    by_seed = [S().sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0][0]
               for s in range(20)]
    assert len(set(by_seed)) > 15
    assert mix_seed(7, 0) != mix_seed(7, 1) != mix_seed(8, 1)
    assert 0 <= mix_seed(2**70, 3) < 2**63


def test_unseeded_rows_use_the_sampler_generator():
    logits = torch.zeros(50, 1000)
    p = [SamplingParams(temperature=1.0)] * 50
    assert S(seed=5).sample(logits, p, [0] * 50)[0] == S(seed=5).sample(logits, p, [0] * 50)[0]
    assert S(seed=5).sample(logits, p, [0] * 50)[0] != S(seed=6).sample(logits, p, [0] * 50)[0]


def test_min_tokens_masks_eos_and_stop_token_ids():
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 5.0]])  # eos is the argmax, then token 4
    s = S(eos=eos, seed=0)
    g = dict(temperature=0.0)
    assert s.sample(logits, [SamplingParams(**g, min_tokens=2)], [1])[0] == [4]
    assert s.sample(logits, [SamplingParams(**g, min_tokens=2, stop_token_ids=(4,))], [0])[0] == [2]
    assert s.sample(logits, [SamplingParams(**g, min_tokens=2)], [2])[0] == [eos]
    assert s.sample(logits, [SamplingParams(**g, min_tokens=2, ignore_eos=True)], [0])[0] == [eos]
    # processed logprobs (default) come from the masked distribution; raw ones from the model's
    _, lp = s.sample(logits, [SamplingParams(**g, min_tokens=2, logprobs=0)], [1])
    masked = logits.clone()
    masked[0, eos] = float("-inf")
    assert lp[0].logprob == pytest.approx(torch.log_softmax(masked, -1)[0, 4].item())
    _, lp = S(eos=eos, seed=0, logprobs_mode="raw").sample(
        logits, [SamplingParams(**g, min_tokens=2, logprobs=0)], [1])
    assert lp[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 4].item())


def test_bad_input():
    sampler = Sampler()
    with pytest.raises(ValueError, match="logit rows"):
        sampler.sample(torch.zeros(2, 4), sampler.prepare([Row(SamplingParams())], 4))
    assert S().sample(torch.zeros(0, 4), [], []) == ([], [])
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="logits")


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45])
def test_tiny_temperature_is_the_greedy_limit(temperature):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 49152, generator=g) * 5
    params = [SamplingParams(temperature=temperature, seed=7, logprobs=0),
              SamplingParams(temperature=temperature, logprobs=0),
              SamplingParams(temperature=temperature, top_p=0.5, top_k=3, logprobs=0)]
    tokens, lps = S(seed=0).sample(logits, params, [0, 3, 1])
    assert tokens == logits.argmax(-1).tolist()
    assert all(math.isfinite(x.logprob) for x in lps)


def test_random_draws_never_pick_a_banned_token():
    eos = 0
    logits = torch.tensor([[8.0, 1.0, 0.5, 0.0]]).expand(500, -1)  # eos holds ~99.8% of the mass
    params = [SamplingParams(temperature=1.0, seed=s, min_tokens=1) for s in range(500)]
    tokens, _ = S(eos=eos, seed=0).sample(logits, params, [0] * 500)
    assert eos not in tokens and set(tokens) == {1, 2, 3}


# ---- penalties and logit_bias: expected logits computed by hand from the definitions

def processed_logprobs(logits, params, history, counts=None):
    """The processed (T=1, greedy) log-distribution the sampler reports for one row."""
    _, lps = S(seed=0).sample(logits, [params], counts or [0], history=[history])
    return lps[0]


def test_frequency_and_presence_penalties_follow_openai_definition():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=4)
    lp = processed_logprobs(logits, p, ((), (2, 2, 1)))  # token 2 twice, token 1 once in the output
    # logit - f * count - p * [count > 0]
    expect = torch.tensor([[1.0, 2.0 - 0.5 - 0.25, 3.0 - 1.0 - 0.25, 0.5]]).log_softmax(-1)[0]
    got = dict(lp.top)
    assert [got[i] for i in range(4)] == pytest.approx(expect.tolist(), abs=1e-6)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_seen_anywhere():
    logits = torch.tensor([[2.0, -1.0, 3.0, 1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=4)
    lp = processed_logprobs(logits, p, ((0, 1), (3,)))  # prompt has 0 and 1, output has 3
    expect = torch.tensor([[1.0, -2.0, 3.0, 0.5]]).log_softmax(-1)[0]
    got = dict(lp.top)
    assert [got[i] for i in range(4)] == pytest.approx(expect.tolist(), abs=1e-6)


def test_penalties_change_the_greedy_choice_and_only_their_row():
    logits = torch.tensor([[3.0, 2.9, 0.0]]).expand(2, -1)
    plain = SamplingParams(temperature=0.0)
    pen = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    tokens, _ = S(seed=0).sample(logits, [pen, plain], [1, 1], history=[((), (0,)), ((), (0,))])
    assert tokens == [1, 0]


def test_logit_bias_adds_to_logits():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    tokens, lps = S(seed=0).sample(logits, [SamplingParams(temperature=0.0, logit_bias=((2, 10.0), (1, -100.0)),
                                                           logprobs=0)], [0])
    assert tokens == [2]
    assert lps[0].logprob == pytest.approx(torch.tensor([0.0, -95.0, 11.0]).log_softmax(-1)[2].item())
    # ids outside the vocabulary are ignored (the server refuses them before)
    assert S(seed=0).sample(logits, [SamplingParams(temperature=0.0, logit_bias=((7, 50.0),))], [0])[0] == [1]


def test_processed_logprobs_include_temperature_and_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    _, lps = S(seed=0).sample(logits, [SamplingParams(temperature=0.5, top_k=2, seed=1, logprobs=3)], [0])
    scaled = torch.tensor([[4.0, 2.0, float("-inf"), float("-inf")]]).log_softmax(-1)[0]
    lp = lps[0]
    assert lp.logprob == pytest.approx(scaled[lp.token_id].item())
    assert [t for t, _ in lp.top[:2]] == [0, 1] and lp.top[2][1] == float("-inf")


def test_prompt_logprobs_are_raw_log_softmax_of_the_next_token():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 30, generator=g)
    entries = prompt_logprobs(logits, [5, 7, 11], k=2)
    ref = logits.log_softmax(-1)
    assert [e.token_id for e in entries] == [5, 7, 11]
    assert [e.logprob for e in entries] == pytest.approx([ref[0, 5].item(), ref[1, 7].item(), ref[2, 11].item()])
    assert [t for t, _ in entries[1].top] == ref[1].topk(2).indices.tolist()


def test_seeded_sampling_is_robust_to_tiny_logit_changes():
    """Gumbel-max coupling: logits changed by at most d change a draw with probability
    <= 2 TV / (1 + TV), TV <= exp(2 d / T) - 1 (~4.4e-5 here): over 300 draws with the
    model's vocabulary width, expect none (allow one)."""
    g = torch.Generator().manual_seed(11)
    V, n = 8192, 300
    logits = torch.randn(1, V, generator=g) * 3
    noisy = logits + (torch.rand(1, V, generator=g) * 2 - 1) * 1e-5
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(n)]
    a, _ = S(seed=0).sample(logits.expand(n, -1), params, [12] * n)
    b, _ = S(seed=0).sample(noisy.expand(n, -1), params, [12] * n)
    assert sum(x != y for x, y in zip(a, b)) <= 1
