"""The loop on a GPU in deterministic mode: same seed, same checksums; samples batch-invariant."""

from __future__ import annotations

import json
import torch

from rlbench.config import load_config
from rlbench.session import run
from tests.helpers import cuda_bf16


def _small(out, seed=3):
    return load_config(
        steps=4,
        seed=seed,
        device="cuda",
        deterministic=True,
        out=str(out),
        data__prompts_per_step=4,
        rollout__n_samples_per_prompt=4,
        train__minibatches=2,
        train__micro_batch_size=8,
    )


def test_cuda_runs_repeat_bit_for_bit(tmp_path):
    run(_small(tmp_path / "a"))
    run(_small(tmp_path / "b"))
    assert (tmp_path / "a" / "checksums.jsonl").read_bytes() == (tmp_path / "b" / "checksums.jsonl").read_bytes()
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["device"] == "cuda" and manifest["determinism"]["deterministic_algorithms"]


def test_cuda_learning_signal(tmp_path):
    """30 steps of the default task learn on a GPU as on the CPU. On the CPU (seeds 1 and 2) the mean reward of
    steps 20-29 beats that of steps 0-9 by 0.40 and 0.31, reaching 0.49 and 0.43; a CUDA run draws other samples,
    so the bounds are half that rise and a level no random policy reaches (it scores about 0.1)."""
    result = run(load_config(steps=30, device="cuda", out=str(tmp_path / "c")))
    rewards = [h["rollout/raw_reward"] for h in result.history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.15 and last >= 0.25, (first, last)


def test_cuda_bf16_runs_repeat_bit_for_bit_and_a_flipped_bit_is_caught(tmp_path):
    """bf16 with fp32 master weights, CUDA graphs and checksums on the device: two runs, one seed, the same
    checksums.jsonl; resumed from checkpoint 2 the run recomputes step 2 to the same checksums, and with one bit
    of that checkpoint's weights flipped it is refused (exit 2, naming the file); a bit flipped in a recorded
    tensor is refused on read."""
    import shutil

    import pytest
    from safetensors.torch import load_file, save_file

    from rlbench.errors import BadInput
    from rlbench.rundir import recording
    from tests.conftest import run_cli

    run(cuda_bf16(tmp_path / "a"))
    run(cuda_bf16(tmp_path / "b"))
    a = tmp_path / "a"
    assert (a / "checksums.jsonl").read_bytes() == (tmp_path / "b" / "checksums.jsonl").read_bytes()
    for flip in (False, True):
        resumed = shutil.copytree(a, tmp_path / f"r{flip}")
        lines = (resumed / "metrics.jsonl").read_text().splitlines(keepends=True)
        (resumed / "metrics.jsonl").write_text("".join(lines[:3]))
        if flip:
            path = resumed / "checkpoints" / "000002" / "model.safetensors"
            weights = load_file(path)
            name = sorted(weights)[0]
            raw = weights[name].clone().reshape(-1).view(torch.uint8)
            raw[raw.numel() // 2] ^= 8
            weights[name] = raw.view(weights[name].dtype).reshape(weights[name].shape)
            save_file(weights, path)
        res = run_cli("run", "--resume", str(resumed), "--json")
        if flip:  # in mixed precision the weights file must be the fp32 masters rounded: refused on load
            assert res.returncode == 2 and "000002/model.safetensors" in res.stderr, res.stderr
        else:
            assert res.returncode == 0, res.stderr
            assert (resumed / "checksums.jsonl").read_bytes() == (a / "checksums.jsonl").read_bytes()
    data = bytearray((a / "rollouts" / "000001.safetensors").read_bytes())
    data[-3] ^= 1  # a byte of the last tensor's data
    (a / "rollouts" / "000001.safetensors").write_bytes(bytes(data))
    with pytest.raises(BadInput):
        recording.read_step(a, 1)
