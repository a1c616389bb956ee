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
    assert (
        "note: rollout id(s) 0: no train dump, PPO's critic-only steps (--num-critic-only-steps 1: slime's actor "
        "neither computes nor dumps there); their steps hold the rollout side only" in " ".join(done.stdout.split())
    )
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
        prompt = torch.ones(tensors["tokens"].numel(), dtype=torch.bool)
        for start, end in _spans(tensors):
            prompt[start:end] = False
        assert all(bool((tensors[name][prompt] == 0).all()) for name in ("values", "token_advantages", "returns"))
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


def _steps(n: int) -> list[tuple[int, None, list]]:
    return [(rid, None, []) for rid in range(n)]


def test_only_a_leading_block_of_missing_train_dumps_in_a_ppo_run_counts_as_critic_only(tmp_path):
    from rlbench.replay.slime_joined import critic_only_steps

    ppo = {rid: [PPO_DUMPS / "train_data" / f"{rid}.pt"] for rid in (1, 2)}
    grpo = {rid: [REPO / "examples" / "slime-dump-details" / "train_data" / f"{rid}.pt"] for rid in (1, 2)}
    v1 = {
        rid: [REPO / "tests" / "slime_dumps" / "v1" / "train_data" / f"{rid}_{r}.pt" for r in range(4)]
        for rid in (1, 2)
    }
    assert critic_only_steps(_steps(3), ppo) == 1
    assert critic_only_steps(_steps(4), {**ppo, 3: ppo[2]}) == 1
    assert critic_only_steps(_steps(3), {0: ppo[1], **ppo}) == 0  # nothing missing
    assert critic_only_steps(_steps(3), {0: ppo[1], 2: ppo[2]}) == 0  # rollout 1 missing, not a leading block
    assert critic_only_steps(_steps(2), {}) == 0  # no train dump at all: no PPO run to tell
    assert critic_only_steps(_steps(3), grpo) == 0  # no critic's values: each missing one is a finding
    assert critic_only_steps(_steps(3), v1) == 0  # format 1 (a file per rank): slime before its PPO path
    single = {1: [tmp_path / "1_0.pt"], 2: ppo[2]}  # one file, named as format 1's
    shutil.copy(ppo[1][0], single[1][0])
    assert critic_only_steps(_steps(3), single) == 0


def test_two_leading_rollouts_without_train_dumps_are_two_critic_only_steps(tmp_path):
    two = tmp_path / "two"
    shutil.copytree(PPO_DUMPS, two)
    (two / "train_data" / "1.pt").unlink()
    res = _import(two, tmp_path / "out")
    assert res.returncode == 0 and "rollout id(s) 0, 1: no train dump" in res.stdout, res.stdout + res.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["config"]["algo"]["num_critic_only_steps"] == 2
    sums = [json.loads(line) for line in (tmp_path / "out" / "checksums.jsonl").read_text().splitlines()]
    assert ["values" in row for row in sums] == [False, False, True]


def test_each_train_field_is_a_stage_or_kept_never_both_nor_neither(imported, tmp_path):
    """GRPO's per-sample advantages are a stage, its per-token returns kept; PPO's values, advantages and returns
    are stages; what the trainer computed on untrained tokens is kept but for what a stage already holds there."""
    grpo = tmp_path / "grpo"
    assert _import(REPO / "examples" / "slime-dump-details", grpo).returncode == 0
    cases = (
        (grpo, {"returns", "kl"}, {"advantages", "values"}, ["advantages", "log_probs", "ref_log_probs"]),
        (imported, {"kl"}, {"advantages", "values", "returns"}, ["log_probs"]),
    )
    for run, kept, staged, untrained in cases:
        _, meta = recording.read_step(run, 1)
        fields = [s["slime_train"] for s in meta["samples"]]
        assert all(kept <= set(f) and not staged & set(f) for f in fields), (run.name, fields[0])
        spans = [f["untrained_tokens"] for f in fields if "untrained_tokens" in f]
        assert spans and all(sorted(span) == sorted(untrained + ["response_tokens"]) for span in spans), spans[0]


def test_the_trainers_log_probs_are_recorded_on_trained_response_tokens_only(tmp_path):
    """old_logprobs and ref_logprobs from a GRPO run's train dumps: the dump's values on trained tokens, 0 on the
    prompt and on tokens outside the loss mask (kept apart in the sample's untrained_tokens)."""
    grpo = tmp_path / "grpo"
    assert _import(REPO / "examples" / "slime-dump-details", grpo).returncode == 0
    tensors, meta = recording.read_step(grpo, 1)
    dump = torch.load(REPO / "examples" / "slime-dump-details" / "train_data" / "1.pt", weights_only=True)
    by_index = {s["sample_index"]: s for s in dump["samples"]}
    mask = tensors["loss_mask"].bool()
    for ours, key in (("old_logprobs", "log_probs"), ("ref_logprobs", "ref_log_probs")):
        assert bool((tensors[ours][~mask] == 0).all()), ours
        for k, (start, end) in enumerate(_spans(tensors)):
            theirs = torch.as_tensor(by_index[meta["samples"][k]["index"]][key]).float()
            trained = mask[start:end]
            assert torch.equal(tensors[ours][start:end][trained], theirs[trained]), (ours, k)
