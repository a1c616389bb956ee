"""The CLI surface, frozen: the commands and the options of `rlbench run`.

Users script against these names. Changing them must be deliberate: when you add, rename or
remove an option, update the expected set here in the same change (and the docs).
"""

from __future__ import annotations

import pytest
import typer

import rlbench.cli
from tests.conftest import run_cli

EXPECTED_COMMANDS = {"run", "replay", "diff", "import", "check", "golden", "serve"}

EXPECTED_RUN_OPTIONS = {
    "--config", "-c",
    "--seed",
    "--steps",
    "--out",
    "--mode",
    "--rollouts",
    "--resume",
    "--rollout-backend", "--rollout",
    "--rollout-external-engine-addrs",
    "--sglang-router-url",
    "--rollout-num-engines",
    "--sglang-server",
    "--placement",
    "--ray-address",
    "--trainer-backend", "--trainer",
    "--tp",
    "--dp",
    "--deterministic",
    "--custom-rm-path",
    "--device",
    "--threads",
    "--no-record",
    "--json",
    "--debug",
}

EXPECTED_SERVE_OPTIONS = {"--model-path", "--tokenizer-path", "--host", "--port", "--random-seed", "--dtype", "--device",
                          "--threads", "--decode", "--decode-batch-size", "--batch-wait-ms", "--weight-version",
                          "--log-level", "--debug"}

EXPECTED_GOLDEN_OPTIONS = {
    ("check", "golden"): {"--tier", "--ignore", "--tolerance", "--rename", "--plot", "--json", "--debug"},
    ("golden", "update"): {"--reason", "--tolerance", "--step-interval", "--json", "--debug"},
}

CHANGE_MESSAGE = ("the CLI surface changed; if that is deliberate, update the expected set in "
                  "tests/cpu/test_cli_surface.py (and the docs) in the same change")


def _group():
    return typer.main.get_command(rlbench.cli.app)


def _option_names(command) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)}


def test_commands_are_frozen():
    assert set(_group().commands) == EXPECTED_COMMANDS, CHANGE_MESSAGE


def test_run_options_are_frozen():
    got = _option_names(_group().commands["run"])
    added, removed = sorted(got - EXPECTED_RUN_OPTIONS), sorted(EXPECTED_RUN_OPTIONS - got)
    assert got == EXPECTED_RUN_OPTIONS, f"{CHANGE_MESSAGE}: added {added}, removed {removed}"


def test_serve_options_are_frozen():
    assert _option_names(_group().commands["serve"]) == EXPECTED_SERVE_OPTIONS, CHANGE_MESSAGE


@pytest.mark.parametrize("path", sorted(EXPECTED_GOLDEN_OPTIONS))
def test_golden_options_are_frozen(path):
    group, name = path
    got = {opt for opt in _option_names(_group().commands[group].commands[name]) if opt.startswith("-")}
    assert got == EXPECTED_GOLDEN_OPTIONS[path], CHANGE_MESSAGE


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_top_level_help(flag):
    res = run_cli(flag, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    for command in EXPECTED_COMMANDS:
        assert command in res.stdout, f"{command!r} not in `rlbench {flag}`:\n{res.stdout}"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_run_help_mentions_every_option(flag):
    res = run_cli("run", flag, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    missing = sorted(opt for opt in EXPECTED_RUN_OPTIONS if opt not in res.stdout)
    assert not missing, f"`rlbench run {flag}` does not mention {missing}:\n{res.stdout}"


def test_no_arguments_shows_help(tmp_path):
    """Bare `rlbench`: the help on stdout, exit 0, no traceback."""
    res = run_cli(cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    for command in EXPECTED_COMMANDS:
        assert command in res.stdout, f"{command!r} not in bare `rlbench` output:\n{res.stdout}"
    assert list(tmp_path.iterdir()) == [], "bare `rlbench` wrote files"
