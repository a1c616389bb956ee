"""`check golden RUN GOLDEN --tier history`: every value a history file holds (metric, step) held to its band, the
mean of the trusted runs' values there plus or minus max(k * sd, rel * |mean|, atol); a value the run lacks or a
non-finite one fails; too few trusted values is undetermined. The file, its rule and why: golden_history.py.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path

from rlbench.checks.golden import config_identity, num_out, platform_of, run_series
from rlbench.checks.golden_history import LEFT_OUT, Band, History, load_history, not_the_config, open_run_dir
from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir


@dataclass
class ValueVerdict:
    """One (metric, step) the file holds, as judged: pass, fail (outside the band), missing, nonfinite, or
    undetermined (fewer trusted values than min_runs); the band the trusted values there give."""

    metric: str
    step: int
    status: str
    got: float | None
    band: Band

    def to_json(self) -> dict:
        band = self.band if self.status != "undetermined" else None  # too few values: no band was drawn
        return {
            "metric": self.metric,
            "step": self.step,
            "status": self.status,
            "got": None if self.got is None else num_out(self.got),
            "band": None if band is None else [band.lo, band.hi],
            "mean": None if band is None else band.mean,
            "sd": None if band is None else band.sd,
            "n": self.band.n,
            "message": self.message,
        }

    @property
    def message(self) -> str:
        b = self.band
        if self.status == "missing":
            return "not logged by the run"
        if self.status == "undetermined":
            return f"{b.n} trusted value(s), fewer than min_runs: not judged"
        got = repr(self.got) if self.status != "nonfinite" else num_out(self.got)
        where = "inside" if self.status == "pass" else "outside"
        note = " (a non-finite value fails)" if self.status == "nonfinite" else ""
        return (
            f"{got} {where} [{b.lo!r}, {b.hi!r}]{note}: mean {b.mean!r} +- {b.half_width:.4g} "
            f"(sd {b.sd:.4g} over {b.n} runs)"
        )


@dataclass
class HistoryReport:
    run: str
    golden: str
    rule: dict
    runs: int  # trusted runs in the file
    values: list[ValueVerdict]
    ignored: list[str]
    not_in_golden: list[str]
    notes: list[str]
    tier: str = "history"

    @property
    def compared(self) -> int:
        """How many values were held to a band (a missing or non-finite value counts: it was judged, and failed)."""
        return sum(v.status != "undetermined" for v in self.values)

    @property
    def failures(self) -> list[ValueVerdict]:
        return [v for v in self.values if v.status in ("fail", "missing", "nonfinite")]

    @property
    def undetermined(self) -> list[ValueVerdict]:
        return [v for v in self.values if v.status == "undetermined"]

    @property
    def verdict(self) -> str:
        """failed: a value outside its band, missing or non-finite; undetermined: nothing failed but some value
        (or every one) could not be judged; passed: every value the file holds was judged and held."""
        if self.failures:
            return "failed"
        return "undetermined" if self.undetermined or not self.values else "passed"

    @property
    def ok(self) -> bool:
        return self.verdict == "passed"

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "verdict": self.verdict,
            "tier": self.tier,
            "run": self.run,
            "golden": self.golden,
            "rule": self.rule,
            "runs": self.runs,
            "compared": self.compared,
            "metrics": len({v.metric for v in self.values}),
            "failures": [v.to_json() for v in self.failures],
            "undetermined": [v.to_json() for v in self.undetermined],
            "ignored": self.ignored,
            "not_in_golden": self.not_in_golden,
            "notes": self.notes,
        }


def compare_history(run: RunDir, history: History, ignore: list[str] = ()) -> HistoryReport:
    """Hold every value the file holds (metric, step), less the --ignore'd metrics, to its band. Refuses (BadInput)
    a run of another configuration: a history is one configuration's."""
    identity = config_identity(run.manifest)
    if history.config != identity:
        raise BadInput(not_the_config(history.config, identity), path=history.path, field="config")
    got = run_series(run)
    held: dict[str, dict[int, list[float]]] = {}
    for trusted in history.runs:
        for metric, by_step in trusted.series.items():
            for step, value in by_step.items():
                held.setdefault(metric, {}).setdefault(step, []).append(value)
    ignored = sorted(m for m in held if any(fnmatch.fnmatchcase(m, glob) for glob in ignore))
    values = []
    for metric in sorted(set(held) - set(ignored)):
        for step, trusted_values in sorted(held[metric].items()):
            band = history.rule.band(trusted_values)
            value = got.get(metric, {}).get(step)
            if value is None:  # a value the run lacks, or a non-finite one, fails whatever the history holds
                status = "missing"
            elif not math.isfinite(value):
                status = "nonfinite"
            elif len(trusted_values) < history.rule.min_runs:
                status = "undetermined"
            else:
                status = "pass" if band.holds(value) else "fail"
            values.append(ValueVerdict(metric, step, status, value, band))
    platforms = sorted({r.identity.get("platform") for r in history.runs} - {None})
    notes = [f"{run.root}: {n}" for n in run.notes]
    if platform_of(run.manifest) not in platforms:
        notes.append(f"the run's platform {platform_of(run.manifest)}; the trusted runs': {', '.join(platforms)}")
    not_in_golden = sorted(
        m for m in got if m not in held and not any(fnmatch.fnmatchcase(m, g) for g in (*ignore, *LEFT_OUT))
    )
    beyond = sum(s not in held[m] for m in set(held) - set(ignored) for s in got.get(m, {}))
    if beyond:
        notes.append(f"{beyond} of the run's values are at steps no trusted run holds: not compared")
    return HistoryReport(
        str(run.root),
        str(history.path),
        history.rule.to_json(),
        len(history.runs),
        values,
        ignored,
        not_in_golden,
        notes,
    )


def check_history(run: RunDir | str | Path, golden: str | Path, ignore: list[str] = ()) -> HistoryReport:
    """`check golden RUN GOLDEN --tier history` as a library call: read both (BadInput where either is bad) and
    hold the run to the file's bands. The verdict is the report's (`verdict`, `ok`); nothing is printed."""
    return compare_history(open_run_dir(run), load_history(golden), ignore)
