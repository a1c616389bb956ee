"""Each CLI option that sets a config field is declared from that field (rlbench/cli/options.py)
and held to it here: the type it parses, the default its help shows, the help text. An option
that drifts from its field fails this file; the checker itself is tested on options that drift."""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Optional

import pytest
import typer

import rlbench.cli
from rlbench import __version__
from rlbench.config import RunConfig
from rlbench.cli.options import FieldOption, config_option, disagreements, option_fields
from rlbench.cli.runs import RUN_FIELDS
from tests.conftest import cli

# Options that set no config field: what the command does with the config, not what it holds.
NOT_FIELDS = {"run": {"config", "resume", "print_config", "as_json", "debug", "ctx"}, "serve": {"debug"}}


def _command(name):
    return typer.main.get_command(rlbench.cli.app).commands[name]


@pytest.mark.parametrize("name", ["run", "serve"])
def test_every_option_agrees_with_its_field(name):
    command = _command(name)
    assert disagreements(command.callback, command) == []


@pytest.mark.parametrize("name", ["run", "serve"])
def test_every_option_that_sets_a_setting_is_declared_from_its_field(name):
    command = _command(name)
    fields = option_fields(command.callback)
    params = {p.name for p in command.params} - {"help"}
    assert params - set(fields) == NOT_FIELDS[name] - {"ctx"}
    assert len(fields) >= 14


def test_the_run_table_is_what_the_resume_refusal_reads():
    assert RUN_FIELDS["rollout_backend"] == FieldOption(
        "rollout.backend", RUN_FIELDS["seed"].root, None, ("--rollout-backend", "--rollout")
    )
    assert RUN_FIELDS["no_record"].flag_value is False


@pytest.mark.parametrize(
    "args, named",
    [
        (["--seed", "3"], "--seed"),
        (["--trainer", "torch", "--tp", "1"], "--trainer, --tp"),
        (["--no-record", "--deterministic"], "--deterministic, --no-record"),
        (["--rollout-external-engine-addrs", "a:1"], "--rollout-external-engine-addrs"),
        (["-c", "x.toml", "--device", "cpu"], "--config, --device"),
    ],
)
def test_resume_refuses_every_setting_by_its_name(tmp_path, args, named):
    res = cli("run", "--resume", str(tmp_path / "r"), *args)
    assert res.returncode == 2 and f"drop {named}" in res.stderr, res.stderr


def test_version():
    res = cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"rlbench {__version__}"


def test_the_command_is_built_once_and_each_call_parses_its_own_line():
    """main() reuses one click command a process (typer builds it from ~200 option declarations); what a call
    parses stays with that call: an option given once is not there the next time."""
    assert rlbench.cli.command() is rlbench.cli.command()
    first = cli("run", "--steps", "2", "--seed", "5", "--print-config")
    second = cli("run", "--steps", "2", "--print-config")
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert json.loads(first.stdout)["seed"] == 5
    assert json.loads(second.stdout)["seed"] == RunConfig().seed != 5


# ---------------------------------------------------------------- the checker, on options that drift


class Backend(str, Enum):
    hf = "hf"
    vllm = "vllm"


def _drifting(
    steps: Annotated[Optional[float], config_option("steps")] = None,
    backend: Annotated[Optional[Backend], config_option("rollout.backend")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Master seed. [default: 7]")] = None,
    threads: Annotated[int, config_option("threads")] = 4,
    record: Annotated[bool, config_option("record", "--record", flag_value=True)] = False,
) -> None:
    """Every option here disagrees with its field but `seed`, which is not declared from one."""


def test_the_checker_names_each_kind_of_drift():
    app = typer.Typer()
    app.command()(_drifting)
    command = typer.main.get_command(app)
    found = disagreements(_drifting, command)
    assert any("--steps" in f and "parses float, the field holds int" in f for f in found), found
    assert any("--backend" in f and "choices ['hf', 'vllm'], the field takes ['hf', 'sglang']" in f for f in found)
    assert any("--threads" in f and "defaults to 4 itself" in f for f in found), found
    assert any("--record" in f and "a flag sets a bool field to its non-default value" in f for f in found), found
    assert not any("--seed" in f for f in found) and "seed" not in option_fields(_drifting)


def test_the_checker_catches_help_and_default_that_drift(monkeypatch):
    from rlbench.cli import options

    app = typer.Typer()

    def command(steps: Annotated[Optional[int], config_option("steps")] = None) -> None:
        """One option, declared from its field."""

    app.command()(command)
    click_command = typer.main.get_command(app)
    assert disagreements(command, click_command) == []
    param = click_command.params[0]
    monkeypatch.setattr(param, "help", param.help.replace("Number of steps", "How many steps"))
    assert any("help" in f for f in disagreements(command, click_command))
    monkeypatch.undo()
    monkeypatch.setattr(param, "help", param.help.replace("100", "60"))
    assert any("does not show the field's default ([default: 100])" in f for f in disagreements(command, click_command))
    assert options.shown(()) == "none" and options.shown(True) == "true" and options.shown(None) == "none"


def test_a_field_without_help_cannot_become_an_option():
    with pytest.raises(KeyError, match="checkpoint_every has no help"):
        config_option("checkpoint_every")
    with pytest.raises(KeyError, match="no field"):
        config_option("rollout.nothing")


def test_rlbench_run_resolves_its_command_line_through_the_library_function(tmp_path):
    """`rlbench run ... --print-config --json` prints what rlbench.command.run_config returns for the same command
    line: options, slime's arguments (with slime's defaults) and --sglang-* passthrough."""
    from rlbench.command import run_config

    argv = [
        "--out",
        str(tmp_path / "r"),
        "--rollout",
        "sglang",
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "4",
        "--global-batch-size",
        "8",
        "--sglang-mem-fraction-static",
        "0.5",
    ]
    printed = cli("run", *argv, "--print-config", "--json")
    assert printed.returncode == 0, printed.stderr
    resolved = run_config(argv[4:], given={"out": str(tmp_path / "r"), "rollout__backend": "sglang"})
    assert json.loads(printed.stdout)["config"] == json.loads(json.dumps(resolved.config.to_dict(), default=list))
    assert resolved.config.data.prompts_per_step == 2 and resolved.config.rollout.n_samples_per_prompt == 4
    assert resolved.config.rollout.sglang == {"mem-fraction-static": "0.5"} and resolved.notes == []
    assert resolved.config.steps == 3 and {name for name, _, _ in resolved.slime} >= {
        "--num-rollout",
        "--rollout-batch-size",
        "--n-samples-per-prompt",
        "--rollout-max-response-len",
    }
