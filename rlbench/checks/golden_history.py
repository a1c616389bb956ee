"""The golden files' history tier: a run's metrics held, value by value, to a band around the mean of the last
N trusted runs' values, for runs whose values wander from run to run and version to version (GPU runs), where
the exact and approx tiers (golden.py) fit a deterministic CPU run. This module: the file, its rule, reading it and
appending a trusted run (`golden update --tier history`); the check (`check golden --tier history`):
golden_history_compare.py. The library calls: `append_history(run, golden, reason, keep)` here and
`golden_history_compare.check_history(run, golden, ignore)`, which print nothing.

A history file (schema `rlbench.golden-history/1`, JSON; `rlbench.golden/1` files are untouched by it) holds:

- `history`: the band rule, its constants and where it comes from (`BandRule.to_json`);
- `config`, `config_hash`: the configuration identity (golden.py `config_identity`) every run in it shares;
- `runs`: at most `keep` trusted runs, oldest first, each `{reason, identity (config_hash, platform, numerics,
  device_name, versions, determinism, the run's command and creation time), added (UTC), series {metric:
  {step: value}}}`;
- `updates`: one entry per `golden update` (date, reason, command, the runs it dropped).

The rule. For every metric and step the file holds, the values the trusted runs hold there (n of them) give
mean m and sample standard deviation s (n - 1; 0 for one value); the run's value there must lie in
[m - w, m + w], w = max(k * s, rel * |m|, atol) (inclusive). A value the run lacks, or one that is NaN or
infinite, fails, by name, never skipped. With n < min_runs the value is not judged: "undetermined", which is
never a pass (design.md: a verdict over nothing). Defaults keep 20, min_runs 2, k 3, rel 0.05, atol 1e-6.

Taken from Miles' metric-history gate (radixark/miles docs/ci/03-metric-history-gate.md, tests/ci/metric_history/
gate.py and constraints.py): the reference is the mean of up to 20 trusted past values, each step judged only
against its own step's history; the band is two-sided, its width from the reference (never from the value
judged) with a relative part and an absolute floor, inclusive; a missing or non-finite value is an error, never
a skip; a trusted run's values become the baseline, so they are finite (Miles' store refuses NaN). Where rlbench
differs, and why: (1) the width has a spread term k * s (the issue asks for a band from the runs' spread; Miles
lists `band = k·std` as its planned self-calibrating constraint): Miles' bands are per-metric literals tuned by
hand, rlbench's follow the trusted runs; with k = 0 the rule is Miles' (symmetric); (2) one symmetric band for
every metric, where Miles writes up and down sides per metric: the spread term scales each metric by its own
wander, and rel and atol are the approx tier's defaults for an unnamed metric (golden_tolerance.py "other":
rtol 0.05, atol 1e-6, Megatron-LM's approximate tier); Miles' per-metric floors (0.02..0.1 absolute, 20..80 %
relative) are loose starting points for its large GPU tests and would swallow a tiny model's whole curve;
(3) fewer than min_runs = 2 trusted values is undetermined, where Miles activates at 1 and passes a cold start
vacuously: a spread needs two values, and rlbench never passes what it did not judge; (4) the trusted runs are
the ones `golden update --tier history` appended on purpose, in the file beside the test, not a database fed
by CI runs that passed; (5) `perf/*` (wall time) is left out, as Miles' capture list leaves it out.
"""

from __future__ import annotations

import datetime
import fnmatch
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlbench.checks.golden import config_hash, config_identity, numerics_of, platform_of, run_series, run_versions
from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir
from rlbench.rundir.jsonio import read_json

SCHEMA = "rlbench.golden-history/1"
LEFT_OUT = ("perf/*",)  # wall time: a machine's load, not the run's numbers
SOURCE = "radixark/miles docs/ci/03-metric-history-gate.md (tests/ci/metric_history/gate.py, constraints.py)"
RULE = (
    "each value at [mean - w, mean + w], w = max(k * sd, rel * |mean|, atol), mean and sd (sample, n - 1) over the "
    "trusted runs' values at that metric and step; a missing or non-finite value fails; fewer than min_runs "
    "trusted values: undetermined"
)


@dataclass(frozen=True)
class Band:
    n: int
    mean: float
    sd: float
    half_width: float

    @property
    def lo(self) -> float:
        return self.mean - self.half_width

    @property
    def hi(self) -> float:
        return self.mean + self.half_width

    def holds(self, value: float) -> bool:
        return self.lo <= value <= self.hi  # False for NaN


