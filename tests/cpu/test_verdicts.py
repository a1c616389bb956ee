"""No vacuous verdicts: "reproduced" and "no difference" only after every committed step of both sides
was compared on every stage they share, with the counts said; missing, truncated, corrupt or edited
verification data is bad input (exit 2), never a verdict; gates pass on finite numbers only. Each
case that a user met on a fresh machine (issue 9) is here, each verdict tested both ways."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli, RANDOM_INIT_MODEL
from tests.cpu.recordings import copy_run, edit_step, small_run

STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A small run and its replay (the same checksums, a different directory)."""
    from rlbench.replay.replay import replay

    root = tmp_path_factory.mktemp("verdicts")
    small_run(root / "a", STEPS)
    assert replay(root / "a", root / "replay").ok
    return root / "a", root / "replay"


def _one_line(res, code: int, *needles: str) -> str:
    assert res.returncode == code, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    if code == 2:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rlbench: error: "), res.stderr
        text = lines[0]
    else:
        text = res.stdout
    for needle in needles:
        assert needle in text, text
    return text


def _cut_lines(path, keep: int) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:keep]))


# --------------------------------------------------------------------------- must hold


def test_replay_and_diff_say_what_they_compared(runs, tmp_path):
    a, rep = runs
    res = run_cli("replay", str(a), "--out", str(tmp_path / "r"))
    _one_line(
        res,
        0,
        f"reproduced {STEPS} steps (0..{STEPS - 1})",
        f"{STEPS * 9} checksums compared",
        "9 stages at every step",
        "old_logprobs, loss, grads, weights",
        "checkpoints verified: 3",
    )
    res = run_cli("diff", str(a), str(rep))
    _one_line(
        res,
        0,
        "no difference (bit for bit)",
        f"{STEPS} steps x 9 stages",
        f"{STEPS * 9} checksums compared",
        f"recordings verified: A {STEPS} steps, B {STEPS} steps",
        "checkpoints verified: A 3, B 3",
    )
    assert "stages only A records (not compared): engine_weights" in res.stderr
    doc = json.loads(run_cli("diff", str(a), str(a), "--json").stdout)
    assert doc["first"] is None and doc["comparisons"] == STEPS * 10 and doc["steps_compared"] == list(range(STEPS))


def test_an_infinite_tolerance_finds_no_difference_in_equal_runs(runs):
    a, _ = runs
    _one_line(run_cli("diff", str(a), str(a), "--rtol", "inf"), 0, "no difference (within atol=0, rtol=inf)")
    _one_line(run_cli("diff", str(a), str(a), "--atol", "0", "--rtol", "0"), 0, "no difference")


# --------------------------------------------------------------------------- must not hold: bad input


@pytest.mark.parametrize("command", ["replay", "diff"])
def test_missing_checksums_are_bad_input(runs, tmp_path, command):
    a, _ = runs
    b = copy_run(a, tmp_path / "b")
    (b / "checksums.jsonl").unlink()
    args = [str(b), "--out", str(tmp_path / "r")] if command == "replay" else [str(a), str(b)]
    _one_line(run_cli(command, *args), 2, "checksums.jsonl", f"{STEPS} committed steps and no checksums")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", ["replay", "diff", "resume"])
def test_truncated_checksums_are_bad_input(runs, tmp_path, command):
    a, _ = runs
    b = copy_run(a, tmp_path / "b")
    _cut_lines(b / "checksums.jsonl", 2)
    args = {
        "replay": ["replay", str(b), "--out", str(tmp_path / "r")],
        "diff": ["diff", str(a), str(b)],
        "resume": ["run", "--resume", str(b)],
    }[command]
    _one_line(run_cli(*args), 2, "checksums.jsonl", f"no checksums for committed step(s) 2, 3 of {STEPS}")


