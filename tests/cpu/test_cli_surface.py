"""The CLI surface, frozen: the commands and the options of `rlbench run`.

Users script against these names. Changing them must be deliberate: when you add, rename or
remove an option, update the expected set here in the same change (and the docs).
"""

from __future__ import annotations

import os
import re

import pytest
import typer

import rlbench.cli
from tests.conftest import cli

EXPECTED_COMMANDS = {"run", "replay", "diff", "import", "check", "golden", "serve", "report", "export"}

EXPECTED_RUN_OPTIONS = {
    "--config",
    "-c",
    "--seed",
    "--steps",
    "--out",
    "--mode",
    "--rollouts",
    "--resume",
    "--rollout-backend",
    "--rollout",
    "--rollout-external-engine-addrs",
    "--sglang-router-url",
    "--rollout-num-engines",
    "--sglang-server",
    "--placement",
    "--ray-address",
    "--ray-timeout",
    "--trainer-backend",
    "--trainer",
    "--tp",
    "--dp",
    "--deterministic",
    "--custom-rm-path",
    "--custom-generate-function-path",
    "--group-rm",
    "--async",
    "--max-staleness",
    "--update-weights-interval",
    "--update-weight-mode",
    "--device",
    "--threads",
    "--no-record",
    "--print-config",
    "--json",
    "--debug",
}

EXPECTED_SERVE_OPTIONS = {
    "--model-path",
    "--load-format",
    "--tokenizer-path",
    "--host",
    "--port",
    "--random-seed",
    "--dtype",
    "--device",
    "--threads",
    "--decode",
    "--decode-batch-size",
    "--batch-wait-ms",
    "--batch-variant",
    "--weight-version",
    "--log-level",
    "--context-length",
    "--skip-tokenizer-init",
    "--max-request-bytes",
    "--debug",
    "--incremental-streaming-output",
    "--stream-output",
    "--api-key",
    "--allow-unauthenticated",
    "--weights-dir",
}

EXPECTED_GOLDEN_OPTIONS = {
    ("check", "golden"): {"--tier", "--ignore", "--tolerance", "--rename", "--plot", "--json", "--debug"},
    ("golden", "update"): {"--reason", "--tolerance", "--step-interval", "--tier", "--keep", "--json", "--debug"},
}

EXPECTED_ROOT_OPTIONS = {"--version", "--show-completion", "--install-completion"}  # shell completion: typer's

CHANGE_MESSAGE = (
    "the CLI surface changed; if that is deliberate, update the expected set in "
    "tests/cpu/test_cli_surface.py (and the docs) in the same change"
)


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


def test_root_options_are_frozen():
    assert _option_names(_group()) == EXPECTED_ROOT_OPTIONS, CHANGE_MESSAGE


def test_serve_options_are_frozen():
    assert _option_names(_group().commands["serve"]) == EXPECTED_SERVE_OPTIONS, CHANGE_MESSAGE


@pytest.mark.parametrize("path", sorted(EXPECTED_GOLDEN_OPTIONS))
def test_golden_options_are_frozen(path):
    group, name = path
    got = {opt for opt in _option_names(_group().commands[group].commands[name]) if opt.startswith("-")}
    assert got == EXPECTED_GOLDEN_OPTIONS[path], CHANGE_MESSAGE


# ---------------------------------------------------------------- what --help shows, parsed


def _help(monkeypatch, *args) -> str:
    monkeypatch.setenv("COLUMNS", "200")  # one row per option, as wide as the help needs
    res = cli(*args)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    return res.stdout


def _panels(text: str) -> dict[str, list[str]]:
    """The help's boxed panels (Options, Arguments, Commands): title -> each line's content inside the box."""
    panels, title = {}, None
    for line in text.splitlines():
        line = line.strip()
        head = re.match(r"╭─ (.+?) ─", line)
        if head:
            title = head.group(1)
            panels[title] = []
        elif line.startswith("╰"):
            title = None
        elif title is not None:
            panels[title].append(line[1:-1].rstrip())  # between the box's │ and │
    return panels


def _rows(lines: list[str], starts, lead) -> list[tuple[list[str], str]]:
    """Each table row as (its cells before the help text, the help text with its wrapped lines joined).
    A row starts on a line that `starts` accepts, and the lines after it that it does not are its help's
    continuation. Cells are separated by two or more spaces; `lead(cells)` says how many come before the help."""
    rows = []
    for line in lines:
        if starts(line):
            cells = re.split(r"\s{2,}", line.strip())
            n = lead(cells)
            rows.append((cells[:n], " ".join(cells[n:])))
        else:
            assert rows, f"a continuation line before any row: {line!r}"
            rows[-1] = (rows[-1][0], f"{rows[-1][1]} {line.strip()}")
    return rows


