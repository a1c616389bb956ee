"""Servers a run starts itself, and all of them dying: the run stops with exit 2 and one line, its
committed steps intact and nothing of the failed step recorded; `--resume` starts new servers and
finishes the run with the checksums of a run that was never disturbed; Ctrl-C stops a run too;
each time no process the run started is left behind (and none after a clean stop either:
test_sglang.py's fleet fixture checks that)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from rlbench.config import apply_overrides
from rlbench.core.loop import run
from rlbench.rundir.directory import read_run
from tests.conftest import cli, small_toml, tagged_processes


@pytest.fixture
def reference(small_config, tmp_path) -> Path:
    out = tmp_path / "reference"
    run(apply_overrides(small_config, out=str(out)))
    return out


def _checksums(run_dir: Path) -> bytes:
    return (run_dir / "checksums.jsonl").read_bytes()


def test_every_server_dead_stops_the_run_then_resume_finishes_it(tmp_path, reference, monkeypatch):
    """Servers the run starts itself (one `rlbench serve` behind a router it starts): the server dies at
    step 1's fourth request (a failpoint in it). No engine answers: exit 2, one line, step 0 committed
    and readable, nothing of step 1 recorded, nothing left running. Resumed, with a Ctrl-C
    (KeyboardInterrupt, as Python raises it) once its last step is committed: the reference run's
    checksums, and again nothing left running."""
    from rlbench.replay.resume import resume

    tag = uuid.uuid4().hex
    monkeypatch.setenv("RLBENCH_TEST_TAG", tag)  # inherited by every process the run starts
    (tmp_path / "s.toml").write_text(small_toml(3))
    out = tmp_path / "run"
    monkeypatch.setenv("RLBENCH_FAILPOINT", "serve.generate@12")  # the server's 12th /generate: step 1's 4th
    res = cli("run", "-c", str(tmp_path / "s.toml"), "--rollout", "sglang", "--sglang-server", "rlbench",
              "--out", str(out), "--json")
    monkeypatch.delenv("RLBENCH_FAILPOINT")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("rlbench: error: no SGLang server answers: http://127.0.0.1:"), lines[0]
    assert read_run(out).steps == [0] and not list((out / "rollouts").glob("000001*"))
    assert tagged_processes(tag) == []

    def interrupt(state):
        if state.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        resume(out, on_step=interrupt)
    assert read_run(out).steps == [0, 1, 2]
    assert _checksums(out) == _checksums(reference)
    assert tagged_processes(tag) == []
