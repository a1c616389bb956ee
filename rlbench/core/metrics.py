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


def logprob_abs_diff(tensors: dict[str, torch.Tensor]) -> float:
    """Mean |trainer log-prob - rollout log-prob| over trained tokens (slime's
    train/train_rollout_logprob_abs_diff); exactly 0 only when both sides computed the same bits."""
    mask = tensors["loss_mask"].bool()
    diff = (tensors["old_logprobs"][mask] - tensors["rollout_logprobs"][mask]).abs()
    return float(diff.mean()) if diff.numel() else 0.0
