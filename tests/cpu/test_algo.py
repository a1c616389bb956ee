"""The RL maths in rlbench/core/algo.py: GRPO advantages (by group size and by group id), whitening,
PPO-clip, dual-clip, GSPO and CISPO losses, TIS, KL estimators, sample-mean and per-token aggregation
and token log-probs, checked against their definitions; the algorithm's settings (AlgoConfig), the
loop's groups and the logprob metrics. slime's own values: tests/conformance/slime/test_algo.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbench.config import AlgoConfig, RunConfig, config_from_dict, load_config
from rlbench.core import algo, loop, metrics
from rlbench.core.algo import (
    grpo_advantages,
    kl_penalty,
    ppo_clip_loss,
    sample_mean,
    sequence_logprobs,
    token_entropy,
    token_logprobs,
)
from rlbench.errors import BadInput
from tests.helpers import TableLogits

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
    torch.testing.assert_close(
        adv.view(-1, group_size).mean(dim=1), torch.zeros(len(rewards) // group_size), atol=1e-5, rtol=0
    )


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
    # eps is added to the std: it matters where the std is as small as eps itself
    tiny = grpo_advantages(torch.tensor([0.0, 2e-6]), 2)
    std = math.sqrt(2) * 1e-6
    assert tiny.tolist() == pytest.approx([-1e-6 / (std + 1e-6), 1e-6 / (std + 1e-6)], rel=1e-4)
    assert grpo_advantages(torch.tensor([0.0, 2e-6]), 2, eps=0.0).tolist() == pytest.approx(
        [-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-4
    )


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


# Asymmetric clipping (DAPO's clip-higher): eps_low bounds the ratio below, eps_high above. Each case is one
# token of one sample: (ratio, advantage, the ratio the loss uses, whether the token is clipped). The ratios
# between the two bounds (1.25; 0.75) tell the bounds apart: swapped, each would be clipped the other way.
EPS_LOW, EPS_HIGH = 0.2, 0.28
ASYMMETRIC = [
    (1.25, 1.0, 1.25, False),  # above 1 + eps_low, below 1 + eps_high: not clipped
    (1.5, 1.0, 1.28, True),  # above 1 + eps_high: clipped to it
    (0.5, 1.0, 0.5, False),  # A > 0 and a lower ratio: the pessimistic bound is the unclipped one
    (0.75, -1.0, 0.8, True),  # below 1 - eps_low, above 1 - eps_high: clipped to 1 - eps_low
    (0.5, -1.0, 0.8, True),  # far below: clipped to 1 - eps_low
    (0.85, -1.0, 0.85, False),  # inside the range
    (1.5, -1.0, 1.5, False),  # A < 0 and a higher ratio: the unclipped term, not 1 + eps_high
    (1.25, 2.0, 1.25, False),
    (0.75, -3.0, 0.8, True),
]


@pytest.mark.parametrize("ratio, advantage, used, clipped", ASYMMETRIC)
def test_ppo_asymmetric_clip_both_advantage_signs(ratio, advantage, used, clipped):
    old = torch.tensor([[0.0, -1.0]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    mask = torch.tensor([[0.0, 1.0]])
    loss, clipfrac, ppo_kl = ppo_clip_loss(logp, old, torch.tensor([advantage]), mask, EPS_LOW, EPS_HIGH)
    assert loss.item() == pytest.approx(-advantage * used, rel=1e-6)
    assert clipfrac.item() == (1.0 if clipped else 0.0)
    assert ppo_kl.item() == pytest.approx(-math.log(ratio), rel=1e-5)
    loss.backward()
    # d/dlogp of -A * exp(logp - old) is -A * ratio; a clipped token's term is constant
    assert logp.grad[0, 0].item() == 0.0  # masked
    assert logp.grad[0, 1].item() == pytest.approx(0.0 if clipped else -advantage * ratio, rel=1e-5)


def test_ppo_asymmetric_clip_in_one_batch_takes_the_sample_mean():
    """The cases above as one batch of samples with two tokens each (the second a ratio-1 token): the loss is
    the mean over samples of each sample's token mean."""
    n = len(ASYMMETRIC)
    old = torch.full((n, 3), -2.0)
    logp = old.clone()
    logp[:, 1] += torch.tensor([math.log(r) for r, *_ in ASYMMETRIC])
    adv = torch.tensor([a for _, a, *_ in ASYMMETRIC])
    mask = torch.tensor([[0.0, 1.0, 1.0]] * n)
    loss, clipfrac, _ = ppo_clip_loss(logp, old, adv, mask, EPS_LOW, EPS_HIGH)
    expected = sum((-a * used - a) / 2 for _, a, used, _ in ASYMMETRIC) / n
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert clipfrac.item() == pytest.approx(sum(c for *_, c in ASYMMETRIC) / 2 / n)


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
    # by hand: k1 = logp - ref; k3 = e^(ref - logp) - (ref - logp) - 1
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.5])
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 0.5, math.exp(1.5) - 2.5])


