"""PPO's stages one by one (rlbench/core/critic_stages.py) on a hand-made step with a stand-in critic: what each
passes the critic, what it records, and the one line each gives where a value is NaN or infinite (the step not
committed); the rollout metrics' means as slime's per-rollout means take them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlbench.config import load_config
from rlbench.core import algo, critic_stages, loop
from rlbench.errors import BadInput, NonFinite

# two samples: a 2-token prompt and 3 response tokens, a 1-token prompt and 2 response tokens (the second's last
# token untrained)
OFFSETS = [0, 5, 8]


def _state(rewards=(1.0, 0.0), mask=(0, 0, 1, 1, 1, 0, 1, 0), meta=None) -> loop.StepState:
    state = loop.StepState(4)
    state.tensors = {
        "tokens": torch.arange(3, 11),
        "offsets": torch.tensor(OFFSETS),
        "prompt_lengths": torch.tensor([2, 1]),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "rewards": torch.tensor(rewards, dtype=torch.float32),
    }
    state.sample_meta = meta or [{}, {}]
    return state


class Critic:
    """Stands in for the critic: its values and step are given; what it was asked is kept."""

    def __init__(self, values=None, losses=(0.5, 0.25), grad_norm=1.5):
        self.given_values, self.losses, self.grad_norm, self.asked = values, losses, grad_norm, []

    def values(self, tokens, lengths=None):
        self.asked.append(("values", tokens.clone(), lengths))
        return self.given_values.clone()

    def train_step(self, batch, step):
        self.asked.append(("train_step", batch, step))
        metrics = {"train/critic-value_loss": 0.1, "train/critic-value_clipfrac": 0.0}
        metrics["train/critic-grad_norm"] = self.grad_norm
        return algo.TrainStats(metrics, torch.tensor(self.losses), "g" * 64, {"head.weight": "h" * 64})

    def export_hf_weights(self):
        return {"head.weight": torch.ones(1, 2)}


def _ctx(critic, **algo_settings) -> SimpleNamespace:
    config = load_config(algo__advantage="ppo", **{f"algo__{k}": v for k, v in algo_settings.items()})
    return SimpleNamespace(critic=critic, config=config)


def _padded(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_values_asks_the_critic_with_each_samples_length_and_keeps_the_response_tokens_only():
    critic = Critic(_padded([[9, 9, 0.5, 0.25, 0.125], [9, 0.75, 1.0, 7, 7]]))
    state = _state()
    critic_stages.values(_ctx(critic), state, loop._finite)
    _, tokens, lengths = critic.asked[0]
    assert tokens.tolist() == [[3, 4, 5, 6, 7], [8, 9, 10, 0, 0]] and lengths.tolist() == [5, 3]
    assert state.tensors["values"].tolist() == [0, 0, 0.5, 0.25, 0.125, 0, 0.75, 1.0]
    assert len(state.checksums["values"]) == 64


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_stops_the_step_naming_its_sample_and_token(bad):
    critic = Critic(_padded([[0, 0, 0.5, 0.25, 0.125], [0, 0.75, bad, 0, 0]]))
    with pytest.raises(NonFinite) as caught:
        critic_stages.values(_ctx(critic), _state(), loop._finite)
    assert str(caught.value).startswith(
        f"step 4, stage values: values is {bad} at sample 1, token 2 (the critic's forward); the step was not"
    )


def test_advantage_is_gae_of_the_raw_reward_at_the_last_response_token():
    state = _state()
    state.tensors["values"] = torch.tensor([0, 0, 0.5, 0.25, 0.125, 0, 0.75, 1.0])
    critic_stages.advantage(_ctx(Critic(), gamma=0.5, lambd=1.0), state, loop._finite)
    # sample 0: rewards (0, 0, 1); A_2 = 1 - 0.125, A_1 = 0.5 * 0.125 - 0.25 + 0.5 * A_2, A_0 = 0.5 * 0.25 - 0.5 + ...
    a2 = 1 - 0.125
    a1 = 0.5 * 0.125 - 0.25 + 0.5 * a2
    a0 = 0.5 * 0.25 - 0.5 + 0.5 * a1
    b1 = 0.0 - 1.0
    b0 = 0.5 * 1.0 - 0.75 + 0.5 * b1
    want = torch.tensor([0, 0, a0, a1, a2, 0, b0, b1])
    torch.testing.assert_close(state.tensors["token_advantages"], want, rtol=0, atol=1e-7)
    torch.testing.assert_close(state.tensors["returns"], want + state.tensors["values"], rtol=0, atol=1e-7)
    assert state.tensors["token_advantages"].dtype == state.tensors["returns"].dtype == torch.float32


def test_whitened_advantages_take_their_statistics_over_the_trained_tokens_only():
    state = _state()
    state.tensors["values"] = torch.tensor([0, 0, 0.5, 0.25, 0.125, 0, 0.75, 1.0])
    critic_stages.advantage(_ctx(Critic(), normalize_advantages=True), state, loop._finite)
    trained = state.tensors["loss_mask"].bool()
    advantages = state.tensors["token_advantages"].double()
    assert abs(float(advantages[trained].mean())) < 1e-7
    assert float(advantages[trained].var()) == pytest.approx(1.0, abs=1e-6)  # Bessel's, eps 1e-8 under the root
    assert float(advantages[~trained][0]) == 0  # a prompt token: no advantage
    assert state.tensors["returns"][4] == 1.0  # returns never whitened


def test_an_advantage_past_float32s_range_stops_the_step():
    state = _state(rewards=(3e38, 0.0))
    state.tensors["values"] = torch.tensor([0, 0, 0, 0, -3.3e38, 0, 0, 0])
    with pytest.raises(NonFinite, match=r"^step 4, stage advantage: token_advantages is inf at sample 0, token 4"):
        critic_stages.advantage(_ctx(Critic()), state, loop._finite)


def _trained_state(meta=None) -> loop.StepState:
    state = _state(meta=meta)
    state.tensors["values"] = torch.tensor([0, 0, 0.5, 0.25, 0.125, 0, 0.75, 1.0])
    critic_stages.advantage(_ctx(Critic()), state, loop._finite)
    return state


def test_critic_train_gives_the_critic_its_old_values_and_returns_and_records_its_step():
    critic, state = Critic(), _trained_state()
    critic_stages.critic_train(_ctx(critic), state, loop._finite)
    _, batch, step = critic.asked[0]
    assert step == 4 and batch.rollouts is None
    assert batch.values.tolist() == [[0, 0, 0.5, 0.25, 0.125], [0, 0.75, 1.0, 0, 0]]
    assert batch.returns[0, 2:].tolist() == [1.0, 1.0, 1.0] and batch.returns[1].tolist() == [0.0] * 5
    assert state.tensors["critic_losses"].tolist() == [0.5, 0.25] and state.metrics["train/critic-grad_norm"] == 1.5
    assert state.checksums["critic_grads"] == "g" * 64
    assert set(state.checksums) >= {"critic_loss", "critic_grads", "critic_weights"}
    digests = state.extra["critic_param_digests"]
    assert sorted(digests) == ["grads", "weights"] and digests["grads"] == {"head.weight": "h" * 64}
    assert list(digests["weights"]) == ["head.weight"]


def test_a_fan_outs_shared_rollouts_reach_the_critic_which_refuses_them():
    from rlbench.backends.critic_trainer import CriticTrainer

    meta = [{"rollout": 0}, {"rollout": 0}]
    critic, state = Critic(), _trained_state(meta)
    critic_stages.critic_train(_ctx(critic), state, loop._finite)
    assert critic.asked[0][1].rollouts.tolist() == [0, 0]
    refusing = SimpleNamespace(train_step=lambda batch, step: CriticTrainer.train_step(None, batch, step))
    with pytest.raises(BadInput, match="^step 4: PPO's critic over samples that share rollouts"):
        critic_stages.critic_train(SimpleNamespace(critic=refusing), _trained_state(meta), loop._finite)


@pytest.mark.parametrize(
    "losses, grad_norm, says",
    [
        ((0.5, float("nan")), 1.5, "stage critic_train: critic_losses is nan at minibatch 1"),
        ((0.5, 0.25), float("inf"), "stage critic_train: train/critic-grad_norm is inf at the mean over minibatches"),
    ],
)
def test_a_non_finite_critic_step_stops_before_the_step_commits(losses, grad_norm, says):
    with pytest.raises(NonFinite, match=f"^step 4, {says}; the step was not committed"):
        critic_stages.critic_train(_ctx(Critic(losses=losses, grad_norm=grad_norm)), _trained_state(), loop._finite)


def test_the_rollout_metrics_are_per_sample_means_over_trained_tokens_then_over_samples():
    state = _trained_state()
    got = critic_stages.rollout_metrics(state)
    # sample 0: trained response tokens 0.5, 0.25, 0.125; sample 1: one trained token, 0.75
    assert got["rollout/values"] == pytest.approx(((0.5 + 0.25 + 0.125) / 3 + 0.75) / 2)
    assert got["rollout/returns"] == pytest.approx((1.0 + 0.0) / 2)
    one = _state(rewards=(1.0,), mask=(0, 0, 1, 0, 0))
    one.tensors.update(offsets=torch.tensor([0, 5]), prompt_lengths=torch.tensor([2]), tokens=torch.arange(5))
    one.tensors["values"] = torch.tensor([0, 0, 0.5, 0.25, 0.125])
    critic_stages.advantage(_ctx(Critic()), one, loop._finite)
    alone = critic_stages.rollout_metrics(one)
    assert alone["rollout/values"] == 0.5 and alone["rollout/advantages"] == pytest.approx(0.5)
    none = _state(mask=(0, 0, 0, 0, 0, 0, 1, 0))  # sample 0 trains no token: its mean counts as 0 over 1
    none.tensors["values"] = torch.tensor([0, 0, 0.5, 0.25, 0.125, 0, 0.75, 1.0])
    critic_stages.advantage(_ctx(Critic()), none, loop._finite)
    assert critic_stages.rollout_metrics(none)["rollout/values"] == pytest.approx(0.75 / 2)
