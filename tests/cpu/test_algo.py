"""The RL maths in rlbench/core/algo.py: GRPO advantages, PPO-clip loss, KL estimators,
sample-mean aggregation and token log-probs, checked against their definitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbench.core.algo import grpo_advantages, kl_penalty, ppo_clip_loss, sample_mean, token_entropy, token_logprobs

PROPERTY = settings(max_examples=50, deadline=None, database=None)  # hermetic: no .hypothesis/

# Rewards as multiples of 1/4: group sums and means are exact in float32, so "identical rewards"
# really are identical after centring (see test_identical_group_non_dyadic for the general case).
dyadic_reward = st.integers(-40, 40).map(lambda k: k / 4)


@st.composite
def grouped_rewards(draw, reward=dyadic_reward, min_group=1):
    group_size = draw(st.integers(min_group, 8))
    groups = draw(st.integers(1, 6))
    values = draw(st.lists(reward, min_size=group_size * groups, max_size=group_size * groups))
    return torch.tensor(values, dtype=torch.float32), group_size


# ---------------------------------------------------------------- GRPO advantages


@PROPERTY
@given(grouped_rewards(), st.booleans())
def test_grpo_group_means_are_zero(case, normalize_std):
    rewards, group_size = case
    adv = grpo_advantages(rewards, group_size, normalize_std=normalize_std)
    assert adv.shape == rewards.shape
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv.view(-1, group_size).mean(dim=1), torch.zeros(len(rewards) // group_size),
                               atol=1e-5, rtol=0)


@PROPERTY
@given(grouped_rewards(min_group=2))
def test_grpo_normalised_groups_have_unit_sample_std(case):
    rewards, group_size = case
    grouped = rewards.view(-1, group_size)
    adv = grpo_advantages(rewards, group_size).view(-1, group_size)
    varied = grouped.std(dim=1) > 0  # rewards differ by >= 1/4, so std >> eps here
    if varied.any():
        torch.testing.assert_close(adv[varied].std(dim=1), torch.ones(int(varied.sum())), rtol=1e-4, atol=0)


@PROPERTY
@given(grouped_rewards(min_group=2), dyadic_reward, st.data())
def test_grpo_identical_group_gets_zero_not_nan(case, value, data):
    rewards, group_size = case
    which = data.draw(st.integers(0, len(rewards) // group_size - 1))
    rewards = rewards.clone()
    rewards.view(-1, group_size)[which] = value
    adv = grpo_advantages(rewards, group_size).view(-1, group_size)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[which], torch.zeros(group_size))


@PROPERTY
@given(st.floats(-1e3, 1e3, allow_nan=False, width=32), st.integers(1, 8), st.booleans())
def test_grpo_identical_group_is_finite_for_any_value(value, group_size, normalize_std):
    """Whatever the value, a constant group never yields NaN or inf (exactness: the test below)."""
    adv = grpo_advantages(torch.full((group_size,), value, dtype=torch.float32), group_size, normalize_std)
    assert torch.isfinite(adv).all()


@PROPERTY
@given(st.floats(-1e3, 1e3, allow_nan=False, width=32), st.integers(1, 8))
def test_identical_group_gets_exactly_zero(value, group_size):
    """Non-dyadic values (0.1, -55.94764) included: a group with no signal pushes nothing."""
    adv = grpo_advantages(torch.full((group_size,), value, dtype=torch.float32), group_size)
    assert torch.equal(adv, torch.zeros(group_size))


@PROPERTY
@given(grouped_rewards())
def test_grpo_without_std_is_centred_rewards(case):
    rewards, group_size = case
    grouped = rewards.view(-1, group_size).double()
    expected = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1).float()
    torch.testing.assert_close(grpo_advantages(rewards, group_size, normalize_std=False), expected, atol=0, rtol=0)


def test_grpo_matches_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float32)
    adv = grpo_advantages(rewards, 3)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]) / (std + 1e-6)
    torch.testing.assert_close(adv, expected.float())


# ---------------------------------------------------------------- PPO-clip loss


def _batch(n=4, length=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, length, generator=gen) * 3
    adv = torch.randn(n, generator=gen)
    mask = torch.ones(n, length)
    mask[:, 0] = 0  # position 0 is never a response token
    mask[1, 4:] = 0  # a shorter sample
    return old, adv, mask


def test_ppo_ratio_one_gives_minus_mean_advantage():
    old, adv, mask = _batch()
    loss, clipfrac, ppo_kl = ppo_clip_loss(old.clone(), old, adv, mask, 0.2, 0.2)
    # every token of sample i carries adv[i]; the token mean within a sample is adv[i], then a sample mean
    torch.testing.assert_close(loss, -adv.mean())
    assert clipfrac.item() == 0.0
    assert ppo_kl.item() == 0.0


def test_ppo_clipping_engages_above_one_plus_eps_for_positive_advantage():
    old, _, mask = _batch()
    adv = torch.tensor([1.0, 2.0, 0.5, 3.0])
    logp = (old + math.log(1.5)).requires_grad_(True)  # ratio 1.5 > 1 + 0.2
    loss, clipfrac, _ = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2)
    torch.testing.assert_close(loss, -(adv * 1.2).mean())
    assert clipfrac.item() == pytest.approx(1.0)
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0  # clipped tokens carry no gradient


def test_ppo_clipfrac_counts_clipped_tokens_per_sample_mean():
    old = torch.zeros(2, 5)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    logp = old.clone()
    logp[0, 1] = math.log(1.5)  # 1 of sample 0's 4 tokens above 1 + eps
    logp[1, 1] = math.log(1.1)  # within the clip range
    logp[1, 2] = math.log(2.0)  # 1 of sample 1's 2 tokens above
    _, clipfrac, _ = ppo_clip_loss(logp, old, torch.tensor([1.0, 1.0]), mask, 0.2, 0.2)
    assert clipfrac.item() == pytest.approx((1 / 4 + 1 / 2) / 2)


def test_ppo_no_clip_below_one_plus_eps_high_for_positive_advantage():
    old, _, mask = _batch()
    adv = torch.ones(4)
    loss, clipfrac, _ = ppo_clip_loss(old + math.log(1.1), old, adv, mask, 0.2, 0.28)
    assert clipfrac.item() == 0.0
    torch.testing.assert_close(loss, torch.tensor(-1.1))


# ---------------------------------------------------------------- KL to the reference


@PROPERTY
@given(st.integers(0, 2**31 - 1))
def test_k3_is_nonnegative(seed):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 7, generator=gen) * 10
    ref = -torch.rand(3, 7, generator=gen) * 10
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_kl_zero_when_logp_equals_ref():
    logp = -torch.rand(3, 7) * 5
    assert torch.equal(kl_penalty(logp, logp.clone(), "k1"), torch.zeros(3, 7))
    assert torch.equal(kl_penalty(logp, logp.clone(), "k3"), torch.zeros(3, 7))


def test_kl_estimators_match_definitions():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -0.5])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), logp - ref)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.exp(ref - logp) - (ref - logp) - 1)


# ---------------------------------------------------------------- sample_mean


def test_sample_mean_ignores_masked_tokens():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    before = sample_mean(values, mask)
    changed = values.clone()
    changed[mask == 0] = 1e6
    assert torch.equal(sample_mean(changed, mask), before)
    torch.testing.assert_close(before, torch.tensor((1.5 + 5.5) / 2))


def test_sample_mean_weights_samples_equally_regardless_of_length():
    values = torch.zeros(2, 10)
    values[0, 0] = 1.0
    mask = torch.zeros(2, 10)
    mask[0, 0] = 1  # one token, value 1
    mask[1, :] = 1  # ten tokens, value 0
    assert sample_mean(values, mask).item() == pytest.approx(0.5)  # a token mean would give 1/11


# ---------------------------------------------------------------- token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_token_logprobs_matches_hand_computation(temperature):
    gen = torch.Generator().manual_seed(7)
    n, length, vocab = 2, 5, 11
    logits = torch.randn(n, length, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (n, length), generator=gen)
    expected = torch.zeros(n, length)
    for i in range(n):
        for t in range(1, length):
            expected[i, t] = torch.log_softmax(logits[i, t - 1] / temperature, dim=-1)[tokens[i, t]]
    got = token_logprobs(logits, tokens, temperature)
    assert got.shape == (n, length)
    assert torch.equal(got[:, 0], torch.zeros(n))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("keep", [2, 4])
def test_logprobs_and_entropy_from_the_last_positions_only(keep):
    """The trainer keeps logits of the response span only: the same values there, 0 before it."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 9, generator=gen)
    tokens = torch.randint(0, 9, (2, 6), generator=gen)
    full, part = token_logprobs(logits, tokens, 0.7), token_logprobs(logits[:, -keep:], tokens, 0.7)
    assert part.shape == full.shape and torch.equal(part[:, -(keep - 1):], full[:, -(keep - 1):])
    assert not part[:, : 6 - keep + 1].any()
    whole, tail = token_entropy(logits, 0.7), token_entropy(logits[:, -keep:], 0.7, 6)
    assert tail.shape == whole.shape and torch.equal(tail[:, -(keep - 1):], whole[:, -(keep - 1):])
