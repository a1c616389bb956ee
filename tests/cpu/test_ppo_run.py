"""PPO with a critic in the loop (issue 56), as a user runs it: the critic's stages recorded and checksummed, a run
twice the same bits, replay reproducing the critic's stages, diff naming the first critic stage where two runs part,
a SIGKILLed run resumed to the same files, critic-only steps, slime's PPO command line, and what is refused."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from rlbench.config import load_config
from rlbench.errors import BadInput
from rlbench.rundir import recording
from tests.conftest import run_cli, small_toml
from tests.cpu.test_crash_resume import assert_same_run

PPO = small_toml(3).replace("checkpoint_every = 2", "checkpoint_every = 1") + '[algo]\nadvantage = "ppo"\n'
CRITIC_STAGES = ("values", "critic_loss", "critic_grads", "critic_weights")


def _run(tmp: Path, name: str, toml: str = PPO, config: str | None = None) -> Path:
    config = config or f"{name}.toml"
    (tmp / config).write_text(toml)
    res = run_cli("run", "-c", str(tmp / config), "--out", str(tmp / name), "--json")
    assert res.returncode == 0, res.stderr
    return tmp / name


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Path:
    """The reference run, under the names the crash test's runs take (their manifests name the config file)."""
    return _run(tmp_path_factory.mktemp("ppo"), "run", config="s.toml")


def _rows(path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (path / name).read_text().splitlines()]


def test_a_ppo_run_records_the_critics_stages_and_twice_is_the_same_bits(ppo_run, tmp_path):
    again = _run(tmp_path, "b")
    assert (again / "checksums.jsonl").read_bytes() == (ppo_run / "checksums.jsonl").read_bytes()
    for row in _rows(ppo_run, "checksums.jsonl"):
        assert all(len(row[key]) == 64 for key in CRITIC_STAGES + ("advantages", "old_logprobs", "weights"))
    manifest = json.loads((ppo_run / "manifest.json").read_text())
    assert manifest["stages"] == [
        "data", "rollout", "reward", "values", "advantage", "critic_train", "logprob", "train", "sync"
    ]  # fmt: skip
    tensors, _ = recording.read_step(ppo_run, 1)
    response = torch.zeros(tensors["tokens"].numel(), dtype=torch.bool)
    offsets, prompts = tensors["offsets"].tolist(), tensors["prompt_lengths"].tolist()
    reward_of = torch.zeros(tensors["tokens"].numel())
    for i in range(len(prompts)):
        response[offsets[i] + prompts[i] : offsets[i + 1]] = True
        reward_of[offsets[i] : offsets[i + 1]] = tensors["rewards"][i]
    assert "advantages" not in tensors and tensors["critic_losses"].numel() == 2  # two minibatches
    for name in ("values", "token_advantages", "returns"):
        assert tensors[name].shape == tensors["tokens"].shape and bool((tensors[name][~response] == 0).all()), name
    assert bool((tensors["values"][response] != 0).all())  # every response token, trained or not
    # gamma = lambd = 1, no KL in the reward: each token's return is its sample's reward, its advantage R - V
    torch.testing.assert_close(tensors["returns"][response], reward_of[response], rtol=0, atol=1e-6)
    torch.testing.assert_close(
        tensors["token_advantages"][response], (reward_of - tensors["values"])[response], rtol=0, atol=1e-6
    )
    metrics = _rows(ppo_run, "metrics.jsonl")[1]
    for key in ("train/critic-value_loss", "train/critic-value_clipfrac", "train/critic-grad_norm", "train/loss"):
        assert key in metrics, key
    for key in ("rollout/values", "rollout/returns", "rollout/advantages"):  # slime's per-rollout means
        assert key in metrics, key
    assert metrics["rollout/returns"] == pytest.approx(float(tensors["rewards"].mean()), abs=1e-6)
    for done in (0, 1, 2, 3):
        folder = ppo_run / "checkpoints" / f"{done:06d}" / "critic"
        assert sorted(p.name for p in folder.iterdir()) == [
            "model.safetensors",
            "optimizer.json",
            "optimizer.safetensors",
        ]


