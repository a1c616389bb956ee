"""One damage, one answer: every command that reads a run directory verifies it the same way (replay/integrity.py).

A table of damages (each of metrics.jsonl, checksums.jsonl, rollouts/, one checkpoint, one rollout file removed;
one recording edited; every committed step emptied away) against every command that judges a run: each refuses
with exit 2 and one line naming the same file, and none prints a verdict. Then the same commands on the whole run,
the other way: each judges it (exit 0), so the refusals are the damage's, not the commands'."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import cli
from tests.cpu.recordings import copy_run, edit_step

STEPS = 4  # checkpoint_every 2: checkpoints after 0, 2 and 4 steps


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A complete small run and a golden file written from it."""
    from rlbench.config import load_config
    from rlbench.session import run

    root = tmp_path_factory.mktemp("integrity")
    run(
        load_config(
            out=str(root / "a"),
            steps=STEPS,
            checkpoint_every=2,
            data__prompts_per_step=2,
            rollout__n_samples_per_prompt=4,
            train__minibatches=2,
            train__micro_batch_size=4,
        )
    )
    res = cli("golden", "update", str(root / "a"), str(root / "golden.json"), "--reason", "the table's reference")
    assert res.returncode == 0, res.stderr
    return root / "a", root / "golden.json"


def _commands(run, whole_run, golden, out):
    """Every command that reads a run directory and judges it (or writes from it), with RUN as the damaged one."""
    return {
        "replay": ["replay", str(run), "--out", str(out / "replay")],
        "diff A": ["diff", str(run), str(whole_run)],
        "diff B": ["diff", str(whole_run), str(run)],
        "resume": ["run", "--resume", str(run)],
        "check tito": ["check", "tito", str(run)],
        "check logprobs": ["check", "logprobs", str(run)],
        "report": ["report", str(run), "--out", str(out / "page.html")],
        "check golden": ["check", "golden", str(run), str(golden)],
        "golden update": ["golden", "update", str(run), str(out / "new.json"), "--reason", "r"],
    }


def _remove(path):
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def _edit_rewards(run):
    def change(tensors, meta):
        tensors["rewards"][0] = 1.0 - tensors["rewards"][0]

    edit_step(run, 1, change, checksums=False)  # the checksums left as the run wrote them


# damage -> (what it does to a copy of the run, the file every command must name, commands that do not read it)
DAMAGES = {
    "metrics.jsonl removed": (lambda run: _remove(run / "metrics.jsonl"), "metrics.jsonl", ()),
    "checksums.jsonl removed": (lambda run: _remove(run / "checksums.jsonl"), "checksums.jsonl", ()),
    "rollouts/ removed": (lambda run: _remove(run / "rollouts"), "rollouts", ()),
    "a checkpoint removed": (lambda run: _remove(run / "checkpoints" / "000002"), "checkpoints/000002", ()),
    "a rollout file removed": (lambda run: _remove(run / "rollouts" / "000001.json"), "rollouts/000001.json", ()),
    "a rollout's tensors removed": (
        lambda run: _remove(run / "rollouts" / "000002.safetensors"),
        "rollouts/000002.safetensors",
        (),
    ),
    # an edited recording is consistent in itself (its own digests rewritten) but not with checksums.jsonl: caught
    # by every reader of recordings; check golden and golden update read metrics only and see the file is there
    "a recording edited": (_edit_rewards, "rollouts/000001.safetensors", ("check golden", "golden update")),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_every_command_refuses_the_same_damage_naming_the_same_file(whole, tmp_path, damage):
    whole_run, golden = whole
    harm, named, unread = DAMAGES[damage]
    run = copy_run(whole_run, tmp_path / "run")
    harm(run)
    answers = {}
    for name, args in _commands(run, whole_run, golden, tmp_path).items():
        if name in unread:
            continue
        res = cli(*args)
        lines = res.stderr.strip().splitlines()
        answers[name] = (res.returncode, lines)
        assert res.returncode == 2, f"{name}: exit {res.returncode}\n{res.stdout}{res.stderr}"
        assert len(lines) == 1 and lines[0].startswith("rlbench: error: "), f"{name}: {res.stderr}"
        assert str(run / named) in lines[0], f"{name}: {lines[0]}"
        assert "Traceback" not in res.stderr
        for verdict in ("no drift", "no difference", "reproduced", "passed", "already complete"):
            assert verdict not in res.stdout, f"{name}: {res.stdout}"
    assert not (tmp_path / "replay").exists() and not (tmp_path / "page.html").exists()
    assert not (tmp_path / "new.json").exists()
    # the damage was seen the same way by all: one message, whatever the command
    assert len({lines[0].split(": error: ", 1)[1] for _, lines in answers.values()}) == 1, answers


def test_a_run_that_committed_nothing_gets_no_verdict(whole, tmp_path):
    """Killed before its first commit: both logs empty. Every judging command says there is nothing to judge
    (exit 2); resume, which judges nothing, continues it; diff against a run with steps finds them differing."""
    whole_run, golden = whole
    run = copy_run(whole_run, tmp_path / "run")
    for log in ("metrics.jsonl", "checksums.jsonl"):
        (run / log).write_bytes(b"")
    shutil.rmtree(run / "rollouts")
    (run / "rollouts").mkdir()
    for path in (run / "checkpoints").iterdir():
        shutil.rmtree(path)
    commands = _commands(run, whole_run, golden, tmp_path)
    for name in ("replay", "check tito", "check logprobs", "report", "check golden", "golden update"):
        res = cli(*commands[name])
        assert res.returncode == 2, f"{name}: {res.stdout}{res.stderr}"
        assert "no committed step" in res.stderr, f"{name}: {res.stderr}"
    res = cli("diff", str(run), str(run))
    assert res.returncode == 2 and "neither run has a committed step" in res.stderr, res.stderr
    res = cli(*commands["diff A"])
    assert res.returncode == 1 and "step 0 is committed in B only" in res.stdout, res.stdout


def test_every_command_judges_the_whole_run(whole, tmp_path):
    """The other way: the undamaged run passes every command the table refuses it in."""
    whole_run, golden = whole
    run = copy_run(whole_run, tmp_path / "run")
    for name, args in _commands(run, whole_run, golden, tmp_path).items():
        res = cli(*args)
        assert res.returncode == 0, f"{name}: exit {res.returncode}\n{res.stdout}{res.stderr}"


def test_a_run_stopped_before_its_last_checkpoint_is_read_with_a_note(whole, tmp_path):
    """The loop commits a step before writing its checkpoint: a crash between the two leaves a committed step
    without its due checkpoint. Readers say so; resume writes it. Only the last committed step's may be missing."""
    from rlbench.replay.integrity import open_run

    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:2]))  # steps 0 and 1 committed; the checkpoint after 2 due
    shutil.rmtree(run / "checkpoints" / "000004")
    shutil.rmtree(run / "checkpoints" / "000002")
    found = open_run(run, checkpoints="present")
    assert found.checkpoints_present == [0]
    assert any("000002: not there (the run stopped before writing it" in note for note in found.notes)
    res = cli("run", "--resume", str(run))
    assert res.returncode == 0, res.stderr
    assert (run / "checkpoints" / "000002" / "state.json").is_file()
    assert cli("diff", str(run), str(whole_run)).returncode == 0
