"""One damage, one answer: every command that reads a run directory verifies it the same way (replay/integrity.py).

A table of damages (each of metrics.jsonl, checksums.jsonl, rollouts/, one checkpoint, one rollout file removed;
one recording edited; every committed step emptied away) against every command that judges a run: each refuses
with exit 2 and one line naming the same file, and none prints a verdict. Then the same commands on the whole run,
the other way: each judges it (exit 0), so the refusals are the damage's, not the commands'."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import cli
from tests.cpu.recordings import copy_run, edit_step, small_run

STEPS = 4  # checkpoint_every 2: checkpoints after 0, 2 and 4 steps
DEEP = {"recordings": "verify", "checkpoints": "present", "need_steps": True, "need_recordings": True}


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A complete small run and a golden file written from it."""
    root = tmp_path_factory.mktemp("integrity")
    small_run(root / "a", STEPS)
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
    found = open_run(run, **DEEP)
    assert found.checkpoints_present == [0]
    assert any("000002: not there (the run stopped before writing it" in note for note in found.notes)
    res = cli("run", "--resume", str(run))
    assert res.returncode == 0, res.stderr
    assert (run / "checkpoints" / "000002" / "state.json").is_file()
    assert cli("diff", str(run), str(whole_run)).returncode == 0


def test_a_run_whose_every_sample_was_removed_gets_no_verdict(whole, tmp_path):
    """Steps committed, but every sample removed (slime's remove_sample: not trained, not judged): check tito and
    check logprobs have nothing to compare and say "undetermined" (exit 2), never "no drift" over 0 samples."""
    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")

    def remove_all(tensors, meta):
        tensors["loss_mask"].zero_()
        for sample in meta["samples"]:
            sample["remove_sample"] = True

    for step in range(STEPS):
        edit_step(run, step, remove_all)
    for args, says in (
        (("check", "tito", str(run)), f"undetermined: no sample to judge in {STEPS} committed steps"),
        (("check", "logprobs", str(run)), "undetermined: no trained token with engine log-probs to judge"),
    ):
        res = cli(*args)
        assert res.returncode == 2 and says in res.stderr, res.stdout + res.stderr
        assert "no drift" not in res.stdout


# ---------------------------------------------------------------- open_run itself: each refusal, its words, its file


def _refused(run, **how) -> str:
    from rlbench.errors import BadInput
    from rlbench.replay.integrity import open_run

    with pytest.raises(BadInput) as info:
        open_run(run, **{**DEEP, **how})
    return str(info.value)


def _rewrite(path, rows) -> None:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _manifest(run, **changes) -> None:
    import json

    manifest = json.loads((run / "manifest.json").read_text())
    for key, value in changes.items():
        if key == "config":
            manifest["config"].update(value)
        else:
            manifest[key] = value
    (run / "manifest.json").write_text(json.dumps(manifest))


def test_what_a_whole_run_verifies_at_each_depth(whole, tmp_path):
    """verify reads every recording; present only sees each file; checkpoints verify holds each to its checksums."""
    from rlbench.replay.integrity import open_run

    whole_run, _ = whole
    deep = open_run(whole_run, **DEEP)
    assert (deep.recordings, deep.recordings_present) == (STEPS, 0)
    assert (deep.checkpoints, deep.checkpoints_present) == ([], [0, 2, 4])
    full = open_run(whole_run, recordings="verify", checkpoints="verify", need_steps=True, need_recordings=True)
    assert (full.checkpoints, full.checkpoints_present) == ([0, 2, 4], [])
    torn = copy_run(whole_run, tmp_path / "torn")  # the reader's notes kept beside the checkpoints' own
    (torn / "metrics.jsonl").write_text((torn / "metrics.jsonl").read_text() + '{"step": 4')
    (torn / "checkpoints" / ".000006.tmp").mkdir()
    notes = open_run(torn, recordings="verify", checkpoints="verify", need_steps=True, need_recordings=True).notes
    assert notes[0] == "metrics.jsonl: ignored a torn last line (a write was cut off)"
    assert notes[1].endswith(".000006.tmp: ignored (an unfinished checkpoint)"), notes
    light = open_run(whole_run, recordings="present", checkpoints="present", need_steps=True, need_recordings=False)
    assert (light.recordings, light.recordings_present) == (0, STEPS)
    # present sees files, not bytes: an edited recording passes it, and is refused when read
    run = copy_run(whole_run, tmp_path / "run")
    _edit_rewards(run)
    assert open_run(run, recordings="present", checkpoints="present", need_steps=True, need_recordings=False)
    assert _refused(run) == (
        f"{run / 'rollouts' / '000001.safetensors'}: the recording of step 1 does not match checksums.jsonl at "
        "rewards (an edited or mixed-up file)"
    )


