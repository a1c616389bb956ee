"""PPO's stages in the loop (issue 56), in slime 624b824a's order (train.py: the critic's `async_train` is the
argument the actor's waits on, so the critic's whole step comes first; actor.py `train_critic`):

    values        the critic's values of every response token before its update (eval, no grad): the value loss's
                  old values and GAE's values
    advantage     GAE over each response from the raw reward at its last response token: per-token advantages
                  (whitened when asked) and returns (core/ppo.py)
    critic_train  the critic's step on the clipped value loss (backends/critic_trainer.py)

then the actor's logprob and train (skipped on the first `num_critic_only_steps` steps: slime's actor computes
nothing there) and the engine's sync, every step.

Recorded: `values` and `returns` float32[T] on every response token (0 on the prompt), the per-token advantages as
`token_advantages` float32[T] (the `advantages` stage's checksum covers both), `critic_losses` float32[m]; the
checksums values, critic_loss, critic_grads, critic_weights. slime's names for the metrics: train/critic-value_loss,
train/critic-value_clipfrac, train/critic-grad_norm, and on the actor's steps rollout/values, rollout/returns and
rollout/advantages (a per-rollout mean over each sample's trained tokens, as slime's log_rollout_data).
"""

from __future__ import annotations

import torch

from rlbench.core import ppo, samples
from rlbench.rundir import recording
from rlbench.rundir.digest import tensors_digest, weights_digests


def response_mask(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """[T] bool: the response tokens (after each sample's prompt), trained or not."""
    offsets, prompts = tensors["offsets"], tensors["prompt_lengths"]
    out = torch.zeros(int(offsets[-1]), dtype=torch.bool)
    for start, end, prompt in zip(offsets[:-1].tolist(), offsets[1:].tolist(), prompts.tolist()):
        out[start + prompt : end] = True
    return out


def values(ctx, state, finite) -> None:
    """The critic's values before its update, on every response token."""
    batch = samples.train_batch(state.tensors)
    padded = ctx.critic.values(batch.tokens, batch.lengths)
    flat = recording.unpad(padded, state.tensors["offsets"])
    state.tensors["values"] = torch.where(response_mask(state.tensors), flat, torch.zeros_like(flat))
    finite(state, "values", "values", state.tensors["values"], "the critic's forward")
    state.checksums["values"] = tensors_digest({"values": state.tensors["values"]})


def advantage(ctx, state, finite) -> None:
    """GAE's advantages and returns per response token (float64, recorded as float32), the advantages whitened over
    the step's trained tokens when algo.normalize_advantages (returns never). Each return is a convex combination
    of n-step returns, each the reward or a value discounted (gamma <= 1): finite where they are, so the advantages
    alone are checked (a difference of two large values can pass float32's range)."""
    cfg = ctx.config.algo
    tensors = state.tensors
    offsets, prompts = tensors["offsets"].tolist(), tensors["prompt_lengths"].tolist()
    spans = [(offsets[i] + prompts[i], offsets[i + 1]) for i in range(len(prompts))]
    rewards = ppo.token_rewards(tensors["rewards"], [end - start for start, end in spans])
    value_rows = [tensors["values"][start:end] for start, end in spans]
    advantages, returns = ppo.gae(rewards, value_rows, cfg.gamma, cfg.lambd)
    if cfg.normalize_advantages:
        advantages = ppo.whiten_tokens(advantages, [tensors["loss_mask"][start:end] for start, end in spans])
    for name, rows in (("token_advantages", advantages), ("returns", returns)):
        flat = torch.zeros(int(offsets[-1]), dtype=torch.float32)
        for (start, end), row in zip(spans, rows):
            flat[start:end] = row.float()
        tensors[name] = flat
    finite(state, "advantage", "token_advantages", tensors["token_advantages"])


def critic_train(ctx, state, finite) -> None:
    """The critic's step on the step's values (its old values) and returns."""
    batch = samples.train_batch(state.tensors)
    batch.rollouts = samples.rollouts(
        state.sample_meta
    )  # a fan-out's shared rollouts: the critic refuses them (not built)
    offsets = state.tensors["offsets"]
    width = batch.tokens.shape[1]
    batch.values = recording.padded(state.tensors["values"], offsets, width)
    batch.returns = recording.padded(state.tensors["returns"], offsets, width)
    stats = ctx.critic.train_step(batch, state.step)
    finite(state, "critic_train", "critic_losses", stats.losses)
    grad_norm = torch.tensor([stats.metrics["train/critic-grad_norm"]])
    finite(state, "critic_train", "train/critic-grad_norm", grad_norm)
    state.metrics.update(stats.metrics)
    state.tensors["critic_losses"] = stats.losses
    state.checksums["critic_loss"] = tensors_digest({"critic_losses": stats.losses})
    state.checksums["critic_grads"] = stats.grads_digest
    state.checksums["critic_weights"], per_tensor = weights_digests(ctx.critic.export_hf_weights())
    state.extra["critic_param_digests"] = {"grads": stats.param_grads, "weights": per_tensor}


def actor_trains(ctx, step: int) -> bool:
    """slime's `rollout_id >= num_critic_only_steps` (train.py): whether the actor scores and trains this step."""
    return ctx.critic is None or step >= ctx.config.algo.num_critic_only_steps


def rollout_metrics(state) -> dict[str, float]:
    """rollout/values, rollout/returns, rollout/advantages: each sample's mean over its trained tokens (1 where it
    has none, as slime's sum_of_sample_mean clamps), averaged over the samples (slime's per-rollout-mean keys)."""
    tensors = state.tensors
    offsets = tensors["offsets"].tolist()
    mask = tensors["loss_mask"].double()
    out = {}
    for key, name in (("values", "values"), ("returns", "returns"), ("advantages", "token_advantages")):
        flat = tensors[name].double() * mask
        means = [
            float(flat[offsets[i] : offsets[i + 1]].sum() / max(float(mask[offsets[i] : offsets[i + 1]].sum()), 1.0))
            for i in range(len(offsets) - 1)
        ]
        out[f"rollout/{key}"] = sum(means) / max(len(means), 1)
    return out
