"""Rollout-only mode generates, scores and records, logs rollout metrics, and trains nothing."""

from __future__ import annotations

import json

from safetensors.torch import load_file


def test_rollout_only_records_everything_and_trains_nothing(run_small, tmp_path):
    result = run_small("ro", mode="rollout-only")
    root = tmp_path / "ro"
    assert list((root / "checkpoints").iterdir()) == []
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["stages"] == ["data", "rollout", "reward"]
    metrics = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert {"rollout/raw_reward", "rollout/response_len/mean", "rollout/truncated_ratio"} <= set(m)
        assert not any(k.startswith("train/") for k in m)
    checksums = [json.loads(line) for line in (root / "checksums.jsonl").read_text().splitlines()]
    assert all(set(c) == {"step", "data", "rollout_tokens", "rollout_logprobs", "rewards"} for c in checksums)
    for step, m in enumerate(metrics):
        tensors = load_file(str(root / "rollouts" / f"{step:06d}.safetensors"))
        meta = json.loads((root / "rollouts" / f"{step:06d}.json").read_text())
        samples = meta["samples"]
        offsets = tensors["offsets"]
        assert len(samples) == offsets.numel() - 1 == 8
        assert int(offsets[-1]) == tensors["tokens"].numel() == tensors["loss_mask"].numel()
        lengths = (offsets[1:] - offsets[:-1] - tensors["prompt_lengths"]).tolist()
        assert lengths == [s["response_length"] for s in samples]
        assert int(tensors["loss_mask"].sum()) == sum(lengths)
        assert tensors["rewards"].tolist() == [s["reward"] for s in samples]
        assert abs(sum(s["reward"] for s in samples) / 8 - m["rollout/raw_reward"]) < 1e-12
        assert all(s["status"] in ("completed", "truncated") for s in samples)
    # No training happened: the engine never moved off weight version 0, in any step.
    for step in range(3):
        meta = json.loads((root / "rollouts" / f"{step:06d}.json").read_text())
        assert all(s["weight_version"] == 0 for s in meta["samples"])
    assert len(result.history) == 3


def test_rollout_only_samples_equal_full_mode_first_step(run_small, tmp_path):
    """Step 0 samples with the initial weights either way: the modes share one rollout path."""
    run_small("ro", mode="rollout-only", steps=1)
    run_small("full", steps=1)
    a = json.loads((tmp_path / "ro" / "checksums.jsonl").read_text().splitlines()[0])
    b = json.loads((tmp_path / "full" / "checksums.jsonl").read_text().splitlines()[0])
    for stage in ("data", "rollout_tokens", "rollout_logprobs", "rewards"):
        assert a[stage] == b[stage]
