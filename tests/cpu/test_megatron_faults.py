"""A megatron worker rank that dies while the ranks are set up is named as soon as it has exited
(launch.py's `Watched`: its exit ends rank 0's waits), not after the setup timeout: one line, exit 2,
no torch warning on stderr, no rank left behind.

- launch.py alone, with stand-in workers (`python -c` scripts: no megatron-core, a few seconds): a
  worker that exits before it signs in, one that dies inside the group's rendezvous (the others are
  stopped), one that never signs in (JOIN_TIMEOUT).
- A real `rlbench run --tp 2` (slow): rank 1 SIGKILLed as it is about to join the group
  (RLBENCH_MEGATRON_KILL=1:join@1, worker.py) on a fresh run, and, on a --resume, as it receives the
  init command (1:init@1: rank 0 is then inside megatron-core's model-parallel init); the committed
  steps stay, and a plain --resume ends with the uninterrupted run's files.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from rlbench.backends.megatron import launch
from rlbench.rundir.directory import read_run
from tests.conftest import run_cli, tagged_processes
from tests.cpu.megatron_reference import TOML, reference_runs, run_process
from tests.cpu.test_crash_resume import assert_same_run

# Before launch.py watched the workers' exits, a setup death was named only once SETUP_TIMEOUT (2 min) had passed
# after the workers started, with torch's warning lines before it. A run now takes a few seconds; the bound is the
# old wait itself, so a busy machine's slow start-up cannot fail the test, and the one-line stderr check below
# tells the old behaviour apart on its own.
PROMPT_S = launch.SETUP_TIMEOUT.total_seconds()

_SIGN_IN_AND_DIE = """
import os, signal, sys
import torch.distributed as dist
from rlbench.backends.megatron import launch
port, rank, world = (int(a) for a in sys.argv[1:])
store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
launch.signed_in(store, rank)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
launch.init_rank(rank, world, "cpu", store)  # the others wait in the rendezvous until rank 0 stops them
"""


class _Scripts:
    """Ranks 1.. as `python -c SCRIPT PORT RANK WORLD`: stand-in workers that need no megatron-core."""

    host = "127.0.0.1"

    def __init__(self, script: str):
        self.script = script

    def start(self, port: int, world: int, device: str) -> list[subprocess.Popen]:
        return [
            subprocess.Popen(
                [sys.executable, "-c", self.script, str(port), str(rank), str(world)], stdin=subprocess.DEVNULL
            )
            for rank in range(1, world)
        ]


def _join(world: int, script: str) -> tuple[launch.Pending, launch.RankDied]:
    pending = launch.spawn(world, "cpu", _Scripts(script))
    with pytest.raises(launch.RankDied) as died:
        launch.join(pending)
    assert all(proc.poll() is not None for proc in pending.workers)  # stopped and reaped: none left behind
    assert not dist.is_initialized()
    return pending, died.value


def test_workers_rank_0_stops_itself_are_no_news_to_their_watchers():
    """Rank 0 stopping the workers (a run refused after they started, or its normal end) closes its store's
    watch first: a watcher woken by that exit reports nothing and touches no store, since the process may be
    exiting and its stores going (a watcher's store call during interpreter exit aborted it: 'terminate called
    without an active exception', exit 134, seen 1 run in 5). Its stand-in `side` store fails any call."""
    pending = launch.spawn(2, "cpu", _Scripts("import time; time.sleep(60)"))
    touched = []

    class Untouchable:
        def __getattr__(self, name):
            touched.append(name)
            raise AssertionError(f"store call after close: {name}")

    pending.watched.side = Untouchable()
    launch.kill(pending.workers, pending.watched)
    assert all(proc.poll() is not None for proc in pending.workers)
    for thread in [t for t in __import__("threading").enumerate() if t.name.startswith("megatron-rank-")]:
        thread.join()  # the watcher ends once it has seen the exit: an event, not a time
    assert pending.watched.closed and pending.watched.error is None and touched == []


def test_a_worker_that_exits_before_it_signs_in_is_named(capfd):
    pending, died = _join(2, "raise SystemExit(3)")
    assert str(died) == "megatron rank 1 of 2 exited with code 3 before it joined the others; nothing was trained"
    # Nothing of rlbench's. torch's TCPStore (this process hosts it) may log that it could not answer the dead
    # rank, or not, as the kill and the store's write race: its line is torch's, its timing not ours.
    assert [line for line in capfd.readouterr().err.splitlines() if "[c10d]" not in line] == []


def test_a_worker_that_dies_in_the_rendezvous_is_named_and_the_others_stopped(capfd):
    """Rank 1 signs in and dies; rank 2 waits in init_process_group's rendezvous with rank 0, which is named
    rank 1's death when it happens (its wait in the store ends), stops rank 2, and prints nothing."""
    pending, died = _join(3, _SIGN_IN_AND_DIE)
    assert str(died) == (
        "megatron rank 1 of 3 was killed (SIGKILL) while the ranks set up their process groups; nothing was trained"
    )
    assert [proc.poll() for proc in pending.workers] == [-signal.SIGKILL, -signal.SIGKILL]
    # Nothing of rlbench's. torch's TCPStore (this process hosts it) may log that it could not answer the dead
    # rank, or not, as the kill and the store's write race: its line is torch's, its timing not ours.
    assert [line for line in capfd.readouterr().err.splitlines() if "[c10d]" not in line] == []


def test_a_worker_that_never_signs_in_is_named_at_the_join_timeout(monkeypatch):
    monkeypatch.setattr(launch, "JOIN_TIMEOUT", 0.5)
    pending, died = _join(2, "import time; time.sleep(300)")
    assert str(died) == "megatron rank(s) 1 of 2 did not start within 0.5 s; nothing was trained"
    assert pending.workers[0].poll() == -signal.SIGKILL


@pytest.fixture(scope="module")
def runs(tmp_path_factory, worker_id):
    """The TP=1 and TP=2 reference runs, made once per session (megatron_reference.py)."""
    return reference_runs(tmp_path_factory, worker_id)


def _stopped(res: subprocess.CompletedProcess, took: float, line: str, tag: str) -> None:
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.splitlines() == [line]  # one line: no torch warning before it
    assert took < PROMPT_S, took
    assert tagged_processes(tag) == []  # rank 0 stopped and reaped its workers before it exited


@pytest.mark.slow  # four rank-0 processes, each with a worker importing megatron-core
def test_a_rank_dead_during_setup_stops_the_run_at_once_and_resume_finishes_it(runs, tmp_path, monkeypatch):
    (tmp_path / "s.toml").write_text(TOML)
    run_dir, tag = tmp_path / "tp2", str(tmp_path)
    monkeypatch.setenv("RLBENCH_TEST_TAG", tag)  # the workers inherit it: found in /proc if one is left

    monkeypatch.setenv("RLBENCH_MEGATRON_KILL", "1:join@1")  # on a fresh run: inside the group's rendezvous
    start = time.monotonic()
    res = run_process(tmp_path, "tp2", "--tp", "2")  # named as the reference: manifests compare their commands
    _stopped(
        res,
        time.monotonic() - start,
        "rlbench: error: megatron rank 1 of 2 was killed (SIGKILL) while the "
        "ranks set up their process groups; nothing was trained",
        tag,
    )
    assert not run_dir.exists()  # nothing was committed, so the run left no directory

    # The reference TP=2 run as a run killed once step 2 was committed (its checkpoint 2 kept): its later lines
    # and files are what a resume discards (test_megatron_parallel.py kills rank 0 there for real).
    shutil.copytree(runs / "tp2", run_dir)
    manifest = (run_dir / "manifest.json").read_text()  # as if made here: its command names its directory
    (run_dir / "manifest.json").write_text(
        manifest.replace(str(runs / "tp2"), str(run_dir)).replace(str(runs), str(tmp_path))
    )
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:3]))

    monkeypatch.setenv("RLBENCH_MEGATRON_KILL", "1:init@1")  # on the resume: inside model-parallel init
    start = time.monotonic()
    res = run_cli("run", "--resume", str(run_dir), "--json", process=True)
    _stopped(
        res,
        time.monotonic() - start,
        "rlbench: error: megatron rank 1 of 2 was killed (SIGKILL) while "
        "running the init command; the run stopped (its committed steps are kept: rlbench run --resume RUN "
        "continues it)",
        tag,
    )
    assert read_run(run_dir).steps == [0, 1, 2]

    monkeypatch.delenv("RLBENCH_MEGATRON_KILL")
    res = run_cli("run", "--resume", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["restarted_from_checkpoint"], doc["recomputed_and_verified"]) == (2, 1)
    assert_same_run(run_dir, runs / "tp2")
