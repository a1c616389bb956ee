"""What the CLI prints where no terminal reads it (a CI log, `| tee`, `| cat`, `2>log`): tables at their
natural width or one record per row (rlbench/cli/app.py: render_table), progress lines by step count
(app.progress), and a run's files untouched by either. `--help` at 80 columns: test_cli_surface.py."""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from rich.table import Table

from tests.conftest import REPO, cli, small_toml

app = importlib.import_module("rlbench.cli.app")  # the module: `rlbench.cli.app` as an attribute is the typer app
LINE = re.compile(r"step (\d+)/(\d+) reward -?\d+\.\d{3}( loss [+-]\d+\.\d{4})? \d+\.\d s")


def _printed(table: Table, **console) -> str:
    out = io.StringIO()
    app.render_table(table, Console(file=out, width=80, **console))
    return out.getvalue()


def _findings_table(rows: int, width: int) -> Table:
    table = Table(title="token-in-token-out drift: findings")
    for column in ("shape", "where", "before", "got"):
        table.add_column(column, overflow="fold")
    for i in range(rows):
        table.add_row(f"shape-{i}", "final re-render", "x" * width, f"[{i}, 2] '<|im_start|>user'")
    return table


# ---------------------------------------------------------------- tables


def test_a_table_that_fits_is_drawn_whole_with_its_title_on_a_line_of_its_own():
    text = _printed(_findings_table(2, 10))
    lines = text.splitlines()
    assert lines[0] == "token-in-token-out drift: findings"
    assert max(map(len, lines)) <= 80 and "│ shape-1 │ final re-render │ xxxxxxxxxx │" in text, text
    assert "[1, 2] '<|im_start|>user'" in text


def test_a_table_wider_than_80_columns_is_one_record_per_row_never_a_word_per_line():
    """rich would fold each cell of this table into its share of 80 columns; every value stays whole on its line."""
    text = _printed(_findings_table(2, 60))
    assert text.splitlines() == [
        "token-in-token-out drift: findings",
        "- shape: shape-0",
        "  where: final re-render",
        f"  before: {'x' * 60}",
        "  got: [0, 2] '<|im_start|>user'",
        "- shape: shape-1",
        "  where: final re-render",
        f"  before: {'x' * 60}",
        "  got: [1, 2] '<|im_start|>user'",
    ]


def test_a_table_without_headers_is_key_value_lines_and_empty_cells_are_left_out():
    table = Table(show_header=False)
    table.add_column()
    table.add_column()
    table.add_row("where", "y" * 100)
    table.add_row("", "a note on it")
    headed = Table()
    for column in ("statistic", "gate", "what"):
        headed.add_column(column)
    headed.add_row("p99", "", "z" * 100)
    assert _printed(table).splitlines() == [f"where: {'y' * 100}", "  a note on it"]
    assert _printed(headed).splitlines() == ["- statistic: p99", f"  what: {'z' * 100}"]


@pytest.mark.parametrize("width", [5, 90])
def test_cells_are_data_never_markup(width):
    """A Llama-style token `[/INST]` in a cell was a rich closing tag: MarkupError, an internal error."""
    table = _findings_table(1, width)
    table.add_row("[bold]x[/bold]", "[/INST]", "", "")
    text = _printed(table)
    assert "[/INST]" in text and "[bold]x[/bold]" in text


def test_on_a_terminal_rich_draws_the_table_as_before():
    text = _printed(_findings_table(2, 60), force_terminal=True, color_system=None)
    assert "┃ shape" in text and "- shape:" not in text and max(map(len, text.splitlines())) == 80


