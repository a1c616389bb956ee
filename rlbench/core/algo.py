"""The RL algorithm: GRPO advantages, the PPO-clip policy loss, KL to a reference, entropy.

- GRPO (Shao et al. 2024): a sample's advantage is its reward minus its group's mean,
  divided by the group's standard deviation (unbiased, as slime computes it) when
  `normalize_std`; every response token of the sample gets that advantage.
- PPO-clip: per token, max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high)) with
  r = exp(logp - old_logp); `old_logp` is the trainer's log-prob before this step's updates.
- KL to the reference (initial) policy: k1 = logp - ref, k3 = exp(ref - logp) - (ref - logp) - 1.
- Aggregation: a token mean within each sample, then a mean over samples (slime's default,
  not the per-token mean), so long responses do not outweigh short ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainBatch:
    """A step's training input: right-padded token ids and per-token tensors aligned with them."""

    tokens: torch.Tensor  # [n, L] int64, right-padded
    loss_mask: torch.Tensor  # [n, L] float32; 1 on sampled response tokens (position t predicts token t)
    advantages: torch.Tensor  # [n] float32
    old_logprobs: torch.Tensor  # [n, L] float32, aligned with tokens (0 where mask is 0)
    ref_logprobs: torch.Tensor | None  # [n, L] or None when KL is off
    lengths: torch.Tensor | None = None  # [n] real length of each row (the rest is padding)


@dataclass
class TrainStats:
    """What one rollout step of training produced: metrics and the bytes that get checksummed."""

    metrics: dict[str, float]
    losses: torch.Tensor  # [minibatches] float32, each optimizer step's loss
    grads_digest: str  # sha256 over every optimizer step's gradients (before clipping)
    param_grads: dict[str, str]  # the same, per parameter: lets `diff` name the parameter


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages for rewards laid out group after group."""
    # float64: the float32 mean of identical non-dyadic rewards (0.1, ...) is off by an ulp, and
    # dividing by the tiny std would blow that into a same-sign push on a group with no signal.
    grouped = rewards.view(-1, group_size).double()
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1).to(rewards.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token t | tokens < t) as [n, L], from the logits of the last k positions of `tokens`
    [n, L] (k = L: all of them); positions they do not predict get 0 (position 0 always)."""
    k, length = logits.shape[1], tokens.shape[1]
    scaled = logits[:, :-1].float()
    if temperature > 0:
        scaled = scaled / temperature
    picked = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, length - k + 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (length - k + 1, 0))


def sequence_logprobs(model: torch.nn.Module, ids: torch.Tensor, temperature: float, device: str) -> torch.Tensor:
    """Teacher-forced log-probs of one sequence at batch size 1, no cache, no padding: the single
    definition that the engine (true on-policy) and the trainer share, so both get the same bits."""
    ids = ids.to(device)[None]
    return token_logprobs(model(input_ids=ids, use_cache=False).logits, ids, temperature)[0].cpu()


def token_entropy(logits: torch.Tensor, temperature: float, length: int | None = None) -> torch.Tensor:
    """Entropy of the next-token distribution predicting token t, as [n, length], from the logits
    of the last k positions (as `token_logprobs`; length None: k); unpredicted positions get 0."""
    scaled = logits[:, :-1].float()
    if temperature > 0:
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    unpredicted = (length or logits.shape[1]) - logits.shape[1] + 1
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (unpredicted, 0))


def sample_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sample's masked tokens, then over samples (samples with no token count 0)."""
    per_sample = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sample.mean()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    return torch.exp(-log_ratio) + log_ratio - 1  # k3, non-negative, unbiased (Schulman 2020)


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, clip fraction, approx KL old->new), each aggregated with `sample_mean`."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = sample_mean(torch.maximum(unclipped, clipped), mask)
    clipfrac = sample_mean((clipped > unclipped).float(), mask)
    ppo_kl = sample_mean(-log_ratio, mask)
    return loss, clipfrac.detach(), ppo_kl.detach()
