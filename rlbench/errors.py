"""Typed errors. Library code raises these; only the CLI turns them into a line and an exit code.

`BadInput` is every problem the user can fix (a missing file, a malformed line, an invalid
value, an output directory that holds another run): the CLI prints its one line and exits 2.
`CheckFailed` is a check that stopped a command because it found a difference: exit 1.
"""

from __future__ import annotations

from pathlib import Path


class RlbenchError(Exception):
    """Base class of rlbench's own errors."""


class BadInput(RlbenchError):
    """Bad input or usage: which file (or option), which field, what was expected."""

    def __init__(self, message: str, *, path: str | Path | None = None, field: str | None = None):
        self.path = str(path) if path is not None else None
        self.field = field
        where = self.path or ""
        if field:
            where = f"{where}: {field}" if where else field
        super().__init__(f"{where}: {message}" if where else message)


class CheckFailed(RlbenchError):
    """A check inside a command found a difference: the CLI prints its line and exits 1."""


class WeightMismatch(CheckFailed):
    """After a weight sync the engine's weights are not the trainer's export (weight_check.py)."""
