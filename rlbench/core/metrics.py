"""Step metrics under slime's names (train/*, rollout/*, perf/*), computed from a step's flat
recording tensors, so a run and its replay compute them from the same bytes."""

from __future__ import annotations

import torch


def rollout_metrics(tensors: dict[str, torch.Tensor], finish_reasons: list[str]) -> dict[str, float]:
    offsets = tensors["offsets"]
    response_len = (offsets[1:] - offsets[:-1] - tensors["prompt_lengths"]).double()
    return {
        "rollout/raw_reward": float(tensors["rewards"].double().mean()),
        "rollout/response_len/mean": float(response_len.mean()),
        "rollout/truncated_ratio": sum(r == "length" for r in finish_reasons) / len(finish_reasons),
    }


def logprob_abs_diff(
    tensors: dict[str, torch.Tensor], per_token: bool = False, known: torch.Tensor | None = None
) -> float:
    """slime's train/train_rollout_logprob_abs_diff: |trainer log-prob - rollout log-prob| over trained
    tokens, reduced as slime reduces its loss: a mean within each sample, then over samples (a sample
    with no trained token counts, as 0); with `per_token` (slime --calculate-per-token-loss) the sum
    over trained tokens over their count, a sample with none counting as one. Over the whole step, and
    over the samples `known` marks (those whose engine reported log-probs; None: all)."""
    sums, counts = _per_sample(tensors, (tensors["old_logprobs"] - tensors["rollout_logprobs"]).abs())
    if known is not None:
        sums, counts = sums[known], counts[known]
    if per_token:
        return float(sums.sum() / counts.clamp(min=1).sum())
    return float((sums / counts.clamp(min=1)).mean())


def logprob_abs_diff_token_mean(tensors: dict[str, torch.Tensor], known: torch.Tensor | None = None) -> float:
    """Mean |trainer log-prob - rollout log-prob| over the step's trained tokens, every token weighing
    the same (train/rollout_logprob_abs_diff_token_mean; `check logprobs`' mean), over the samples
    `known` marks (None: all); exactly 0 only when both sides computed the same bits."""
    mask = tensors["loss_mask"].bool()
    if known is not None:
        offsets = tensors["offsets"]
        mask = mask & torch.repeat_interleave(known, offsets[1:] - offsets[:-1])
    diff = (tensors["old_logprobs"][mask] - tensors["rollout_logprobs"][mask]).abs()
    return float(diff.mean()) if diff.numel() else 0.0


def _per_sample(tensors: dict[str, torch.Tensor], values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of `values` over each sample's trained tokens, their count), float64, from flat tensors."""
    offsets = tensors["offsets"]
    sample = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets[1:] - offsets[:-1])
    mask = tensors["loss_mask"].double()
    zeros = torch.zeros(len(offsets) - 1, dtype=torch.float64)
    return zeros.index_add(0, sample, values.double() * mask), zeros.index_add(0, sample, mask)
