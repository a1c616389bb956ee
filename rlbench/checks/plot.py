"""`check golden --plot`: each compared metric against its golden band, failing steps marked.

matplotlib's object API (Figure + the Agg canvas), not pyplot: no global figure state, no
display backend to pick, safe to call from a test process.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from rlbench.checks.golden_compare import GoldenReport, MetricResult
from rlbench.errors import BadInput

COLUMNS = 3


def require_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise BadInput("--plot needs matplotlib: pip install 'rlbench[plot]'", field="--plot") from None
    return Figure, FigureCanvasAgg


def figure(report: GoldenReport):
    """One panel per compared metric: the golden values, the tolerance band, the run's curve and
    the failing steps (red crosses). In the exact tier the band is the metric's approx tolerance,
    drawn for scale; the crosses are the steps that differ at all."""
    Figure, _ = require_matplotlib()
    metrics = report.metrics
    if not metrics:
        raise BadInput("no metric was compared; nothing to plot", field="--plot")
    cols = min(COLUMNS, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig = Figure(figsize=(5.4 * cols, 3.5 * rows + 0.7), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        _panel(ax, metric, report.tier)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    failed = len(report.failed)
    fig.suptitle(
        f"{report.run}  vs  {report.golden}\ntier {report.tier}: "
        f"{'PASS' if not failed else f'{failed} of {len(metrics)} metrics FAIL'}",
        color="black" if not failed else "tab:red",
        fontsize=12,
    )
    return fig


def _panel(ax, m: MetricResult, tier: str) -> None:
    steps = m.steps
    expected = [m.expected[s] for s in steps]
    run_steps = [s for s in steps if s in m.got]
    band = m.band
    if band.get("kind") == "median":
        lo, hi = band["window"]
        window = [s for s in steps if lo <= s <= hi]
        if m.median_expected is not None:
            limit = m.median_expected * band["max_ratio"]
            ax.fill_between(
                window,
                [0.0] * len(window),
                [limit] * len(window),
                color="tab:green",
                alpha=0.15,
                label=f"allowed median (<= x{band['max_ratio']:g})",
            )
            ax.hlines(m.median_expected, lo, hi, colors="black", linestyles="--", linewidth=1, label="golden median")
        if m.median_got is not None:
            ax.hlines(m.median_got, lo, hi, colors="tab:blue", linestyles="--", linewidth=1, label="run median")
    elif band.get("kind") == "approx":
        allow = [band["atol"] + band["rtol"] * abs(e) if math.isfinite(e) else math.nan for e in expected]
        label = "tolerance band" if tier == "approx" else "approx band (for scale)"
        ax.fill_between(
            steps,
            [e - a for e, a in zip(expected, allow)],
            [e + a for e, a in zip(expected, allow)],
            color="tab:green",
            alpha=0.2,
            linewidth=0,
            label=f"{label}: atol {band['atol']:g}, rtol {band['rtol']:g}",
        )
    ax.plot(
        steps,
        expected,
        color="black",
        marker="o",
        markersize=3.5,
        linestyle="--",
        linewidth=0.9,
        label="golden",
        zorder=3,
    )
    if run_steps:
        ax.plot(
            run_steps, [m.got[s] for s in run_steps], color="tab:blue", linewidth=1.6, alpha=0.8, label="run", zorder=2
        )
    if m.failures:
        ax.scatter(
            [f.step for f in m.failures],
            [f.got for f in m.failures],
            marker="x",
            color="tab:red",
            s=55,
            linewidths=2,
            zorder=5,
            label=f"failing steps ({len(m.failures)})",
        )
    status = m.status if m.status == "pass" else m.status.upper()
    ax.set_title(
        f"{m.name}  [{m.kind}: {status}]" + (f"\n{m.message}" if m.message else ""),
        fontsize=9,
        color="black" if m.status == "pass" else "tab:red",
    )
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def save(report: GoldenReport, path: str | Path) -> Path:
    """Write the figure as PNG under a temporary name, then rename: never a half-written file."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise BadInput("expected a .png file name", path=path, field="--plot")
    if not path.parent.is_dir():
        raise BadInput("its directory does not exist", path=path, field="--plot")
    _, FigureCanvasAgg = require_matplotlib()
    fig = figure(report)
    FigureCanvasAgg(fig)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
    return path
