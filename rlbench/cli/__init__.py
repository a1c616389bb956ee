"""The `rlbench` command line. Thin: each command builds a config, calls one library function,
and renders its result (a rich table, or one JSON document with `--json`). Only this package
prints. Exit codes: 0 done / the check holds, 1 a check found a difference, 2 bad input.

    __init__.py   the app, the consoles and options every command shares, main() (errors -> exit codes)
    runs.py       run, replay, diff, import slime
    checks.py     check logprobs / tito / golden, golden update
"""

from __future__ import annotations

import sys
import traceback
from typing import Annotated

import typer
from rich.console import Console

from rlbench.errors import CheckFailed, RlbenchError

app = typer.Typer(
    name="rlbench",
    help="Reproduce and debug LLM RL post-training runs: run, replay, diff, check.",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
stderr = Console(stderr=True)
# Options every command has. `--debug` is read by main() from argv; commands declare it for --help.
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as one JSON document.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
stdout = Console()


@app.callback(invoke_without_command=True)
def _group(ctx: typer.Context) -> None:
    """Reproduce and debug LLM RL post-training runs: run, replay, diff, check."""
    if ctx.invoked_subcommand is None:  # bare `rlbench`: the help, and success
        stdout.print(ctx.get_help(), markup=False, highlight=False)
        raise typer.Exit(0)


def main() -> None:
    """Console entry point: typer's app, with errors mapped to one line and an exit code."""
    debug = "--debug" in sys.argv
    try:
        code = app(standalone_mode=False)  # without standalone mode, an Exit(n) comes back as n
        if isinstance(code, int) and code != 0:
            sys.exit(code)
    except CheckFailed as exc:
        if debug:
            traceback.print_exc()
        _fail(str(exc), code=1, kind="check failed")
    except RlbenchError as exc:
        if debug:
            traceback.print_exc()
        _fail(str(exc))
    except typer.Exit as exc:  # --help
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        stderr.print("rlbench: interrupted; committed steps are kept", markup=False, highlight=False)
        sys.exit(130)
    except typer.TyperException as exc:  # typer's (vendored click's) usage errors: unknown option, bad value
        if debug:
            traceback.print_exc()
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        _fail(" ".join(message.split()))


def _fail(message: str, code: int = 2, kind: str = "error") -> None:
    stderr.print(f"rlbench: {kind}: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


# Importing them registers their commands on `app`, in this order (the order of `rlbench --help`).
from rlbench.cli import runs  # noqa: E402,F401
from rlbench.cli import checks  # noqa: E402,F401
