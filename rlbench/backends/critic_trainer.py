"""PPO's critic trained as slime 624b824a's `train_critic` trains it (issue 56): the torch trainer's machinery (its
minibatches from the same seeded permutation as the actor's, micro-batches, fp32 masters in mixed precision, fused
AdamW, gradient clipping, gradient digests, checkpoints) with the value loss in place of the policy loss.

slime's critic trains on the same rollout data and schedule as its actor (the same micro-batches and global batch
sizes); its loss (loss.py `value_loss_function`) is the clipped value loss, max((V_old + clip(V - V_old, -c, c) -
R)^2, (V - R)^2) over the trained tokens, reduced as the policy loss is (per sample, or per token with
--calculate-per-token-loss), V_old the critic's values before the step's update. It logs `train/critic-value_loss`,
`train/critic-value_clipfrac` and `train/critic-grad_norm` (model.py's role tag "critic-").
"""

from __future__ import annotations

import dataclasses

import torch

from rlbench.backends.torch_trainer import TorchTrainer
from rlbench.core import algo, ppo
from rlbench.core.critic import ValueModel, token_values
from rlbench.errors import BadInput


def critic_settings(train, algo_config):
    """The critic's optimizer and algorithm settings: train.critic_lr (unset: train.lr) and the actor's others;
    slime's critic role: no KL term (kl_coef 0, so no reference model) and no importance weights."""
    lr = train.lr if train.critic_lr is None else train.critic_lr
    return dataclasses.replace(train, lr=lr), dataclasses.replace(algo_config, kl_coef=0.0, use_tis=False)


class CriticLoss:
    """The critic's side of a trainer (mixed into TorchTrainer here, into the megatron rank's trainer in
    backends/megatron/critic.py): its values and its step on the value loss. `_token_values(ids)` is the one
    place the two differ."""

    value_clip: float

    @torch.no_grad()
    def values(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[n, L] float32: the value of each token (read at the position before it; position 0 gets 0), in the
        trainer's micro-batches, eval mode: the old values of the value loss and GAE's values."""
        self.model.eval()
        out = torch.zeros(tokens.shape, dtype=torch.float32)
        real = lengths if lengths is not None else torch.full((tokens.shape[0],), tokens.shape[1])
        for mb in self._micro_batches(real.tolist()):
            rows = torch.as_tensor(list(mb))
            trim = self.train_config.max_tokens_per_micro_batch is not None
            width = int(real[rows].max()) if trim else tokens.shape[1]
            out[rows, :width] = self._token_values(tokens[rows, :width].to(self.device)).cpu()
        return out

    def _token_values(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def train_step(self, batch: algo.TrainBatch, step: int) -> algo.TrainStats:
        if batch.values is None or batch.returns is None:
            raise BadInput(f"step {step}: the critic trains on values and returns, and the batch lacks them")
        if batch.rollouts is not None:
            raise BadInput(f"step {step}: PPO's critic over samples that share rollouts (a fan-out) is not built yet")
        stats = super().train_step(batch, step)
        # slime's names: the value loss is the critic's loss, its grad norm the critic's
        metrics = stats.metrics
        stats.metrics = {
            "train/critic-value_loss": metrics["train/value_loss"],
            "train/critic-value_clipfrac": metrics["train/value_clipfrac"],
            "train/critic-grad_norm": metrics["train/grad_norm"],
        }
        return stats

    def _metric_names(self) -> tuple[str, ...]:
        return ("value_loss", "value_clipfrac")

    def _loss(
        self,
        batch: algo.TrainBatch,
        index: torch.Tensor,
        weight: float,
        sums: dict,
        tokens: torch.Tensor | None = None,
        rollouts: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        mask = batch.loss_mask[index].to(self.device)
        values = self._token_values(batch.tokens[index].to(self.device))
        old, returns = (getattr(batch, name)[index].to(self.device) for name in ("values", "returns"))
        loss, clipped = ppo.value_loss_terms(values, old, returns, self.value_clip)
        reduce = algo.reducer(mask, tokens)
        loss, clipfrac = reduce(loss), reduce(clipped)
        sums["value_loss"] += loss.detach().double() * weight
        sums["value_clipfrac"] += clipfrac.detach().double() * weight
        return loss * weight


class CriticTrainer(CriticLoss, TorchTrainer):
    """Trains a `ValueModel` on a batch's `values` (before the update) and `returns`."""

    def __init__(self, model: ValueModel, train, algo_config, value_clip: float, seed: int, device: str = "cpu"):
        train, critic_algo = critic_settings(train, algo_config)
        TorchTrainer.__init__(self, model, train, critic_algo, 1.0, seed, device)
        self.value_clip = value_clip

    def _token_values(self, ids: torch.Tensor) -> torch.Tensor:
        return token_values(self.model, ids)
