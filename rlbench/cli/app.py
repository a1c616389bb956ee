"""The typer app every command registers on, the two consoles, the options every command shares,
and how output reads where no terminal shows it (a CI log, `| tee`, `| cat`: rich assumes 80 columns
there): every table goes through `render_table`, a long command's progress through `progress`, and
`--help` keeps option names whole. Imports nothing of the commands: they import it (rlbench.cli
imports both, in order)."""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from typing import Annotated, Optional

import typer
import typer.rich_utils
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from rlbench import __version__

app = typer.Typer(
    name="rlbench",
    help="Reproduce and debug LLM RL post-training runs: run, replay, diff, check.",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
stderr = Console(stderr=True)
# Options every command has. `--debug` is read by main() from argv; commands declare it for --help.
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as one JSON document.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
stdout = Console()
INTERRUPTED = "rlbench: interrupted; committed steps are kept (rlbench run --resume RUN continues a run)"


def _print_version(value: bool) -> None:
    if value:
        stdout.print(f"rlbench {__version__}", markup=False, highlight=False)
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def _group(
    ctx: typer.Context,
    version: Annotated[
        Optional[bool],
        typer.Option("--version", help="Print rlbench's version and exit.", callback=_print_version, is_eager=True),
    ] = None,
) -> None:
    """Reproduce and debug LLM RL post-training runs: run, replay, diff, check."""
    if ctx.invoked_subcommand is None:  # bare `rlbench`: the help, and success
        stdout.print(ctx.get_help(), markup=False, highlight=False)
        raise typer.Exit(0)


# ---------------------------------------------------------------- tables

_UNBOUNDED = 1 << 16  # a width no table reaches: what a table needs, unwrapped


def render_table(table: Table, console: Console | None = None) -> None:
    """Print `table` on `console` (stdout). Its cells are data, printed as they are (a token `[/INST]` is
    text, not a rich closing tag). On a terminal rich draws it to the terminal's width. Elsewhere rich
    would wrap every cell to fit 80 columns (COLUMNS, where set), a word per line: there the title is a
    line of its own, and the table is drawn at its natural width where that fits, else each row is
    written as its own lines (`- column: value`, or `key: value` for a table without headers)."""
    console = console or stdout
    for column in table.columns:  # rich keeps a column's cells in _cells; str cells would be read as markup
        column._cells = [Text(cell) if isinstance(cell, str) else cell for cell in column._cells]
    if console.is_terminal:
        console.print(table)
        return
    if table.title:
        console.print(_plain(table.title), markup=False, highlight=False, soft_wrap=True)
    body = copy.copy(table)
    body.title = None
    if Measurement.get(console, console.options.update_width(_UNBOUNDED), body).maximum <= console.width:
        console.print(body)
        return
    for line in _records(body):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _records(table: Table) -> list[str]:
    """Each row of `table` as lines: `- header: value` then `  header: value` for each non-empty cell;
    without headers, `first: the rest` on one line (an empty first cell: the rest, indented)."""
    lines = []
    for row in zip(*([_plain(cell) for cell in column.cells] for column in table.columns)):
        if not table.show_header:
            rest = "  ".join(cell for cell in row[1:] if cell)
            lines.append(f"{row[0]}: {rest}" if row[0] else f"  {rest}")
            continue
        fields = [f"{_plain(column.header)}: {cell}" for column, cell in zip(table.columns, row) if cell]
        lines += [f"{'  ' if i else '- '}{field}" for i, field in enumerate(fields)]
    return lines


def _plain(cell) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


# ---------------------------------------------------------------- progress

PROGRESS_EVERY = 10  # steps between progress lines where no terminal shows the bar: 9 lines for 85 steps


def progress(total: int, start: int = 0):
    """A context handing out an `on_step(state)` callback that shows a long command's progress on
    stderr: a bar on a terminal; elsewhere a line every PROGRESS_EVERY steps and at the last step
    (`step 10/85 reward 0.412 loss -0.0021 12.3 s`). By step count, not by time, so that what a run
    prints is the same on every machine; the wall time in a line is stderr's only (no run file holds it)."""
    return _bar(total, start) if stderr.is_terminal else _lines(total)


def _step_info(state, gap: str = "  ") -> str:
    info = f"reward {state.metrics['rollout/raw_reward']:.3f}"
    if "train/loss" in state.metrics:
        info += f"{gap}loss {state.metrics['train/loss']:+.4f}"
    return info


@contextmanager
def _lines(total: int):
    began = time.monotonic()

    def on_step(state) -> None:
        done = state.step + 1
        if done % PROGRESS_EVERY == 0 or done == total:
            stderr.print(
                f"step {done}/{total} {_step_info(state, ' ')} {time.monotonic() - began:.1f} s",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    yield on_step


@contextmanager
def _bar(total: int, start: int):
    """A step progress bar on stderr. Started at the first step, not before: inputs are validated while a
    run is built, and a bad one must leave one error line on stderr, not a progress line above it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=stderr,
    )
    task = bar.add_task("run", total=total, completed=start, info="")

    def on_step(state) -> None:
        bar.start()
        bar.update(task, completed=state.step + 1, info=_step_info(state))

    try:
        yield on_step
    except BaseException:  # an error is reported in one line of its own, which names the step it stopped at
        if bar.live.is_started:
            stderr.quiet = True  # stop the bar without printing its last state
            try:
                bar.stop()
            finally:
                stderr.quiet = False
        raise
    finally:
        if bar.live.is_started:  # stopping one never started would print an empty line
            bar.stop()


# ---------------------------------------------------------------- --help


class _HelpTable(Table):
    """The table typer's rich help lays each panel out in (typer.rich_utils builds an options table from
    rows alone), with the cells before the type and the help kept whole: rich shrinks every column
    alike to fit 80 columns, which cut `--rollout-external-engine-addrs` to `--rollout-external-en…`.
    The help text takes the room left, folded where a word is longer (never an ellipsis)."""

    def add_row(self, *renderables, **kwargs) -> None:
        super().add_row(*renderables, **kwargs)
        for column in self.columns[:-2]:  # the required marker and the names; the commands panel has none
            column.no_wrap = True
        self.columns[-1].overflow = "fold"
        for part in getattr(renderables[-1], "renderables", []):  # an option's help: rich Columns of texts
            if isinstance(part, Text):
                part.overflow = "fold"


typer.rich_utils.Table = _HelpTable  # typer names no hook for its help's layout: its module's Table is the one