# ---------------------------------------------------------------- the trainer's loss: pg - entropy + KL


def _by_hand(table, tokens, mask, adv, old, ref, temperature, eps_low, eps_high, kl_type):
    """(pg, entropy, kl) of the trainer's loss, in Python floats from the definitions in algo.py's docstring."""

    def log_softmax(row):
        top = max(row)
        norm = top + math.log(sum(math.exp(x - top) for x in row))
        return [x - norm for x in row]

    per_sample = {"pg": [], "entropy": [], "kl": []}
    for i in range(len(tokens)):
        terms = {"pg": [], "entropy": [], "kl": []}
        for t in range(1, len(tokens[i])):
            if not mask[i][t]:
                continue
            logps = log_softmax([x / temperature for x in table[t - 1]])
            logp = logps[tokens[i][t]]
            ratio = math.exp(logp - old[i][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            terms["pg"].append(max(-adv[i] * ratio, -adv[i] * clipped))
            terms["entropy"].append(-sum(math.exp(lp) * lp for lp in logps))
            log_ratio = logp - ref[i][t]
            terms["kl"].append(log_ratio if kl_type == "k1" else math.exp(-log_ratio) + log_ratio - 1)
        for key, values in terms.items():
            per_sample[key].append(sum(values) / len(values))
    return {key: sum(values) / len(values) for key, values in per_sample.items()}


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_trainer_loss_is_pg_minus_entropy_plus_kl_by_hand(kl_type):
    """kl_coef and entropy_coef above 0, eps_clip != eps_clip_high, a temperature: the trainer's reported
    loss and each of its terms equal the hand computation (before the optimizer step changes anything)."""
    from rlbench.backends.torch_trainer import TorchTrainer
    from rlbench.config import AlgoConfig, TrainConfig
    from rlbench.core.algo import TrainBatch

    gen = torch.Generator().manual_seed(11)
    table = torch.randn(4, 6, generator=gen)
    tokens = [[0, 2, 5, 1], [0, 3, 1, 0]]  # the second sample is one token shorter (right-padded)
    mask = [[0, 1, 1, 1], [0, 1, 1, 0]]
    adv = [1.5, -0.5]
    temperature, eps_low, eps_high, kl_coef, entropy_coef = 0.7, 0.1, 0.3, 0.25, 0.05
    exact = token_logprobs(table[None].expand(2, 4, 6), torch.tensor(tokens), temperature)
    # old log-probs that put ratios on both sides of both bounds, and a reference apart from the policy
    old = (exact - torch.tensor([[0.0, 0.2, -0.5, 0.05], [0.0, -0.3, 0.15, 0.0]])).tolist()
    ref = (exact + torch.tensor([[0.0, 0.4, -0.7, 0.1], [0.0, 0.3, -0.2, 0.0]])).tolist()
    algo_config = AlgoConfig(
        eps_clip=eps_low, eps_clip_high=eps_high, kl_coef=kl_coef, kl_type=kl_type, entropy_coef=entropy_coef
    )
    trainer = TorchTrainer(
        TableLogits(table), TrainConfig(minibatches=1, micro_batch_size=2), algo_config, temperature, seed=0
    )
    batch = TrainBatch(
        torch.tensor(tokens),
        torch.tensor(mask, dtype=torch.float32),
        torch.tensor(adv),
        torch.tensor(old),
        torch.tensor(ref),
    )
    metrics = trainer.train_step(batch, step=0).metrics
    hand = _by_hand(table.tolist(), tokens, mask, adv, old, ref, temperature, eps_low, eps_high, kl_type)
    assert metrics["train/pg_loss"] == pytest.approx(hand["pg"], rel=1e-5)
    assert metrics["train/entropy_loss"] == pytest.approx(hand["entropy"], rel=1e-5)
    assert metrics["train/kl_loss"] == pytest.approx(hand["kl"], rel=1e-5)
    expected = hand["pg"] - entropy_coef * hand["entropy"] + kl_coef * hand["kl"]
    assert metrics["train/loss"] == pytest.approx(expected, rel=1e-5)
    assert 0 < metrics["train/pg_clipfrac"] < 1  # some tokens were clipped, not all


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


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_token_logprobs_matches_hand_computation(temperature):
    """Temperature 0 (greedy decoding) leaves the logits unscaled."""
    gen = torch.Generator().manual_seed(7)
    n, length, vocab = 2, 5, 11
    logits = torch.randn(n, length, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (n, length), generator=gen)
    expected = torch.zeros(n, length)
    for i in range(n):
        for t in range(1, length):
            expected[i, t] = torch.log_softmax(logits[i, t - 1] / (temperature or 1.0), dim=-1)[tokens[i, t]]
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
    assert part.shape == full.shape and torch.equal(part[:, -(keep - 1) :], full[:, -(keep - 1) :])
    assert not part[:, : 6 - keep + 1].any()
    whole, tail = token_entropy(logits, 0.7), token_entropy(logits[:, -keep:], 0.7, 6)
    assert tail.shape == whole.shape and torch.equal(tail[:, -(keep - 1) :], whole[:, -(keep - 1) :])


def test_sequence_logprobs_is_one_unpadded_row_of_token_logprobs():
    """The true on-policy definition: one sequence, batch size 1, its own length; returned on the CPU."""
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(6, 9, generator=gen)
    ids = torch.tensor([3, 1, 8, 0, 5])
    got = sequence_logprobs(TableLogits(table), ids, 0.5, "cpu")
    assert got.shape == (5,) and got.device.type == "cpu"
    assert torch.equal(got, token_logprobs(table[None, :5], ids[None], 0.5)[0])
    assert got[0] == 0 and bool((got[1:] < 0).all())


def test_sequence_logprobs_runs_the_model_on_the_device_it_is_given():
    """The ids go to `device` before the forward (a GPU engine's model is there). This machine has no second
    device with data, so the meta device stands in: the forward sees meta ids, and the CPU copy of a result
    that has no data is refused (with the ids left on the CPU, it would have run and returned)."""
    seen = []

    class Model(torch.nn.Module):
        def forward(self, input_ids, use_cache=None):
            seen.append(input_ids.device)
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 4, device=input_ids.device))

    with pytest.raises(NotImplementedError, match="meta"):
        sequence_logprobs(Model(), torch.tensor([1, 2, 3]), 1.0, "meta")
    assert seen == [torch.device("meta")]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_token_entropy_matches_hand_computation(temperature):
    """Entropy of the distribution predicting each token; temperature 0 (greedy) leaves the logits unscaled."""
    logits = torch.tensor([[[0.0, 0.0], [1.0, -1.0], [5.0, 5.0]]])
    got = token_entropy(logits, temperature)
    scale = temperature or 1.0
    p = 1 / (1 + math.exp(-2 / scale))  # softmax of (1, -1) / T
    assert got.shape == (1, 3) and got[0, 0] == 0
    assert got[0, 1].item() == pytest.approx(math.log(2))
    assert got[0, 2].item() == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), rel=1e-5)


