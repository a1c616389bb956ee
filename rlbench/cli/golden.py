"""`rlbench check golden` (a run's metrics against a golden log) and `rlbench golden update` (writing one)."""

from __future__ import annotations

import json
import shlex
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from rlbench.cli.app import AsJson, Debug, app, render_table, stderr, stdout
from rlbench.cli.checks import check_app
from rlbench.errors import BadInput


class Tier(str, Enum):
    exact = "exact"
    approx = "approx"
    history = "history"


Tolerances = Annotated[
    Optional[list[str]],
    typer.Option(
        "--tolerance",
        help="Per-metric tolerance override, "
        "METRIC-GLOB:key=value[,key=value]; keys kind "
        "(exact|approx|median), rtol, atol, "
        "failing_steps, mean_residual, max_ratio, "
        "min_ratio, window=A:B. Repeatable.",
    ),
]


@check_app.command("golden")
def check_golden(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    golden: Annotated[
        Path,
        typer.Argument(
            help="A golden file (rlbench.golden/1, written by `rlbench golden update`) "
            "or a Megatron-LM golden values file (approx tier, its own tolerances; "
            "its iteration k is the run's step k - 1)."
        ),
    ],
    tier: Annotated[
        Tier,
        typer.Option(
            help="exact: every value bit for bit (refused, exit 2, across platforms or "
            "versions). approx: each metric within its tolerance. history: each value "
            "within the band of a history file's trusted runs (rlbench.golden-history/1)."
        ),
    ] = Tier.exact,
    ignore: Annotated[
        Optional[list[str]],
        typer.Option("--ignore", help="Leave out metrics matching this glob (e.g. 'perf/*'). Repeatable."),
    ] = None,
    tolerance: Tolerances = None,
    rename: Annotated[
        Optional[list[str]],
        typer.Option(
            "--rename", help="GOLDEN_NAME=RUN_NAME, e.g. 'lm loss=train/loss' for a Megatron-LM file. Repeatable."
        ),
    ] = None,
    plot: Annotated[
        Optional[Path],
        typer.Option(
            "--plot",
            help="Write a PNG: each compared metric, its golden values and tolerance band, failing steps marked.",
        ),
    ] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Compare a run's metrics with a golden log. Exit 0: within the golden; exit 1: a regression (the failing metrics \
and steps are listed: expected, got, tolerance); exit 2: bad input, or a comparison that means nothing (another \
configuration; in the exact tier another platform, versions or determinism settings), with the reason.

    perf/* metrics compare window medians, never exactly: the run's median may be at most max_ratio times the golden's.

    A Megatron-LM golden values file (tests/functional_tests/test_cases/.../golden_values_*.json) compares in the \
approx tier with Megatron-LM's own tolerances (lm loss and memory rtol 0.05, num-zeros rtol 0.2, iteration-time the \
median of a steady window within 5%), at the steps it holds a value for: its iteration k against the run's step k - 1.

    --tier history holds every value of a history file (`golden update --tier history`) to the band around the mean \
of its trusted runs' values, max(k x sd, rel x |mean|, atol) wide (the file states k, rel, atol): outside, missing or \
NaN is exit 1; fewer trusted runs than the file's min_runs is undetermined, exit 2, never a pass.
    """
    from rlbench.checks import golden as g
    from rlbench.checks import golden_history
    from rlbench.checks.golden_compare import compare
    from rlbench.checks.golden_history_compare import check_history
    from rlbench.replay.integrity import METRICS_ONLY, open_run

    if tier is Tier.history:
        for name, given in (("--tolerance", tolerance), ("--rename", rename), ("--plot", plot)):
            if given:
                raise BadInput("applies to the exact and approx tiers, not to --tier history", field=name)
        report = check_history(open_run(run_dir, **METRICS_ONLY).run, golden, ignore or [])
        _render_history(report, as_json)
        return
    if golden_history.is_history_file(golden):
        raise BadInput(
            f"is a history file ({golden_history.SCHEMA}); check it with --tier history", path=golden, field="schema"
        )
    renames = parse_renames(rename)
    overrides = [g.parse_override(spec) for spec in tolerance or []]
    if plot is not None:
        from rlbench.checks.plot import require_matplotlib

        require_matplotlib()  # before the comparison's work, not after it
    run = open_run(run_dir, **METRICS_ONLY).run
    report = compare(run, g.load_golden(golden, renames), tier.value, ignore or [], overrides)
    if plot is not None:
        from rlbench.checks.plot import save

        save(report, plot)
    if as_json:
        doc = report.to_json()
        doc["plot"] = str(plot) if plot is not None else None
        stdout.print_json(json.dumps(doc))
    else:
        _render_golden(report, plot)
    if not report.ok:
        raise typer.Exit(1)


def _render_history(report, as_json: bool) -> None:
    """The history tier's verdict: passed (exit 0), failed (exit 1: each failing value with its band, the mean
    and spread it came from), undetermined (exit 2, one line: too few trusted runs, never a pass)."""
    verdict = report.verdict
    if as_json:
        stdout.print_json(json.dumps(report.to_json()))
    else:
        for note in report.notes:
            stderr.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
        metrics = len({v.metric for v in report.values})
        counted = f"{report.compared} values of {metrics} metrics held to the band of {report.runs} trusted runs"
        if verdict == "passed":
            stdout.print(
                f"golden check passed (history tier): {counted}; {report.run} within {report.golden}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        if verdict == "failed":
            table = Table(title=f"golden check, history tier: {len(report.failures)} values failed ({counted})")
            for col in ("metric", "step", "got", "band", "mean", "sd", "runs", "what failed"):
                table.add_column(col, justify="left" if col in ("metric", "what failed") else "right", overflow="fold")
            for v in report.failures[:40]:
                b = v.band
                why = {"fail": "outside the band", "missing": "not logged by the run", "nonfinite": "not finite"}
                table.add_row(
                    v.metric,
                    str(v.step),
                    _fmt(v.got),
                    f"[{b.lo!r}, {b.hi!r}]",
                    repr(b.mean),
                    f"{b.sd:.4g}",
                    str(b.n),
                    why[v.status],
                    style="bold red",
                )
            render_table(table)
            if len(report.failures) > 40:
                stdout.print(f"... and {len(report.failures) - 40} more failing values (--json lists all)")
            if report.undetermined:
                stdout.print(
                    f"undetermined (fewer trusted runs than min_runs {report.rule['min_runs']}, not judged): "
                    f"{len(report.undetermined)} values",
                    markup=False,
                    highlight=False,
                )
        for label, names in (
            ("ignored", report.ignored),
            ("not in the history file (not compared)", report.not_in_golden),
        ):
            if names and not as_json:
                stdout.print(f"{label}: {', '.join(names)}", markup=False, highlight=False, soft_wrap=True)
    if verdict == "failed":
        raise typer.Exit(1)
    if verdict == "undetermined":
        few = report.undetermined
        what = (
            f"{len(few)} of {len(report.values)} values have fewer trusted runs than min_runs "
            f"{report.rule['min_runs']} (first: {few[0].metric} at step {few[0].step}, {few[0].band.n})"
            if few
            else "no value left to compare"
        )
        raise BadInput(
            f"undetermined: {what}; append trusted runs with `rlbench golden update --tier history`", path=report.golden
        )


def _fmt(value) -> str:
    return "-" if value is None else repr(value)  # shortest round-trip form: a 1-ulp change shows


def _render_golden(report, plot: Path | None) -> None:
    for note in report.notes:
        stderr.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    steps = sorted({s for m in report.metrics for s in m.steps})
    span = f"steps {steps[0]}..{steps[-1]}" if steps else "no steps"
    offset = report.golden_step_offset
    if steps and offset:
        span += f", the golden's {steps[0] + offset}..{steps[-1] + offset}"
    compared = f"{report.compared} values compared, {span}"
    if report.ok:
        stdout.print(
            f"golden check passed ({report.tier} tier): {len(report.metrics)} metrics ({compared}) of "
            f"{report.run} match {report.golden}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    else:
        summary = Table(
            title=f"golden check, {report.tier} tier: {len(report.failed)} of {len(report.metrics)} "
            f"metrics regressed ({compared})"
        )
        for col in ("metric", "compared as", "what failed"):
            summary.add_column(col, overflow="fold")
        for m in report.failed:
            summary.add_row(m.name, m.kind, m.message, style="bold red")
        render_table(summary)
        rows = [(m, f) for m in report.failed for f in m.failures]
        if rows:
            table = Table(title="failing steps")
            step = "step (golden's)" if offset else "step"
            for col in ("metric", step, "expected", "got", "got - expected", "tolerance"):
                table.add_column(col, justify="left" if col == "metric" else "right", overflow="fold")
            for m, f in rows[:40]:
                table.add_row(
                    m.name,
                    f"{f.step} ({f.step + offset})" if offset else str(f.step),
                    _fmt(f.expected),
                    _fmt(f.got),
                    f"{f.delta:+.3g}",
                    "exact" if m.kind == "exact" else f"+-{f.allowed:.3g}",
                )
            render_table(table)
            if len(rows) > 40:
                stdout.print(f"... and {len(rows) - 40} more failing steps (--json lists all)")
        passed = [m.name for m in report.metrics if m.status == "pass"]
        if passed:
            stdout.print(f"passed: {', '.join(passed)}", markup=False, highlight=False, soft_wrap=True)
    if report.ignored:
        stdout.print(f"ignored: {', '.join(report.ignored)}", markup=False, highlight=False, soft_wrap=True)
    if report.not_in_golden:
        stdout.print(
            f"not in the golden file (not compared): {', '.join(report.not_in_golden)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if plot is not None:
        stdout.print(f"plot: {plot}", markup=False, highlight=False, soft_wrap=True)


golden_app = typer.Typer(help="Write golden logs, deliberately.", no_args_is_help=True)
app.add_typer(golden_app, name="golden")


@golden_app.command("update")
def golden_update(
    run_dir: Annotated[Path, typer.Argument(help="The run directory whose metrics become the golden values.")],
    golden: Annotated[Path, typer.Argument(help="The golden file to write or refresh (JSON).")],
    reason: Annotated[str, typer.Option("--reason", help="Why the golden values change (kept in the file's history).")],
    tolerance: Tolerances = None,
    step_interval: Annotated[int, typer.Option(help="Keep every Nth step (Megatron-LM keeps every 5th).", min=1)] = 1,
    tier: Annotated[
        Tier,
        typer.Option(
            help="exact or approx: write the golden file both tiers check. history: append the run to a history "
            "file as a trusted run (created where absent), the oldest dropped beyond --keep."
        ),
    ] = Tier.exact,
    keep: Annotated[
        Optional[int],
        typer.Option(help="--tier history: how many trusted runs the file keeps (a new file: 20).", min=1),
    ] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Write or refresh a golden file from a run: every metric at every committed step, tolerances from the \
metric-family defaults (losses, rewards, grad norms, lengths, perf/*), with earlier --tolerance overrides carried and \
new ones applied. The reason is appended to the file's history. The file is replaced atomically; an existing file that \
is not a valid golden file is refused and left as it is."""
    from rlbench.checks import golden as g
    from rlbench.checks import golden_build, golden_history
    from rlbench.replay.integrity import METRICS_ONLY, open_run

    if tier is Tier.history:
        for name, given in (("--tolerance", tolerance), ("--step-interval", step_interval != 1)):
            if given:
                raise BadInput("applies to the exact and approx golden file, not to --tier history", field=name)
        _append_history(open_run(run_dir, **METRICS_ONLY).run, golden, reason, keep, as_json)
        return
    if keep is not None:
        raise BadInput("applies to --tier history", field="--keep")
    if golden.exists() and golden_history.is_history_file(golden):
        raise BadInput(
            f"is a history file ({golden_history.SCHEMA}); append to it with --tier history",
            path=golden,
            field="schema",
        )
    overrides = [g.parse_override(spec) for spec in tolerance or []]
    run = open_run(run_dir, **METRICS_ONLY).run
    previous = g.load_golden(golden) if golden.exists() else None
    if previous is not None and previous.format != "rlbench":
        raise BadInput(
            "is a Megatron-LM golden values file; write the rlbench golden file to another path", path=golden
        )
    command = shlex.join(["rlbench", *sys.argv[1:]])
    doc, changes = golden_build.build_golden(run, reason, command, previous, overrides, step_interval)
    golden_build.write_golden(golden, doc)
    for note in run.notes:
        stderr.print(f"note: {run_dir}: {note}", markup=False, highlight=False, soft_wrap=True)
    metrics = doc["metrics"]
    first = next(iter(metrics.values()))
    result = {
        "golden": str(golden),
        "run": str(run_dir),
        "metrics": len(metrics),
        "steps": [first["start_step"], first["end_step"]],
        "step_interval": step_interval,
        "history": len(doc["header"]["history"]),
        **changes,
    }
    if as_json:
        stdout.print_json(json.dumps(result))
        return
    verb = "refreshed" if previous is not None else "wrote"
    stdout.print(
        f"{verb} {golden}: {len(metrics)} metrics over steps {first['start_step']}..{first['end_step']} "
        f"(every {step_interval}), platform {doc['header']['platform']}; history: "
        f"{result['history']} entr{'y' if result['history'] == 1 else 'ies'}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    for key in ("changed", "added", "removed", "tolerance_changed"):
        if changes[key]:
            stdout.print(
                f"{key.replace('_', ' ')}: {', '.join(changes[key])}", markup=False, highlight=False, soft_wrap=True
            )
    if changes["config_changed"]:
        stdout.print(
            f"note: the configuration differs from the one {golden} held; it now holds this run's",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if changes["platform_changed"]:
        numerics = ", ".join(f"{k} {v}" for k, v in doc["header"]["numerics"].items())
        stdout.print(
            f"note: the platform changed to {doc['header']['platform']}{f' ({numerics})' if numerics else ''}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _append_history(run, golden: Path, reason: str, keep: int | None, as_json: bool) -> None:
    from rlbench.checks import golden_history

    command = shlex.join(["rlbench", *sys.argv[1:]])
    done = golden_history.append_history(run, golden, reason, keep, command)
    for note in run.notes:
        stderr.print(f"note: {run.root}: {note}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        stdout.print_json(json.dumps(done.to_json()))
        return
    rule = done.rule
    lines = [
        f"{'wrote' if done.created else 'appended to'} {golden}: {done.runs} trusted run{'s' * (done.runs != 1)} "
        f"(keeps {done.keep}); this one {done.metrics} metrics, {done.values} values; band mean +- "
        f"max({rule['k']:g} x sd, {rule['rel']:g} x |mean|, {rule['atol']:g}), judged from {rule['min_runs']} runs"
    ]
    if done.dropped:
        lines.append(f"dropped the oldest: {'; '.join(done.dropped)}")
    if done.added_metrics:
        lines.append(f"metrics no earlier run holds: {', '.join(done.added_metrics)}")
    for line in lines:
        stdout.print(line, markup=False, highlight=False, soft_wrap=True)


def parse_renames(items: list[str] | None) -> dict[str, str]:
    """`--rename GOLDEN_NAME=RUN_NAME`, each given once or more, as {golden name: run name}."""
    renames = {}
    for item in items or []:
        old, eq, new = item.partition("=")
        if not eq or not old or not new:
            raise BadInput(f"expected GOLDEN_NAME=RUN_NAME, got {item!r}", field="--rename")
        renames[old] = new
    return renames
