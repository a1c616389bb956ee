"""The typer app every command registers on, the two consoles, the options every command shares,
and how output reads where no terminal shows it (a CI log, `| tee`, `| cat`: rich assumes 80 columns
there): every table goes through `render_table`, a long command's progress through `progress` (which
also names, on Ctrl-C, the run directory whose committed steps are kept), and `--help` keeps option
names whole and each option's help at least HELP_ROOM columns wide. Shell completion is typer's, for
a shell named (`--show-completion bash`): a script no terminal or detection is needed for. A mistyped
option gets the closest name (`closest`). Imports nothing of the commands: they import it (rlbench.cli
imports both, in order)."""

from __future__ import annotations

import copy
import difflib
import shlex
import time
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.completion
import typer.rich_utils
from rich.console import Console
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from rlbench import __version__
from rlbench.errors import BadInput, RlbenchError

app = typer.Typer(
    name="rlbench",
    help="Reproduce and debug LLM RL post-training runs: run, replay, diff, check.",
    add_completion=False,  # typer's own pair detects the shell; ours (_group) are told it, so a pipe or CI works
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
stderr = Console(stderr=True)
# Options every command has. `--debug` is read by main() from argv; commands declare it for --help.
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as one JSON document.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
stdout = Console()
INTERRUPTED = "rlbench: interrupted"


def _print_version(value: bool) -> None:
    if value:
        stdout.print(f"rlbench {__version__}", markup=False, highlight=False)
        raise typer.Exit(0)


class Shell(str, Enum):  # the shells typer writes a completion script for
    bash = "bash"
    zsh = "zsh"
    fish = "fish"
    powershell = "powershell"
    pwsh = "pwsh"


def _show_completion(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Shell]) -> None:
    if value is not None and not ctx.resilient_parsing:
        typer.completion.show_callback(ctx, param, value.value)  # prints the script and exits 0


def _install_completion(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Shell]) -> None:
    if value is not None and not ctx.resilient_parsing:
        typer.completion.install_callback(ctx, param, value.value)  # says where it wrote and exits 0


@app.callback(invoke_without_command=True)
def _group(
    ctx: typer.Context,
    version: Annotated[
        Optional[bool],
        typer.Option("--version", help="Print rlbench's version and exit.", callback=_print_version, is_eager=True),
    ] = None,
    show_completion: Annotated[
        Optional[Shell],
        typer.Option(
            help="Print rlbench's completion script for this shell and exit (eval it, or save it where the shell "
            "reads completions).",
            callback=_show_completion,
            is_eager=True,
        ),
    ] = None,
    install_completion: Annotated[
        Optional[Shell],
        typer.Option(
            help="Install rlbench's completion for this shell (in its startup file) and exit.",
            callback=_install_completion,
            is_eager=True,
        ),
    ] = None,
) -> None:
    """Reproduce and debug LLM RL post-training runs: run, replay, diff, check."""
    if ctx.invoked_subcommand is None:  # bare `rlbench`: the help, and success
        stdout.print(ctx.get_help(), markup=False, highlight=False)
        raise typer.Exit(0)


# ---------------------------------------------------------------- mistyped options


def closest(name: str, names, cutoff: float = 0.6) -> str | None:
    """The name in `names` closest to a mistyped `name` (difflib's ratio, at least `cutoff`), or None."""
    found = difflib.get_close_matches(name, sorted(names), n=1, cutoff=cutoff)
    return found[0] if found else None


