"""Failpoints: named places where a test can kill the process, to prove crash safety.

`RLBENCH_FAILPOINT=name@N` makes the N-th time execution reaches `hit("name")` send SIGKILL to
this process (no cleanup, no flush: as a power cut or the OOM killer would); `name@N:stop` sends
SIGSTOP instead, so a test can hold the process there (its locks held) and SIGCONT it later.
Unset, `hit` is one dictionary lookup. The points sit inside the run directory's write path, between the steps
that the commit protocol orders (temp file written / renamed / log appended / line half-written).
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "step.start",  # before a step computes anything
    "rollout.tmp_written",  # a rollout file written under its temporary name, not yet renamed
    "rollout.renamed",  # the step's rollout files in place, checksums not yet appended
    "checksums.appended",  # checksums line on disk, metrics line not yet
    "metrics.half_written",  # the metrics line half written: a torn line
    "metrics.appended",  # the step committed
    "checkpoint.partial",  # a checkpoint's first file written in its temporary directory
    "checkpoint.tmp_complete",  # a checkpoint complete under its temporary name, not yet renamed
    "checkpoint.renamed",  # a checkpoint in place
    "resume.cut_back",  # resume: cut the directory back, nothing recomputed yet
    "claim.made",  # a new run directory made whole beside --out, not yet renamed into place
    "serve.generate",  # rlbench serve: a /generate request read, before the engine sees it (a worker dying mid-step)
    "pull.staging",  # /pull_weights: a new file staged in .weight_sync/staging, not every one yet
    "pull.staged",  # every new file staged, no journal yet
    "pull.journal",  # the journal written, nothing renamed
    "pull.renamed",  # a staged file renamed into the checkpoint
    "pull.removed",  # a file the new version lacks removed from the checkpoint
    "pull.marked",  # the version marked, the journal not yet removed
)

_armed: dict[str, int] = {}
_signal = signal.SIGKILL
_spec = os.environ.get("RLBENCH_FAILPOINT")
if _spec:
    _spec, _, _action = _spec.partition(":")
    name, _, count = _spec.partition("@")
    if name not in POINTS or _action not in ("", "stop"):
        raise ValueError(f"RLBENCH_FAILPOINT: expected NAME@N[:stop], NAME one of {', '.join(POINTS)}")
    _armed[name] = int(count or 1)
    _signal = signal.SIGSTOP if _action == "stop" else signal.SIGKILL


def hit(name: str) -> None:
    if name in _armed:
        _armed[name] -= 1
        if _armed[name] == 0:
            os.kill(os.getpid(), _signal)
