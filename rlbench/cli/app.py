"""The typer app every command registers on, the two consoles, and the options every command
shares. Imports nothing of the commands: they import it (rlbench.cli imports both, in order)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

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
def _group(ctx: typer.Context,
           version: Annotated[Optional[bool], typer.Option("--version", help="Print rlbench's version and exit.",
                                                           callback=_print_version, is_eager=True)] = None) -> None:
    """Reproduce and debug LLM RL post-training runs: run, replay, diff, check."""
    if ctx.invoked_subcommand is None:  # bare `rlbench`: the help, and success
        stdout.print(ctx.get_help(), markup=False, highlight=False)
        raise typer.Exit(0)
