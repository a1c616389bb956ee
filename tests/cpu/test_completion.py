"""Shell completion (typer's, rlbench/cli/app.py): `rlbench --show-completion SHELL` prints the script with no
terminal and no shell detection, `--install-completion SHELL` writes it where the shell reads it, and the
script's calls back into `rlbench` (`_RLBENCH_COMPLETE=complete_bash`) pass through main()'s error boundary
and complete commands, options and choices. docs/usage.md, "Shell completion"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish", "powershell", "pwsh"])
def test_show_completion_prints_the_script_of_the_shell_named(shell):
    res = cli("--show-completion", shell)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    protocol = {"pwsh": "powershell"}.get(shell, shell)  # PowerShell 7's script speaks PowerShell's
    assert "_RLBENCH_COMPLETE" in res.stdout and f"complete_{protocol}" in res.stdout, res.stdout


def test_a_shell_typer_has_no_script_for_is_one_line():
    res = cli("--show-completion", "tcsh")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("rlbench: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "'bash', 'zsh', 'fish', 'powershell', 'pwsh'" in res.stderr


@pytest.mark.parametrize(
    "words, cword, expected",
    [
        ("rlbench ru", 1, ["run"]),
        ("rlbench run --ste", 2, ["--steps"]),
        ("rlbench run --rollout ", 3, ["hf", "sglang"]),
        ("rlbench check go", 2, ["golden"]),
    ],
)
def test_the_scripts_call_back_completes_commands_options_and_choices(monkeypatch, words, cword, expected):
    """What bash's script asks `rlbench` for at each Tab (typer's bash protocol), answered through main()."""
    monkeypatch.setenv("_RLBENCH_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", words)
    monkeypatch.setenv("COMP_CWORD", str(cword))
    res = cli()
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.split() == expected


def test_install_completion_writes_the_script_where_bash_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    res = cli("--install-completion", "bash")
    assert res.returncode == 0, res.stderr
    script = tmp_path / ".bash_completions" / "rlbench.sh"
    assert "complete -o default -F _rlbench_completion rlbench" in script.read_text()
    assert str(script) in (tmp_path / ".bashrc").read_text() and str(script) in res.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_bash_completes_rlbench_through_the_printed_script(tmp_path):
    """The whole loop in bash itself: the script printed into a pipe (no terminal), evaluated, and its
    function run at `rlbench ru<Tab>` against an `rlbench` on PATH."""
    (tmp_path / "rlbench").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m rlbench.cli "$@"\n')
    (tmp_path / "rlbench").chmod(0o755)
    script = (
        'eval "$(rlbench --show-completion bash | cat)"; COMP_WORDS=(rlbench ru); COMP_CWORD=1; '
        '_rlbench_completion rlbench; echo "${COMPREPLY[@]}"'
    )
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    res = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["run"], res.stderr
