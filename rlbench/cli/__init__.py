"""The `rlbench` command line. Thin: each command builds a config (`rlbench run`: rlbench/command.py's
run_config), calls one library function,
and renders its result (a rich table, or one JSON document with `--json`). Only this package
prints. Exit codes: 0 done / the check holds, 1 a check found a difference, 2 bad input, 3 an internal
error, 130 Ctrl-C.

    __init__.py   main(): the one error boundary (errors -> exit codes; Ctrl-C -> what is kept)
    app.py        the typer app, the consoles, the options every command shares, --version, shell
                  completion; tables, progress and --help as they read without a terminal; mistyped options
    options.py    CLI options declared from the config fields they set, so an option cannot drift from its field
    runs.py       run, replay, diff
    imports.py    import slime
    checks.py     check tito / weights (the check group)
    logprobs.py   check logprobs, and its --attribute split of the mismatch by cause
    golden.py     check golden, golden update
    engine_check.py  check engine: the determinism certificate of an SGLang server or router
    serve.py      serve: the embedded engine behind SGLang's native HTTP API
    report.py     report: one HTML page of a run, or of where two runs part
    export.py     export: a run's checkpoint as a Hugging Face model directory
    __main__.py   `python -m rlbench.cli`: the same as the `rlbench` console script
"""

from __future__ import annotations

import functools
import sys
import traceback

import typer
import typer.completion

from rlbench.cli.app import app, stderr, stdout  # noqa: F401 - the app and its consoles, re-exported
from rlbench.cli.app import INTERRUPTED, Interrupted, closest, interrupted
from rlbench.errors import RlbenchError


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


@functools.cache
def command():
    """The click command of the app, built once a process: typer builds it from every command's signature
    (~30 ms); a process that calls `main` again (a test, a notebook) reuses it. Parsing state is per call."""
    typer.completion.completion_init()  # typer's completion classes, which the scripts of --show-completion call
    built = typer.main.get_command(app)
    _polish(built)
    return built


def main() -> None:
    """Console entry point: the one error boundary. Exit 0 done / the check holds, 1 a check found a
    difference, 2 bad input or usage (one line), 3 an internal error (a bug in rlbench), 130 Ctrl-C."""
    debug = "--debug" in sys.argv
    try:
        code = command().main(args=sys.argv[1:], prog_name="rlbench", standalone_mode=False)
    except RlbenchError as exc:
        if debug:
            traceback.print_exc()
        _fail(str(exc), exc.exit_code, "check failed" if exc.exit_code == 1 else "error")
    except typer.Exit as exc:  # --help
        sys.exit(exc.exit_code)
    except Interrupted as exc:  # Ctrl-C while a run directory was written: what of it is kept
        _interrupted(interrupted(exc.out))
    except (typer.Abort, KeyboardInterrupt):
        _interrupted()
    except typer.TyperException as exc:  # typer's (vendored click's) usage errors: unknown option, bad value
        if debug:
            traceback.print_exc()
        message = " ".join((exc.format_message() if hasattr(exc, "format_message") else str(exc)).split())
        if getattr(exc, "possibilities", None):  # an unknown option: the closest name, not click's list of near ones
            message = f"{exc.message} (did you mean {closest(exc.option_name, exc.possibilities, cutoff=0)}?)"
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


def _interrupted(message: str = INTERRUPTED) -> None:
    stderr.print(message, markup=False, highlight=False, soft_wrap=True)
    sys.exit(130)


def _fail(message: str, code: int = 2, kind: str = "error") -> None:
    stderr.print(f"rlbench: {kind}: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


# Importing them registers their commands on `app`, in this order (the order of `rlbench --help`).
from rlbench.cli import runs  # noqa: E402,F401
from rlbench.cli import imports  # noqa: E402,F401
from rlbench.cli import checks  # noqa: E402,F401
from rlbench.cli import logprobs  # noqa: E402,F401
from rlbench.cli import golden  # noqa: E402,F401
from rlbench.cli import engine_check  # noqa: E402,F401
from rlbench.cli import serve  # noqa: E402,F401
from rlbench.cli import report  # noqa: E402,F401
from rlbench.cli import export  # noqa: E402,F401