@dataclass(frozen=True)
class BandRule:
    """The history tier's rule (module docstring) and its constants, as the file states them."""

    keep: int = 20
    min_runs: int = 2
    k: float = 3.0
    rel: float = 0.05
    atol: float = 1e-6

    def band(self, values: list[float]) -> Band:
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return Band(len(values), mean, sd, max(self.k * sd, self.rel * abs(mean), self.atol))

    def to_json(self) -> dict:
        return {"rule": RULE, **asdict(self), "left_out": list(LEFT_OUT), "source": SOURCE}

    @classmethod
    def from_json(cls, doc, path: Path) -> BandRule:
        if not isinstance(doc, dict):
            raise BadInput("expected an object stating the band rule and its constants", path=path, field="history")
        values = {}
        for key in ("keep", "min_runs"):
            v = doc.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BadInput(f"expected an integer >= 1, got {v!r}", path=path, field=f"history.{key}")
            values[key] = v
        for key in ("k", "rel", "atol"):
            v = doc.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise BadInput(f"expected a finite number >= 0, got {v!r}", path=path, field=f"history.{key}")
            values[key] = float(v)
        if values["min_runs"] > values["keep"]:
            raise BadInput(
                f"min_runs {values['min_runs']} is more than the {values['keep']} runs kept: no value could be judged",
                path=path,
                field="history.min_runs",
            )
        return cls(**values)


@dataclass
class TrustedRun:
    reason: str
    identity: dict
    added: str
    series: dict[str, dict[int, float]]

    def to_json(self) -> dict:
        series = {m: {str(s): v for s, v in sorted(by_step.items())} for m, by_step in sorted(self.series.items())}
        return {"reason": self.reason, "identity": self.identity, "added": self.added, "series": series}


@dataclass
class History:
    path: Path
    rule: BandRule
    config: dict
    config_hash: str
    runs: list[TrustedRun]
    updates: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "history": self.rule.to_json(),
            "config": self.config,
            "config_hash": self.config_hash,
            "runs": [r.to_json() for r in self.runs],
            "updates": self.updates,
        }


def is_history_file(path: str | Path) -> bool:
    """Whether `path` is a history file (for the exact and approx tiers' hint); any doubt: False, and their
    own reading says what is wrong."""
    try:
        doc = read_json(Path(path))  # bounded: a file nested too deeply is refused, not a RecursionError
    except (OSError, ValueError, BadInput):
        return False
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA


def load_history(path: str | Path) -> History:
    """Read and validate a history file; anything amiss is BadInput naming the field."""
    path = Path(path)
    if not path.is_file():
        raise BadInput("no such history file" if not path.exists() else "not a file", path=path)
    doc = read_json(path)
    schema = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
    if schema != SCHEMA:
        hint = (
            ": a golden file of the exact and approx tiers; keep the history in a file of its own"
            if schema == "rlbench.golden/1"
            else ""
        )
        raise BadInput(f"expected {SCHEMA!r}, got {schema!r}{hint}", path=path, field="schema")
    rule = BandRule.from_json(doc.get("history"), path)
    config, chash = doc.get("config"), doc.get("config_hash")
    if not isinstance(config, dict) or chash != config_hash(config):
        raise BadInput("expected the configuration identity and its sha256", path=path, field="config")
    raw_runs = doc.get("runs")
    if not isinstance(raw_runs, list) or not 1 <= len(raw_runs) <= rule.keep:
        got = len(raw_runs) if isinstance(raw_runs, list) else type(raw_runs).__name__
        raise BadInput(f"expected a list of 1 to {rule.keep} trusted runs, got {got}", path=path, field="runs")
    runs = [_run_in(r, path, f"runs[{i}]") for i, r in enumerate(raw_runs)]
    updates = doc.get("updates", [])
    if not isinstance(updates, list):
        raise BadInput("expected a list", path=path, field="updates")
    return History(path, rule, config, chash, runs, updates)


def _run_in(doc, path: Path, where: str) -> TrustedRun:
    if not isinstance(doc, dict):
        raise BadInput("expected an object {reason, identity, added, series}", path=path, field=where)
    for key, kind in (("reason", str), ("identity", dict), ("added", str), ("series", dict)):
        if not isinstance(doc.get(key), kind):
            raise BadInput(f"expected {'an object' if kind is dict else 'a string'}", path=path, field=f"{where}.{key}")
    series: dict[str, dict[int, float]] = {}
    for metric, by_step in doc["series"].items():
        at = f"{where}.series.{metric}"
        if not isinstance(by_step, dict) or not by_step:
            raise BadInput("expected a non-empty object of step: value", path=path, field=at)
        series[metric] = {}
        for key, v in by_step.items():
            if not (key.isdigit() and key == str(int(key))):
                raise BadInput(f"step {key!r} is not an integer step", path=path, field=at)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise BadInput(f"expected a finite number (a trusted value), got {v!r}", path=path, field=f"{at}.{key}")
            series[metric][int(key)] = float(v)
    return TrustedRun(doc["reason"], doc["identity"], doc["added"], series)


