"""Replay reproduces a run bit for bit; an edited recording is caught at exactly its step and
stage; diff names the step, stage and position of one injected change; train-only trains a
different trainer on the same data."""

from __future__ import annotations

import json

import pytest
import torch

from rlbench.config import RunConfig
from rlbench.replay.diff import diff
from rlbench.rundir.recording import read_step
from rlbench.replay.replay import replay
from tests.conftest import run_cli
from tests.cpu.recordings import bump_response_token, copy_run, edit_step

# A dense reward (the response's length) gives every step a training signal, whatever the
# default task's learning curve: the tests below need gradients from step 0 on.
SMALL = dict(steps=5, checkpoint_every=2, reward__custom_rm_path="tests.cpu.plugins.rewards.response_length")
LR = RunConfig().train.lr


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    from rlbench.config import load_config
    from rlbench.session import run

    root = tmp_path_factory.mktemp("orig")
    config = load_config(
        out=str(root / "a"),
        data__prompts_per_step=2,
        rollout__n_samples_per_prompt=4,
        train__minibatches=2,
        train__micro_batch_size=3,
        **SMALL,
    )
    run(config)
    return root / "a"


def _first_step_with_signal(root) -> int:
    step = 0
    while not read_step(root, step)[0]["rewards"].unique().numel() > 1:
        step += 1
    return step