# ---------------------------------------------------------------- groups by id, of any size


@st.composite
def unequal_groups(draw):
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(ids))))
    rewards = draw(st.lists(dyadic_reward, min_size=len(ids), max_size=len(ids)))
    return torch.tensor(rewards, dtype=torch.float32), torch.tensor([ids[i] for i in order])


@PROPERTY
@given(unequal_groups(), st.booleans())
def test_groups_by_id_are_each_normalised_on_their_own(case, normalize_std):
    """Each group, wherever its samples sit, gets what it would get alone (consecutive, by size)."""
    rewards, ids = case
    adv = grpo_advantages(rewards, ids, normalize_std)
    for group in ids.unique():
        members = ids == group
        alone = grpo_advantages(rewards[members], int(members.sum()), normalize_std)
        torch.testing.assert_close(adv[members], alone, atol=1e-6, rtol=0)


@PROPERTY
@given(grouped_rewards(), st.booleans())
def test_consecutive_ids_equal_the_group_size(case, normalize_std):
    rewards, group_size = case
    ids = torch.arange(len(rewards)) // group_size
    torch.testing.assert_close(
        grpo_advantages(rewards, ids, normalize_std),
        grpo_advantages(rewards, group_size, normalize_std),
        atol=1e-6,
        rtol=0,
    )


