"""Crash safety: SIGKILL the run at named points of its write path (rlbench/rundir/failpoints.py),
then `rlbench run --resume`. Every killed directory stays readable, and every resumed run ends
with the same files as a run that was never interrupted: checksums, rollouts and checkpoints
byte for byte, metrics equal apart from perf/*, and no temporary file left behind."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from rlbench.rundir.directory import read_run
from tests.conftest import run_cli, small_toml

TOML = small_toml(6)

# (failpoint, which hit). Writes per step: 2 rollout files, 1 checksums line, 1 metrics line;
# checkpoints after 0, 2, 4 and 6 steps, 4 files each.
CRASHES = [
    ("step.start", 3),  # between steps
    ("rollout.tmp_written", 1),  # step 0's safetensors under its temp name
    ("rollout.tmp_written", 6),  # step 2's JSON under its temp name
    ("rollout.renamed", 4),  # step 3's rollouts in place, no log line yet
    ("checksums.appended", 4),  # step 3's checksums, no metrics line
    ("metrics.half_written", 2),  # a torn metrics line for step 1
    ("metrics.half_written", 6),  # a torn metrics line for the last step
    ("metrics.appended", 5),  # exactly after step 4 committed, before checkpoint 6... of 4
    ("checkpoint.partial", 1),  # checkpoint 0, one file of four
    ("checkpoint.partial", 6),  # checkpoint 2, two files of four
    ("checkpoint.tmp_complete", 3),  # checkpoint 4 complete but not renamed
    ("checkpoint.renamed", 2),  # checkpoint 2 in place
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    (root / "s.toml").write_text(TOML)
    proc = run_cli("run", "-c", str(root / "s.toml"), "--out", str(root / "run"), "--json")
    assert proc.returncode == 0, proc.stderr
    return root / "run"


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _metrics(data: bytes) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")} for line in data.splitlines()]


def _manifest(data: bytes, root: Path) -> dict:
    """A manifest with only what may differ between two runs of one configuration masked: its creation time,
    and where the run was made (its command line and config name the run directory and the config file beside
    it)."""
    doc = json.loads(data.decode().replace(str(root), "<run>").replace(str(root.parent), "<dir>"))
    doc.pop("created")
    return doc


def assert_same_run(got: Path, want: Path) -> None:
    a, b = _files(got), _files(want)
    assert sorted(a) == sorted(b), f"files differ: extra {sorted(set(a) - set(b))}, missing {sorted(set(b) - set(a))}"
    # Plain comparisons with a short message: pytest's own rendering of two differing multi-kB
    # byte strings runs difflib over them, which takes minutes.
    for name in a:
        if name == "metrics.jsonl":
            same = _metrics(a[name]) == _metrics(b[name])
        elif name == "manifest.json":
            same = _manifest(a[name], got) == _manifest(b[name], want)
        else:
            same = a[name] == b[name]
        if not same:
            raise AssertionError(f"{name} differs from the uninterrupted run's")


def _crash(tmp_path: Path, point: str, count: int) -> Path:
    (tmp_path / "s.toml").write_text(TOML)
    out = tmp_path / "run"
    env = {"RLBENCH_FAILPOINT": f"{point}@{count}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc = run_cli("run", "-c", str(tmp_path / "s.toml"), "--out", str(out), "--json", process=True)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    return out


@pytest.mark.parametrize("point, count", CRASHES, ids=[f"{p}@{c}" for p, c in CRASHES])
def test_killed_run_resumes_to_the_same_files(tmp_path, reference, point, count):
    out = _crash(tmp_path, point, count)
    read_run(out)  # readable as it was left: torn tails are ignored, not fatal
    proc = run_cli("run", "--resume", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["complete"] and doc["restarted_from_checkpoint"] <= doc["committed_before"]
    assert_same_run(out, reference)


def test_killed_during_resume_then_resumed_again(tmp_path, reference):
    out = _crash(tmp_path, "metrics.half_written", 4)
    os.environ["RLBENCH_FAILPOINT"] = "resume.cut_back@1"
    try:
        proc = run_cli("run", "--resume", str(out), "--json", process=True)
    finally:
        del os.environ["RLBENCH_FAILPOINT"]
    assert proc.returncode == -signal.SIGKILL
    read_run(out)
    proc = run_cli("run", "--resume", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    assert_same_run(out, reference)


def test_resume_of_a_complete_run_changes_nothing(tmp_path, reference):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(reference, copy)
    before = _files(copy)
    proc = run_cli("run", "--resume", str(copy), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"] is None
    assert _files(copy) == before


def test_the_comparison_can_fail(tmp_path, reference):
    """assert_same_run is not vacuous: a run with another seed is caught."""
    (tmp_path / "s.toml").write_text(TOML)
    proc = run_cli("run", "-c", str(tmp_path / "s.toml"), "--seed", "99", "--out", str(tmp_path / "other"), "--json")
    assert proc.returncode == 0
    with pytest.raises(AssertionError):
        assert_same_run(tmp_path / "other", reference)


def test_the_manifest_comparison_masks_only_time_and_place(tmp_path, reference):
    """A copy of the run made elsewhere at another time is the same run; any other manifest field is not."""
    import shutil

    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(reference, moved)
    manifest = json.loads(
        (moved / "manifest.json")
        .read_text()
        .replace(str(reference), str(moved))
        .replace(str(reference.parent), str(moved.parent))
    )
    assert str(moved) in manifest["command"]  # the masked place is really there
    manifest["created"] = "2001-01-01T00:00:00+00:00"
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert_same_run(moved, reference)
    for edit in (
        lambda m: m["hashes"].update(tokenizer="0" * 64),
        lambda m: m.update(seed=m["seed"] + 1),
        lambda m: m["determinism"].update(torch_threads=2),
        lambda m: m.pop("numerics"),
    ):
        changed = json.loads(json.dumps(manifest))
        edit(changed)
        (moved / "manifest.json").write_text(json.dumps(changed))
        with pytest.raises(AssertionError, match="manifest.json differs"):
            assert_same_run(moved, reference)
