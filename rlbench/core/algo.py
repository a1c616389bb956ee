"""The RL algorithm, with slime's estimators, loss options and aggregation (slime/utils/ppo_utils.py,
slime/backends/megatron_utils/loss.py, slime/ray/rollout.py at the commit in
tests/conformance/slime/expected_algo.json, which holds rlbench to them within 1e-6).

- Advantages, one per sample (every response token of a sample gets it):
  grpo, gspo, cispo: the reward minus its group's mean, divided by the group's standard deviation
  (unbiased) + 1e-6 when `normalize_std`; reinforce_plus_plus_baseline: the reward minus its group's
  mean; reinforce_plus_plus: the reward itself (slime's discounted return with gamma 1 and no KL
  shaping). Groups are given per sample (slime's `group_index`), so they may differ in size; slime's
  default reshapes by `n_samples_per_prompt` and falls back to one group for the whole batch when the
  count differs, which docs/design.md lists as a deliberate difference. `normalize_advantages`
  whitens them over the step's trained tokens (slime's distributed_masked_whiten).
- Policy loss per token, r = exp(logp - old_logp), `old_logp` the trainer's log-prob before this
  step's updates: PPO-clip max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high)), and with dual clip
  (`eps_clip_c`) at most -eps_clip_c * A where A < 0 (grpo, reinforce_plus_plus*); gspo: the same
  with r the exponent of the sample's mean log-ratio; cispo: -sg(clip(r)) * A * logp.
  TIS multiplies it by clamp(exp(old_logp - rollout_logp), tis_clip_low, tis_clip).
- KL to the reference (initial) policy, in the loss: k1 = logp - ref, k2 = (logp - ref)^2 / 2,
  k3 = exp(ref - logp) - (ref - logp) - 1, low_var_kl = k3 clamped to [-10, 10].
- Aggregation (slime's reducer): a token mean within each sample, then a mean over samples, so long
  responses do not outweigh short ones; with `per_token_loss`, the sum over a minibatch's trained
  tokens over their count. A sample with no trained token (slime's remove_sample) counts in both
  denominators: as one sample, or as one token (slime's clamp_min(mask.sum(), 1)). Where a slime plugin's
  fan-out gave one rollout several samples (their shared `rollout_id`), minibatches hold whole rollouts and the
  mean is over rollouts, each a token mean over all its samples' trained tokens (slime #1933's
  rollout_mask_sums); the per-token loss is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlbench.errors import BadInput

if TYPE_CHECKING:
    from rlbench.config import AlgoConfig

# The estimators whose rewards are group-normalised with the standard deviation (slime's
# grpo_std_normalization applies to these three only).
STD_NORMALISED = ("grpo", "gspo", "cispo")


@dataclass
class TrainBatch:
    """A step's training input: right-padded token ids and per-token tensors aligned with them."""

    tokens: torch.Tensor  # [n, L] int64, right-padded
    loss_mask: torch.Tensor  # [n, L] float32; 1 on sampled response tokens (position t predicts token t)
    advantages: torch.Tensor  # [n] float32, or [n, L] per token (PPO with a critic, aligned with tokens)
    old_logprobs: torch.Tensor  # [n, L] float32, aligned with tokens (0 where mask is 0)
    ref_logprobs: torch.Tensor | None  # [n, L] or None when KL is off
    lengths: torch.Tensor | None = None  # [n] real length of each row (the rest is padding)
    rollout_logprobs: torch.Tensor | None = None  # [n, L] the engine's log-probs, for TIS (None when it is off)
    # [n] int64: the rollout each sample belongs to, where a slime plugin's fan-out gave one rollout several samples
    # (None: one sample, one rollout). Minibatches then hold whole rollouts, and the loss is a mean over rollouts.
    rollouts: torch.Tensor | None = None
    # PPO's critic (issue 56): its values before the update and the returns, [n, L] aligned with tokens (the value
    # of token t at t), for the value loss (backends/critic_trainer.py); None for the policy
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


@dataclass
class TrainStats:
    """What one rollout step of training produced: metrics and the bytes that get checksummed."""

    metrics: dict[str, float]
    losses: torch.Tensor  # [minibatches] float32, each optimizer step's loss
    grads_digest: str  # checksum (rundir/digest.py) of every optimizer step's gradients (before clipping)
    param_grads: dict[str, str]  # the same, per parameter: lets `diff` name the parameter