def test_a_group_of_one_gets_zero_and_a_constant_group_exactly_zero():
    adv = grpo_advantages(torch.tensor([1.0, 0.9, 0.9, 0.9, 0.0, 1.0]), torch.tensor([0, 1, 1, 1, 2, 2]))
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4:].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-5)


def _config(**changes) -> AlgoConfig:
    return AlgoConfig(**changes)


def test_normalised_rewards_per_estimator():
    rewards, ids = torch.tensor([1.0, 0.0, 0.5, 0.25]), torch.tensor([0, 0, 1, 1])
    centred = [0.5, -0.5, 0.125, -0.125]
    assert algo.normalised_rewards(rewards, ids, _config(normalize_std=False)).tolist() == centred
    for estimator in ("grpo", "gspo", "cispo"):  # the std applies to these three
        got = algo.normalised_rewards(rewards, ids, _config(advantage=estimator))
        assert got.tolist() == pytest.approx([c / (math.sqrt(2 * c * c) + 1e-6) for c in centred], rel=1e-6)
    baseline = _config(advantage="reinforce_plus_plus_baseline", normalize_advantages=True)
    assert algo.normalised_rewards(rewards, ids, baseline).tolist() == centred  # centred only, std or not
    plain = _config(advantage="reinforce_plus_plus", normalize_advantages=True)
    assert algo.normalised_rewards(rewards, ids, plain).tolist() == rewards.tolist()


# ---------------------------------------------------------------- whitening over trained tokens


def test_whiten_weighs_each_sample_by_its_trained_tokens():
    values, counts = torch.tensor([1.0, 3.0, 100.0]), torch.tensor([3, 1, 0])  # the third trains on nothing
    tokens = torch.tensor([1.0, 1.0, 1.0, 3.0])
    expected = (values - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)  # unbiased, over the 4 tokens
    torch.testing.assert_close(algo.whiten(values, counts), expected)
    got = algo.advantages(
        values, torch.tensor([0, 1, 2]), counts, _config(advantage="reinforce_plus_plus", normalize_advantages=True)
    )
    torch.testing.assert_close(got, expected)
    one = algo.whiten(torch.tensor([2.0, 5.0]), torch.tensor([1, 0]))  # one token: no Bessel correction, variance 0
    assert one.tolist() == pytest.approx([0.0, 3 / math.sqrt(1e-8)])


def test_whiten_refuses_a_step_with_no_trained_token():
    with pytest.raises(BadInput, match="algo.normalize_advantages: no trained token"):
        algo.whiten(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]))


# ---------------------------------------------------------------- the loss options


def test_k2_and_low_var_kl_match_definitions():
    logp, ref = torch.tensor([-1.0, -2.0, -1.0]), torch.tensor([-1.5, -0.5, 4.0])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 1.125, 12.5])
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[2].item() == pytest.approx(math.exp(5) - 6)  # about 142
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx([k3[0].item(), k3[1].item(), 10.0])


def test_dual_clip_bounds_a_negative_advantage():
    """A < 0 and ratio 3: PPO-clip's loss is -A * 3; dual clip at 2 makes it -A * 2 (no gradient); A > 0 is
    untouched."""
    old = torch.zeros(2, 2)
    logp = torch.full((2, 2), math.log(3.0)).requires_grad_(True)
    adv, mask = torch.tensor([-1.0, 1.0]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    plain, _, _, _ = algo.policy_terms(logp, old, adv, mask, "grpo", 0.2, 0.2)
    dual, _, _, _ = algo.policy_terms(logp, old, adv, mask, "grpo", 0.2, 0.2, eps_c=2.0)
    assert plain[:, 1].tolist() == pytest.approx([3.0, -1.2])
    assert dual[:, 1].tolist() == pytest.approx([2.0, -1.2])
    (dual * mask).sum().backward()
    assert logp.grad[0, 1].item() == 0.0


def test_gspo_uses_the_samples_mean_ratio_on_every_token():
    old = torch.zeros(1, 4)
    logp = torch.tensor([[0.0, 0.1, 0.3, 9.0]])  # the last token is masked: not in the mean
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    loss, clipped, ppo_kl, ratio = algo.policy_terms(logp, old, torch.tensor([1.0]), mask, "gspo", 0.2, 0.28)
    assert ratio[0].tolist() == pytest.approx([math.exp(0.2)] * 4)
    assert ppo_kl[0].tolist() == pytest.approx([-0.2] * 4) and clipped.sum() == 0
    assert loss[0, 1].item() == pytest.approx(-math.exp(0.2))


def test_cispo_clips_the_weight_and_keeps_the_gradient():
    """CISPO: -sg(clip(r)) * A * logp; a clipped token still has the gradient -clip(r) * A (PPO's would be 0)."""
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.0, math.log(1.5)]]).requires_grad_(True)
    mask = torch.tensor([[0.0, 1.0]])
    loss, clipped, _, _ = algo.policy_terms(logp, old, torch.tensor([2.0]), mask, "cispo", 0.2, 0.28)
    assert loss[0, 1].item() == pytest.approx(-1.28 * 2.0 * math.log(1.5))
    assert clipped[0, 1].item() == 1.0
    (loss * mask).sum().backward()
    assert logp.grad[0, 1].item() == pytest.approx(-1.28 * 2.0)


