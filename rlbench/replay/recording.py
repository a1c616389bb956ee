"""A step's samples as flat tensors (the safetensors half of a recording) and per-sample JSON.

Layout, all token-aligned arrays indexed by `offsets` (sample i is tokens[offsets[i]:offsets[i+1]]):
    tokens            int64  [T]    prompt then response ids of every sample
    offsets           int64  [n+1]
    prompt_lengths    int64  [n]
    loss_mask         uint8  [T]    1 on tokens the policy sampled and is trained on
    rollout_logprobs  float32[T]    the engine's log-prob of each sampled token (0 elsewhere)
    rewards           float32[n]
    advantages        float32[n]    (full mode)
    old_logprobs      float32[T]    the trainer's log-probs before the update (full mode)
    ref_logprobs      float32[T]    the reference policy's (when KL is on)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlbench.core.types import Sample


def flatten(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    lengths = [len(s.tokens) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0)
    mask, logprobs = [], []
    for s in samples:
        mask += [0] * len(s.prompt_ids) + list(s.loss_mask)
        logprobs += [0.0] * len(s.prompt_ids) + list(s.rollout_log_probs)
    return {
        "tokens": torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long),
        "offsets": offsets,
        "prompt_lengths": torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "rollout_logprobs": torch.tensor(logprobs, dtype=torch.float32),
    }


def padded(flat: torch.Tensor, offsets: torch.Tensor, width: int, fill: float = 0) -> torch.Tensor:
    """[n, width] right-padded rows from a flat token-aligned array."""
    n = offsets.numel() - 1
    out = torch.full((n, width), fill, dtype=flat.dtype)
    for i in range(n):
        a, b = int(offsets[i]), int(offsets[i + 1])
        out[i, : b - a] = flat[a:b]
    return out


def unpad(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The inverse of `padded`: a flat token-aligned array from [n, width] rows."""
    if offsets.numel() <= 1:
        return rows.new_empty(0)
    return torch.cat([rows[i, : int(offsets[i + 1] - offsets[i])] for i in range(offsets.numel() - 1)])
