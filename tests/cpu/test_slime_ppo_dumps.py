"""A slime PPO run's `--dump-details` directory (tests/slime_dumps/ppo, written by slime's own writers and its own
compute_advantages_and_returns: tests/slime_dumps/make_ppo_dumps.py) imported: the critic's values, GAE's per-token
advantages and returns recorded as rlbench's PPO runs record them, the leading rollout without a train dump named
as a critic-only step, not a finding; two imports compare equal, an edited value is the first difference, at its
place; a rollout missing its train dump elsewhere stays a finding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlbench.core import ppo
from rlbench.rundir import recording
from tests.conftest import REPO, cli

PPO_DUMPS = REPO / "tests" / "slime_dumps" / "ppo"


def _import(directory: Path, out: Path):
    return cli("import", "slime", str(directory), "--out", str(out))


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ppo") / "run"
    done = _import(PPO_DUMPS, out)
    assert done.returncode == 0, done.stderr
    assert "rollout id(s) 0: no train dump, PPO's critic-only steps (--num-critic-only-steps 1" in done.stdout
    return out


def _spans(tensors: dict) -> list[tuple[int, int]]:
    offsets, prompts = tensors["offsets"].tolist(), tensors["prompt_lengths"].tolist()
    return [(offsets[i] + prompts[i], offsets[i + 1]) for i in range(len(prompts))]


def test_the_critics_fields_are_recorded_on_every_response_token_and_step_0_is_critic_only(imported):
    manifest = json.loads((imported / "manifest.json").read_text())
    assert manifest["stages"] == ["data", "rollout", "reward", "values", "advantage", "logprob"]
    assert manifest["config"]["algo"]["advantage"] == "ppo" and manifest["config"]["algo"]["num_critic_only_steps"] == 1
    sums = [json.loads(line) for line in (imported / "checksums.jsonl").read_text().splitlines()]
    assert not {"values", "advantages", "old_logprobs"} & set(sums[0])
    assert all({"values", "advantages", "old_logprobs"} <= set(row) for row in sums[1:])
    step0, _ = recording.read_step(imported, 0)
    assert not {"values", "token_advantages", "returns", "old_logprobs"} & set(step0)
    for step in (1, 2):
        tensors, meta = recording.read_step(imported, step)
        dump = torch.load(PPO_DUMPS / "train_data" / f"{step}.pt", weights_only=True)
        by_index = {s["sample_index"]: s for s in dump["samples"]}
        for k, (start, end) in enumerate(_spans(tensors)):
            theirs = by_index[meta["samples"][k]["index"]]
            for ours, key in (("values", "values"), ("token_advantages", "advantages"), ("returns", "returns")):
                assert torch.equal(tensors[ours][start:end], torch.as_tensor(theirs[key]).float()), (step, k, ours)
            kept = meta["samples"][k]["slime_train"]
            assert not {"values", "advantages", "returns"} & set(kept)  # stages, not kept fields


def test_slimes_dumped_advantages_are_rlbenchs_gae_of_the_dumped_values(imported):
    """The import holds what slime computed; rlbench's own GAE and whitening of the same values and rewards give it
    back within slime's float32 rounding (the conformance bound: test_ppo.py)."""
    for step in (1, 2):
        tensors, _ = recording.read_step(imported, step)
        spans = _spans(tensors)
        rewards = ppo.token_rewards(tensors["rewards"], [end - start for start, end in spans])
        advantages, returns = ppo.gae(rewards, [tensors["values"][a:b] for a, b in spans], 1.0, 1.0)
        whitened = ppo.whiten_tokens(advantages, [tensors["loss_mask"][a:b] for a, b in spans])
        for (a, b), adv, ret in zip(spans, whitened, returns):
            torch.testing.assert_close(tensors["token_advantages"][a:b].double(), adv, rtol=0, atol=1e-6)
            torch.testing.assert_close(tensors["returns"][a:b].double(), ret, rtol=0, atol=1e-6)


def test_two_imports_agree_and_an_edited_value_is_the_first_difference(imported, tmp_path):
    again = tmp_path / "again"
    assert _import(PPO_DUMPS, again).returncode == 0
    same = cli("diff", str(imported), str(again))
    assert same.returncode == 0 and "3 not computed by either run: PPO's critic-only steps" in same.stdout, same.stdout
    edited = tmp_path / "edited"
    shutil.copytree(PPO_DUMPS, edited)
    path = edited / "train_data" / "2.pt"
    dump = torch.load(path, weights_only=True)
    dump["samples"][3]["values"][1] += 0.25
    torch.save(dump, path)
    assert _import(edited, tmp_path / "e").returncode == 0
    res = cli("diff", str(imported), str(tmp_path / "e"), "--json")
    first = json.loads(res.stdout)["first"]
    assert res.returncode == 1 and (first["step"], first["stage"]) == (2, "values"), first
    assert "response token 1" in first["where"] and first["b"] - first["a"] == pytest.approx(0.25)


def test_a_ppo_dump_without_a_train_dump_after_its_first_trained_rollout_is_a_finding(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(PPO_DUMPS, broken)
    (broken / "train_data" / "2.pt").unlink()
    res = _import(broken, tmp_path / "out")
    assert res.returncode == 1 and "rollout 2: no train dump (train_data/2.pt)" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()