def test_tis_weights_and_metrics():
    old, rollout = torch.tensor([0.0, 0.0, 0.0]), torch.log(torch.tensor([0.25, 1.0, 2.0]))  # ratios 4, 1, 0.5
    weight, terms = algo.tis_terms(old, rollout, 0.6, 2.0)
    assert weight.tolist() == pytest.approx([2.0, 1.0, 0.6])
    assert terms["tis"].tolist() == pytest.approx([4.0, 1.0, 0.5])
    assert terms["tis_clipfrac"].tolist() == [1.0, 0.0, 1.0]
    assert terms["tis_abs"].tolist() == pytest.approx([3.0, 0.0, 0.5])


def test_per_token_reducer_counts_a_removed_sample_as_one_token():
    values = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [7.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    tokens = algo.token_denominator(mask)
    assert tokens.item() == 5  # 3 + 1 (removed: clamp to 1) + 1
    assert algo.reducer(mask, tokens)(values).item() == pytest.approx((1 + 2 + 3 + 7) / 5)
    assert algo.reducer(mask)(values).item() == pytest.approx((2 + 0 + 7) / 3)  # per sample: removed counts as 0


def test_policy_loss_metric_names_follow_the_options():
    # kl_coef pinned to 0: without the KL term (the default's kl_coef is 0.1), no kl_loss
    assert algo.loss_metric_names(_config(kl_coef=0.0)) == ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss")
    assert algo.loss_metric_names(_config(kl_coef=0.1, use_tis=True))[4:] == (
        "kl_loss",
        "ois",
        "tis",
        "tis_clipfrac",
        "tis_abs",
    )


# ---------------------------------------------------------------- AlgoConfig


@pytest.mark.parametrize(
    "key, value",
    [
        ("advantage", "vanilla_pg"),
        ("normalize_std", 1),
        ("eps_clip", 0),
        ("eps_clip_high", -0.1),
        ("eps_clip_c", 1.0),
        ("eps_clip_c", "3"),
        ("kl_coef", -1),
        ("kl_type", "k4"),
        ("entropy_coef", math.inf),
        ("normalize_advantages", "yes"),
        ("per_token_loss", None),
        ("use_tis", 0),
        ("tis_clip", 0),
        ("tis_clip_low", -1),
    ],
)
def test_algo_config_refuses_by_name(key, value):
    with pytest.raises(BadInput, match=f"algo.{key}: expected"):
        AlgoConfig(**{key: value})


@pytest.mark.parametrize(
    "changes, key, fix",
    [
        ({"advantage": "cispo", "eps_clip_c": 3.0}, "eps_clip_c", None),
        ({"advantage": "reinforce_plus_plus"}, "normalize_advantages", True),
        ({"advantage": "reinforce_plus_plus_baseline"}, "normalize_advantages", True),
        ({"tis_clip": 1.5, "tis_clip_low": 1.6}, "tis_clip_low", 1.5),
    ],
)
def test_algo_config_refuses_what_slime_refuses_or_ignores(changes, key, fix):
    with pytest.raises(BadInput, match=f"algo.{key}: expected"):
        AlgoConfig(**changes)
    AlgoConfig(**{**changes, key: fix})  # the same with that one setting changed is taken


def test_algo_config_from_toml_and_from_an_older_manifest(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[algo]\nadvantage = "gspo"\neps_clip_c = 3\nkl_type = "low_var_kl"\nper_token_loss = true\n')
    algo_config = load_config(path).algo
    assert (algo_config.advantage, algo_config.eps_clip_c, algo_config.kl_type, algo_config.per_token_loss) == (
        "gspo",
        3.0,
        "low_var_kl",
        True,
    )
    path.write_text('[algo]\neps_clip_c = "high"\n')
    with pytest.raises(BadInput, match="algo.eps_clip_c: expected a number"):
        load_config(path)
    table = RunConfig().to_dict()
    table["algo"] = {
        k: table["algo"][k]
        for k in ("advantage", "normalize_std", "eps_clip", "eps_clip_high", "kl_coef", "kl_type", "entropy_coef")
    }  # before issue 21
    assert config_from_dict(table, "manifest.json").algo == AlgoConfig()
    assert config_from_dict(RunConfig(algo=algo_config).to_dict(), "manifest.json").algo == algo_config


# ---------------------------------------------------------------- the loop's groups and the logprob metrics


def _state(meta: list[dict], n: int):
    state = loop.StepState(3)
    state.sample_meta, state.tensors["rewards"] = meta, torch.zeros(n)
    return state


def test_groups_from_recorded_sample_metadata():
    ctx = SimpleNamespace(group_size=4)
    assert loop.groups(ctx, _state([{}] * 8, 8)) == 4  # a live run or a recording without "group"
    assert loop.groups(ctx, _state([{"group": g} for g in (7, 7, 9, 9, 9)], 5)).tolist() == [7, 7, 9, 9, 9]
    with pytest.raises(BadInput, match="samples.group: the recording of step 3: 5 samples do not make groups"):
        loop.groups(ctx, _state([{}] * 5, 5))
    with pytest.raises(BadInput, match="sample 1's group is None; expected an integer >= 0 on every sample"):
        loop.groups(ctx, _state([{"group": 0}, {}], 2))
    with pytest.raises(BadInput, match="sample 0's group is True"):
        loop.groups(ctx, _state([{"group": True}], 1))


def _flat(lengths, masks, diffs):
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    mask = torch.tensor([m for row in masks for m in row], dtype=torch.uint8)
    old = torch.tensor([d for row in diffs for d in row], dtype=torch.float32)
    return {"offsets": offsets, "loss_mask": mask, "old_logprobs": old, "rollout_logprobs": torch.zeros_like(old)}


def test_logprob_abs_diff_is_slimes_per_sample_mean_not_the_token_mean():
    """One short sample with a large difference, one long with a small one, one removed: the per-sample mean
    (slime's train/train_rollout_logprob_abs_diff) weighs the samples, the token mean the tokens."""
    tensors = _flat([2, 5, 2], [[0, 1], [0, 1, 1, 1, 1], [0, 0]], [[0, 0.8], [0, 0.1, -0.1, 0.1, 0.1], [0, 0.5]])
    assert metrics.logprob_abs_diff(tensors) == pytest.approx((0.8 + 0.1 + 0) / 3)
    assert metrics.logprob_abs_diff(tensors, per_token=True) == pytest.approx((0.8 + 0.4) / (1 + 4 + 1))
    assert metrics.logprob_abs_diff_token_mean(tensors) == pytest.approx((0.8 + 0.4) / 5)
    # a sample whose engine reported no log-probs (0.0 in the tensor) is left out, not read as a log-prob
    known = torch.tensor([True, False, True])
    assert metrics.logprob_abs_diff(tensors, known=known) == pytest.approx((0.8 + 0) / 2)
    assert metrics.logprob_abs_diff(tensors, per_token=True, known=known) == pytest.approx(0.8 / 2)
    assert metrics.logprob_abs_diff_token_mean(tensors, known) == pytest.approx(0.8)


# ---------------------------------------------------------------- the trainer's refusals


def _trainer(**algo_changes):
    from rlbench.backends.torch_trainer import TorchTrainer
    from rlbench.config import TrainConfig

    table = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    return TorchTrainer(
        TableLogits(table), TrainConfig(minibatches=2, micro_batch_size=2), AlgoConfig(**algo_changes), 1.0, seed=0
    )


def test_trainer_refuses_samples_that_do_not_split_into_minibatches_and_tis_without_rollout_logprobs():
    from rlbench.core.algo import TrainBatch

    def batch(n):
        return TrainBatch(
            torch.zeros(n, 4, dtype=torch.long), torch.ones(n, 4), torch.zeros(n), torch.zeros(n, 4), None
        )

    with pytest.raises(BadInput, match="train.minibatches: step 0 has 3 samples, which do not split into 2"):
        _trainer().train_step(batch(3), 0)
    with pytest.raises(BadInput, match="algo.use_tis: step 0: TIS needs the rollout log-probs"):
        _trainer(use_tis=True).train_step(batch(4), 0)


def _logprob_stage(meta: list[dict], **algo_changes):
    tensors = _flat([2, 3], [[0, 1], [0, 1, 1]], [[0, 0.5], [0, 0.25, 0.25]])
    tensors["tokens"], tensors["advantages"] = torch.tensor([1, 2, 1, 3, 4]), torch.zeros(2)
    tensors["rollout_logprobs"] = -tensors.pop("old_logprobs")  # the trainer's below are 0: |delta| as above
    state = _state(meta, 2)
    state.tensors.update(tensors)
    ctx = SimpleNamespace(
        config=SimpleNamespace(rollout=SimpleNamespace(true_on_policy=False), algo=AlgoConfig(**algo_changes)),
        trainer=SimpleNamespace(logprobs=lambda tokens, **kwargs: torch.zeros(tokens.shape)),
    )
    loop.logprob(ctx, state)
    return state


def test_logprob_stage_leaves_out_samples_without_rollout_logprobs_and_tis_refuses_them():
    state = _logprob_stage([{}, {}])
    assert state.metrics["train/train_rollout_logprob_abs_diff"] == pytest.approx((0.5 + 0.25) / 2)
    assert state.metrics["train/rollout_logprob_abs_diff_token_mean"] == pytest.approx(1.0 / 3)
    state = _logprob_stage([{}, {"has_rollout_logprobs": False}])
    assert state.metrics["train/train_rollout_logprob_abs_diff"] == pytest.approx(0.5)
    assert "train/train_rollout_logprob_abs_diff" not in _logprob_stage([{"has_rollout_logprobs": False}] * 2).metrics
    assert _logprob_stage([{}, {}], use_tis=True).batch.rollout_logprobs is not None
    with pytest.raises(BadInput, match="algo.use_tis: step 3: sample 1 has no rollout log-probs"):
        _logprob_stage([{}, {"has_rollout_logprobs": False}], use_tis=True)


def test_per_token_advantages_are_each_tokens_own_and_a_constant_row_is_the_per_sample_advantage():
    """PPO with a critic (issue 56) gives every token its own advantage ([n, L]); the other estimators one per sample
    ([n]), which is the same as that value on every token of its row, bit for bit."""
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.9, -1.1]])
    old = torch.tensor([[-1.2, -0.4, -1.0], [-0.3, -1.5, -1.1]])
    mask = torch.ones(2, 3)
    per_sample = torch.tensor([0.7, -1.3])
    one = algo.policy_terms(logp, old, per_sample, mask, "grpo", 0.2, 0.28)
    rows = algo.policy_terms(logp, old, per_sample[:, None].expand(2, 3), mask, "grpo", 0.2, 0.28)
    assert all(torch.equal(a, b) for a, b in zip(one, rows))
    per_token = torch.tensor([[0.5, -1.0, 2.0], [0.0, 1.5, -0.25]])
    loss, clipped, _, ratio = algo.policy_terms(logp, old, per_token, mask, "grpo", 0.2, 0.28)
    unclipped, bounded = -per_token * ratio, -per_token * ratio.clamp(0.8, 1.28)
    assert torch.equal(loss, torch.maximum(unclipped, bounded))
    assert torch.equal(clipped, (bounded > unclipped).float())
    assert clipped.sum() > 0 and loss[1, 0] == 0  # some token clipped; an advantage of 0 gives no loss


