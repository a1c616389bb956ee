"""Samples that share a rollout (a slime plugin's fan-out, their `rollout_id`): slime's per-rollout loss
(slime/backends/megatron_utils/cp_utils.py get_sum_of_sample_mean with `sample_denoms` = rollout_mask_sums,
over the step's rollout count; slime #1933, Miles #1931) and minibatches of whole rollouts (slime's
build_dp_schedule), in the torch trainer the megatron ranks share."""

from __future__ import annotations

import torch

from rlbench.core import algo
from rlbench.core.samples import rollouts
from tests.conftest import RANDOM_INIT_MODEL


def test_the_rollout_reducer_is_one_token_mean_per_rollout_then_a_mean_over_rollouts():
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    values = torch.tensor([[1.0, 2, 9, 9], [3, 4, 5, 9], [1, 1, 1, 1], [7, 7, 7, 7]])
    ids = torch.tensor([5, 5, 8, 9])  # rollout 5 has two samples; rollout 9's sample trains no token
    denominators = algo.rollout_denominators(mask, ids)
    assert denominators.tolist() == [5.0, 5.0, 4.0, 0.0]
    got = algo.rollout_reducer(mask, denominators, rollouts=3)(values)
    by_hand = ((1 + 2 + 3 + 4 + 5) / 5 + 4 / 4 + 0 / 1) / 3  # slime's clamp_min(denominator, 1)
    assert abs(float(got) - by_hand) < 1e-6
    # one sample per rollout: slime's "strict no-op", the per-sample mean
    alone = algo.rollout_reducer(mask, mask.sum(-1), rollouts=4)(values)
    assert torch.allclose(alone, algo.sample_mean(values, mask))


def test_only_shared_rollouts_take_the_rollout_path():
    assert rollouts([{"rollout": 0}, {"rollout": 1}]) is None  # a rollout each: the per-sample path
    assert rollouts([{"index": 0}, {"index": 1}]) is None  # no rollout recorded (every run but a fan-out)
    assert rollouts([{"rollout": 3}, {"rollout": 3}, {"rollout": 4}]).tolist() == [3, 3, 4]


def _trainer(minibatches: int, seed: int = 3):
    from rlbench.backends.registry import make_trainer
    from rlbench.config import load_config
    from rlbench.core.model import build_model

    # no KL term (the default's kl_coef is 0.1 since issue 52): these batches carry no reference log-probs (the
    # loop computes them), and what is tested here does not depend on the KL term
    config = load_config(seed=seed, train__minibatches=minibatches, train__micro_batch_size=3, algo__kl_coef=0.0)
    model = build_model(RANDOM_INIT_MODEL, config.seed, "float32", "cpu", init="random")
    return make_trainer(config, model)


def _batch(n: int = 8, width: int = 12, seed: int = 0) -> algo.TrainBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 200, (n, width), generator=g)
    mask = torch.zeros(n, width)
    for i in range(n):
        mask[i, 5 : 6 + i % 5] = 1
    return algo.TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        advantages=torch.randn(n, generator=g),
        old_logprobs=-torch.rand(n, width, generator=g) * mask,
        ref_logprobs=None,
        lengths=torch.full((n,), width),
    )


def test_minibatches_hold_whole_rollouts(monkeypatch):
    trainer = _trainer(minibatches=2)
    seen = []
    monkeypatch.setattr(type(trainer), "_updates", lambda self, batch, minibatches, shared: seen.append(minibatches))
    batch = _batch()
    batch.rollouts = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    trainer.train_step(batch, step=0)
    (minibatches,) = seen
    assert len(minibatches) == 2 and sorted(torch.cat(minibatches).tolist()) == list(range(8))
    for index in minibatches:
        assert len(index) == 4 and set(batch.rollouts[index].tolist()) == {int(r) for r in batch.rollouts[index][::2]}
        assert all(int(batch.rollouts[i]) == int(batch.rollouts[j]) for i, j in zip(index[::2], index[1::2]))


def test_one_sample_per_rollout_trains_as_the_per_sample_path_within_float_noise():
    plain, shared = _trainer(minibatches=2), _trainer(minibatches=2)
    batch = _batch()
    first = plain.train_step(batch, step=0)
    batch.rollouts = torch.arange(8)
    second = shared.train_step(batch, step=0)
    assert torch.allclose(first.losses, second.losses, rtol=1e-5, atol=1e-7), (first.losses, second.losses)


def test_an_imported_dumps_rollout_id_is_not_a_fan_out():
    """An imported slime dump records the step's rollout id on every sample (`rollout_id`): that is not a shared
    rollout, and replay of an import keeps the per-sample path."""
    assert rollouts([{"rollout_id": 7}, {"rollout_id": 7}, {"rollout_id": 7}]) is None
