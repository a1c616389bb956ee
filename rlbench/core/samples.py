"""Conversions between stages: engine results to `Sample`s, flat recording tensors to the
`data` stage's tensors and to the trainer's batch. Both the engine path and the recorded path
(train-only, replay) go through the flat tensors, so both compute the same checksums."""

from __future__ import annotations

import torch

from rlbench.core import algo
from rlbench.core.types import GenerateRequest, GenerateResult, Prompt, Sample
from rlbench.rundir import recording


def prompt_tensors(prompts: list[Prompt], prompt_ids: dict[int, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """What the `data` stage is checksummed as: which rows, and the token ids they render to."""
    ids = [prompt_ids[p.index] for p in prompts]
    return {
        "prompt_index": torch.tensor([p.index for p in prompts], dtype=torch.long),
        "prompt_lengths": torch.tensor([len(x) for x in ids], dtype=torch.long),
        "prompt_tokens": torch.tensor([t for x in ids for t in x], dtype=torch.long),
    }


def recorded_prompt_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same `data` tensors, read back from a recording: the first sample of each group."""
    groups = tensors["group_index"]
    firsts = [i for i in range(groups.numel()) if i == 0 or groups[i] != groups[i - 1]]
    starts, lengths = tensors["offsets"][firsts], tensors["prompt_lengths"][firsts]
    tokens = [tensors["tokens"][int(a) : int(a) + int(n)] for a, n in zip(starts, lengths)]
    return {
        "prompt_index": tensors["prompt_index"][firsts].clone(),
        "prompt_lengths": lengths.clone(),
        "prompt_tokens": torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long),
    }


def flatten(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """A step's samples as the recording's flat tensors (rlbench/rundir/recording.py's layout)."""
    return recording.pack(
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        [s.loss_mask for s in samples],
        [s.rollout_log_probs for s in samples],
        [s.prompt.index for s in samples],
        [s.group_index for s in samples],
    )


def to_sample(tokenizer, prompt: Prompt, group: int, index: int, req: GenerateRequest, res: GenerateResult) -> Sample:
    return Sample(
        group_index=group,
        index=index,
        prompt=prompt,
        prompt_ids=req.prompt_ids,
        response_ids=res.output_ids,
        response=tokenizer.decode(res.output_ids, skip_special_tokens=True),
        rollout_log_probs=res.logprobs,
        loss_mask=(1,) * len(res.output_ids),
        finish_reason=res.finish_reason,
        seed=req.seed,
        engine_id=res.engine_id,
        weight_version=res.weight_version,
        # the engine's own ids, kept apart from the trained ones: what `check tito` holds them to
        extra={"turns": [{"prompt_ids": list(req.prompt_ids), "output_ids": list(res.output_ids)}]},
    )


def from_trajectory(traj, name: str, prompt: Prompt, group: int, index: int, req: GenerateRequest) -> Sample:
    """A custom generate function's trajectory as a Sample (held to its contract first)."""
    from rlbench.core.generate import check_trajectory

    traj = check_trajectory(traj, name)
    return Sample(
        group_index=group,
        index=index,
        prompt=prompt,
        prompt_ids=tuple(traj.prompt_ids) if traj.prompt_ids is not None else req.prompt_ids,
        response_ids=tuple(traj.response_ids),
        response=traj.answer,
        rollout_log_probs=tuple(traj.logprobs),
        loss_mask=tuple(traj.loss_mask),
        finish_reason=traj.finish_reason,
        seed=req.seed,
        engine_id=traj.engine_id,
        weight_version=traj.weight_version,
        extra={"conversation": traj.messages, "turns": traj.turns},
    )


def token_counts(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sample's number of trained (loss-mask 1) tokens, from a step's flat tensors."""
    offsets = tensors["offsets"]
    sample = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets[1:] - offsets[:-1])
    return torch.zeros(len(offsets) - 1, dtype=torch.long).index_add(0, sample, tensors["loss_mask"].long())


def padded_rollout_logprobs(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The engine's log-probs in the trainer's right-padded layout (as `train_batch`'s tokens)."""
    offsets = tensors["offsets"]
    return recording.padded(tensors["rollout_logprobs"], offsets, int((offsets[1:] - offsets[:-1]).max()))


def train_batch(tensors: dict[str, torch.Tensor]) -> algo.TrainBatch:
    """The trainer's right-padded view of a step's flat recording tensors."""
    offsets = tensors["offsets"]
    width = int((offsets[1:] - offsets[:-1]).max())
    return algo.TrainBatch(
        tokens=recording.padded(tensors["tokens"], offsets, width),
        loss_mask=recording.padded(tensors["loss_mask"], offsets, width).float(),
        advantages=_advantages(tensors, width),
        old_logprobs=torch.zeros(0),
        ref_logprobs=None,
        lengths=offsets[1:] - offsets[:-1],
    )


def _advantages(tensors: dict[str, torch.Tensor], width: int) -> torch.Tensor:
    """[n] per sample, or [n, width] per token (PPO's `token_advantages`); empty before PPO's advantage stage (the
    critic's values and step read no advantages)."""
    if "advantages" in tensors:
        return tensors["advantages"]
    if "token_advantages" in tensors:
        return recording.padded(tensors["token_advantages"], tensors["offsets"], width)
    return torch.zeros(0)


def rollouts(sample_meta: list[dict]) -> torch.Tensor | None:
    """Each sample's rollout where a slime plugin's fan-out gave a rollout several samples (their recorded
    `rollout`, slime's shared Sample.rollout_id); None where every sample is a rollout of its own (the trainers'
    per-sample path). An imported slime dump's `rollout_id` is the step's, not this."""
    ids = [m.get("rollout") for m in sample_meta]
    if not ids or any(not isinstance(i, int) or isinstance(i, bool) for i in ids) or len(set(ids)) == len(ids):
        return None
    return torch.tensor(ids, dtype=torch.long)
