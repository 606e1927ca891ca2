"""decoding.sampling.Sampler: the distribution a request samples from, and sampling it."""

from __future__ import annotations

import math

import pytest
import torch

from edgespec.decoding.sampling import Sampler
from edgespec.decoding.types import SamplingParams

DIST = [0.5, 0.3, 0.15, 0.05]


def sampler(vocab: int = 4, **params) -> Sampler:
    return Sampler(SamplingParams(**params), vocab)


def log_dist(p: list[float]) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float32).log()


def random_logits(vocab: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def kept(probs: torch.Tensor) -> list[int]:
    return torch.nonzero(probs > 0).flatten().tolist()


# --- greedy and bias ---------------------------------------------------------------------------------


def test_greedy_is_argmax():
    s = sampler(32, temperature=0.0)
    assert s.params.greedy
    for seed in range(5):
        logits = random_logits(seed=seed)
        probs = s.probs(logits)
        assert probs.sum().item() == 1.0 and probs.max().item() == 1.0
        assert int(probs.argmax()) == int(logits.argmax())
        assert s.sample(probs) == int(logits.argmax())


def test_greedy_ignores_top_k_top_p_and_seed():
    logits = random_logits(seed=1)
    a = sampler(32, temperature=0.0, top_k=3, top_p=0.1, min_p=0.5, seed=1)
    b = sampler(32, temperature=0.0, seed=2)
    assert [a.choose(logits) for _ in range(3)] == [b.choose(logits) for _ in range(3)] == [int(logits.argmax())] * 3


def test_greedy_takes_the_first_of_equal_maxima():
    # as torch's argmax does, from a row of a pass's logits [1, T, V] as the policies pass it
    logits = torch.zeros(1, 2, 6)
    logits[0, 1, [2, 4]] = 5.0
    assert sampler(6, temperature=0.0).choose(logits[0, -1]) == 2 == int(logits[0, -1].argmax())


def test_logit_bias_forces_a_token():
    logits = random_logits(seed=2)
    target = int(logits.argmin())
    greedy = sampler(32, temperature=0.0, logit_bias={target: 100.0})
    assert greedy.choose(logits) == target
    sampling = sampler(32, temperature=1.0, seed=0, logit_bias={target: 100.0})
    assert {sampling.choose(logits) for _ in range(50)} == {target}
    assert sampling.probs(logits)[target].item() == pytest.approx(1.0)


def test_logit_bias_bans_a_token():
    logits = random_logits(seed=3)
    top = int(logits.argmax())
    s = sampler(32, temperature=0.0, logit_bias={top: -100.0})
    assert s.choose(logits) == int(logits.topk(2).indices[1])
    adjusted = s.adjusted_logits(logits)
    assert adjusted[top].item() == pytest.approx(logits[top].item() - 100.0)
    others = torch.arange(32) != top
    assert torch.equal(adjusted[others], logits[others])


# --- penalties ---------------------------------------------------------------------------------------


def test_presence_and_frequency_penalties_exact():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    s = sampler(5, presence_penalty=0.5, frequency_penalty=0.25)
    assert torch.equal(s.adjusted_logits(logits), logits)  # nothing generated yet
    for t in (1, 1, 3, 1):
        s.observe(t)
    # token 1 seen 3 times: -0.5 - 0.75; token 3 once: -0.5 - 0.25
    want = torch.tensor([1.0, 2.0 - 0.5 - 0.75, 3.0, 4.0 - 0.5 - 0.25, 5.0])
    assert torch.allclose(s.adjusted_logits(logits), want, atol=1e-6)
    assert torch.allclose(s.probs(logits), torch.softmax(want, -1), atol=1e-6)


def test_negative_penalties_encourage_repeats():
    logits = torch.zeros(4)
    s = sampler(4, presence_penalty=-1.0, frequency_penalty=-0.5)
    s.observe(2)
    s.observe(2)
    assert torch.allclose(s.adjusted_logits(logits), torch.tensor([0.0, 0.0, 2.0, 0.0]))


def test_choose_records_tokens_for_the_penalties():
    logits = torch.tensor([3.0, 2.9, 0.0])
    s = sampler(3, temperature=0.0, frequency_penalty=0.2)
    # 0 wins, then its penalty (0.2) puts it below 1; 1 wins, both penalised once: 0 again ...
    assert [s.choose(logits) for _ in range(4)] == [0, 1, 0, 1]
    assert s.counts.tolist() == [2.0, 2.0, 0.0]


@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_repetition_penalty_is_transformers_rule(penalty):
    """transformers' RepetitionPenaltyLogitsProcessor over the tokens generated so far is the reference (a seen
    token's logit divided by the penalty when positive, multiplied when negative)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = random_logits(seed=7)
    generated = [3, 3, 11, 0, 20]
    s = sampler(32, repetition_penalty=penalty)
    for t in generated:
        s.observe(t)
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([generated]), logits.clone()[None])[0]
    assert torch.allclose(s.adjusted_logits(logits), want, atol=1e-6)
    assert torch.equal(sampler(32, repetition_penalty=1.0).adjusted_logits(logits), logits)


def test_bias_applies_before_penalties_and_temperature():
    logits = torch.tensor([0.0, 1.0, 2.0])
    s = sampler(3, temperature=2.0, presence_penalty=1.0, logit_bias={0: 3.0})
    s.observe(2)
    want = torch.softmax(torch.tensor([3.0, 1.0, 1.0]) / 2.0, -1)
    assert torch.allclose(s.probs(logits), want, atol=1e-6)


# --- temperature, top_k, top_p, min_p -----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.5, 4.0])
def test_temperature_scales_logits(temperature):
    logits = random_logits(seed=4)
    probs = sampler(32, temperature=temperature).probs(logits)
    assert torch.allclose(probs, torch.softmax(logits / temperature, -1), atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 5, 31])
def test_top_k_keeps_exactly_k(k):
    logits = random_logits(seed=5)
    probs = sampler(32, top_k=k).probs(logits)
    top = logits.topk(k).indices
    assert sorted(kept(probs)) == sorted(top.tolist())
    assert torch.allclose(probs[top], torch.softmax(logits[top], -1), atol=1e-6)
    assert probs.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("k", [0, 32, 100])
def test_top_k_off_or_at_least_vocab_keeps_everything(k):
    logits = random_logits(seed=6)
    probs = sampler(32, top_k=k).probs(logits)
    assert torch.allclose(probs, torch.softmax(logits, -1), atol=1e-6)


@pytest.mark.parametrize(
    ("top_p", "n_kept"),
    [(0.3, 1), (0.5, 1), (0.51, 2), (0.7, 2), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1.0, 4)],
)
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p, n_kept):
    probs = sampler(top_p=top_p).probs(log_dist(DIST))
    assert kept(probs) == list(range(n_kept))
    mass = sum(DIST[:n_kept])
    assert torch.allclose(probs[:n_kept], torch.tensor(DIST[:n_kept]) / mass, atol=1e-6)


def test_top_p_works_on_unsorted_tokens():
    order = [2, 0, 3, 1]  # token order[i] has probability DIST[i]
    p = [0.0] * 4
    for token, mass in zip(order, DIST, strict=True):
        p[token] = mass
    probs = sampler(top_p=0.7).probs(log_dist(p))
    assert sorted(kept(probs)) == sorted(order[:2])


def test_top_p_comes_after_temperature():
    # at temperature 1 the first token alone has 0.5 mass; at temperature 100 the distribution is near uniform
    assert kept(sampler(top_p=0.5).probs(log_dist(DIST))) == [0]
    assert kept(sampler(top_p=0.5, temperature=100.0).probs(log_dist(DIST))) == [0, 1]


@pytest.mark.parametrize(("min_p", "n_kept"), [(0.05, 4), (0.2, 3), (0.5, 2), (0.9, 1)])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top(min_p, n_kept):
    probs = sampler(min_p=min_p).probs(log_dist(DIST))
    assert kept(probs) == list(range(n_kept))
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_k_then_top_p_then_min_p():
    dist = [0.4, 0.25, 0.2, 0.1, 0.05]
    # alone, top_p 0.87 keeps 4 (0.85 before the 4th, 0.95 before the 5th)
    assert kept(sampler(5, top_p=0.87).probs(log_dist(dist))) == [0, 1, 2, 3]
    # top_k 4 first renormalises to [0.421, 0.263, 0.211, 0.105]: 0.895 before the 4th, so top_p keeps 3
    probs = sampler(5, top_k=4, top_p=0.87).probs(log_dist(dist))
    assert kept(probs) == [0, 1, 2]
    # min_p 0.6 of the max then drops 0.2 / 0.4 = 0.5
    probs = sampler(5, top_k=4, top_p=0.87, min_p=0.6).probs(log_dist(dist))
    assert kept(probs) == [0, 1]
    assert torch.allclose(probs[:2], torch.tensor([0.4, 0.25]) / 0.65, atol=1e-6)


# --- seeds and the empirical distribution ---------------------------------------------------------------


def test_same_seed_same_samples_different_seed_different_samples():
    logits = torch.zeros(256)  # uniform: 40 draws that all agree by chance are out of the question

    def draws(seed):
        s = sampler(256, seed=seed)
        return [s.choose(logits) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_unseeded_samplers_differ():
    logits = torch.zeros(256)
    a, b = sampler(256), sampler(256)
    assert [a.choose(logits) for _ in range(40)] != [b.choose(logits) for _ in range(40)]


def assert_frequencies(s: Sampler, logits: torch.Tensor, expected: list[float], n: int) -> None:
    probs = s.probs(logits)
    counts = [0] * len(expected)
    for _ in range(n):
        counts[s.sample(probs)] += 1
    for token, p in enumerate(expected):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[token] - n * p) <= 5 * sigma + 1e-9, (token, counts, expected)


def test_empirical_frequencies_match_the_distribution():
    dist = [0.1, 0.2, 0.3, 0.4]
    assert_frequencies(sampler(seed=11), log_dist(dist), dist, n=20000)


def test_empirical_frequencies_after_top_k_and_temperature():
    dist = [0.1, 0.2, 0.3, 0.4]
    # temperature 0.5 squares the probabilities; top_k 2 keeps 0.09 and 0.16 -> 9/25 and 16/25
    assert_frequencies(sampler(seed=12, temperature=0.5, top_k=2), log_dist(dist), [0, 0, 9 / 25, 16 / 25], n=10000)


# --- logprobs ------------------------------------------------------------------------------------------


def test_logprob_is_log_softmax_with_top_alternatives():
    logits = random_logits(seed=13)
    s = sampler(32, top_logprobs=5, logprobs=True)
    logp = torch.log_softmax(logits, -1)
    token = int(logits.argsort()[10])  # not one of the top ones
    lp = s.logprob(logits, token)
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(logp[token].item(), abs=1e-6)
    assert [t for t, _ in lp.top] == logits.topk(5).indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(logp.topk(5).values.tolist(), abs=1e-6)
    values = [v for _, v in lp.top]
    assert values == sorted(values, reverse=True)
    assert all(v <= 0 for v in values)


def test_logprob_without_top_and_under_the_raw_distribution():
    logits = random_logits(seed=14)
    s = sampler(32, temperature=0.3, logit_bias={0: 50.0}, presence_penalty=1.0, logprobs=True)
    s.observe(int(logits.argmax()))
    lp = s.logprob(logits, 0)
    assert lp.top == ()
    assert lp.logprob == pytest.approx(torch.log_softmax(logits, -1)[0].item(), abs=1e-6)
