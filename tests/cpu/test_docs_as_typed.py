"""What the docs promise about running their commands as typed, beside the runs of the blocks themselves
(test_readme_examples.py, test_doc_journeys.py): no two command blocks of README.md and docs/*.md write the same
output (so a user can follow the README's tour, then docs/usage.md's examples, then the journeys, in one checkout),
and every output goes under `runs/`, never into the repository's root; a slime plugin that cannot import slime
says in its one error line what to run; and the one rule for relative paths in a config file (docs/usage.md,
"Paths in a config file"; `rlbench run --help`), with the recorded paths a later command reads.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from rlbench.core.plugins import SLIME_MISSING, load_function
from rlbench.errors import BadInput
from tests.conftest import REPO, cli, doc_commands, small_toml

COMMAND_FENCES = ("bash", "sh", "")  # a plain block may show commands too; its other lines are skipped
# The options of an rlbench command that name a file or directory it writes.
WRITING_OPTIONS = ("--out", "--plot", "--save")


def fenced(text: str) -> list[tuple[str, str]]:
    """A Markdown text's fenced blocks: (language, body)."""
    blocks, language, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, body = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(body)))
                language = None
        elif language is not None:
            body.append(line)
    return blocks


def doc_blocks() -> list[tuple[str, list[str]]]:
    """Every command block of README.md and docs/*.md, in reading order: (file:block number, its lines)."""
    blocks = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, (language, body) in enumerate(fenced(doc.read_text())):
            if language in COMMAND_FENCES:
                lines = [part.strip() for line, _ in doc_commands(body) for part in line.split("&&")]
                blocks.append((f"{doc.relative_to(REPO)}:{n}", lines))
    return blocks


def written(line: str) -> list[str]:
    """What an `rlbench` line writes, as the user typed it (`VAR=value` before the command skipped; `--resume` and
    an input are read, not written; a bare `rlbench run` writes runs/run-<time>, never the same twice)."""
    if not re.match(r"(\w+=\S*\s+)*rlbench\s", line):
        return []
    argv = shlex.split(line.rstrip("&").strip())
    while argv and re.match(r"\w+=", argv[0]):
        argv = argv[1:]
    out = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in WRITING_OPTIONS]
    out += [arg.partition("=")[2] for arg in argv if arg.partition("=")[0] in WRITING_OPTIONS and "=" in arg]
    if argv[1:3] == ["golden", "update"]:
        out.append([a for a in argv[3:] if not a.startswith("-")][1])  # golden update RUN FILE
    return out


def test_the_parser_finds_what_a_line_writes():
    assert written("PYTHONPATH=x rlbench run --steps 3 --out runs/sp") == ["runs/sp"]
    assert written("rlbench golden update runs/d runs/mine.json --reason 'a b'") == ["runs/mine.json"]
    assert written("rlbench check golden runs/d g.json --plot=runs/d.png") == ["runs/d.png"]
    assert written("rlbench run --resume runs/d") == written("python x.py --out y") == []


def test_no_two_doc_commands_write_one_output_and_none_writes_into_the_root():
    seen: dict[str, str] = {}
    for where, lines in doc_blocks():
        for line in lines:
            for path in written(line):
                assert path.startswith("runs/") and ".." not in Path(path).parts, (
                    f"{where}: `{line}` writes {path}, outside runs/"
                )
                assert path not in seen, f"{where}: `{line}` writes {path}, which {seen[path]} wrote already"
                seen[path] = where
    assert {"runs/tour", "runs/sp", "runs/a", "runs/served"} <= set(seen), sorted(seen)


def _plugin(tmp_path, monkeypatch, name: str, source: str) -> BadInput:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BadInput) as err:
        load_function(f"{name}.generate", "--custom-generate-function-path")
    return err.value


@pytest.mark.parametrize("module", ["slime", "miles"])
def test_a_plugin_without_slime_says_what_to_run(tmp_path, monkeypatch, module):
    """The import a slime plugin makes of slime or Miles fails: one line naming the module, then what to run
    (absent modules under slime's and Miles' names, so the test holds whether or not they are importable here)."""
    err = _plugin(tmp_path, monkeypatch, f"p_{module}", f"from {module}.rlbench_absent.http_utils import post\n")
    line = str(err)
    assert "\n" not in line and f"cannot import module 'p_{module}' (No module named '{module}" in line
    assert line.endswith(f"; a slime plugin imports slime or Miles: {SLIME_MISSING}")
    assert "python tests/get_miles.py" in SLIME_MISSING and "PYTHONPATH=.vendor/miles-rl-0.0.2 rlbench" in SLIME_MISSING


