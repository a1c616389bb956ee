"""rlbench for a team's own test suite: run the loop, and hold a run to each of rlbench's verdicts, from Python.

Every helper here gives the verdict the command line gives, through the command line's own entry point, in this
process (the same parsing, checks, texts and exit codes as `rlbench ...` in a shell, without an interpreter's
start-up): a check that holds returns its outcome; one that finds a difference, or cannot judge, raises
`VerdictFailed` (an AssertionError) whose message is what the user would read on the command line: where, what,
both values, how many were compared. The pytest plugin (rlbench/pytest_plugin.py: the `rlbench_run` and
`rlbench_golden` fixtures) is built on them.

    from rlbench.testing import assert_no_tito_drift, assert_same_run, run

    a = run("configs/ci.toml", out=tmp_path / "a", steps=3)
    assert_same_run(a, run("configs/ci.toml", out=tmp_path / "b", steps=3))
    assert_no_tito_drift(a)

Exit codes (rlbench/cli/__init__.py): 0 the check holds, 1 a difference, 2 bad input or a verdict that cannot be
given ("undetermined"), 3 an internal error. Only 0 passes.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Outcome",
    "VerdictFailed",
    "assert_logprobs_agree",
    "assert_no_tito_drift",
    "assert_replay_reproduces",
    "assert_same_run",
    "assert_template_clean",
    "check_golden",
    "rlbench",
    "run",
    "update_golden",
]


@dataclass(frozen=True)
class Outcome:
    """One `rlbench ...` command: its arguments, exit code, and what it printed."""

    args: tuple[str, ...]
    code: int
    stdout: str
    stderr: str

    @property
    def text(self) -> str:
        """What a user would read: the command, then its output and its error lines."""
        shown = " ".join(["rlbench", *self.args])
        return "\n".join(part.rstrip() for part in (f"$ {shown}  (exit {self.code})", self.stdout, self.stderr) if part)


class VerdictFailed(AssertionError):
    """A verdict that did not hold (exit 1), or could not be given (exit 2, 3): its message is the command's output."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome.text)
        self.outcome = outcome


def rlbench(*args: str | os.PathLike) -> Outcome:
    """`rlbench ARGS`, in this process, through the console entry point. Returns whatever the exit code; the
    working directory, sys.argv and sys.path are as they were after it."""
    from rlbench.cli import main

    argv = tuple(str(a) for a in args)
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    sys.argv = ["rlbench", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        os.chdir(saved_cwd)
    return Outcome(argv, code, out.getvalue(), err.getvalue())


def _held(*args: str | os.PathLike) -> Outcome:
    __tracebackhide__ = True  # pytest shows the verdict, not this frame
    outcome = rlbench(*args)
    if outcome.code != 0:
        raise VerdictFailed(outcome)
    return outcome


def _options(options: dict[str, Any]) -> list[str]:
    """Keyword options as the command line's: steps=3 -> --steps 3, record=False -> --no-record, True -> the flag."""
    args: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            for item in value:
                args += [flag, str(item)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def run(config=None, *, out: str | os.PathLike, args: tuple[str, ...] = (), **options: Any) -> Path:
    """A run into `out` (a new directory): of `config`, a RunConfig, a TOML file, or None for the defaults, with
    `options` as `rlbench run`'s own (steps=3, rollout_batch_size=4, ...) and `args` as further command-line words
    (slime's arguments among them). A RunConfig runs as it is (its `out` replaced), through the library; the others
    through `rlbench run`. Returns the run directory; a run that fails raises VerdictFailed with its error line."""
    from rlbench.config import RunConfig

    out = Path(out)
    if isinstance(config, RunConfig):
        if options or args:
            raise TypeError("run(RunConfig, ...): set the options in the config (config.replace(...))")
        from rlbench.session import run as run_loop

        run_loop(config.replace(out=str(out)), command=f"rlbench.testing.run(RunConfig, out={str(out)!r})")
        return out
    given = ["--config", str(config)] if config is not None else []
    _held("run", *given, "--out", str(out), *_options(options), *args)
    return out


def assert_no_tito_drift(run_dir: str | os.PathLike, *args: str) -> Outcome:
    """`rlbench check tito RUN`: the ids each sample trained on are the ids the engine sampled."""
    __tracebackhide__ = True
    return _held("check", "tito", run_dir, *args)


def assert_template_clean(tokenizer_dir: str | os.PathLike, *args: str) -> Outcome:
    """`rlbench check tito --audit DIR`: the chat template renders history as it was sampled, in every shape."""
    __tracebackhide__ = True
    return _held("check", "tito", "--audit", "--tokenizer", tokenizer_dir, *args)


def assert_logprobs_agree(run_dir: str | os.PathLike, *args: str) -> Outcome:
    """`rlbench check logprobs RUN [options]`: train and inference log-probs agree within the gate."""
    __tracebackhide__ = True
    return _held("check", "logprobs", run_dir, *args)


def assert_same_run(a: str | os.PathLike, b: str | os.PathLike, *args: str) -> Outcome:
    """`rlbench diff A B`: the two runs are the same at every committed step and stage (else where they part)."""
    __tracebackhide__ = True
    return _held("diff", a, b, *args)


def assert_replay_reproduces(run_dir: str | os.PathLike, *args: str) -> Outcome:
    """`rlbench replay RUN`: training again from the run's recorded rollouts gives its checksums, bit for bit."""
    __tracebackhide__ = True
    return _held("replay", run_dir, *args)


def check_golden(run_dir: str | os.PathLike, golden: str | os.PathLike, tier: str = "exact", *args: str) -> Outcome:
    """`rlbench check golden RUN GOLDEN --tier TIER`: the run's metrics against the golden file's."""
    __tracebackhide__ = True
    return _held("check", "golden", run_dir, golden, "--tier", tier, *args)


def update_golden(
    run_dir: str | os.PathLike, golden: str | os.PathLike, reason: str, tier: str = "exact", *args: str
) -> Outcome:
    """`rlbench golden update RUN GOLDEN --reason R`: write or refresh a golden file (the reason kept in its history);
    the history tier appends the run to the file's trusted runs."""
    __tracebackhide__ = True
    tiers = ["--tier", "history"] if tier == "history" else []
    return _held("golden", "update", run_dir, golden, "--reason", reason, *tiers, *args)
