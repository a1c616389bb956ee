"""PPO's critic (issue 56), rlbench/core/critic.py: the value model as slime builds it (the policy's decoder under a
one-output head drawn N(0, 0.02), bias 0, its output float32) and its values laid out as the log-probs are (the
value of token t read at position t - 1)."""

from __future__ import annotations

import pytest
import torch

from rlbench.config_sections import FIXTURES
from rlbench.core.critic import HEAD_STD, ValueModel, token_values
from rlbench.core.model import build_model
from rlbench.core.seeding import generator

MODEL = str(FIXTURES / "models" / "tiny-qwen3-sft")


@pytest.fixture(scope="module")
def policy():
    return build_model(MODEL, 1234, "float32", "cpu", init="checkpoint").eval()


def test_the_head_is_one_output_drawn_from_the_runs_seed_with_a_zero_bias(policy):
    critic = ValueModel(policy, seed=7)
    hidden = policy.config.hidden_size
    assert tuple(critic.head.weight.shape) == (1, hidden) and tuple(critic.head.bias.shape) == (1,)
    expected = torch.empty(1, hidden).normal_(0.0, HEAD_STD, generator=generator(7, "critic_head"))
    assert torch.equal(critic.head.weight, expected) and torch.equal(critic.head.bias, torch.zeros(1))
    assert HEAD_STD == 0.02  # Megatron's init_method_std, slime's critic head's
    assert torch.equal(ValueModel(policy, seed=7).head.weight, critic.head.weight)
    assert not torch.equal(ValueModel(policy, seed=8).head.weight, critic.head.weight)


def test_the_trunk_is_the_policys_decoder_copied_and_its_output_layer_is_not_part_of_it(policy):
    critic = ValueModel(policy, seed=7)
    theirs = dict(policy.get_decoder().named_parameters())
    ours = dict(critic.trunk.named_parameters())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not any(p is q for p in critic.parameters() for q in policy.parameters())  # trained apart
    names = {name for name, _ in critic.named_parameters()}
    assert names == {f"trunk.{k}" for k in theirs} | {"head.weight", "head.bias"}


def test_the_value_of_token_t_is_the_head_at_position_t_minus_1_in_float32(policy):
    critic = ValueModel(policy, seed=7)
    tokens = torch.tensor([[5, 9, 14, 3, 22, 8], [4, 4, 17, 30, 2, 11]])
    with torch.no_grad():
        values = token_values(critic, tokens)
        hidden = policy.get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state
        head = hidden @ critic.head.weight[0] + critic.head.bias[0]
    assert values.dtype == torch.float32 and values.shape == tokens.shape
    assert torch.equal(values[:, 0], torch.zeros(2))
    assert torch.allclose(values[:, 1:], head[:, :-1], rtol=0, atol=1e-6)


def test_padding_after_a_sequence_leaves_its_values_and_gradients_reach_trunk_and_head(policy):
    critic = ValueModel(policy, seed=3)
    short = torch.tensor([[5, 9, 14, 3]])
    padded = torch.tensor([[5, 9, 14, 3, 0, 0, 0]])
    with torch.no_grad():
        assert torch.allclose(token_values(critic, padded)[:, :4], token_values(critic, short), rtol=0, atol=1e-6)
    token_values(critic, short).sum().backward()
    assert critic.head.weight.grad is not None and critic.head.weight.grad.abs().sum() > 0
    assert critic.head.bias.grad is not None and float(critic.head.bias.grad) == 3.0  # three positions read
    assert all(p.grad is not None for p in critic.trunk.layers[0].parameters())


def test_a_bf16_policy_gives_a_bf16_critic_whose_values_are_float32(policy):
    critic = ValueModel(build_model(MODEL, 1234, "bfloat16", "cpu", init="checkpoint"), seed=7)
    assert critic.head.weight.dtype == torch.bfloat16 == next(critic.trunk.parameters()).dtype
    expected = torch.empty(1, policy.config.hidden_size).normal_(0.0, HEAD_STD, generator=generator(7, "critic_head"))
    assert torch.equal(critic.head.weight.float(), expected.to(torch.bfloat16).float())
    with torch.no_grad():
        assert token_values(critic, torch.tensor([[5, 9, 14]])).dtype == torch.float32


# --------------------------------------------------------------------------- the critic's trainer


def _batch(n: int = 6, width: int = 9, seed: int = 0):
    from rlbench.core.algo import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 60, (n, width), generator=g)
    lengths = torch.tensor([width - (i % 3) for i in range(n)])
    mask = torch.zeros(n, width)
    for i, length in enumerate(lengths.tolist()):
        tokens[i, length:] = 0
        mask[i, 3:length] = 1.0  # the response: positions 3.. of each sequence
    mask[1, 5] = 0.0  # a tool token
    returns = torch.randn(n, width, generator=g) * mask
    return TrainBatch(tokens, mask, torch.zeros(n), torch.zeros(n, width), None, lengths=lengths, returns=returns)


def _trainer(policy, seed: int = 5, algo=None, **train):
    from rlbench.backends.critic_trainer import CriticTrainer
    from rlbench.config import AlgoConfig, TrainConfig

    config = TrainConfig(**{"minibatches": 2, "micro_batch_size": 2, "lr": 1e-3, **train})
    # the actor's options as a run gives them: KL and TIS are the actor's, the critic has neither
    options = AlgoConfig(kl_coef=0.1, use_tis=True) if algo is None else algo
    return CriticTrainer(ValueModel(policy, seed=seed), config, options, 0.2, seed)