def test_each_refusal_names_its_file_in_its_words(whole, tmp_path):
    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    assert _refused(run) == (
        f"{run / 'metrics.jsonl'}: missing: the run's commit log (metrics.jsonl); the run directory is damaged and "
        "cannot be judged"
    )
    run = copy_run(whole_run, tmp_path / "empty")  # no step committed, and the checksums log gone
    (run / "metrics.jsonl").write_bytes(b"")
    (run / "checksums.jsonl").unlink()
    assert _refused(run, need_steps=False) == (
        f"{run / 'checksums.jsonl'}: missing: the checksums that verify the run's steps; the run directory is "
        "damaged and cannot be judged"
    )
    (run / "checksums.jsonl").write_bytes(b"")
    assert _refused(run) == f"{run / 'metrics.jsonl'}: no committed step: nothing to judge (undetermined)"
    from rlbench.replay.integrity import open_run

    nothing = open_run(run, **{**DEEP, "need_steps": False})  # a side diff may take: nothing read, nothing counted
    assert (nothing.recordings, nothing.checkpoints_present, nothing.run.steps) == (0, [], [])


def test_committed_steps_that_skip_one_are_an_edited_log(whole, tmp_path):
    import json

    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")
    for log in ("metrics.jsonl", "checksums.jsonl"):
        rows = [json.loads(line) for line in (run / log).read_text().splitlines()]
        _rewrite(run / log, [row for row in rows if row["step"] != 1])
    assert _refused(run) == f"{run / 'metrics.jsonl'}: committed steps are not consecutive (an edited log)"
    # a run that began later (a replay of a step range) is consecutive from its first step
    for log in ("metrics.jsonl", "checksums.jsonl"):
        rows = [json.loads(line) for line in (run / log).read_text().splitlines()]
        _rewrite(run / log, [row for row in rows if row["step"] >= 2])
    from rlbench.replay.integrity import open_run

    found = open_run(run, **DEEP)
    assert found.run.steps == [2, 3] and found.checkpoints_present == [4]  # no initial weights: it began at step 2


def test_a_run_without_recordings_is_judged_only_where_none_is_read(whole, tmp_path):
    from rlbench.replay.integrity import open_run

    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")
    _manifest(run, config={"record": False})
    shutil.rmtree(run / "rollouts")
    assert _refused(run) == (f"{run / 'rollouts'}: the run was made with --no-record: it holds no recording to judge")
    found = open_run(run, **{**DEEP, "need_recordings": False})
    assert (found.recordings, found.recordings_present, found.checkpoints_present) == (0, 0, [0, 2, 4])


def test_a_recording_that_is_not_there_is_named_at_either_depth(whole, tmp_path):
    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")
    shutil.rmtree(run / "rollouts")
    for depth in ("verify", "present"):
        assert _refused(run, recordings=depth) == (
            f"{run / 'rollouts'}: missing: the recording of {STEPS} committed steps is not there"
        )
    run = copy_run(whole_run, tmp_path / "one")
    (run / "rollouts" / "000003.json").unlink()
    for depth in ("verify", "present"):
        assert _refused(run, recordings=depth) == (
            f"{run / 'rollouts' / '000003.json'}: missing: the recording of committed step 3 is not there"
        )


def test_an_id_outside_the_runs_vocabulary_is_a_damaged_recording(whole, tmp_path):
    """Its checksums rewritten to agree, a token id the model cannot have sampled is still refused, by file."""
    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")
    edit_step(run, 2, lambda t, m: t["tokens"].__setitem__(3, 10**6))
    said = _refused(run)
    assert said.startswith(f"{run / 'rollouts' / '000002.safetensors'}: tokens: token id 1000000 is outside"), said


def test_the_checkpoints_a_schedule_wrote():
    from rlbench.replay.integrity import due_checkpoints

    assert due_checkpoints([0, 1, 2, 3], 2, 4) == [0, 2, 4]
    assert due_checkpoints([0, 1, 2, 3], 3, 4) == [0, 3, 4]
    assert due_checkpoints([0, 1, 2], 25, 85) == [0]  # stopped early: the initial weights only
    assert due_checkpoints([0, 1, 2, 3, 4], 25, 5) == [0, 5]
    assert due_checkpoints([2, 3], 2, 4) == [4]  # a replay of steps 2..3 starts from a checkpoint it does not write
    assert due_checkpoints([4, 5], 3, 85) == [6]


