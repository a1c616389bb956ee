"""The megatron trainer on CUDA in deterministic mode (slime's recipe): two runs with one seed
write the same checksums and metrics, and the manifest records the settings. With two GPUs,
TP=2 (NCCL) agrees with TP=1 within rtol 1e-6. With three, `--placement ray` (two rank actors and
the engine's actor, a GPU each) writes the in-process TP=2 run's checksums."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_cli, small_toml


def _run(tmp_path, name: str, *args: str, dtype: str = "float32"):
    (tmp_path / "s.toml").write_text(small_toml(4) + f'[model]\ndtype = "{dtype}"\n')
    res = run_cli("run", "-c", str(tmp_path / "s.toml"), "--seed", "7", "--trainer", "megatron", "--device", "cuda",
                  "--deterministic", "--out", str(tmp_path / name), "--json", *args)
    assert res.returncode == 0, res.stderr
    return tmp_path / name


def _metrics(run):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_deterministic_megatron_runs_repeat_bit_for_bit(tmp_path):
    a, b = _run(tmp_path, "a"), _run(tmp_path, "b")
    assert (a / "checksums.jsonl").read_bytes() == (b / "checksums.jsonl").read_bytes()
    assert _metrics(a) == _metrics(b)
    res = run_cli("diff", str(a), str(b))
    assert res.returncode == 0, res.stdout + res.stderr
    settings = json.loads((a / "manifest.json").read_text())["determinism"]
    assert settings["deterministic"] and settings["deterministic_algorithms"]
    assert settings["cublas_workspace_config"] == ":4096:8" and settings["nccl_algo"] == "Ring"
    assert json.loads((a / "manifest.json").read_text())["versions"]["megatron-core"] is not None


def test_megatron_bf16_on_cuda_repeats_bit_for_bit_over_fp32_masters_and_resumes(tmp_path):
    """Megatron's own mixed precision on the GPU (bf16 parameters, gradients reduced into fp32 buffers, fp32
    masters and AdamW state): two runs with one seed write the same checksums; the checkpoint's masters are fp32
    and the model shard is them rounded; a run resumed from step 2 writes the straight run's checksums."""
    import shutil

    from safetensors.torch import load_file

    a, b = _run(tmp_path, "a", dtype="bfloat16"), _run(tmp_path, "b", dtype="bfloat16")
    assert (a / "checksums.jsonl").read_bytes() == (b / "checksums.jsonl").read_bytes()
    assert _metrics(a) == _metrics(b)
    point = a / "checkpoints" / "000002"
    masters = {k.removeprefix("master/"): v for k, v in load_file(point / "optimizer-tp00.safetensors").items()
               if k.startswith("master/")}
    weights = load_file(point / "model-tp00.safetensors")
    assert masters and all(v.dtype == torch.float32 for v in masters.values())
    assert all(weights[k].dtype == torch.bfloat16 and torch.equal(v.to(torch.bfloat16), weights[k])
               for k, v in masters.items())
    resumed = shutil.copytree(a, tmp_path / "resumed")
    lines = (resumed / "metrics.jsonl").read_text().splitlines(keepends=True)
    (resumed / "metrics.jsonl").write_text("".join(lines[:3]))
    res = run_cli("run", "--resume", str(resumed))
    assert res.returncode == 0, res.stderr
    assert (resumed / "checksums.jsonl").read_bytes() == (a / "checksums.jsonl").read_bytes()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_on_two_gpus_matches_tp1(tmp_path):
    one, two = _run(tmp_path, "tp1"), _run(tmp_path, "tp2", "--tp", "2")
    res = run_cli("diff", str(one), str(two), "--rtol", "1e-6")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three GPUs (two trainer ranks, the engine)")
def test_tp2_rank_actors_under_ray_placement_match_in_process_tp2(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    local, ray = _run(tmp_path, "local", "--tp", "2"), _run(tmp_path, "ray", "--tp", "2", "--placement", "ray")
    assert (ray / "checksums.jsonl").read_bytes() == (local / "checksums.jsonl").read_bytes()
    assert _metrics(ray) == _metrics(local)