def test_the_position_chunks_cover_every_position_once_each_at_most_chunk_logits(monkeypatch):
    monkeypatch.setattr(algo, "CHUNK_LOGITS", 13)
    logits = torch.zeros(2, 7, 3)  # 6 logits a position: 2 positions a chunk
    assert algo._position_chunks(logits) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]
    monkeypatch.setattr(algo, "CHUNK_LOGITS", 5)  # less than one position: one position a chunk
    assert algo._position_chunks(logits) == [slice(k, k + 1) for k in range(7)]
    monkeypatch.setattr(algo, "CHUNK_LOGITS", 42)
    assert algo._position_chunks(logits) == [slice(0, 7)]
    assert algo._position_chunks(torch.zeros(2, 0, 3)) == []
    monkeypatch.setattr(algo, "CHUNK_LOGITS", 2)  # one logit a position: two positions a chunk
    assert algo._position_chunks(torch.zeros(1, 5, 1)) == [slice(0, 2), slice(2, 4), slice(4, 5)]


@pytest.mark.parametrize("limit", [6, 13, 1 << 26])
def test_chunked_log_probs_and_entropy_are_the_whole_tensors_bits_and_so_are_their_gradients(monkeypatch, limit):
    """Chunks of positions (checkpointed under autograd, one call a chunk) give the values and gradients of one pass
    over the whole, bit for bit: the log-softmax is computed row by row."""
    import torch.utils.checkpoint as checkpointing

    generator_ = torch.Generator().manual_seed(3)
    base = torch.randn(2, 7, 3, generator=generator_)
    tokens = torch.randint(0, 3, (2, 7), generator=generator_)

    def run():
        logits = base.clone().requires_grad_(True)
        logp = algo.token_logprobs(logits, tokens, 0.7)
        entropy = algo.token_entropy(logits, 0.7)
        (logp.sum() + entropy.sum()).backward()
        return logp.detach(), entropy.detach(), logits.grad

    whole = run()
    calls = []
    real = checkpointing.checkpoint
    # non-reentrant: the reentrant form's backward runs outside autograd's graph (and warns when not asked)
    monkeypatch.setattr(
        checkpointing, "checkpoint", lambda *a, **k: calls.append(k.get("use_reentrant")) or real(*a, **k)
    )
    monkeypatch.setattr(algo, "CHUNK_LOGITS", limit)
    chunked = run()
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    chunks = len(algo._position_chunks(base[:, :-1]))
    assert calls == [False] * (2 * chunks if chunks > 1 else 0)  # log-probs and entropy, each chunk checkpointed
    calls.clear()
    with torch.no_grad():
        assert torch.equal(algo.token_logprobs(base, tokens, 0.7), whole[0]) and not calls  # nothing to keep
    assert torch.equal(algo.token_logprobs(base, tokens, 0.7), whole[0]) and not calls  # logits needing no grad


