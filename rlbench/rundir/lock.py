"""One writer per run directory: an OS lock on `RUN/.lock`, held while a command writes the directory.

POSIX record locks (fcntl F_SETLK) rather than flock: the kernel answers F_GETLK with the pid of the
process that holds one, so a second writer is told who is writing, and the lock file itself stays
empty (two runs' directories stay byte-identical). The kernel drops the lock when its holder dies,
SIGKILL included, so a killed run never leaves a stale lock behind. One caveat of POSIX locks: any
close of the file by the holding process releases them, so nothing else here opens `.lock`.
"""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

from rlbench.errors import BadInput

NAME = ".lock"
_FLOCK = "hhqqi"  # struct flock: l_type, l_whence, l_start, l_len, l_pid (native alignment pads it)


_HELD: dict[Path, list] = {}  # this process's locks: path -> [fd, count] (re-entrant, see above)


class RunLock:
    """An exclusive lock on `root/NAME`; `acquire` raises BadInput naming the holder's pid. Re-entrant
    within a process (resume holds it, then the writer it starts takes it again): the file is opened
    once, and closed when the last holder releases it."""

    def __init__(self, root: str | Path, name: str = NAME):
        self.root = Path(root)
        self.path = self.root / name
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        key = self.path.absolute()
        if key in _HELD:
            _HELD[key][1] += 1
            self.fd = _HELD[key][0]
            return self
        path = self.path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise BadInput(f"cannot open the run directory's lock file ({exc.strerror})", path=path) from None
        try:
            fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise BadInput(
                f"{who} is writing this run directory (it holds {path.name}); wait for it to end, or "
                "choose another directory",
                path=self.root,
            ) from None
        self.fd = fd
        _HELD[key] = [fd, 1]
        return self

    def moved(self, root: str | Path) -> None:
        """The directory holding the lock file was renamed to `root` (the fd still holds the lock)."""
        held = _HELD.pop(self.path.absolute())
        self.root, self.path = Path(root), Path(root) / self.path.name
        _HELD[self.path.absolute()] = held

    def release(self) -> None:
        if self.fd is None:
            return
        key = self.path.absolute()
        _HELD[key][1] -= 1
        if _HELD[key][1] == 0:
            del _HELD[key]
            os.close(self.fd)  # closing drops the lock
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> int | None:
    """The pid holding a conflicting lock on `fd`'s file, as the kernel reports it."""
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError:
        return None
    kind, _, _, _, pid = struct.unpack(_FLOCK, answer)
    return pid if kind != fcntl.F_UNLCK and pid > 0 else None
