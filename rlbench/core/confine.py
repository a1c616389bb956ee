"""One path rule for the files read and written below a confining directory (issue 51): `rlbench serve
--weights-dir`, the versions of a published weight chain, a host-local checkpoint that /pull_weights writes.

- A path is resolved (every link followed) before it is used, and used only where it resolves below the
  directory: a link that stays inside works, one that leaves it is refused by name, nothing read through it.
- Nothing is written through a link: a file is written under a fresh name created exclusively in the directory
  it belongs to (never an existing name, never a link) and renamed over its final name, which replaces a link
  there rather than writing where it points; a directory that rlbench writes into is refused when it is a link.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rlbench.errors import BadInput


class Outside(BadInput):
    """A path that resolves outside the directory that confines it."""


def inside(path: str | Path, root: Path | None) -> Path:
    """`path`, refused (Outside) when `root` is given and it resolves outside it; links inside are followed."""
    path = Path(path)
    if root is None:
        return path
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:  # a loop of links
        raise Outside(f"cannot be resolved ({exc.__class__.__name__})", path=path) from None
    if resolved != root and root not in resolved.parents:
        raise Outside(
            f"resolves to {resolved}, outside {root}, the directory this server reads and writes weights in "
            "(rlbench serve --weights-dir): nothing read or written through it",
            path=path,
        )
    return path


def no_link(directory: Path) -> Path:
    """`directory`, made where absent; refused where it is a link (or not a directory): files are written in it."""
    if directory.is_symlink():
        raise BadInput("is a symbolic link: rlbench writes no file through a link", path=directory)
    directory.mkdir(parents=True, exist_ok=True)
    if directory.is_symlink() or not directory.is_dir():
        raise BadInput("expected a directory", path=directory)
    return directory


def write_new(directory: Path, name: str, data: bytes) -> Path:
    """`data` in a file of a fresh name created exclusively in `directory` (for `name`), flushed to disk; the
    caller renames it over its final name (os.replace)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def replace_with(path: Path, data: bytes) -> None:
    """`path` replaced whole by `data` (a link there is replaced, not followed)."""
    os.replace(write_new(path.parent, path.name, data), path)


def open_lock(path: Path) -> int:
    """A lock file's descriptor, never through a link."""
    return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
