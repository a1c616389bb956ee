"""Same seed, same bytes; another seed, other bytes. One run in-process, one through the CLI in
a fresh process (its own hash seed, its own import order), so nothing process-local can hide."""

from __future__ import annotations

import json

from tests.conftest import run_cli, small_toml

SMALL_TOML = small_toml(3)


def _metrics_without_perf(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def test_same_seed_same_bytes_across_processes(tmp_path, run_small):
    run_small("a", seed=11)
    config = tmp_path / "small.toml"
    config.write_text(SMALL_TOML)
    proc = run_cli(
        "run", "--config", str(config), "--seed", "11", "--out", str(tmp_path / "b"), "--json", process=True, fresh=True
    )  # another interpreter: the bits must not depend on the process
    assert proc.returncode == 0, proc.stderr
    a, b = tmp_path / "a", tmp_path / "b"
    # Booleans, not `bytes == bytes` in the assert: pytest would diff kilobytes of binary on failure.
    same = (a / "checksums.jsonl").read_bytes() == (b / "checksums.jsonl").read_bytes()
    assert same, "checksums.jsonl differs"
    assert _metrics_without_perf(a / "metrics.jsonl") == _metrics_without_perf(b / "metrics.jsonl")
    for rel in [
        "rollouts/000000.safetensors",
        "rollouts/000002.json",
        "checkpoints/000002/model.safetensors",
        "checkpoints/000003/optimizer.safetensors",
    ]:
        same = (a / rel).read_bytes() == (b / rel).read_bytes()
        assert same, f"{rel} differs"
    manifest_a, manifest_b = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert manifest_a["hashes"] == manifest_b["hashes"]


def test_every_stage_is_checksummed(run_small, tmp_path):
    # A dense reward (the response's length): every step has a training signal to move the weights.
    run_small("a", reward__custom_rm_path="tests.cpu.plugins.rewards.response_length")
    rows = [json.loads(line) for line in (tmp_path / "a" / "checksums.jsonl").read_text().splitlines()]
    stages = {
        "data",
        "rollout_tokens",
        "rollout_logprobs",
        "rewards",
        "advantages",
        "old_logprobs",
        "loss",
        "grads",
        "weights",
        "engine_weights",
    }
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert set(row) - {"step"} == stages
        assert all(len(row[s]) == 64 for s in stages)
    # The engine holds what the trainer produced: the sync stage moved the weights bit for bit.
    assert all(row["weights"] == row["engine_weights"] for row in rows)
    # Training changes the weights every step.
    assert len({row["weights"] for row in rows}) == 3


def test_other_seed_other_bytes(run_small, tmp_path):
    run_small("a", seed=1)
    run_small("b", seed=2)
    rows_a = [json.loads(line) for line in (tmp_path / "a" / "checksums.jsonl").read_text().splitlines()]
    rows_b = [json.loads(line) for line in (tmp_path / "b" / "checksums.jsonl").read_text().splitlines()]
    for ra, rb in zip(rows_a, rows_b):
        for stage in ("data", "rollout_tokens", "weights"):
            assert ra[stage] != rb[stage], (ra["step"], stage)
