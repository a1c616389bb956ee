"""`rlbench report`: one self-contained HTML page that shows a run, or where two runs part."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlbench.cli.app import Debug, app, stdout
from rlbench.cli.golden import parse_renames
from rlbench.errors import BadInput


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="The run directory to show.")],
    run_b: Annotated[Optional[Path], typer.Argument(help="A second run: where the two part, overlaid curves.")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="The HTML file to write; must not exist yet.")] = Path(
        "report.html"
    ),
    golden: Annotated[
        Optional[Path],
        typer.Option(
            "--golden",
            help="A golden file (rlbench's or Megatron-LM's): its values and band on the curves, failing steps marked.",
        ),
    ] = None,
    rename: Annotated[
        Optional[list[str]], typer.Option("--rename", help="With --golden: GOLDEN_NAME=RUN_NAME, as for check golden.")
    ] = None,
    tier: Annotated[
        str, typer.Option("--tier", help="With --golden: exact or approx, as for check golden.")
    ] = "approx",
    ignore: Annotated[
        Optional[list[str]],
        typer.Option(
            "--ignore", help="With --golden: metrics not compared (glob patterns, e.g. 'perf/*'), as for check golden."
        ),
    ] = None,
    debug: Debug = False,
) -> None:
    """Write one HTML page (no network: styles, script and charts inline) with the run's metric curves (RUN_B \
overlaid, or a golden file's band), per-stage timings, the first divergence of two runs (the step and stage `rlbench \
diff` names, and the first differing sample's two token sequences), the train-inference log-prob mismatch (histogram, \
worst tokens), TITO findings, the manifest, and every verdict with what it compared.

    Built from the run directory's files a step at a time. Nothing is written unless the whole page is: bad input (not \
a run directory, a corrupt recording) exits 2 with no file left.
    """
    from rlbench.report.collect import collect
    from rlbench.report.page import render

    if out.exists() or out.is_symlink():
        raise BadInput("exists: give a new file (a report never overwrites one)", path=out)
    if not out.parent.is_dir():
        raise BadInput("no such directory to write the report into", path=out.parent)
    from rlbench.replay.slime import as_runs

    with as_runs(run_dir, run_b) as (a, b):  # a slime --dump-details directory is imported first
        page = render(collect(a, b, golden, parse_renames(rename), tier, ignore or []))
    handle, temporary = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=out.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(page)
        os.link(temporary, out)  # refuses, rather than replaces, a file that appeared meanwhile
    finally:
        os.unlink(temporary)
    stdout.print(f"wrote {out} ({len(page.encode()) / 1e6:.2f} MB)", markup=False, highlight=False)