def test_a_checksum_line_missing_a_stage_is_bad_input(runs, tmp_path):
    a, _ = runs
    b = copy_run(a, tmp_path / "b")
    rows = [json.loads(line) for line in (b / "checksums.jsonl").read_text().splitlines()]
    del rows[1]["grads"]
    (b / "checksums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _one_line(run_cli("diff", str(a), str(b)), 2, "step 1: expected a checksum (64 hex digits) for grads")


def test_diff_refuses_a_corrupt_recording_whose_checksums_agree(runs, tmp_path):
    """One flipped byte in a recording the checksums never look at: diff reads and verifies every step."""
    a, _ = runs
    c = copy_run(a, tmp_path / "c")
    path = c / "rollouts" / "000003.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(bytes(raw))
    _one_line(run_cli("diff", str(a), str(c)), 2, "000003.safetensors", "corrupt")
    _one_line(run_cli("replay", str(c), "--out", str(tmp_path / "r")), 2, "000003.safetensors")


def test_diff_refuses_a_recording_edited_behind_its_checksums(runs, tmp_path):
    """A self-consistent file whose values are not the ones the run's checksums were taken of."""
    a, _ = runs
    c = copy_run(a, tmp_path / "c")
    edit_step(c, 1, lambda t, m: t["rewards"].add_(0.25), checksums=False)
    _one_line(run_cli("diff", str(a), str(c)), 2, "000001.safetensors", "does not match checksums.jsonl at rewards")


def _flip_a_bit(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01  # inside the last tensor's values: the file still reads
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "name,why",
    [
        ("000004/optimizer.safetensors", "do not match optimizer.json's tensors_checksum"),
        ("000004/model.safetensors", f"do not match checksums.jsonl's weights at step {STEPS - 1}"),
        ("000000/model.safetensors", "do not match manifest.json's hashes.initial_weights"),
    ],
)
def test_a_checkpoint_with_a_flipped_bit_is_bad_input(runs, tmp_path, name, why):
    """The checksums, the recordings and the metrics agree; one bit of a checkpoint does not: diff and replay hold
    every checkpoint to the checksums its run recorded for it, and name the file (exit 2: a damaged input, which
    its own run's checksums expose, not a difference between the runs). The intact copy is no difference."""
    a, _ = runs
    c = copy_run(a, tmp_path / "c")
    _one_line(run_cli("diff", str(a), str(c)), 0, "no difference (bit for bit)", "checkpoints verified: A 3, B 3")
    _flip_a_bit(c / "checkpoints" / name)
    _one_line(run_cli("diff", str(a), str(c)), 2, f"checkpoints/{name}", why)
    _one_line(run_cli("diff", str(c), str(a), "--json"), 2, f"checkpoints/{name}")
    _one_line(run_cli("replay", str(c), "--out", str(tmp_path / "r")), 2, f"checkpoints/{name}", why)
    assert not (tmp_path / "r").exists()


def test_a_checkpoint_that_is_not_whole_is_bad_input(runs, tmp_path):
    a, _ = runs
    c = copy_run(a, tmp_path / "c")
    (c / "checkpoints" / "000002" / "state.json").unlink()
    _one_line(run_cli("diff", str(a), str(c)), 2, "checkpoints/000002", "no state.json")


def test_a_run_whose_checkpoints_were_removed_is_bad_input(runs, tmp_path):
    """The loop wrote a checkpoint after 0, 2 and 4 steps: a full run without them is damaged, and neither diff nor
    replay speaks for it (replay/integrity.py; only a run with no trainer, rollout-only, has none)."""
    import shutil

    a, _ = runs
    c = copy_run(a, tmp_path / "c")
    shutil.rmtree(c / "checkpoints")
    for args in (("diff", str(a), str(c)), ("replay", str(c), "--out", str(tmp_path / "r"))):
        _one_line(run_cli(*args), 2, str(c / "checkpoints" / "000000"), "the checkpoint after 0 steps is not there")
    assert not (tmp_path / "r").exists()


def test_a_checkpoint_past_the_last_committed_step_is_ignored_and_said(runs, tmp_path):
    """Cut back to 2 committed steps, checkpoint 000004 is past the commit: not read (a note), and not counted."""
    a, _ = runs
    short = copy_run(a, tmp_path / "short")
    for log in ("metrics.jsonl", "checksums.jsonl"):
        _cut_lines(short / log, 2)
    _flip_a_bit(short / "checkpoints" / "000004" / "optimizer.safetensors")
    res = run_cli("diff", str(a), str(short), "--steps", "0:2")
    _one_line(res, 0, "no difference (bit for bit): 2 steps", "checkpoints verified: A 3, B 2")
    assert "checkpoints/000004: ignored (after 4 steps, past the last committed step 1)" in res.stderr


def test_a_truncated_recording_at_the_first_difference_is_bad_input(runs, tmp_path):
    a, _ = runs
    edited = copy_run(a, tmp_path / "edited")
    edit_step(edited, 2, lambda t, m: t["rewards"].__setitem__(0, 0.5))  # another run's rewards, so advantages
    assert run_cli("replay", str(edited), "--out", str(tmp_path / "r")).returncode == 1  # r keeps step 2
    assert run_cli("diff", str(a), str(tmp_path / "r")).returncode == 1
    path = tmp_path / "r" / "rollouts" / "000002.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    _one_line(run_cli("diff", str(a), str(tmp_path / "r")), 2, "000002.safetensors", "truncated")


@pytest.mark.parametrize("value", ["nan", "-1"])
def test_a_tolerance_that_is_not_a_number_is_refused(runs, value):
    a, _ = runs
    res = run_cli("diff", str(a), str(a), "--rtol", value)
    assert res.returncode == 2 and "--rtol" in res.stderr and "Traceback" not in res.stderr


# --------------------------------------------------------------------------- must not hold: a difference


def test_runs_of_different_lengths_differ(runs, tmp_path):
    a, _ = runs
    short = copy_run(a, tmp_path / "short")
    for log in ("metrics.jsonl", "checksums.jsonl"):
        _cut_lines(short / log, 2)
    text = _one_line(
        run_cli("diff", str(a), str(short)), 1, "step 2", "committed in A only", f"A committed {STEPS} steps, B 2"
    )
    assert "no difference" not in text
    doc = json.loads(run_cli("diff", str(short), str(a), "--json").stdout)
    assert doc["first"]["stage"] == "steps" and "B only" in doc["first"]["where"]
    # asked for the steps both have, the verdict speaks for those, and says so
    _one_line(
        run_cli("diff", str(a), str(short), "--steps", "0:2"), 0, "no difference (bit for bit): 2 steps x 10 stages"
    )
    _one_line(run_cli("diff", str(a), str(short), "--steps", "0:3"), 2, "B has not committed step(s) 2..2 of 0..2")


# --------------------------------------------------------------------------- gates


def _nan_logprob(t, meta):
    pos = int((t["loss_mask"] == 1).nonzero()[3])
    t["old_logprobs"][pos] = float("nan")


def test_a_nan_log_prob_fails_every_gate_by_name(runs, tmp_path):
    a, _ = runs
    b = copy_run(a, tmp_path / "b")
    edit_step(b, 1, _nan_logprob)
    res = run_cli("check", "logprobs", str(b), "--max-mean", "0.1", "--max-abs", "10")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "train_rollout_logprob_abs_diff is nan" in res.stdout and "max_abs is nan" in res.stdout
    assert "1 non-finite log-prob deltas; the first at step 1" in res.stdout + res.stderr
    assert "gate passes only on finite numbers" in res.stdout
    ok = run_cli("check", "logprobs", str(a), "--max-mean", "0.1")
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_a_nan_threshold_is_refused(runs):
    a, _ = runs
    _one_line(run_cli("check", "logprobs", str(a), "--max-mean", "nan"), 2, "--max-mean", "finite number")


# --------------------------------------------------------------------------- inputs held to the manifest


def _edited_copy(src, dst, name):
    import shutil

    shutil.copytree(src, dst)
    path = dst / name
    path.write_text(path.read_text().replace("\n", "\n ", 1))  # same meaning, other bytes
    return dst


def test_checks_refuse_another_tokenizer_than_the_recorded_one(runs, tmp_path):
    from rlbench.config import ModelConfig

    a, _ = runs
    other = _edited_copy(ModelConfig().tokenizer, tmp_path / "tok", "tokenizer_config.json")
    _one_line(run_cli("check", "tito", str(a), "--tokenizer", str(other)), 2, "another tokenizer", str(other))
    moved = copy_run(a, tmp_path / "moved")
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["config"]["model"]["tokenizer"] = str(other)
    (moved / "manifest.json").write_text(json.dumps(manifest))
    _one_line(run_cli("check", "logprobs", str(moved)), 2, "another tokenizer")
    _one_line(run_cli("check", "tito", str(moved)), 2, "another tokenizer")


def test_recompute_refuses_another_model_than_the_recorded_one(runs, tmp_path):

    a, _ = runs
    other = _edited_copy(RANDOM_INIT_MODEL, tmp_path / "model", "config.json")
    moved = copy_run(a, tmp_path / "moved")
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["config"]["model"]["path"] = str(other)
    (moved / "manifest.json").write_text(json.dumps(manifest))
    _one_line(run_cli("check", "logprobs", str(moved), "--recompute"), 2, "another model config")
    res = run_cli("check", "logprobs", str(a), "--recompute")
    assert res.returncode == 0, res.stdout + res.stderr
