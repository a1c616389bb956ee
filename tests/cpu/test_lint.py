"""The lint and format gate: `ruff check` over the repository passes, with the rules pyproject.toml's [tool.ruff]
selects (pycodestyle, pyflakes, bugbear, pyupgrade; lines of 120 characters at most), and `ruff format --check`
finds every file in the layout [tool.ruff.format] sets. ruff comes with the dev extra, which the suite's own
set-up installs (README), so CI runs the gate with every test run."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_ruff_check_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_format_check_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