def test_check_tito_audit_piped_through_cat_says_each_finding_on_its_own_lines(tmp_path):
    """The issue's case as a user meets it: `rlbench check tito --audit ... | cat` in a process with no
    terminal and COLUMNS unset (rich's 80 columns): each finding's fields whole, one to a line, no line
    over 80 columns that a field did not make long; --json (the machine format) still one document."""
    tokenizer = str(REPO / "rlbench/fixtures/tokenizers/qwen-tiny")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}

    def run(*extra):
        return subprocess.run(
            [sys.executable, "-m", "rlbench.cli", "check", "tito", "--tokenizer", tokenizer, "--audit", *extra],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )

    text, doc = run(), run("--json")
    assert text.returncode == doc.returncode == 1, text.stderr + doc.stderr
    findings = json.loads(doc.stdout)["findings"]
    assert len(findings) >= 2
    lines = text.stdout.splitlines()
    for f in findings:
        at = lines.index(f"- shape: {f['shape']}")
        assert lines[at + 1 : at + 8] == [
            f"  where: {f['where']}",
            f"  mode: {f['number']} {f['mode']}" + ("" if f["strict"] else " (hazard)"),
            f"  Miles: {f['category']}",
            f"  index: {f['index']}",
            f"  before: {f['context_text']!r}",
            f"  expected: {f['expected']} {f['expected_text']!r}",
            f"  got: {f['got']} {f['got_text']!r}",
        ]
    assert not [line for line in lines if len(line) > 80 and not line.startswith("  ")], text.stdout


# ---------------------------------------------------------------- progress


def _state(step: int, loss: bool = True):
    metrics = {"rollout/raw_reward": 0.5, **({"train/loss": -0.002} if loss else {})}
    return SimpleNamespace(step=step, metrics=metrics)


def test_without_a_terminal_progress_is_a_line_every_10th_step_and_at_the_last(monkeypatch):
    """85 steps: 9 lines, by step count alone (the same on every machine)."""
    out = io.StringIO()
    monkeypatch.setattr(app, "stderr", Console(file=out, width=80))
    with app.progress(85) as on_step:
        for step in range(85):
            on_step(_state(step, loss=step != 84))
    lines = out.getvalue().splitlines()
    assert [LINE.fullmatch(line).group(1, 2) for line in lines] == [(str(n), "85") for n in (*range(10, 90, 10), 85)]
    assert lines[0].startswith("step 10/85 reward 0.500 loss -0.0020 ") and " loss " not in lines[-1]


def test_on_a_terminal_progress_is_rich_bar_and_no_lines(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(app, "stderr", Console(file=out, width=80, force_terminal=True, color_system=None))
    with app.progress(20) as on_step:
        for step in range(20):
            on_step(_state(step))
    assert "━" in out.getvalue() and not any(LINE.fullmatch(line) for line in out.getvalue().splitlines())


def test_a_run_and_its_replay_print_progress_lines_and_the_runs_files_do_not_change(tmp_path, monkeypatch, reference):
    """`rlbench run ... 2>log`: progress lines on stderr (here every 2nd step, and the last), and the run's
    checksums.jsonl byte for byte the in-process run's (no callback, no wall clock); its summary's rewards
    over the steps there are (3, not "10"); `replay` prints its own, and where it wrote without --out;
    `--json` prints none."""
    monkeypatch.setattr(app, "PROGRESS_EVERY", 2)
    (tmp_path / "s.toml").write_text(small_toml(3))
    res = cli("run", "-c", str(tmp_path / "s.toml"), "--out", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    assert [LINE.fullmatch(line).group(1, 2) for line in res.stderr.splitlines()] == [("2", "3"), ("3", "3")]
    assert (tmp_path / "run/checksums.jsonl").read_bytes() == (Path(reference) / "checksums.jsonl").read_bytes()
    assert "reward, first 3 steps" in res.stdout and "reward, last 3 steps" in res.stdout, res.stdout
    replayed = cli("replay", str(tmp_path / "run"))
    assert replayed.returncode == 0, replayed.stderr
    assert [LINE.fullmatch(line).group(1, 2) for line in replayed.stderr.splitlines()] == [("2", "3"), ("3", "3")]
    (written,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replay-")]
    assert replayed.stdout.strip().endswith(f"; the replay is in {written}"), replayed.stdout
    quiet = cli("run", "-c", str(tmp_path / "s.toml"), "--out", str(tmp_path / "json"), "--json")
    assert quiet.returncode == 0 and not any(LINE.fullmatch(line) for line in quiet.stderr.splitlines())
    assert json.loads(quiet.stdout)["steps"] == 3