def test_a_checkpoint_is_excused_only_after_the_last_step_of_a_stopped_run(whole, tmp_path):
    import json

    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")  # complete: its last checkpoint is owed
    shutil.rmtree(run / "checkpoints" / "000004")
    assert _refused(run) == (
        f"{run / 'checkpoints' / '000004'}: missing: the checkpoint after 4 steps is not there (a damaged run)"
    )
    _manifest(run, config={"steps": 6})  # now a run of 6 stopped after 4: the one after step 3 may be missing
    from rlbench.replay.integrity import open_run

    found = open_run(run, **DEEP)
    assert found.checkpoints_present == [0, 2] and found.notes[-1] == (
        f"{run / 'checkpoints' / '000004'}: not there (the run stopped before writing it; --resume writes it)"
    )
    shutil.rmtree(run / "checkpoints" / "000002")  # one before the last is owed, stopped or not
    assert _refused(run).startswith(f"{run / 'checkpoints' / '000002'}: missing: the checkpoint after 2 steps")
    run = copy_run(whole_run, tmp_path / "half")
    (run / "checkpoints" / "000002" / "state.json").unlink()
    assert _refused(run) == (
        f"{run / 'checkpoints' / '000002'}: not a whole checkpoint (no state.json): the checkpoint was changed or "
        "damaged after it was written"
    )
    run = copy_run(whole_run, tmp_path / "rollout-only")  # no trainer, no checkpoints owed
    shutil.rmtree(run / "checkpoints")
    _manifest(run, mode="rollout-only")
    assert open_run(run, **DEEP).checkpoints_present == []
    lines = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(lines + json.dumps({"step": 9})[:5])  # a torn line: read, and said
    assert open_run(run, **DEEP).notes == ["metrics.jsonl: ignored a torn last line (a write was cut off)"]


def test_the_other_inputs_emptied_get_no_verdict(whole, tmp_path):
    """Beyond run directories: a trajectory file with no row (check tito), a golden check with every metric left
    out (check golden --ignore '*'), a log-prob check of steps the run did not commit: each "undetermined", exit 2,
    where each passed over nothing before (issue 50)."""
    import json

    from tests.conftest import REPO

    whole_run, golden = whole
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    tokenizer = REPO / "rlbench" / "fixtures" / "tokenizers" / "tito-clean"
    # the golden's own count: the metrics a default run logs (15 since issue 52's kl_coef 0.1 added kl_loss)
    metrics = len(json.loads(golden.read_text())["metrics"])
    for args, says in (
        (
            ("check", "tito", str(empty), "--tokenizer", str(tokenizer)),
            f"{empty}: undetermined: no trajectory to judge (the file holds no row)",
        ),
        (
            ("check", "golden", str(whole_run), str(golden), "--ignore", "*"),
            f"{golden}: undetermined: no metric left to compare (the golden's {metrics} are all --ignore'd)",
        ),
    ):
        res = cli(*args)
        assert res.returncode == 2 and res.stderr.strip() == f"rlbench: error: {says}", res.stdout + res.stderr
    from rlbench.checks.logprobs import check_logprobs
    from rlbench.errors import BadInput

    with pytest.raises(
        BadInput, match=f"undetermined: none of the steps asked for is committed .the run committed {STEPS}"
    ):
        check_logprobs(whole_run, steps=[STEPS + 3])


def test_the_last_checkpoint_is_owed_after_the_last_step_whatever_the_interval_and_bad_settings_name_the_manifest(
    whole, tmp_path
):
    """A run checkpoints after its last step even where the interval does not fall there; a config or vocabulary
    in the manifest that cannot be read is refused naming manifest.json and the field."""
    from rlbench.replay.integrity import open_run

    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")
    _manifest(run, config={"checkpoint_every": 2 * STEPS})  # no interval falls inside the run: the start and the end
    assert open_run(run, **DEEP).checkpoints_present == [0, STEPS]
    shutil.rmtree(run / "checkpoints" / f"{STEPS:06d}")
    assert _refused(run).startswith(f"{run / 'checkpoints' / f'{STEPS:06d}'}: missing: the checkpoint after {STEPS}")
    run = copy_run(whole_run, tmp_path / "config")
    _manifest(run, config={"steps": "many"})
    assert _refused(run) == f"{run / 'manifest.json'}: config.steps: expected an integer, got 'many'"
    run = copy_run(whole_run, tmp_path / "vocab")
    _manifest(run, vocab={"model": "big", "tokenizer": 3})
    assert _refused(run) == f"{run / 'manifest.json'}: vocab.model: expected an integer in [1, 2**31 - 1], got 'big'"


def test_a_recording_without_what_its_checksums_record_is_not_the_runs(whole, tmp_path):
    """Rewritten whole (its own digests valid) without the trainer's log-probs and losses that step 1's checksums
    record: refused by file, naming each missing stage; with them, the same run reads whole."""
    whole_run, _ = whole
    run = copy_run(whole_run, tmp_path / "run")
    edit_step(run, 1, lambda t, m: [t.pop(k) for k in ("old_logprobs", "ref_logprobs", "losses") if k in t], False)
    said = _refused(run)
    assert said == (
        f"{run / 'rollouts' / '000001.safetensors'}: the recording of step 1 lacks what checksums.jsonl records at "
        "old_logprobs, loss (an edited or mixed-up file)"
    ), said
    from rlbench.replay.integrity import open_run

    assert open_run(whole_run, **DEEP).recordings == STEPS
