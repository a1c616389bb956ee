"""Typed errors. Library code raises these; only the CLI turns them into a line and an exit code.

Each carries its exit code (design.md): `BadInput` is every problem the user can fix (a missing
file, a malformed line, an invalid value, an output directory that holds another run, a plugin
that broke its contract): exit 2. `Divergence` is a check's finding that something differs: exit 1.
Anything else reaching the CLI is a bug in rlbench: exit 3, never 0 or 1.
"""

from __future__ import annotations

from pathlib import Path


class RlbenchError(Exception):
    """Base class of rlbench's own errors."""

    exit_code = 2


class BadInput(RlbenchError):
    """Bad input or usage: which file (or option), which field, what was expected."""

    def __init__(self, message: str, *, path: str | Path | None = None, field: str | None = None):
        self.path = str(path) if path is not None else None
        self.field = field
        where = self.path or ""
        if field:
            where = f"{where}: {field}" if where else field
        super().__init__(f"{where}: {message}" if where else message)


class Divergence(RlbenchError):
    """A check found a difference (a replayed or resumed step, a weight sync): exit 1."""

    exit_code = 1


class NonFinite(BadInput):
    """A value the loop computes or reads is NaN or infinite: the step is not committed."""


class WeightMismatch(Divergence):
    """After a weight sync the engine's weights are not the trainer's export (weight_check.py)."""


class EngineUnavailable(RlbenchError):
    """No rollout engine answers (every SGLang server dead or unreachable): the run stops, exit 2, its
    committed steps intact for `--resume`."""
