"""The megatron trainer over several rank processes (gloo), as users start it: `rlbench run
--trainer megatron --tp 2` / `--dp 2`. TP=2 agrees with TP=1 within rtol 1e-6 over 10 steps, and
does not when the q/k-norm gradients are left unfinalised; DP=2 agrees too; a TP=2 run replays
from its sharded checkpoints, and resumes after SIGKILL to the same files, its workers gone.

Each rank process imports torch, transformers and megatron-core, so these runs are few and short.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from rlbench.rundir.directory import read_run
from tests.conftest import run_cli
from tests.cpu.megatron_reference import STEPS, TOML, reference_runs, run_process
from tests.cpu.test_crash_resume import assert_same_run

pytestmark = pytest.mark.slow  # rank processes each import torch, transformers and megatron-core

@pytest.fixture(scope="module")
def runs(tmp_path_factory, worker_id):
    """The TP=1 and TP=2 reference runs, made once per session (megatron_reference.py)."""
    return reference_runs(tmp_path_factory, worker_id)


def _diff(a: Path, b: Path, *args: str) -> tuple[int, dict]:
    res = run_cli("diff", str(a), str(b), "--json", *args)
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads(res.stdout)


def test_tp2_matches_tp1_within_rtol_1e6(runs):
    code, doc = _diff(runs / "tp1", runs / "tp2", "--rtol", "1e-6")
    assert code == 0 and doc["first"] is None, doc["first"]
    assert doc["steps_compared"] == list(range(STEPS))
    assert {"rollout_tokens", "rewards", "old_logprobs", "loss", "grads"} <= set(doc["stages_compared"])
    code, doc = _diff(runs / "tp1", runs / "tp2")  # not bit for bit: the tolerance is what passes
    assert code == 1 and doc["first"]["step"] == 0
    manifest = json.loads((runs / "tp2" / "manifest.json").read_text())
    assert (manifest["config"]["tp"], manifest["config"]["dp"]) == (2, 1)


def test_unfinalised_qk_norm_grads_part_tp2_from_tp1(runs, tmp_path, monkeypatch):
    (tmp_path / "s.toml").write_text(TOML)
    monkeypatch.setenv("RLBENCH_MEGATRON_FAULT", "no-tp-grad-finalize")
    res = run_process(tmp_path, "unfinalised", "--tp", "2", "--steps", "1")
    assert res.returncode == 0, res.stderr
    code, doc = _diff(runs / "tp1", tmp_path / "unfinalised", "--rtol", "1e-6")
    assert code == 1
    # minibatch 0 trains on the same weights; minibatch 1 on weights the partial grads moved
    assert (doc["first"]["step"], doc["first"]["stage"], doc["first"]["where"]) == (0, "loss", "minibatch 1")


def test_dp2_matches_tp1_within_rtol_1e6(runs, tmp_path):
    (tmp_path / "s.toml").write_text(TOML)
    res = run_process(tmp_path, "dp2", "--dp", "2", "--steps", "3")
    assert res.returncode == 0, res.stderr
    code, doc = _diff(runs / "tp1", tmp_path / "dp2", "--rtol", "1e-6", "--steps", "0:3")
    assert code == 0 and doc["steps_compared"] == [0, 1, 2], doc["first"]


def test_replay_of_a_tp2_run_from_its_sharded_checkpoint(runs, tmp_path):
    res = run_cli("replay", str(runs / "tp2"), "--steps", "8:9", "--out", str(tmp_path / "replay"), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["reproduced"] == 1 and doc["steps"] == [8, 9]


def wait_gone(pids: list[int], limit: float = 120) -> None:
    """Until every process in `pids` has exited: a pidfd turns readable at the exit (an event; no polling
    against a clock). `limit` only bounds a test that would otherwise hang: reaching it fails the test."""
    import select

    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:  # gone already
            pass
    try:
        while fds:
            ready, _, _ = select.select(fds, [], [], limit)
            assert ready, f"processes {pids} still run after {limit} s"
            for fd in ready:
                fds.remove(fd)
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


def _processes_with(tag: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"RLBENCH_TEST_TAG={tag}".encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def test_sigkilled_tp2_run_resumes_to_the_same_files(runs, tmp_path, monkeypatch):
    (tmp_path / "s.toml").write_text(TOML)
    tag = str(tmp_path)
    # rank 0 dies right after step 8 is committed (checkpoint 8 holds the state after step 7)
    monkeypatch.setenv("RLBENCH_FAILPOINT", "metrics.appended@9")
    monkeypatch.setenv("RLBENCH_TEST_TAG", tag)  # the workers inherit it: found in /proc afterwards
    res = run_process(tmp_path, "tp2", "--tp", "2")  # named as the reference: manifests compare their commands
    monkeypatch.delenv("RLBENCH_FAILPOINT")
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    wait_gone(_processes_with(tag))  # the kernel kills them as rank 0 dies (PR_SET_PDEATHSIG)
    assert _processes_with(tag) == [], "a worker rank outlived rank 0"
    assert len(read_run(tmp_path / "tp2").steps) == 9
    res = run_cli("run", "--resume", str(tmp_path / "tp2"), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["restarted_from_checkpoint"] == 8 and doc["recomputed_and_verified"] == 1
    assert_same_run(tmp_path / "tp2", runs / "tp2")


def test_a_killed_worker_rank_stops_the_run_in_one_line_and_resume_finishes_it_the_same(runs, tmp_path, monkeypatch):
    """SIGKILL of rank 1 as it receives step 8's train_step (faults.py: an event, not a time): rank 0 stops
    with exit 2 and one line naming the rank and the command, leaves no worker behind, keeps steps 0..7,
    and --resume ends with the uninterrupted run's files."""
    (tmp_path / "s.toml").write_text(TOML)
    tag = str(tmp_path)
    monkeypatch.setenv("RLBENCH_MEGATRON_KILL", "1:train_step@9")
    monkeypatch.setenv("RLBENCH_TEST_TAG", tag)  # the workers inherit it: found in /proc if one is left
    res = run_process(tmp_path, "tp2", "--tp", "2")  # named as the reference: manifests compare their commands
    monkeypatch.delenv("RLBENCH_MEGATRON_KILL")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.splitlines() == [
        "rlbench: error: megatron rank 1 of 2 was killed (SIGKILL) while running the train_step command of step 8; "
        "the run stopped (its committed steps are kept: rlbench run --resume RUN continues it)"]
    assert _processes_with(tag) == []  # rank 0 stopped and reaped its workers before it exited
    assert read_run(tmp_path / "tp2").steps == list(range(8))
    res = run_cli("run", "--resume", str(tmp_path / "tp2"), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["restarted_from_checkpoint"] == 8
    assert_same_run(tmp_path / "tp2", runs / "tp2")
