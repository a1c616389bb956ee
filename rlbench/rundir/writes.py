"""The run directory's writes, each durable before it counts: a whole file to a temporary name, fsynced and
renamed; a JSONL line appended and fsynced; nothing through a link; and the one background thread that runs
the writes in order (directory.py's commit protocol rests on that order).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from rlbench.rundir.failpoints import hit


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes | memoryview) -> None:
    """Write a whole file, never through a link: a link at `path` is removed, not followed."""
    if path.is_symlink():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write(path: Path, data: bytes, sync_dir: bool = True) -> None:
    """Write `data` to `path` via a temporary file, fsync, rename: readers see old or new, never half.
    With sync_dir=False the caller fsyncs the directory once for several files."""
    tmp = path.with_name(f".{path.name}.tmp")
    write_new(tmp, data)
    if path.parent.name == "rollouts":
        hit("rollout.tmp_written")
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def append_line(path: Path, obj: dict) -> None:
    line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)  # a link is an error, not followed
    with os.fdopen(fd, "ab") as fh:
        if path.name == "metrics.jsonl":
            fh.write(line[: len(line) // 2])
            fh.flush()
            hit("metrics.half_written")
            line = line[len(line) // 2 :]
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


class OrderedWriter:
    """Runs write jobs one at a time, in submission order, on a background thread.

    A failed job stops the queue; its exception is raised in the caller at the next submit or
    flush, so a full disk stops the run instead of passing silently.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="rlbench-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is not None and self._error is None:
                    job()
            except BaseException as exc:  # handed to the caller's thread, re-raised there
                self._error = exc
            finally:
                self._jobs.task_done()
            if job is None:
                return

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def submit(self, job: Callable[[], None]) -> None:
        self._raise()
        self._jobs.put(job)

    def flush(self) -> None:
        """Wait until every submitted job has run; raise the first failure."""
        self._jobs.join()
        self._raise()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self._raise()
