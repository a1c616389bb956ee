"""Step metrics under slime's names (train/*, rollout/*, perf/*), computed from stage outputs."""

from __future__ import annotations

import torch

from rlbench.core.types import Sample


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    n = len(samples)
    return {
        "rollout/raw_reward": sum(s.reward for s in samples) / n,
        "rollout/response_len/mean": sum(s.response_length for s in samples) / n,
        "rollout/truncated_ratio": sum(s.finish_reason == "length" for s in samples) / n,
    }


def logprob_abs_diff(tensors: dict[str, torch.Tensor]) -> float:
    """Mean |trainer log-prob - rollout log-prob| over trained tokens (slime's
    train/train_rollout_logprob_abs_diff); exactly 0 only when both sides computed the same bits."""
    mask = tensors["loss_mask"].bool()
    diff = (tensors["old_logprobs"][mask] - tensors["rollout_logprobs"][mask]).abs()
    return float(diff.mean()) if diff.numel() else 0.0
