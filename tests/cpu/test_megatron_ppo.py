"""PPO's critic under the megatron trainer (issue 56), as users start it (`--trainer megatron`, `--tp 2` / `--dp 2`
over rank processes): in float64, TP=2 and DP=2 agree with TP=1 within rtol 1e-12 on every stage, the critic's
included; the critic starts from the same weights as the torch trainer's (the policy's trunk, the head drawn from
the run's seed, by the same names); a TP=2 PPO run replays from its sharded critic checkpoint; refused as the
torch critic is where it is not built (Ray, async)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbench.config import apply_overrides, load_config
from rlbench.core.model import load_safetensors
from rlbench.session import run
from tests.conftest import run_cli
from tests.cpu.megatron_reference import STEPS as REFERENCE_STEPS
from tests.cpu.megatron_reference import TOML as REFERENCE_TOML
from tests.cpu.megatron_reference import made_once

pytestmark = pytest.mark.slow  # rank processes each import torch, transformers and megatron-core

STEPS = 3  # step 0 the critic's alone, then both
# test_megatron_parallel.py's float64 setting (random weights, an entropy term that keeps the losses away from 0,
# a dense reward), at PPO's: DP=2 needs two micro-batches per minibatch
TOML = (
    REFERENCE_TOML.replace(f"steps = {REFERENCE_STEPS}\ncheckpoint_every = 2\n", "checkpoint_every = 1\n")
    .replace('init = "random"\n', 'init = "random"\ndtype = "float64"\n')
    .replace("[algo]\n", '[algo]\nadvantage = "ppo"\nnum_critic_only_steps = 1\n')
    .replace("micro_batch_size = 3\n", "micro_batch_size = 2\ncritic_lr = 2e-3\n")
)
RTOL = "1e-12"  # test_megatron_parallel.py's, measured there


def _make(root: Path) -> None:
    (root / "s.toml").write_text(TOML)
    run(apply_overrides(load_config(root / "s.toml"), steps=STEPS, out=str(root / "tp1")))  # one rank, in-process
    torch_trainer = apply_overrides(load_config(root / "s.toml"), steps=1, out=str(root / "torch"))
    run(torch_trainer.replace(train=torch_trainer.train.__class__(**{**vars(torch_trainer.train), "backend": "torch"})))
    for name, layout in (("tp2", "--tp"), ("dp2", "--dp")):
        res = run_cli(
            "run", "-c", str(root / "s.toml"), "--steps", str(STEPS), "--out", str(root / name), layout, "2",
            "--json", process=True,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory, worker_id) -> Path:
    return made_once(tmp_path_factory, worker_id, "megatron-ppo", _make)


def _diff(a: Path, b: Path, *args: str) -> tuple[int, dict]:
    res = run_cli("diff", str(a), str(b), "--json", *args)
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads(res.stdout)


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_the_critics_stages_under_tp2_and_dp2_match_tp1_in_float64(runs, layout):
    code, doc = _diff(runs / "tp1", runs / layout, "--rtol", RTOL)
    assert code == 0 and doc["first"] is None, doc["first"]
    assert doc["steps_compared"] == list(range(STEPS))
    critic = {"values", "advantages", "critic_loss", "critic_grads", "critic_weights"}
    assert critic | {"old_logprobs", "loss", "grads", "weights"} <= set(doc["stages_compared"])
    metrics = [json.loads(line) for line in (runs / layout / "metrics.jsonl").read_text().splitlines()]
    assert all(m["train/critic-grad_norm"] > 0 for m in metrics) and "train/loss" not in metrics[0]


def test_the_megatron_critic_starts_from_the_torch_critics_weights(runs):
    """Both trainers' critic: the policy's trunk and the seeded head, bit for bit and by the same names."""
    ours = load_safetensors(runs / "tp1" / "checkpoints" / "000000" / "critic" / "model.safetensors")
    theirs = load_safetensors(runs / "torch" / "checkpoints" / "000000" / "critic" / "model.safetensors")
    assert list(ours) == list(theirs) and all(bool((ours[k] == theirs[k]).all()) for k in ours)
    assert ours["head.weight"].shape == (1, ours["trunk.norm.weight"].shape[0]) and float(ours["head.bias"]) == 0


def test_a_tp2_ppo_run_replays_from_its_sharded_critic_checkpoint(runs, tmp_path):
    layout = json.loads((runs / "tp2" / "checkpoints" / "000002" / "critic" / "layout.json").read_text())
    assert layout["role"] == "critic" and layout["tp"] == 2
    res = run_cli("replay", str(runs / "tp2"), "--steps", "2:3", "--out", str(tmp_path / "replay"), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["reproduced"] == 1 and {"critic_loss", "critic_weights"} <= set(doc["compared_stages"])