@pytest.mark.parametrize("per_token", [False, True])
def test_the_critic_trains_on_the_clipped_value_loss_under_slimes_names(policy, per_token):
    """One minibatch of three micro-batches: every micro-batch at the weights before the update, so the step's
    loss and clip fraction are the value loss of the whole batch, reduced per sample or per token."""
    from rlbench.config import AlgoConfig
    from rlbench.core import algo, ppo

    trainer = _trainer(policy, minibatches=1, algo=AlgoConfig(kl_coef=0.1, use_tis=True, per_token_loss=per_token))
    assert trainer.reference is None  # slime's critic role has no KL term
    batch = _batch()
    now = trainer.values(batch.tokens, batch.lengths)
    batch.values = now + torch.tensor([0.5, -0.1, 0.3, 0.0, -0.4, 0.05])[:, None]  # some past the clip
    terms, clipped = ppo.value_loss_terms(now, batch.values, batch.returns, 0.2)
    reduce = algo.reducer(batch.loss_mask, batch.loss_mask.sum() if per_token else None)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.train_step(batch, step=0)
    assert set(stats.metrics) == {"train/critic-value_loss", "train/critic-value_clipfrac", "train/critic-grad_norm"}
    for key, want in (("value_loss", reduce(terms)), ("value_clipfrac", reduce(clipped))):
        assert abs(stats.metrics[f"train/critic-{key}"] - float(want)) <= 1e-6 * max(1.0, float(want)), key
    assert 0 < stats.metrics["train/critic-value_clipfrac"] < 1 and stats.metrics["train/critic-grad_norm"] > 0
    assert abs(float(stats.losses[0]) - float(reduce(terms))) <= 1e-6 * max(1.0, float(reduce(terms)))
    assert all(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


def test_the_critics_minibatches_are_the_actors_and_its_step_the_same_bits_twice(policy):
    from rlbench.core import algo, ppo

    runs = []
    for _ in range(2):
        trainer = _trainer(policy)
        batch = _batch()
        batch.values = trainer.values(batch.tokens, batch.lengths)
        first = torch.randperm(6, generator=generator(5, "minibatch", 0))[:3]  # the actor's first minibatch
        terms, _ = ppo.value_loss_terms(batch.values[first], batch.values[first], batch.returns[first], 0.2)
        runs.append((trainer.train_step(batch, step=0), float(algo.reducer(batch.loss_mask[first])(terms))))
    (stats, expected), (again, _) = runs
    assert abs(float(stats.losses[0]) - expected) <= 1e-6 * max(1.0, expected)
    assert again.grads_digest == stats.grads_digest and torch.equal(again.losses, stats.losses)


def test_the_critic_refuses_samples_that_share_rollouts(policy):
    from rlbench.errors import BadInput

    trainer = _trainer(policy)
    batch = _batch()
    batch.values, batch.rollouts = torch.zeros_like(batch.returns), torch.arange(6) // 2
    with pytest.raises(BadInput, match="share rollouts"):
        trainer.train_step(batch, step=0)


def test_the_critics_learning_rate_is_train_critic_lr_else_the_actors_with_the_actors_other_settings(policy):
    unset = _trainer(policy, weight_decay=0.01)
    own = _trainer(policy, critic_lr=2e-3, weight_decay=0.01, betas=(0.8, 0.9))
    assert {g["lr"] for g in unset.optimizer.param_groups} == {1e-3} and unset.train_config.lr == 1e-3
    assert {g["lr"] for g in own.optimizer.param_groups} == {2e-3} and own.train_config.lr == 2e-3
    assert own.train_config.betas == (0.8, 0.9) and {g["weight_decay"] for g in own.optimizer.param_groups} == {
        0.0,
        0.01,
    }


def test_the_critic_learns_the_returns_and_refuses_a_batch_without_values(policy):
    from rlbench.errors import BadInput

    trainer = _trainer(policy, minibatches=1, micro_batch_size=6, lr=3e-3)
    batch = _batch()
    with pytest.raises(BadInput, match="the critic trains on values and returns"):
        trainer.train_step(batch, step=0)
    losses = []
    for step in range(8):
        batch.values = trainer.values(batch.tokens, batch.lengths)
        losses.append(trainer.train_step(batch, step=step).metrics["train/critic-value_loss"])
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_actor_trains_on_per_token_advantages_and_a_constant_row_is_its_samples_advantage(policy):
    """The policy's trainer with PPO's [n, L] advantages: a row holding one value on every token trains to the
    same bits as that sample's [n] advantage; other per-token values train otherwise."""
    import copy

    from rlbench.backends.torch_trainer import TorchTrainer
    from rlbench.config import AlgoConfig, TrainConfig

    def step(advantages):
        trainer = TorchTrainer(
            copy.deepcopy(policy), TrainConfig(minibatches=2, micro_batch_size=2), AlgoConfig(kl_coef=0.0), 1.0, 5
        )
        batch = _batch()
        batch.advantages = advantages
        batch.old_logprobs = trainer.logprobs(batch.tokens, lengths=batch.lengths) * batch.loss_mask
        return trainer.train_step(batch, step=0)

    per_sample = torch.tensor([0.5, -1.0, 0.25, 2.0, -0.5, 1.0])
    one, rows = step(per_sample), step(per_sample[:, None].expand(6, 9).clone())
    assert one.grads_digest == rows.grads_digest and torch.equal(one.losses, rows.losses)
    varied = per_sample[:, None] * torch.linspace(0.5, 1.5, 9)[None, :]
    assert step(varied).grads_digest != one.grads_digest
