"""Sampler: greedy, top-k, top-p mass rule, temperature, seeds independent of batching, min_tokens."""
from __future__ import annotations

import math

import pytest
import torch
from goodput.worker.engine.sampling_params import SamplingParams
from goodput.worker.model.sampler import Sampler, apply_top_k_top_p, mix_seed

PROBS = [0.5, 0.3, 0.15, 0.05]  # a hand-made next-token distribution over a 4-token vocabulary
LOGITS = torch.tensor([PROBS]).log()


def test_greedy_is_argmax_and_logprob_is_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 100, generator=g) * 3
    tokens, lps = Sampler(seed=0).sample(logits, [SamplingParams(temperature=0.0)] * 5, [0] * 5)
    assert tokens == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        assert lp == pytest.approx(ref[i, t].item(), abs=1e-6)


def test_top_k_1_is_greedy_at_any_temperature():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 50, generator=g)
    params = [SamplingParams(temperature=t, top_k=1, seed=i) for i, t in enumerate([0.3, 1.0, 1.7, 5.0] * 2)]
    tokens, _ = Sampler(seed=0).sample(logits, params, list(range(8)))
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
    tokens, _ = Sampler(seed=0).sample(logits.expand(n, -1), params, [0] * n)
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
    alone = [Sampler(seed=s).sample(logits[2:3], [mine], [5])[0][0] for s in (0, 1)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, seed=99), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.5)]
    for pos in (0, 2, 5):  # our row at different places in differently composed batches
        rows = list(range(6))
        rows.remove(2)
        rows.insert(pos, 2)
        params = others[:pos] + [mine] + others[pos:]
        tokens, _ = Sampler(seed=pos).sample(logits[rows], params, [0, 7, 1, 3, 9, 2][:pos] + [5]
                                             + [0, 7, 1, 3, 9, 2][pos:5])
        assert tokens[pos] == alone[0] == alone[1]


def test_seeded_draws_depend_on_output_index_and_seed():
    logits = torch.zeros(1, 1000)  # uniform: any two independent draws almost surely differ
    p = SamplingParams(temperature=1.0, seed=7)
    by_index = [Sampler().sample(logits, [p], [i])[0][0] for i in range(20)]
    assert len(set(by_index)) > 15
    by_seed = [Sampler().sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0][0]
               for s in range(20)]
    assert len(set(by_seed)) > 15
    assert mix_seed(7, 0) != mix_seed(7, 1) != mix_seed(8, 1)
    assert 0 <= mix_seed(2**70, 3) < 2**63


def test_unseeded_rows_use_the_sampler_generator():
    logits = torch.zeros(50, 1000)
    p = [SamplingParams(temperature=1.0)] * 50
    assert Sampler(seed=5).sample(logits, p, [0] * 50)[0] == Sampler(seed=5).sample(logits, p, [0] * 50)[0]
    assert Sampler(seed=5).sample(logits, p, [0] * 50)[0] != Sampler(seed=6).sample(logits, p, [0] * 50)[0]


def test_min_tokens_masks_eos_and_stop_token_ids():
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 5.0]])  # eos is the argmax, then token 4
    s = Sampler(eos_token_id=eos, seed=0)
    g = dict(temperature=0.0)
    assert s.sample(logits, [SamplingParams(**g, min_tokens=2)], [1])[0] == [4]
    assert s.sample(logits, [SamplingParams(**g, min_tokens=2, stop_token_ids=(4,))], [0])[0] == [2]
    assert s.sample(logits, [SamplingParams(**g, min_tokens=2)], [2])[0] == [eos]
    assert s.sample(logits, [SamplingParams(**g, min_tokens=2, ignore_eos=True)], [0])[0] == [eos]
    # the reported logprob is the raw model's, not the masked distribution's
    _, lp = s.sample(logits, [SamplingParams(**g, min_tokens=2)], [1])
    assert lp[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 4].item())
    assert math.isfinite(lp[0])


def test_bad_input():
    with pytest.raises(ValueError, match="params"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()], [0, 0])
    assert Sampler().sample(torch.zeros(0, 4), [], []) == ([], [])


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45])
def test_tiny_temperature_is_the_greedy_limit(temperature):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 49152, generator=g) * 5
    params = [SamplingParams(temperature=temperature, seed=7), SamplingParams(temperature=temperature),
              SamplingParams(temperature=temperature, top_p=0.5, top_k=3)]
    tokens, lps = Sampler(seed=0).sample(logits, params, [0, 3, 1])
    assert tokens == logits.argmax(-1).tolist()
    assert all(math.isfinite(x) for x in lps)


def test_random_draws_never_pick_a_banned_token():
    eos = 0
    logits = torch.tensor([[8.0, 1.0, 0.5, 0.0]]).expand(500, -1)  # eos holds ~99.8% of the mass
    params = [SamplingParams(temperature=1.0, seed=s, min_tokens=1) for s in range(500)]
    tokens, _ = Sampler(eos_token_id=eos, seed=0).sample(logits, params, [0] * 500)
    assert eos not in tokens and set(tokens) == {1, 2, 3}