def test_a_plugin_missing_another_module_gets_no_slime_advice(tmp_path, monkeypatch):
    err = _plugin(tmp_path, monkeypatch, "p_other", "import rlbench_absent_module\n")
    assert str(err).endswith("(No module named 'rlbench_absent_module')"), str(err)


def test_the_docs_show_the_path_the_slime_plugin_needs():
    """The path in the docs' line and in the error is where tests/get_miles.py unpacks Miles."""
    from tests.conftest import MILES

    usage = (REPO / "docs" / "usage.md").read_text()
    assert f"PYTHONPATH={MILES.relative_to(REPO)} rlbench run --custom-generate-function-path" in usage


def test_paths_in_a_config_file_are_relative_to_its_folder_and_recorded_absolute(tmp_path):
    """docs/usage.md's rule: a config file's relative paths against its folder, the command line's against the
    working directory; each recorded absolute, so a command run later from elsewhere reads the same path."""
    conf = tmp_path / "conf"
    conf.mkdir()
    toml = 'out = "runs/a"\n' + small_toml(2).replace("[rollout]\n", '[rollout]\nweights_dir = "runs/w"\n')
    (conf / "small.toml").write_text(toml)
    (tmp_path / "elsewhere").mkdir()
    shown = cli("run", "--config", "conf/small.toml", "--print-config", "--json", cwd=tmp_path)
    config = json.loads(shown.stdout)["config"]
    assert config["out"] == str(conf / "runs" / "a") and config["rollout"]["weights_dir"] == str(conf / "runs" / "w")
    res = cli("run", "--config", "conf/small.toml", "--json", cwd=tmp_path)
    assert res.returncode == 0 and (conf / "runs" / "a" / "metrics.jsonl").is_file(), res.stderr
    assert not (tmp_path / "runs").exists()
    assert cli("check", "tito", "conf/runs/a", cwd=tmp_path).returncode == 0  # named from the root, as the docs say
    res = cli("run", "--mode", "train-only", "--rollouts", "conf/runs/a", "--out", "runs/t", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    recorded = json.loads((tmp_path / "runs" / "t" / "manifest.json").read_text())["config"]
    assert recorded["rollouts"] == str(conf / "runs" / "a") and recorded["out"] == "runs/t"  # out: as given
    res = cli("replay", str(tmp_path / "runs" / "t"), "--out", "t-replay", "--json", cwd=tmp_path / "elsewhere")
    assert res.returncode == 0, res.stderr


def test_the_rule_is_in_the_help_of_every_option_that_reads_a_config():
    import typer

    import rlbench.cli

    def commands(group):
        for command in group.commands.values():
            yield from commands(command) if hasattr(command, "commands") else [command]

    helps = [
        param.help
        for command in commands(typer.main.get_command(rlbench.cli.app))
        for param in command.params
        if "--config" in getattr(param, "opts", ())
    ]
    assert helps and all("a relative path in it is relative to the file's folder" in h for h in helps), helps
    usage = " ".join((REPO / "docs" / "usage.md").read_text().split())
    assert "A relative path in a `--config` file is relative to that file's folder" in usage


def test_a_run_config_through_the_library_records_its_relative_paths_as_the_command_line_does(tmp_path, monkeypatch):
    """rlbench.testing.run with a RunConfig (the pytest plugin's way): a relative path against the working directory,
    recorded absolute, so a check run later from elsewhere reads the run's model (it was recorded as given, and read
    against / by then: the model config "missing")."""
    from rlbench.config import load_config
    from rlbench.testing import run

    monkeypatch.chdir(REPO)
    config = load_config(steps=1, data__prompts_per_step=2, model__path="rlbench/fixtures/models/tiny-qwen3-sft")
    out = run(config, out=tmp_path / "r")
    recorded = json.loads((out / "manifest.json").read_text())["config"]
    assert recorded["model"]["path"] == str(REPO / "rlbench" / "fixtures" / "models" / "tiny-qwen3-sft")
    assert recorded["out"] == str(tmp_path / "r")  # out as given
    res = cli("check", "logprobs", str(out), "--recompute", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