# --------------------------------------------------------------------------- golden update --tier history


@dataclass
class Appended:
    """What `append_history` did: the file, the run count, the dropped runs' reasons, what changed."""

    golden: str
    run: str
    created: bool
    runs: int
    keep: int
    dropped: list[str]
    metrics: int
    values: int
    added_metrics: list[str]
    rule: dict

    def to_json(self) -> dict:
        return asdict(self)


def append_history(
    run: RunDir | str | Path, golden: str | Path, reason: str, keep: int | None = None, command: str | None = None
) -> Appended:
    """Append `run` to the history file `golden` as a trusted run (creating the file with the default rule, or
    `keep`), drop the oldest runs beyond keep, and write the file atomically. Refuses (BadInput) an empty reason,
    a run of another configuration than the file's, and a run holding a non-finite value, by name."""
    from rlbench.checks.golden_build import write_golden

    run = open_run_dir(run)
    golden = Path(golden)
    if not reason.strip():
        raise BadInput("give the reason this run is trusted (it is kept with the run)", field="--reason")
    if keep is not None and keep < 1:
        raise BadInput(f"expected an integer >= 1, got {keep}", field="--keep")
    previous = load_history(golden) if golden.exists() else None
    manifest = run.manifest
    identity = config_identity(manifest)
    if previous is not None and previous.config != identity:
        raise BadInput(not_the_config(previous.config, identity), path=golden, field="config")
    series = {
        name: by_step
        for name, by_step in run_series(run).items()
        if not any(fnmatch.fnmatchcase(name, glob) for glob in LEFT_OUT)
    }
    if not series:
        raise BadInput("the run logs no metric to keep (perf/* is left out)", path=run.root / "metrics.jsonl")
    bad = [(m, s) for m, by_step in sorted(series.items()) for s, v in sorted(by_step.items()) if not math.isfinite(v)]
    if bad:
        named = ", ".join(f"{m} at step {s}" for m, s in bad[:3]) + (
            f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        )
        raise BadInput(f"a trusted run holds finite values only; this run has NaN or inf: {named}", path=run.root)
    rule = previous.rule if previous is not None else BandRule()
    if keep is not None and keep < rule.min_runs:
        raise BadInput(
            f"{keep} is fewer than the {rule.min_runs} runs the band is judged from (min_runs)", field="--keep"
        )
    if keep is not None:
        rule = BandRule(keep, rule.min_runs, rule.k, rule.rel, rule.atol)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    trusted = TrustedRun(
        reason.strip(),
        {
            "config_hash": config_hash(identity),
            "platform": platform_of(manifest),
            "numerics": numerics_of(manifest),
            "device_name": manifest.get("device_name"),
            "versions": run_versions(manifest),
            "determinism": manifest.get("determinism"),
            "command": manifest.get("command"),
            "created": manifest.get("created"),
        },
        now,
        series,
    )
    runs = [*(previous.runs if previous is not None else []), trusted]
    dropped, runs = runs[: -rule.keep], runs[-rule.keep :]
    held = {m for r in (previous.runs if previous is not None else []) for m in r.series}
    updates = list(previous.updates) if previous is not None else []
    updates.append(
        {
            "date": now,
            "reason": reason.strip(),
            "command": command,
            "keep": rule.keep,
            "dropped": [{"reason": r.reason, "added": r.added} for r in dropped],
        }
    )
    history = History(golden, rule, identity, config_hash(identity), runs, updates)
    write_golden(history.path, history.to_json())
    return Appended(
        str(golden),
        str(run.root),
        previous is None,
        len(runs),
        rule.keep,
        [r.reason for r in dropped],
        len(series),
        sum(len(v) for v in series.values()),
        sorted(set(series) - held) if previous is not None else [],
        rule.to_json(),
    )


def open_run_dir(run: RunDir | str | Path) -> RunDir:
    if isinstance(run, RunDir):
        return run
    from rlbench.replay.integrity import METRICS_ONLY, open_run

    return open_run(run, **METRICS_ONLY).run


def not_the_config(held: dict, identity: dict) -> str:
    diffs = _differing(held, identity)
    more = f" and {len(diffs) - 4} more" if len(diffs) > 4 else ""
    return (
        f"the run's configuration is not the history's: {'; '.join(diffs[:4])}{more}. A history file holds one "
        "configuration's runs: keep this configuration's in another file"
    )


def _differing(a, b, prefix: str = "") -> list[str]:
    """The fields where two configuration identities differ, as check golden names them."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(set(a) | set(b)) for d in _differing(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [f"{prefix[:-1]} (golden {a!r}, run {b!r})"]
