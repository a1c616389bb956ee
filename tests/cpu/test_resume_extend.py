"""Extending a finished run (issue 53): `rlbench run --resume RUN --steps N` goes on past the recorded steps and
ends with the files of a run of N steps from the start (checksums.jsonl, rollouts and checkpoints byte for byte,
the manifest's config equal, metrics equal apart from perf/*), keeping the checkpoint after the shorter run's last
step, which it restarted from. A run is never shortened; --steps equal to the run's steps is "already complete";
an extension refused before its first new step leaves the manifest as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlbench.errors import BadInput
from tests.conftest import run_cli, small_toml


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """short: 3 steps (checkpoints 0, 2 and 3: every 2 steps and the last); long: 5 steps from the start."""
    root = tmp_path_factory.mktemp("extend")
    (root / "s.toml").write_text(small_toml(3))
    for name, steps in (("short", "3"), ("long", "5")):
        proc = run_cli("run", "-c", str(root / "s.toml"), "--steps", steps, "--out", str(root / name), "--json")
        assert proc.returncode == 0, proc.stderr
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _metrics(data: bytes) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")} for line in data.splitlines()]


def test_extending_a_finished_run_gives_the_longer_runs_files(runs, tmp_path):
    extended = shutil.copytree(runs / "short", tmp_path / "run")
    proc = run_cli("run", "--resume", str(extended), "--steps", "5")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"extending {extended} from 3 to 5 steps\nresumed {extended} from checkpoint 3: ")
    got, want = _files(extended), _files(runs / "long")
    assert sorted(set(got) - set(want)) == [
        f"checkpoints/000003/{name}" for name in sorted(_files(extended / "checkpoints" / "000003"))
    ]
    assert sorted(set(want) - set(got)) == []
    assert got["checksums.jsonl"] == want["checksums.jsonl"]  # byte for byte, as the issue asks
    assert [name for name in want if name.startswith(("rollouts/", "checkpoints/")) and got[name] != want[name]] == []
    assert _metrics(got["metrics.jsonl"]) == _metrics(want["metrics.jsonl"])
    config, fresh = (json.loads(files["manifest.json"])["config"] for files in (got, want))
    assert {**config, "out": None} == {**fresh, "out": None} and config["steps"] == 5

    again = run_cli("run", "--resume", str(extended), "--steps", "5")
    assert (again.returncode, again.stdout.strip()) == (0, f"{extended}: already complete (5 steps); nothing to do")
    fewer = run_cli("run", "--resume", str(extended), "--steps", "4")
    assert fewer.returncode == 2 and fewer.stderr.splitlines() == [
        "rlbench: error: --steps: 4 is fewer than the run's 5 steps; --resume --steps extends a run, never shortens it"
    ]
    other = run_cli("run", "--resume", str(extended), "--steps", "6", "--seed", "1")
    assert other.returncode == 2 and "drop --seed" in other.stderr and "--steps" not in other.stderr
    assert _files(extended) == got  # refusals write nothing


def test_the_json_document_names_the_steps_it_extended_from(runs, tmp_path):
    extended = shutil.copytree(runs / "short", tmp_path / "run")
    proc = run_cli("run", "--resume", str(extended), "--steps", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["extended_from"], doc["committed_before"], doc["restarted_from_checkpoint"]) == (3, 3, 3)
    assert doc["summary"]["steps"] == 4


def test_an_extension_refused_before_its_first_step_leaves_the_manifest_as_it_was(runs, tmp_path, monkeypatch):
    from rlbench.replay import resume as resume_module

    extended = shutil.copytree(runs / "short", tmp_path / "run")
    before = _files(extended)

    def refuse(config, *args, **kwargs):
        assert config.steps == 7 and json.loads((extended / "manifest.json").read_text())["config"]["steps"] == 7
        raise BadInput("refused in build", path=extended)

    monkeypatch.setattr(resume_module, "run", refuse)
    with pytest.raises(BadInput, match="refused in build"):
        resume_module.resume(extended, steps=7)
    assert _files(extended) == before