def grpo_advantages(
    rewards: torch.Tensor, groups: int | torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages. `groups`: a group size (rewards laid out group after group, all of
    that size) or each sample's group id (groups of any size, in any order). A group of one sample
    gets 0 (slime's std of one value is NaN; it turns the std off only when every group has one)."""
    if not isinstance(groups, int):
        return _grouped_by_id(rewards, groups, normalize_std, eps)
    # float64: the float32 mean of identical non-dyadic rewards (0.1, ...) is off by an ulp, and
    # dividing by the tiny std would blow that into a same-sign push on a group with no signal.
    grouped = rewards.view(-1, groups).double()
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and groups > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1).to(rewards.dtype)


def _grouped_by_id(rewards: torch.Tensor, ids: torch.Tensor, normalize_std: bool, eps: float) -> torch.Tensor:
    """`grpo_advantages` for per-sample group ids: each group in float64, as above."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for group in torch.unique(ids):
        members = (ids == group).nonzero()[:, 0]
        values = rewards[members].double()
        centered = values - values.mean()
        if normalize_std and len(members) > 1:
            centered = centered / (values.std() + eps)
        out[members] = centered
    return out.to(rewards.dtype)


def normalised_rewards(rewards: torch.Tensor, groups: int | torch.Tensor, config: AlgoConfig) -> torch.Tensor:
    """slime's reward post-processing for `config.advantage` (rollout.py's _post_process_rewards, by
    group id): grpo, gspo, cispo centre each group and divide by its std when `normalize_std`;
    reinforce_plus_plus_baseline only centres; reinforce_plus_plus keeps the rewards."""
    if config.advantage in STD_NORMALISED:
        return grpo_advantages(rewards, groups, config.normalize_std)
    if config.advantage == "reinforce_plus_plus_baseline":
        return grpo_advantages(rewards, groups, normalize_std=False)
    return rewards.clone()


def advantages(
    rewards: torch.Tensor, groups: int | torch.Tensor, token_counts: torch.Tensor, config: AlgoConfig
) -> torch.Tensor:
    """Each sample's advantage under `config` (the module docstring says how): its normalised reward
    (reinforce_plus_plus: its return, with gamma 1 the reward), whitened over the trained tokens
    (`token_counts` per sample) when `config.normalize_advantages`."""
    out = normalised_rewards(rewards, groups, config)
    return whiten(out, token_counts) if config.normalize_advantages else out


def whiten(values: torch.Tensor, token_counts: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Per-sample values whitened as slime whitens its per-token advantages: mean and unbiased
    variance over every trained token (a sample's value counted once per trained token), then
    (value - mean) / sqrt(variance + eps); in float64 (slime: float32, E[x^2] - E[x]^2)."""
    counts = token_counts.double()
    total = counts.sum()
    if total == 0:
        raise BadInput(
            "no trained token in the step: there is nothing to whiten the advantages over",
            field="algo.normalize_advantages",
        )
    x = values.double()
    mean = (x * counts).sum() / total
    variance = ((x - mean).square() * counts).sum() / total
    if total >= 2:
        variance = variance * total / (total - 1)  # Bessel's correction, as slime
    # math.sqrt of the Python float: torch.sqrt on the CPU is MKL's VML, whose last bit differs across vendors
    return ((x - mean) / math.sqrt(float(variance + eps))).to(values.dtype)


