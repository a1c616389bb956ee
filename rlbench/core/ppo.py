"""PPO with a critic (issue 56): the arithmetic of the critic's side as slime 624b824a computes it.

slime's ppo path (slime/backends/megatron_utils/loss.py `compute_advantages_and_returns`, slime/utils/ppo_utils.py):

- rewards stay raw (no group normalisation); each sample's token rewards are 0 with its reward added at its last
  response token, whatever that token's loss mask (`token_level_rewards[-1] += reward`; the KL shaping before it is
  0 at rlbench's kl_coef in the reward, the only one it takes);
- generalised advantage estimation over each response: delta_t = r_t + gamma V_{t+1} - V_t, with the value past the
  last token 0 (slime pads every sample with zero values and rewards), A_t = delta_t + gamma lambd A_{t+1}, and the
  returns A_t + V_t (`get_advantages_and_returns_batch`, chunked by default: `chunked_gae`);
- with `--normalize-advantages` the advantages whitened over the step's trained tokens (mean and Bessel-corrected
  variance over loss-mask-1 tokens, applied to every token, eps 1e-8: `distributed_masked_whiten`); returns never;
- the critic's clipped value loss: max((V_old + clip(V - V_old, -c, c) - R)^2, (V - R)^2) per token, no 0.5
  factor, reduced as the policy loss is, and its clip fraction |V - V_old| > c (`value_loss_function`).

Arithmetic: float64, by the backward recurrence (`gae`) and two-pass statistics (`whiten_tokens`), element by
element, so the bits are the same on any CPU. slime computes in float32 (its values' dtype) with chunked scans as
matrix products; the two agree within slime's float32 rounding, which grows with the response's length (about
5e-7 relative at 130 tokens, 2e-6 at 1000, gamma = lambd = 1): tests/conformance/slime/test_ppo.py holds rlbench to
slime's own functions on float64 inputs exactly and on float32 inputs within that rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rlbench.errors import BadInput


def token_rewards(rewards: torch.Tensor, response_lengths: Sequence[int]) -> list[torch.Tensor]:
    """Each sample's per-token rewards (float64): 0, its reward at its last response token."""
    out = []
    for reward, length in zip(rewards.double().tolist(), response_lengths):
        row = torch.zeros(int(length), dtype=torch.float64)
        if length > 0:
            row[-1] = reward
        out.append(row)
    return out


def gae(
    rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor], gamma: float, lambd: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(advantages, returns) per sample, float64, from its per-token rewards and values (each [R_i])."""
    if len(rewards) != len(values) or any(len(r) != len(v) for r, v in zip(rewards, values)):
        raise ValueError("gae: one reward and one value per response token")
    if not rewards:
        return [], []
    width = max(len(r) for r in rewards)
    padded_values = torch.zeros(len(values), width + 1, dtype=torch.float64)  # the value past the end: 0
    padded_rewards = torch.zeros(len(rewards), width, dtype=torch.float64)
    for i, (r, v) in enumerate(zip(rewards, values)):
        padded_rewards[i, : len(r)] = r.double()
        padded_values[i, : len(v)] = v.double()
    advantages = torch.zeros(len(rewards), width, dtype=torch.float64)
    last = 0.0
    for t in reversed(range(width)):  # past a sample's end: delta 0, so its last token starts from A = 0
        delta = padded_rewards[:, t] + gamma * padded_values[:, t + 1] - padded_values[:, t]
        last = delta + (gamma * lambd) * last
        advantages[:, t] = last
    out = [advantages[i, : len(r)].clone() for i, r in enumerate(rewards)]
    return out, [a + v.double() for a, v in zip(out, values)]


def whiten_tokens(advantages: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], eps: float = 1e-8):
    """Per-token advantages whitened as slime's distributed_masked_whiten: the mean and the Bessel-corrected
    variance over the loss-mask-1 tokens of the step, (a - mean) / sqrt(variance + eps) applied to every token."""
    flat = torch.cat([a.double() for a in advantages])
    mask = torch.cat([m.double() for m in masks])
    total = mask.sum()
    if total == 0:
        raise BadInput(
            "no trained token in the step: there is nothing to whiten the advantages over",
            field="algo.normalize_advantages",
        )
    mean = (flat * mask).sum() / total
    variance = ((flat - mean).square() * mask).sum() / total
    if total >= 2:
        variance = variance * total / (total - 1)  # Bessel's correction, as slime
    scale = math.sqrt(float(variance + eps))  # the Python float's sqrt: torch.sqrt on the CPU differs by vendor
    whitened = (flat - mean) / scale
    return list(whitened.split([len(a) for a in advantages]))


def value_loss_terms(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the clipped value loss and whether the new value moved more than `clip` from the old one (as
    float), for the caller's reducer (algo.reducer: slime's sum_of_sample_mean or the per-token sum)."""
    moved = values - old_values
    clipped = old_values + moved.clamp(-clip, clip)
    loss = torch.maximum((clipped - returns).square(), (values - returns).square())
    return loss, (moved.abs() > clip).to(values.dtype)
