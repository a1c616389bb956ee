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