def _widened(logits: torch.Tensor) -> torch.Tensor:
    """The logits in float32, or in their own dtype where it is wider (a float64 run stays float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


# The float32 log-softmax of the train and log-prob passes runs over at most this many logits at a time (256 MiB
# of float32): at a real vocabulary (151,936) a micro-batch's [n, L, V] float32 copy would be gigabytes (issue 34).
# Chunks are whole positions along L; log_softmax is computed row by row, so a chunk's values are the bits the
# whole tensor's would be, and under autograd each chunk is recomputed in the backward rather than kept.
CHUNK_LOGITS = 1 << 26


def _position_chunks(logits: torch.Tensor) -> list[slice]:
    """Slices along dim 1 of [n, L, V] logits, each of at most CHUNK_LOGITS logits (one position at least)."""
    n, length, vocab = logits.shape
    per = max(1, CHUNK_LOGITS // max(1, n * vocab))
    return [slice(start, min(start + per, length)) for start in range(0, length, per)]


def _chunked(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """fn(logits[:, chunk], *(o[:, chunk])) for each position chunk, concatenated along dim 1; a single chunk is
    fn over the whole, and under autograd each chunk of several is checkpointed (its float32 intermediates
    recomputed in the backward, the same bits)."""
    chunks = _position_chunks(logits)
    if len(chunks) == 1:
        return fn(logits, *others)
    keep = torch.is_grad_enabled() and logits.requires_grad
    from torch.utils.checkpoint import checkpoint

    parts = [
        checkpoint(fn, logits[:, c], *(o[:, c] for o in others), use_reentrant=False)
        if keep
        else fn(logits[:, c], *(o[:, c] for o in others))
        for c in chunks
    ]
    return torch.cat(parts, dim=1)


def _picked_logprobs(temperature: float):
    def picked(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        scaled = _widened(logits)
        if temperature > 0:
            scaled = scaled / temperature
        return torch.log_softmax(scaled, dim=-1).gather(-1, targets[..., None]).squeeze(-1)

    return picked


def _entropies(temperature: float):
    def entropy(logits: torch.Tensor) -> torch.Tensor:
        scaled = _widened(logits)
        if temperature > 0:
            scaled = scaled / temperature
        logp = torch.log_softmax(scaled, dim=-1)
        return -(logp.exp() * logp).sum(-1)

    return entropy


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token t | tokens < t) as [n, L], from the logits of the last k positions of `tokens`
    [n, L] (k = L: all of them); positions they do not predict get 0 (position 0 always)."""
    k, length = logits.shape[1], tokens.shape[1]
    picked = _chunked(_picked_logprobs(temperature), logits[:, :-1], tokens[:, length - k + 1 :])
    return torch.nn.functional.pad(picked, (length - k + 1, 0))


def sequence_logprobs(model: torch.nn.Module, ids: torch.Tensor, temperature: float, device: str) -> torch.Tensor:
    """Teacher-forced log-probs of one sequence at batch size 1, no cache, no padding: the single
    definition that the engine (true on-policy) and the trainer share, so both get the same bits."""
    ids = ids.to(device)[None]
    return token_logprobs(model(input_ids=ids, use_cache=False).logits, ids, temperature)[0].cpu()


def token_entropy(logits: torch.Tensor, temperature: float, length: int | None = None) -> torch.Tensor:
    """Entropy of the next-token distribution predicting token t, as [n, length], from the logits
    of the last k positions (as `token_logprobs`; length None: k); unpredicted positions get 0."""
    unpredicted = (length or logits.shape[1]) - logits.shape[1] + 1
    return torch.nn.functional.pad(_chunked(_entropies(temperature), logits[:, :-1]), (unpredicted, 0))


def sample_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sample's masked tokens, then over samples (samples with no token count 0)."""
    per_sample = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sample.mean()


def token_denominator(mask: torch.Tensor) -> torch.Tensor:
    """The per-token loss's denominator for a minibatch: its trained tokens, a sample with none counting
    as one (slime's sum of clamp_min(loss_mask.sum(), 1))."""
    return mask.sum(-1).clamp(min=1).sum()


def rollout_denominators(mask: torch.Tensor, rollouts: torch.Tensor) -> torch.Tensor:
    """Each sample's rollout's trained-token total (slime's `rollout_mask_sums`, convert_samples_to_train_data)."""
    totals = mask.sum(-1)
    _, inverse = torch.unique(rollouts, return_inverse=True)
    return torch.zeros(int(inverse.max()) + 1, dtype=totals.dtype).index_add(0, inverse, totals)[inverse]