def _option_cells(cells: list[str]) -> int:
    """The cells before an option's help: a required marker, its names, its metavar (`<int range> [x>=1]`)."""
    n = 0
    while n < len(cells) - 1 and cells[n][:1] in ("*", "-", "<"):
        n += 1
    return n


def _as_written(help_text: str) -> str:
    """A help string as its author means it to read: `\\[` is how a bracket is written for rich, which would
    take `[megatron]` for a style and drop it. Whitespace collapsed, as the terminal wraps it."""
    return " ".join(help_text.replace("\\[", "[").split())


def _commands(group) -> list[tuple[tuple[str, ...], object]]:
    """(argv, command) for every command, groups' subcommands included."""
    out = []
    for name, command in group.commands.items():
        out.append(((name,), command))
        out += [((name, *sub), c) for sub, c in _commands(command)] if hasattr(command, "commands") else []
    return out


LEAVES = [(argv, c) for argv, c in _commands(_group()) if not hasattr(c, "commands")]
GROUPS = [((), _group())] + [(argv, c) for argv, c in _commands(_group()) if hasattr(c, "commands")]


def test_the_parser_reads_what_it_claims():
    """The help parser on a box written by hand: each row's names, metavar and wrapped help text, as written."""
    box = [
        "│ --config   -c   <path>  TOML file of settings; CLI options        │",
        "│                          override it.                              │",
        "│ --json                   Print the result as one JSON document.    │",
    ]
    text = "\n".join(["╭─ Options ──────╮", *box, "╰────────╯"])
    rows = _rows(_panels(text)["Options"], lambda line: line[1:2] == "-", _option_cells)
    assert rows == [
        (["--config", "-c", "<path>"], "TOML file of settings; CLI options override it."),
        (["--json"], "Print the result as one JSON document."),
    ]


@pytest.mark.parametrize("argv, command", LEAVES, ids=[" ".join(argv) for argv, _ in LEAVES])
def test_help_shows_every_option_and_argument_with_its_own_text(monkeypatch, argv, command):
    """`rlbench ... CMD --help`, parsed: the Options panel lists exactly the command's options (and --help/-h),
    each with the help text it declares, rendered as written (rich markup such as `[megatron]` would eat
    brackets); the Arguments panel names every argument."""
    from typer.core import TyperArgument, TyperOption

    panels = _panels(_help(monkeypatch, *argv, "--help"))
    shown = {}
    # a row starts with its option, after the required-marker column when one is shown (" *  --reason")
    for cells, text in _rows(panels["Options"], lambda line: re.match(r" [* ]{0,4}-", line) is not None, _option_cells):
        names = [n for cell in cells if cell.startswith("-") for n in cell.split(",")]
        assert names, (cells, text)
        for name in names:
            shown[name] = text
    declared = {
        opt: p
        for p in command.params
        if isinstance(p, TyperOption) and not p.hidden
        for opt in (*p.opts, *p.secondary_opts)
    }
    assert set(shown) == set(declared) | {"--help", "-h"}, CHANGE_MESSAGE
    for opt, param in declared.items():
        assert " ".join(shown[opt].split()).startswith(_as_written(param.help or "")), (opt, shown[opt], param.help)
    arguments = [p.name for p in command.params if isinstance(p, TyperArgument)]
    names = [
        cells[0].removesuffix("...")
        for line in panels.get("Arguments", [])
        for cells in [[c for c in re.split(r"\s{2,}", line.strip()) if c != "*"]]
        if len(cells) > 1 and cells[1].startswith("<")
    ]
    assert names == arguments


@pytest.mark.parametrize("argv, group", GROUPS, ids=[" ".join(argv) or "rlbench" for argv, _ in GROUPS])
def test_help_lists_exactly_the_commands_of_each_group(monkeypatch, argv, group):
    rows = _rows(
        _panels(_help(monkeypatch, *argv, "--help"))["Commands"], lambda line: line[1:2] != " ", lambda cells: 1
    )
    assert [cells[0] for cells, _ in rows] == list(group.commands), CHANGE_MESSAGE
    for cells, text in rows:
        assert _as_written(group.commands[cells[0]].help).startswith(" ".join(text.split())), (cells[0], text)
    if not argv:
        assert set(group.commands) == EXPECTED_COMMANDS
        assert _help(monkeypatch, "-h") == _help(monkeypatch, "--help")


def test_no_arguments_shows_help(tmp_path, monkeypatch):
    """Bare `rlbench`: the help on stdout, exit 0, no traceback, nothing written."""
    monkeypatch.chdir(tmp_path)
    assert _help(monkeypatch) == _help(monkeypatch, "--help")
    assert list(tmp_path.iterdir()) == [], "bare `rlbench` wrote files"