def refuse_misspelt(ctx: typer.Context, known, passed: str) -> None:
    """A command that takes options it does not declare (`rlbench run`: slime's arguments, `known`, and every
    `passed`-prefixed one) lets a typo through too: an extra `--name` that is none of these but very close to one
    of them or of the command's own options is refused, naming the closest (click suggests only for the declared).
    Very close: a ratio of 0.82, which a letter dropped, added or swapped reaches (--step, --sede: 0.92, 0.83) and
    a slime argument rlbench does not model, refused as such further on, does not (--eval-interval: 0.80)."""
    names = {o for p in ctx.command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")} | set(known)
    for arg in ctx.args:
        name = arg.partition("=")[0]
        best = closest(name, names, cutoff=0.82) if name.startswith("--") and not name.startswith(passed) else None
        if best is not None and name not in names:
            raise BadInput(f"no such option: {name} (did you mean {best}?)", field=ctx.command_path)


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


@contextmanager
def progress(total: int, start: int = 0, out: str | Path | None = None, quiet: bool = False):
    """A context handing out an `on_step(state)` callback that shows a long command's progress on
    stderr: a bar on a terminal; elsewhere a line every PROGRESS_EVERY steps and at the last step
    (`step 10/85 reward 0.412 loss -0.0021 12.3 s`); nothing where `quiet` (--json). By step count, not
    by time, so that what a run prints is the same on every machine; the wall time in a line is stderr's
    only (no run file holds it). Ctrl-C inside it is `Interrupted(out)`: the run directory the command
    writes, of which main() says what is kept."""
    shown = _quiet() if quiet else _bar(total, start) if stderr.is_terminal else _lines(total)
    try:
        with shown as on_step:
            yield on_step
    except KeyboardInterrupt:
        raise Interrupted(out) from None


class Interrupted(Exception):
    """Ctrl-C while a command wrote the run directory `out` (None: a directory nobody resumes)."""

    def __init__(self, out: str | Path | None):
        super().__init__("interrupted")
        self.out = out


def interrupted(out: str | Path | None) -> str:
    """What Ctrl-C leaves, in one line: where a run directory holds committed steps, how to go on from them."""
    if out is None:
        return INTERRUPTED
    from rlbench.rundir.directory import read_run

    try:
        steps = len(read_run(out).steps)
    except (RlbenchError, OSError):  # not claimed yet, or torn before its first commit
        steps = 0
    if steps:
        return (
            f"{INTERRUPTED}; {steps} committed step{'s' * (steps != 1)} kept in {out} "
            f"(rlbench run --resume {shlex.quote(str(out))} continues it)"
        )
    if Path(out).exists():
        return f"{INTERRUPTED} before the first step was committed; {out} holds no step to resume from"
    return f"{INTERRUPTED}; nothing was written"


@contextmanager
def _quiet():
    yield lambda state: None


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


HELP_ROOM = 40  # the fewest columns an option's help is written in; with less room it goes under the option


class _HelpTable(Table):
    """The table typer's rich help lays each panel out in (typer.rich_utils builds an options table from
    rows alone), with the cells before the type and the help kept whole: rich shrinks every column
    alike to fit 80 columns, which cut `--rollout-external-engine-addrs` to `--rollout-external-en…`.
    Where the cells before the help leave it fewer than HELP_ROOM columns (`rlbench run --help` in 80
    columns: a pipe, a CI log, a small terminal), each row is two parts instead: its names and type on a
    line, then its help below, indented, in the panel's whole width. Else the help takes the room left,
    folded only where a word is longer than that (never an ellipsis)."""

    def add_row(self, *renderables, **kwargs) -> None:
        super().add_row(*renderables, **kwargs)
        for column in self.columns[:-2]:  # the required marker and the names; the commands panel has none
            column.no_wrap = True
        self.columns[-1].overflow = "fold"
        for part in getattr(renderables[-1], "renderables", []):  # an option's help: rich Columns of texts
            if isinstance(part, Text):
                part.overflow = "fold"

    def __rich_console__(self, console, options):
        lead = self.columns[:-1]
        widths = [max((Measurement.get(console, options, cell).maximum for cell in c.cells), default=0) for c in lead]
        if options.max_width - sum(widths) - 2 * len(widths) >= HELP_ROOM:  # a space of padding each side
            yield from super().__rich_console__(console, options)
            return
        for *cells, help_text in zip(*(column.cells for column in self.columns)):
            shown = [_styled(cell, column.style) for cell, column in zip(cells, lead) if _plain(cell)]
            yield Text("  ").join(shown)
            yield Padding(help_text, (0, 0, 0, 4))


def _styled(cell, style) -> Text:
    text = cell.copy() if isinstance(cell, Text) else Text(str(cell))
    if style:
        text.stylize(style)
    return text


typer.rich_utils.Table = _HelpTable  # typer names no hook for its help's layout: its module's Table is the one