def rollout_reducer(
    mask: torch.Tensor, denominators: torch.Tensor, rollouts: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's reducer for samples that share rollouts (get_sum_of_sample_mean with `sample_denoms`, over the
    step's rollout count, slime #1933): each sample's masked sum over its rollout's token total, summed, over
    the `rollouts` of the minibatch: one token-weighted mean per rollout, then a mean over rollouts."""
    return lambda values: ((values * mask).sum(-1) / denominators.clamp(min=1)).sum() / rollouts


def reducer(mask: torch.Tensor, tokens: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's aggregation of per-token values over `mask`: `sample_mean`, or with `tokens` (the
    minibatch's `token_denominator`) the masked sum over it, this micro-batch's share of the token mean."""
    if tokens is None:
        return lambda values: sample_mean(values, mask)
    return lambda values: (values * mask).sum() / tokens


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """slime's compute_approx_kl (Schulman 2020's estimators) of the policy to the reference."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio.square() / 2
    k3 = torch.exp(-log_ratio) + log_ratio - 1  # non-negative, unbiased
    return k3.clamp(-10, 10) if kind == "low_var_kl" else k3


def policy_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    estimator: str,
    eps_low: float,
    eps_high: float,
    eps_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token, before aggregation: (policy loss, clipped 0/1, KL old->new, importance ratio) of
    `estimator`'s loss (the module docstring); gspo's ratio and KL are its sample's, on every token."""
    log_ratio = logp - old_logp
    if estimator == "gspo":
        log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(logp)
    ratio = torch.exp(log_ratio)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]  # PPO's per token, the others' per sample
    if estimator == "cispo":
        truncated = ratio.clamp(1 - eps_low, 1 + eps_high)
        return -truncated.detach() * adv * logp, (truncated != ratio).float(), -log_ratio, ratio
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if eps_c is not None:  # dual clip: a negative advantage's loss is bounded by -eps_c * A
        loss = torch.where(adv < 0, torch.minimum(-eps_c * adv, loss), loss)
    return loss, (clipped > unclipped).float(), -log_ratio, ratio


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, clip fraction, approx KL old->new) of PPO-clip, each aggregated with `sample_mean`."""
    loss, clipped, ppo_kl, _ = policy_terms(logp, old_logp, advantages, mask, "grpo", eps_low, eps_high)
    return sample_mean(loss, mask), sample_mean(clipped, mask).detach(), sample_mean(ppo_kl, mask).detach()


def tis_terms(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's vanilla TIS per token: the weight clamp(exp(old - rollout), low, high) and the metrics
    tis (the untruncated ratio), tis_clipfrac (truncated or not) and tis_abs (|ratio - 1|)."""
    ratio = torch.exp(old_logp - rollout_logp)
    weight = ratio.clamp(low, high)
    return weight, {"tis": ratio, "tis_clipfrac": (weight != ratio).float(), "tis_abs": (ratio - 1).abs()}


def loss_metric_names(config: AlgoConfig) -> tuple[str, ...]:
    """The train/* metrics `policy_loss` reports under `config`, in slime's names."""
    return (
        ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss")
        + (("kl_loss",) if config.kl_coef > 0 else ())
        + (("ois", "tis", "tis_clipfrac", "tis_abs") if config.use_tis else ())
    )


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor,
    config: AlgoConfig,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's policy_loss_function on per-token tensors [n, L]: the loss pg_loss - entropy_coef *
    entropy + kl_coef * kl (each term aggregated with `reduce`) and its metrics (loss_metric_names).
    `entropy` per token (with a graph only when entropy_coef > 0); `ref_logp` when kl_coef > 0;
    `rollout_logp` when use_tis."""
    c = config
    pg, clipped, ppo_kl, ratio = policy_terms(
        logp, old_logp, advantages, mask, c.advantage, c.eps_clip, c.eps_clip_high, c.eps_clip_c
    )
    tis = {}
    if c.use_tis:
        weight, tis = tis_terms(old_logp, rollout_logp, c.tis_clip_low, c.tis_clip)
        pg, tis = pg * weight, {"ois": ratio, **tis}
    metrics = {
        "pg_loss": reduce(pg),
        "pg_clipfrac": reduce(clipped).detach(),
        "ppo_kl": reduce(ppo_kl).detach(),
        "entropy_loss": reduce(entropy),
    }
    loss = metrics["pg_loss"] - c.entropy_coef * metrics["entropy_loss"] if c.entropy_coef > 0 else metrics["pg_loss"]
    if c.kl_coef > 0:
        metrics["kl_loss"] = reduce(kl_penalty(logp, ref_logp, c.kl_type))
        loss = loss + c.kl_coef * metrics["kl_loss"]
    metrics.update({key: reduce(value.detach()) for key, value in tis.items()})
    return loss, metrics