# ---------------------------------------------------------------- --help where no terminal is, and at 80 columns


def _no_terminal(fd):
    raise OSError("not a terminal")


@pytest.mark.parametrize(
    "terminal", [_no_terminal, lambda fd: os.terminal_size((80, 24))], ids=["no terminal", "80-column terminal"]
)
@pytest.mark.parametrize("argv, command", LEAVES + GROUPS, ids=[" ".join(a) or "rlbench" for a, _ in LEAVES + GROUPS])
def test_help_shows_every_option_name_whole_at_80_columns(monkeypatch, terminal, argv, command):
    """`rlbench ... --help | cat` with COLUMNS unset: rich lays the help out in 80 columns there (and on an
    80-column terminal), where it once cut `--rollout-external-engine-addrs` to `--rollout-external-en…`.
    Every declared option name stands whole in the Options panel, and nothing is cut with an ellipsis."""
    from typer.core import TyperOption

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(os, "get_terminal_size", terminal)  # rich sizes its console from stdin/stdout/stderr's
    res = cli(*argv, "--help")
    assert res.returncode == 0, res.stderr
    assert max(map(len, res.stdout.splitlines())) == 80 and "…" not in res.stdout, res.stdout
    rows = _rows(_panels(res.stdout)["Options"], _row_start, _row_cells)
    shown = {name for cells, _ in rows for cell in cells if cell.startswith("-") for name in cell.split(",")}
    declared = {
        opt
        for p in command.params
        if isinstance(p, TyperOption) and not p.hidden
        for opt in (*p.opts, *p.secondary_opts)
    }
    assert shown == declared | {"--help", "-h"}, res.stdout


def _row_cells(cells: list[str]) -> int:
    """`_option_cells`, and every cell of a row whose help is on the lines under it (names and metavar only)."""
    return len(cells) if all(cell[:1] in ("*", "-", "<") for cell in cells) else _option_cells(cells)


def _row_start(line: str) -> bool:
    """An option's row: its names, after the required marker's column where a panel has one (" *  --reason");
    a line indented further is help (a wrapped line of it, or where the help goes under its option)."""
    return re.match(r" [* ]{0,4}-", line) is not None and not line.startswith(" " * 5)


@pytest.mark.parametrize("argv, command", LEAVES + GROUPS, ids=[" ".join(a) or "rlbench" for a, _ in LEAVES + GROUPS])
def test_help_through_a_pipe_gives_each_help_40_columns_whole_words_and_no_source_file(monkeypatch, argv, command):
    """`rlbench run --help | cat` once gave each option's help an 18-column column, words cut across lines
    (`rlbench/config_se ctions.py`). Without a terminal (80 columns): each option's and argument's help starts
    at least 40 columns from the box's edge (HELP_ROOM; under its option where the names leave less), its
    words read in the panel as written, none cut; and no help names a source file of rlbench's."""
    from typer.core import TyperArgument, TyperOption

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(os, "get_terminal_size", _no_terminal)
    res = cli(*argv, "--help")
    assert res.returncode == 0, res.stderr
    assert re.findall(r"\S*(?:rlbench/|\.py\b)\S*", res.stdout) == [], res.stdout
    panels = _panels(res.stdout)
    right = max(map(len, res.stdout.splitlines())) - 3  # the box's right border and its padding
    for title, kind in (("Options", TyperOption), ("Arguments", TyperArgument)):
        lines = panels.get(title, [])
        words = " ".join(" ".join(lines).split())
        for param in command.params:
            written = _as_written(param.help or "") if isinstance(param, kind) and not param.hidden else ""
            if not written:
                continue
            assert written in words, (param.name, written, lines)
            first = " ".join(written.split()[:3])
            rooms = [right - line.index(first) for line in lines if first in line]
            assert rooms and min(rooms) >= 40, (param.name, rooms, res.stdout)


def test_stream_output_is_sglangs_earlier_name_kept_out_of_help(monkeypatch):
    """`--stream-output` (SGLang's name before 0.5.23) sets what `--incremental-streaming-output` sets; --help
    lists only the current name (the pair left the help text no room at 80 columns)."""
    import rlbench.serve.server as server
    from tests.conftest import cli

    seen = []
    monkeypatch.setattr(server, "serve", lambda config, announce: seen.append(config.incremental_streaming_output))
    for flags in (["--stream-output"], ["--incremental-streaming-output"], []):
        assert cli("serve", "--port", "0", *flags).returncode == 0
    assert seen == [True, True, False]
    shown = cli("serve", "--help").stdout
    names = re.findall(r"^│ (--[\w,-]+)", shown, re.M)  # each option row's names
    assert "--incremental-streaming-output" in names and "--port" in names
    assert not [n for n in names if "--stream-output" in n], names
