"""The `rlbench` command line. Thin: each command builds a config, calls one library function,
and renders its result (a rich table, or one JSON document with `--json`). Only this package
prints. Exit codes: 0 done / the check holds, 1 a check found a difference, 2 bad input, 3 an internal
error, 130 Ctrl-C.

    __init__.py   the app, the consoles and options every command shares, main() (errors -> exit codes)
    runs.py       run, replay, diff, import slime
    checks.py     check logprobs / tito / golden, golden update
    serve.py      serve: the embedded engine behind SGLang's native HTTP API
"""

from __future__ import annotations

import sys
import traceback
from typing import Annotated

import typer
from rich.console import Console

from rlbench.errors import RlbenchError

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


@app.callback(invoke_without_command=True)
def _group(ctx: typer.Context) -> None:
    """Reproduce and debug LLM RL post-training runs: run, replay, diff, check."""
    if ctx.invoked_subcommand is None:  # bare `rlbench`: the help, and success
        stdout.print(ctx.get_help(), markup=False, highlight=False)
        raise typer.Exit(0)


def _polish(command) -> None:
    """Flags take no value, so their help shows none (typer's rich help would print `<bool>`)."""
    for param in getattr(command, "params", []):
        if getattr(param, "is_flag", False):
            param.metavar = ""
    make_help = command.get_help_option

    def help_option(ctx):
        option = make_help(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = help_option
    for sub in getattr(command, "commands", {}).values():
        _polish(sub)


def main() -> None:
    """Console entry point: the one error boundary. Exit 0 done / the check holds, 1 a check found a
    difference, 2 bad input or usage (one line), 3 an internal error (a bug in rlbench), 130 Ctrl-C."""
    debug = "--debug" in sys.argv
    try:
        command = typer.main.get_command(app)
        _polish(command)
        code = command.main(args=sys.argv[1:], prog_name="rlbench", standalone_mode=False)
    except RlbenchError as exc:
        if debug:
            traceback.print_exc()
        _fail(str(exc), exc.exit_code, "check failed" if exc.exit_code == 1 else "error")
    except typer.Exit as exc:  # --help
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        _interrupted()
    except typer.TyperException as exc:  # typer's (vendored click's) usage errors: unknown option, bad value
        if debug:
            traceback.print_exc()
        message = " ".join((exc.format_message() if hasattr(exc, "format_message") else str(exc)).split())
        if not message:  # a group called without its command: the help is already printed
            sys.exit(2)
        _fail(message)
    except OSError as exc:  # the machine refused a read or write: a disk, a permission, a path
        if debug:
            traceback.print_exc()
        _fail(f"{exc.filename}: {exc.strerror}" if exc.filename else f"{exc.__class__.__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - anything else is rlbench's own bug, never a verdict
        if debug:
            traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc) else ""
        _fail(f"internal error: {exc.__class__.__name__}: {first}; rerun with --debug for the traceback", 3)
    if code == 130:  # typer turns Ctrl-C inside a command into exit code 130
        _interrupted()
    if isinstance(code, int) and code != 0:
        sys.exit(code)


def _interrupted() -> None:
    stderr.print(INTERRUPTED, markup=False, highlight=False, soft_wrap=True)
    sys.exit(130)


def _fail(message: str, code: int = 2, kind: str = "error") -> None:
    stderr.print(f"rlbench: {kind}: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


# Importing them registers their commands on `app`, in this order (the order of `rlbench --help`).
from rlbench.cli import runs  # noqa: E402,F401
from rlbench.cli import checks  # noqa: E402,F401
from rlbench.cli import serve  # noqa: E402,F401
