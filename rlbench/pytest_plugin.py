"""rlbench's pytest plugin: a team's CI suite over its own loop, with nothing to configure but `pip install rlbench`
(the package registers it through the `pytest11` entry point).

Fixtures:

    rlbench_run    a function that runs a config into the test's temporary directory and returns the run
                   directory: rlbench_run(config=None, name="run", args=(), **options), where config is a
                   RunConfig, a TOML file or None (the defaults) and options are `rlbench run`'s (steps=3, ...)
    golden         compares a run with a golden file beside the test: golden.check(run, tier="exact") reads
                   golden/<test name>.json in the test file's folder (golden.path(name) for another name)

Flags:

    --rlbench-update-golden    write the golden files the tests compare with, from this session's runs,
                               through `rlbench golden update`, instead of comparing
    --rlbench-reason TEXT      why (required with --rlbench-update-golden; kept in each file's history)

A golden file that is missing fails its test, saying how to write it: nothing is written without the flag and a
reason. A failed comparison fails the test with the verdict `rlbench check golden` prints: the metric, the step,
both values, how many were compared. The tiers (exact, approx, history) are check golden's own; the helpers
for every other verdict are in rlbench.testing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlbench import testing

UPDATE = "--rlbench-update-golden"
REASON = "--rlbench-reason"


def pytest_addoption(parser) -> None:
    group = parser.getgroup("rlbench", "rlbench: the RL loop's regression checks")
    group.addoption(
        UPDATE,
        action="store_true",
        default=False,
        help="Write the golden files the tests compare with (rlbench golden update), instead of comparing. Needs "
        f"{REASON}.",
    )
    group.addoption(REASON, default=None, metavar="TEXT", help="Why the golden files change: kept in their history.")


def pytest_configure(config) -> None:
    if config.getoption(UPDATE, default=False) and not (config.getoption(REASON, default=None) or "").strip():
        raise pytest.UsageError(f"{UPDATE} needs {REASON} TEXT: why the golden values change (kept in each file)")


@pytest.fixture
def rlbench_run(tmp_path):
    """Run a config into this test's temporary directory: rlbench_run(config=None, name="run", args=(), **options)
    -> the run directory. A run that fails fails the test with its error line."""

    def run(config=None, name: str = "run", args: tuple[str, ...] = (), **options) -> Path:
        return testing.run(config, out=tmp_path / name, args=tuple(args), **options)

    return run


class Golden:
    """The golden files of one test: golden/<name>.json beside the test's file."""

    def __init__(self, request):
        self._node = request.node
        self._update = request.config.getoption(UPDATE)
        self._reason = request.config.getoption(REASON)

    def path(self, name: str | None = None) -> Path:
        """The golden file `name` (default: the test's name, parameters included, as a file name)."""
        stem = re.sub(r"[^\w.-]+", "-", name or self._node.name).strip("-")
        return Path(self._node.path).parent / "golden" / f"{stem}.json"

    def check(self, run_dir, tier: str = "exact", name: str | None = None, args: tuple[str, ...] = ()):
        """Compare `run_dir` with the golden file at `tier` (exact, approx or history; `args`: check golden's options,
        --tolerance and --ignore among them); with --rlbench-update-golden, write it instead. Returns the outcome."""
        path = self.path(name)
        if self._update:
            path.parent.mkdir(parents=True, exist_ok=True)
            return testing.update_golden(run_dir, path, self._reason, tier)
        if not path.is_file():
            pytest.fail(
                f"{path}: no golden file; write it with pytest {UPDATE} {REASON} 'why' (rlbench golden update)",
                pytrace=False,
            )
        try:
            return testing.check_golden(run_dir, path, tier, *args)
        except testing.VerdictFailed as failed:
            text = str(failed)  # failed outside the handler: one failure shown, not the verdict chained to another
        pytest.fail(text, pytrace=False)


@pytest.fixture
def golden(request) -> Golden:
    """This test's golden files: golden.check(run, tier="exact")."""
    return Golden(request)