def test_replay_reproduces_a_ppo_run_counting_the_critics_stages(ppo_run):
    res = run_cli("replay", str(ppo_run), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["reproduced"] == 3
    assert all(stage in doc["compared_stages"] for stage in CRITIC_STAGES + ("advantages",))
    assert doc["checksums_compared"] == 3 * 13  # every stage but the sync's, at every step


def test_diff_names_a_critic_stage_first_when_only_the_critics_learning_rate_differs(ppo_run, tmp_path):
    same = run_cli("diff", str(ppo_run), str(_run(tmp_path, "same")), "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["first"] is None
    other = _run(tmp_path, "lr", PPO.replace("[train]\n", "[train]\ncritic_lr = 0.000303\n"))  # 3e-4 x 1.01
    res = run_cli("diff", str(ppo_run), str(other), "--json")
    assert res.returncode == 1, res.stderr
    first = json.loads(res.stdout)["first"]
    assert first["step"] == 0 and first["stage"] == "critic_loss" and first["where"] == "minibatch 1", first


CRASHES = [("step.start", 3), ("checkpoint.partial", 5)]  # between steps; checkpoint 0's critic, part written


@pytest.mark.parametrize("point, count", CRASHES, ids=[f"{p}@{c}" for p, c in CRASHES])
def test_a_killed_ppo_run_resumes_to_the_same_files(ppo_run, tmp_path, point, count):
    (tmp_path / "s.toml").write_text(PPO)
    out = tmp_path / "run"
    os.environ["RLBENCH_FAILPOINT"] = f"{point}@{count}"
    try:
        proc = run_cli("run", "-c", str(tmp_path / "s.toml"), "--out", str(out), "--json", process=True)
    finally:
        del os.environ["RLBENCH_FAILPOINT"]
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    res = run_cli("run", "--resume", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert_same_run(out, ppo_run)


def test_critic_only_steps_train_the_critic_alone_and_keep_the_actor(tmp_path):
    toml = PPO.replace('advantage = "ppo"\n', 'advantage = "ppo"\nnum_critic_only_steps = 2\n')
    run = _run(tmp_path, "c", toml)
    sums, metrics = _rows(run, "checksums.jsonl"), _rows(run, "metrics.jsonl")
    actor = ("old_logprobs", "loss", "grads", "weights")
    for step in (0, 1):
        assert not any(key in sums[step] for key in actor) and all(key in sums[step] for key in CRITIC_STAGES)
        assert "train/loss" not in metrics[step] and "rollout/values" not in metrics[step]
        assert "train/critic-value_loss" in metrics[step]
    assert all(key in sums[2] for key in actor) and "train/loss" in metrics[2]
    initial = (run / "checkpoints" / "000000" / "model.safetensors").read_bytes()
    for done in (1, 2):  # the actor did not train: its checkpoints hold the initial weights; the critic's moved
        assert (run / "checkpoints" / f"{done:06d}" / "model.safetensors").read_bytes() == initial
    assert sums[0]["engine_weights"] == sums[1]["engine_weights"] != sums[2]["engine_weights"]
    replayed = json.loads(run_cli("replay", str(run), "--json").stdout)
    assert replayed["ok"] and replayed["checksums_compared"] == 2 * 9 + 13
    golden = tmp_path / "golden.json"
    made = run_cli("golden", "update", str(run), str(golden), "--reason", "PPO, two critic-only steps")
    assert made.returncode == 0, made.stderr
    series = json.loads(golden.read_text())["metrics"]
    assert series["train/critic-value_loss"]["start_step"] == 0 and series["train/loss"]["start_step"] == 2
    again = _run(tmp_path, "again", toml)
    checked = run_cli("check", "golden", str(again), str(golden), "--ignore", "perf/*")
    assert checked.returncode == 0 and "golden check passed" in checked.stdout, checked.stdout + checked.stderr
    within = run_cli("diff", str(run), str(again), "--rtol", "1e-9")  # tolerance mode over the critic-only steps
    assert within.returncode == 0 and "8 not computed by either run" in within.stdout, within.stdout + within.stderr
    checked = run_cli("check", "logprobs", str(run), "--json")  # the actor's steps judged, the critic-only ones named
    doc = json.loads(checked.stdout)
    assert checked.returncode == 0 and doc["steps"] == [2], checked.stdout + checked.stderr
    assert "steps [0, 1] not judged: PPO's critic-only steps, where the actor computes no log-probs" in doc["notes"]
    split = run_cli("check", "logprobs", str(run), "--attribute", "--steps", "0:1", "--json")
    reasons = json.loads(split.stdout)["not_measured"]
    assert split.returncode == 0 and "a PPO critic-only step: the actor computed no log-probs" in json.dumps(reasons)
    one = _run(tmp_path, "one", toml.replace("num_critic_only_steps = 2", "num_critic_only_steps = 1"))
    res = run_cli("diff", str(run), str(one), "--json")
    first = json.loads(res.stdout)["first"]
    assert res.returncode == 1 and (first["step"], first["stage"]) == (1, "old_logprobs"), first
    assert "computed by B only" in first["where"]


def test_check_logprobs_over_critic_only_steps_alone_is_undetermined(tmp_path):
    toml = PPO.replace("steps = 3", "steps = 1").replace(
        'advantage = "ppo"\n', 'advantage = "ppo"\nnum_critic_only_steps = 1\n'
    )
    res = run_cli("check", "logprobs", str(_run(tmp_path, "critic", toml)))
    assert res.returncode == 2 and "undetermined: steps [0] are PPO's critic-only steps" in res.stderr, res.stderr


def test_a_recording_without_a_tensor_its_checksums_record_is_bad_input(ppo_run, tmp_path):
    """A step's recording rewritten whole (its own checksum valid) without the trainer's log-probs: not the run's,
    whatever reads it; a PPO critic-only step lacks them by its run's schedule, which no edit can claim."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ppo_run, copy)
    tensors, meta = recording.read_step(copy, 1)
    del tensors["old_logprobs"], tensors["ref_logprobs"]  # what the old_logprobs checksum covers
    tensor_bytes, json_bytes = recording.encode_step(1, tensors, meta["samples"], {})
    (copy / "rollouts" / "000001.safetensors").write_bytes(tensor_bytes)
    (copy / "rollouts" / "000001.json").write_bytes(json_bytes)
    for command in (("check", "logprobs", str(copy)), ("diff", str(ppo_run), str(copy))):
        res = run_cli(*command)
        assert res.returncode == 2, (command, res.stdout, res.stderr)
        assert "the recording of step 1 lacks what checksums.jsonl records at old_logprobs" in res.stderr
        assert str(copy / "rollouts" / "000001.safetensors") in res.stderr


def test_a_damaged_critic_checkpoint_is_bad_input_naming_the_file(ppo_run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ppo_run, copy)
    target = copy / "checkpoints" / "000002" / "critic" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    res = run_cli("diff", str(ppo_run), str(copy))
    assert res.returncode == 2 and str(target) in res.stderr and "critic_weights at step 1" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def _slime_ppo() -> list[str]:
    """slime's PPO arguments of expected_args.json's "ppo" case (slime's parser resolved them: test_args.py), with the
    fixture's parity data and its verifier, and the roles config that sets the critic's learning rate."""
    from rlbench.config_sections import FIXTURES

    conformance = Path(__file__).resolve().parents[1] / "conformance" / "slime"
    argv = json.loads((conformance / "expected_args.json").read_text())["cases"]["ppo"]["argv"]
    argv = [str(FIXTURES / "data" / "parity.jsonl") if arg == "data.jsonl" else arg for arg in argv]
    argv[argv.index("--num-rollout") + 1] = "2"
    return argv + [
        "--rm-type",
        "parity",
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--megatron-config-path",
        str(conformance / "ppo_roles.yaml"),
    ]


def test_slimes_ppo_command_line_runs_and_print_config_shows_what_each_argument_sets(tmp_path):
    shown = run_cli("run", *_slime_ppo(), "--print-config", "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    sets = {row["argument"]: row["sets"] for row in doc["slime"]}
    assert sets["--advantage-estimator"] == {"algo.advantage": "ppo"}
    assert sets["--value-clip"] == {"algo.value_clip": 0.3}
    assert sets["--gamma"] == {"algo.gamma": 0.99} and sets["--lambd"] == {"algo.lambd": 0.95}
    assert sets["--num-critic-only-steps"] == {"algo.num_critic_only_steps": 1}
    assert sets["--megatron-config-path"] == {"train.critic_lr": 1e-5}
    assert doc["config"]["train"]["critic_lr"] == 1e-5 and doc["config"]["train"]["lr"] == 1e-6
    res = run_cli("run", *_slime_ppo(), "--out", str(tmp_path / "s"), "--json")
    assert res.returncode == 0, res.stderr
    sums = _rows(tmp_path / "s", "checksums.jsonl")
    assert "loss" not in sums[0] and "loss" in sums[1]


@pytest.mark.parametrize(
    "text, says",
    [
        ("megatron: {role: critic}\n", "expected a top-level 'megatron' list"),
        ("megatron:\n  - {role: critic, overrides: {lr: 1e-5}}\n  - {role: critic}\n", "at most one entry with role"),
        ("megatron:\n  - {role: critic, overrides: {weight_decay: 0.1}}\n", "overrides.weight_decay: weight_decay is"),
        ("megatron:\n  - {role: critic, overrides: {lr: fast}}\n", "expected a number, got 'fast'"),
        ("megatron: [\n", "not YAML"),
    ],
)
def test_a_role_config_rlbench_cannot_read_whole_is_refused_by_name(tmp_path, text, says):
    roles = tmp_path / "roles.yaml"
    roles.write_text(text)
    argv = [str(roles) if arg.endswith("ppo_roles.yaml") else arg for arg in _slime_ppo()]
    res = run_cli("run", *argv, "--out", str(tmp_path / "r"))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and says in lines[0] and str(roles) in lines[0], res.stderr
    assert not (tmp_path / "r").exists()


def test_slimes_critic_role_without_ppo_and_its_missing_use_critic_are_refused(tmp_path):
    argv = _slime_ppo()
    argv[argv.index("ppo")] = "grpo"
    for key in ("--value-clip", "--gamma", "--lambd", "--num-critic-only-steps"):
        del argv[argv.index(key) : argv.index(key) + 2]
    res = run_cli("run", *argv, "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "role critic's overrides set PPO's critic" in res.stderr, res.stderr
    res = run_cli("run", *_slime_ppo(), "--use-critic", "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "--advantage-estimator ppo turns the critic on" in res.stderr, res.stderr


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"algo__gamma": 0.99}, "algo.gamma"),
        ({"algo__num_critic_only_steps": 1}, "algo.num_critic_only_steps"),
        ({"train__critic_lr": 1e-4}, "train.critic_lr"),
        ({"algo__advantage": "ppo", "placement__backend": "ray"}, "algo.advantage"),
        ({"algo__advantage": "ppo", "rollout__async_mode": "one-step"}, "algo.advantage"),
        ({"algo__advantage": "ppo", "algo__lambd": 1.5}, "algo.lambd"),
    ],
)
def test_what_the_critics_path_cannot_take_is_refused_by_name(overrides, field):
    with pytest.raises(BadInput, match=f"^{field}: expected"):
        load_config(**overrides)