def test_replay_reproduces_every_checksum(original, tmp_path):
    res = replay(original, tmp_path / "rep")
    assert res.ok and res.reproduced == 5
    assert {"old_logprobs", "loss", "grads", "weights"} <= set(res.compared_stages)
    ours = [json.loads(line) for line in (tmp_path / "rep" / "checksums.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (original / "checksums.jsonl").read_text().splitlines()]
    for a, b in zip(ours, theirs):
        assert {k: v for k, v in a.items()} == {k: v for k, v in b.items() if k != "engine_weights"}
    assert diff(original, tmp_path / "rep").first is None
    same = run_cli("diff", str(original), str(tmp_path / "rep"))
    assert same.returncode == 0 and "no difference (bit for bit): 5 steps x 9 stages" in same.stdout, (
        same.stdout + same.stderr
    )


def test_diff_and_replay_verify_every_checkpoint(original, tmp_path):
    """One flipped bit in the last checkpoint's optimizer.safetensors, which no checksum of checksums.jsonl covers:
    diff is not "no difference" and replay does not start; both name the file. The intact run verifies all."""
    from rlbench.errors import BadInput

    done = sorted(int(p.name) for p in (original / "checkpoints").iterdir())
    assert done == [0, 2, 4, 5] and diff(original, original).checkpoints_verified == {"A": done, "B": done}
    assert replay(original, tmp_path / "rep").checkpoints_verified == done
    flipped = copy_run(original, tmp_path / "flipped")
    path = flipped / "checkpoints" / "000005" / "optimizer.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80  # the sign of the last value
    path.write_bytes(bytes(raw))
    for call in (lambda: diff(original, flipped), lambda: replay(flipped, tmp_path / "rep2")):
        with pytest.raises(BadInput, match="tensors_checksum") as info:
            call()
        assert str(path) in str(info.value)


def test_replay_of_a_step_range_starts_from_a_checkpoint(original, tmp_path):
    res = replay(original, tmp_path / "rep", steps="2:4")
    assert res.ok and res.reproduced == 2 and res.steps == (2, 4)
    # the replay committed steps 2 and 3 only: its checkpoint after 4 steps is held to step 3's weights
    assert diff(original, tmp_path / "rep", steps="2:4").checkpoints_verified == {"A": [0, 2, 4, 5], "B": [4]}


def test_replay_names_the_perturbed_reward(original, tmp_path):
    edited = copy_run(original, tmp_path / "edited")
    step = _first_step_with_signal(original)

    def flip(t, meta):
        t["rewards"][3] = 1.0 - t["rewards"][3]

    edit_step(edited, step, flip)
    res = replay(edited, tmp_path / "rep")
    assert not res.ok  # the recording is held to its checksums, so the retraining parts at the first stage it makes
    assert (res.diverged.step, res.diverged.stage) == (step, "advantages")
    # The replay kept the diverging step, so diff can look inside it.
    found = diff(original, tmp_path / "rep").first
    assert (found.step, found.stage, found.where) == (step, "rewards", "sample 3")


def test_replay_cli_exit_codes(original, tmp_path):
    ok = run_cli("replay", str(original), "--out", str(tmp_path / "r1"), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["reproduced"] == 5
    edited = copy_run(original, tmp_path / "edited")
    edit_step(edited, 1, lambda t, m: t["rewards"].__setitem__(0, 0.5))
    bad = run_cli("replay", str(edited), "--out", str(tmp_path / "r2"), "--json")
    assert bad.returncode == 1, bad.stderr
    first = json.loads(bad.stdout)["first_difference"]
    assert (first["step"], first["stage"]) == (1, "advantages")
    behind = copy_run(original, tmp_path / "behind")  # the same edit, its checksums left as the run wrote them
    edit_step(behind, 1, lambda t, m: t["rewards"].__setitem__(0, 0.5), checksums=False)
    refused = run_cli("replay", str(behind), "--out", str(tmp_path / "r3"))
    assert refused.returncode == 2 and "does not match checksums.jsonl at rewards" in refused.stderr, refused.stderr
    assert not (tmp_path / "r3").exists()


def test_diff_names_one_changed_token(original, tmp_path):
    edited = copy_run(original, tmp_path / "edited")
    step, sample = 2, 5
    bump_response_token(edited, step, sample, 1)
    retrained = tmp_path / "retrained"
    res = replay(edited, retrained)  # the recording's own trainer config; stops at the first stage the edit moves
    assert (res.diverged.step, res.diverged.stage) == (step, "old_logprobs")
    found = diff(original, retrained).first
    assert (found.step, found.stage) == (step, "rollout_tokens")
    prompt = int(read_step(original, step)[0]["prompt_lengths"][sample])
    assert found.where == f"sample {sample}, token {prompt + 1} (response token 1)"
    proc = run_cli("diff", str(original), str(retrained), "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["first"]["stage"] == "rollout_tokens"


def test_diff_names_a_learning_rate_change(original, run_small, tmp_path):
    run_small("lr", train__lr=LR * 1.01, **SMALL)
    found = diff(original, tmp_path / "lr").first
    # Until the first step with reward signal every advantage is 0 and the lr changes nothing.
    assert found.step == _first_step_with_signal(original)
    assert found.stage == "loss" and found.where == "minibatch 1"  # minibatch 0 ran on the same weights
    assert found.max_abs > 0


def test_diff_names_a_sampling_seed_change(original, run_small, tmp_path):
    run_small("seed", rollout__sampling_seed=77, **SMALL)
    found = diff(original, tmp_path / "seed").first
    assert (found.step, found.stage) == (0, "rollout_tokens")
    ta, tb = read_step(original, 0)[0], read_step(tmp_path / "seed", 0)[0]
    sample = next(
        i
        for i in range(8)
        if not torch.equal(
            ta["tokens"][ta["offsets"][i] : ta["offsets"][i + 1]], tb["tokens"][tb["offsets"][i] : tb["offsets"][i + 1]]
        )
    )
    assert found.where.startswith(f"sample {sample}, token ")


def test_diff_with_tolerance_accepts_small_and_names_large(original, run_small, tmp_path):
    run_small("lr", train__lr=LR * 1.01, **SMALL)
    assert diff(original, tmp_path / "lr", atol=1.0, rtol=1.0).first is None
    found = diff(original, tmp_path / "lr", atol=1e-9).first
    assert found is not None and found.step == _first_step_with_signal(original)


def test_train_only_trains_another_config_on_the_same_data(original, tmp_path):
    proc = run_cli(
        "run",
        "--mode",
        "train-only",
        "--rollouts",
        str(original),
        "--out",
        str(tmp_path / "t"),
        "--steps",
        "3",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    sums = [json.loads(line) for line in (tmp_path / "t" / "checksums.jsonl").read_text().splitlines()]
    assert len(sums) == 3 and all("engine_weights" not in row for row in sums)
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["mode"] == "train-only" and manifest["source"]["run"] == str(original)


def test_two_runs_made_without_recording_compare_by_their_checksums(run_small, tmp_path):
    """--no-record: no rollouts/ to read, so diff compares the checksums alone (and says the recordings were not
    verified) rather than failing on the recordings' absence."""
    from rlbench.replay.diff import diff

    run_small("a", record=False)
    run_small("b", record=False)
    result = diff(tmp_path / "a", tmp_path / "b")
    assert result.first is None and result.recordings_verified == {"A": 0, "B": 0} and result.versions_compared == 0