def test_a_fan_outs_denominators_are_each_rollouts_token_total_and_its_loss_a_mean_over_rollouts():
    """slime's rollout_mask_sums and its per-rollout reducer: samples of one rollout share its token total; each
    sample's masked sum over it, summed, over the minibatch's rollout count."""
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    rollouts = torch.tensor([7, 7, 2, 9, 4])
    denominators = algo.rollout_denominators(mask, rollouts)
    assert denominators.dtype == mask.dtype and denominators.tolist() == [5.0, 5.0, 0.0, 4.0, 1.0]
    values = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    got = algo.rollout_reducer(mask, denominators, 4)(values)
    sums = (values * mask).sum(-1)  # 1, 15, 0, 54, 16
    expected = (sums / denominators.clamp(min=1)).sum() / 4  # a rollout of no trained token counts as one token
    assert torch.equal(got, expected) and abs(float(got) - (16 / 5 + 0 + 54 / 4 + 16 / 1) / 4) < 1e-6


def test_whitening_two_tokens_takes_bessels_correction():
    out = algo.whiten(torch.tensor([1.0, 3.0]), torch.tensor([1, 1]))
    # mean 2; variance 1 over the two, 2 with Bessel's correction
    assert torch.allclose(out, torch.tensor([-1.0, 1.0]) / (2 + 1e-8) ** 0.5, rtol=0, atol=1e-7)


def test_bf16_logits_are_read_in_float32_and_a_gspo_sample_of_one_token_is_its_own_ratio():
    logits = torch.randn(1, 4, 9, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    tokens = torch.tensor([[1, 5, 2, 7]])
    got = algo.token_logprobs(logits, tokens, 1.0)
    assert got.dtype == torch.float32 and torch.equal(got, algo.token_logprobs(logits.float(), tokens, 1.0))
    logp, old = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, -1.5, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 0.0]])  # one trained token: the mean log-ratio is its own, 0.5
    _, _, kl, ratio = algo.policy_terms(logp, old, torch.tensor([1.0]), mask, "gspo", 0.2, 0.28)
    assert torch.allclose(ratio, torch.full((1, 3), math.exp(0.5))) and torch.allclose(kl, torch.full((1, 3), -0.5))
