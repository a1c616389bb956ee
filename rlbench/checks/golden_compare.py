"""`check golden`: a run's committed metrics against a golden file (see golden.py for the format).

Tiers: `exact` compares every value bit for bit and is refused when the platform, GPU model,
versions or determinism settings differ; `approx` compares each metric by its tolerance. `perf/*`
compares window medians in both. Another configuration is refused in both tiers. A Megatron-LM golden
values file is compared in the approx tier only, at its steps with a value (its "nan" steps are named,
not compared), its iteration k against the run's step k - 1.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from dataclasses import asdict, dataclass, field

from rlbench.checks.golden import (
    TIERS,
    Golden,
    Tolerance,
    apply_override,
    config_identity,
    exact_versions,
    num_out,
    numerics_of,
    platform_of,
    run_series,
    same_bits,
    same_series,
)
from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir


@dataclass
class StepFailure:
    step: int
    expected: float
    got: float
    delta: float
    allowed: float  # 0.0 in the exact tier


@dataclass
class MetricResult:
    name: str
    kind: str  # how it was compared: exact, approx or median
    status: str  # pass, fail or missing
    tolerance: dict
    steps: list[int]
    failures: list[StepFailure] = field(default_factory=list)
    allowed_failing: int = 0
    compared: int = 0  # how many steps' values were compared (a median: the steps of its window)
    max_abs: float | None = None
    mean_residual: float | None = None
    mean_bound: float | None = None
    median_got: float | None = None
    median_expected: float | None = None
    band: dict = field(default_factory=dict)  # the golden's own tolerance, drawn as the band in plots
    message: str = ""
    expected: dict[int, float] = field(default_factory=dict)
    got: dict[int, float] = field(default_factory=dict)


@dataclass
class GoldenReport:
    run: str
    golden: str
    golden_format: str
    tier: str
    platform: dict
    notes: list[str]
    metrics: list[MetricResult]
    ignored: list[str]
    not_in_golden: list[str]
    golden_step_offset: int = 0  # the golden file's own number for the run's step s is s + golden_step_offset

    @property
    def compared(self) -> int:
        """How many (metric, step) values were compared."""
        return sum(m.compared for m in self.metrics)

    @property
    def failed(self) -> list[MetricResult]:
        return [m for m in self.metrics if m.status != "pass"]

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict:
        def metric(m: MetricResult) -> dict:
            doc = asdict(m)
            for key in ("expected", "got"):
                doc[key] = {str(s): num_out(v) for s, v in doc[key].items()}
            doc["failures"] = [
                {k: num_out(v) if isinstance(v, float) else v for k, v in f.items()} for f in doc["failures"]
            ]
            return doc

        return {
            "ok": self.ok,
            "tier": self.tier,
            "run": self.run,
            "golden": self.golden,
            "golden_format": self.golden_format,
            "platform": self.platform,
            "notes": self.notes,
            "failed": [m.name for m in self.failed],
            "ignored": self.ignored,
            "not_in_golden": self.not_in_golden,
            "compared": self.compared,
            "golden_step_offset": self.golden_step_offset,
            "metrics": [metric(m) for m in self.metrics],
        }


def _differences(golden: Golden, manifest: dict) -> list[str]:
    """What makes bit-for-bit agreement not expected (the exact tier's preconditions)."""
    head = golden.header
    if golden.format == "megatron":
        return ["a Megatron-LM golden values file records no platform, versions or configuration"]
    out = []
    run_platform = platform_of(manifest)
    if head.get("platform") != run_platform:
        out.append(f"platform: golden {head.get('platform')}, run {run_platform}")
    changed = _dict_diff(head.get("numerics") or {}, numerics_of(manifest))
    if changed:
        out.append(f"CPU numerics: {'; '.join(changed)}")
    if head.get("device_name") != manifest.get("device_name"):
        out.append(f"device: golden {head.get('device_name')}, run {manifest.get('device_name')}")
    golden_versions, run_versions = head.get("versions") or {}, manifest.get("versions") or {}
    for name in sorted(exact_versions(golden_versions) | exact_versions(run_versions)):
        if golden_versions.get(name) != run_versions.get(name):
            out.append(f"{name}: golden {golden_versions.get(name)}, run {run_versions.get(name)}")
    changed = (
        _dict_diff(head.get("determinism") or {}, manifest.get("determinism") or {}) if "determinism" in head else []
    )
    if changed:
        out.append(f"determinism settings: {'; '.join(changed)}")
    return out


def _dict_diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _dict_diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [f"{prefix[:-1]} (golden {a!r}, run {b!r})"]


def compare(
    run: RunDir, golden: Golden, tier: str = "exact", ignore: list[str] = (), overrides: list[tuple[str, dict]] = ()
) -> GoldenReport:
    """Compare the run's committed metrics with the golden file. Raises BadInput (exit 2) when the
    comparison is meaningless: another configuration (both tiers), another platform, versions or
    determinism settings (exact tier), or a run that does not reach the golden's steps."""
    if tier not in TIERS:
        raise BadInput(f"expected one of {', '.join(TIERS)}, got {tier!r}", field="--tier")
    manifest = run.manifest
    notes = [f"{run.root}: {n}" for n in run.notes]
    if golden.format == "megatron":
        notes.append(golden.header["note"])
    notes += golden.notes
    identity = config_identity(manifest)
    if golden.header.get("config") is not None and golden.header["config"] != identity:
        diffs = _dict_diff(golden.header["config"], identity)
        raise BadInput(
            f"the run's configuration is not the golden's: {'; '.join(diffs[:4])}"
            f"{f' and {len(diffs) - 4} more' if len(diffs) > 4 else ''}. A golden file holds one "
            "configuration's curve: make one for this configuration with `rlbench golden update`",
            path=golden.path,
            field="header.config",
        )
    differences = _differences(golden, manifest)
    if differences and tier == "exact":
        raise BadInput(
            f"the exact tier is meaningless here, bits are not expected to agree: "
            f"{'; '.join(differences)}. Compare within tolerances with --tier approx",
            path=golden.path,
            field="header",
        )
    notes += [f"compared across {d}" for d in differences]
    got = run_series(run)
    results, ignored = [], []
    committed = set(run.steps)
    for name, series in sorted(golden.metrics.items()):
        if any(fnmatch.fnmatchcase(name, g) for g in ignore):
            ignored.append(name)
            continue
        tol = series.tolerance
        steps = sorted(series.values)
        if not steps:
            raise BadInput(
                f'the golden\'s {name} holds no value at any step ("nan" at each): nothing to compare; '
                f"leave it out with --ignore",
                path=golden.path,
            )
        for glob, override in overrides:
            if fnmatch.fnmatchcase(name, glob):
                tol = apply_override(tol, override, name, steps, "--tolerance")
        missing_steps = [s for s in steps if s not in committed]
        if missing_steps:
            raise BadInput(
                f"the run's committed steps are {_span(run.steps)}; the golden's {name} needs "
                f"{_span(steps)}{_own_numbers(golden, steps)}: run it further (or --resume it) first",
                path=run.root,
            )
        if name not in got:
            hint = "; --rename it to a metric the run logs, or --ignore it" if golden.format == "megatron" else ""
            results.append(
                MetricResult(
                    name,
                    tol.kind,
                    "missing",
                    tol.to_json(),
                    steps,
                    band=tol.to_json(),
                    message=f"not logged by the run{hint}",
                    expected=dict(series.values),
                )
            )
            continue
        kind = tol.kind if (tier == "approx" or tol.kind == "median") else "exact"
        results.append(_compare_series(name, series.values, got[name], tol, kind))
    if not results:  # no verdict speaks for nothing
        raise BadInput(
            f"undetermined: no metric left to compare (the golden's {len(golden.metrics)} are all --ignore'd)",
            path=golden.path,
        )
    exact_able = [m for m in results if m.kind != "median" and m.status != "missing"]
    if (
        tier == "approx"
        and exact_able
        and all(m.got.keys() == m.expected.keys() and same_series(m.expected, m.got) for m in exact_able)
    ):
        notes.append(
            "every compared value is equal bit for bit (the exact tier's preconditions are not met, but the bits agree)"
        )
    not_in_golden = sorted(
        n for n in got if n not in golden.metrics and not any(fnmatch.fnmatchcase(n, g) for g in ignore)
    )
    for glob, _ in overrides:
        if not any(fnmatch.fnmatchcase(name, glob) for name in golden.metrics):
            raise BadInput(f"{glob!r} matches no metric of the golden file", field="--tolerance")
    platform = {"run": platform_of(manifest), "golden": golden.header.get("platform")}
    return GoldenReport(
        str(run.root),
        str(golden.path),
        golden.format,
        tier,
        platform,
        notes,
        results,
        ignored,
        not_in_golden,
        golden.step_offset,
    )


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if steps else "none"


def _own_numbers(golden: Golden, steps: list[int]) -> str:
    """The steps as a Megatron-LM file numbers them, where it numbers them otherwise."""
    if golden.format != "megatron":
        return ""
    return f" (Megatron-LM iterations {_span([s + golden.step_offset for s in steps])})"


def _compare_series(
    name: str, expected: dict[int, float], got: dict[int, float], tol: Tolerance, kind: str
) -> MetricResult:
    steps = sorted(expected)
    result = MetricResult(
        name,
        kind,
        "pass",
        tol.to_json() if kind != "exact" else {"kind": "exact"},
        steps,
        band=tol.to_json(),
        expected=dict(expected),
        got={s: got[s] for s in steps if s in got},
    )
    absent = [s for s in steps if s not in got]
    if absent:
        result.status, result.message = "fail", f"not logged at step(s) {', '.join(map(str, absent[:5]))}"
        return result
    if kind == "median":
        window = [s for s in steps if tol.window[0] <= s <= tol.window[1]]
        if not window:
            result.status, result.message = "fail", f"no golden step in the window {tol.window}"
            return result
        exp_med = statistics.median(expected[s] for s in window)
        got_med = statistics.median(got[s] for s in window)
        result.median_expected, result.median_got, result.compared = exp_med, got_med, len(window)
        limit = tol.max_ratio * exp_med
        low = tol.min_ratio * exp_med if tol.min_ratio is not None else -math.inf
        if not low <= got_med <= limit:  # also fails on NaN
            result.status = "fail"
            ratio = got_med / exp_med if exp_med else math.inf
            bounds = (
                f"at most x{tol.max_ratio:g}" if tol.min_ratio is None else f"x{tol.min_ratio:g} to x{tol.max_ratio:g}"
            )
            result.message = f"median {got_med:.4g} is x{ratio:.2f} the golden's {exp_med:.4g} ({bounds})"
        return result
    deltas, inside = [], []
    for s in steps:
        e, g = expected[s], got[s]
        if kind == "exact":
            ok, allowed = same_bits(e, g), 0.0
        else:
            allowed = tol.atol + tol.rtol * abs(e) if math.isfinite(e) else 0.0
            ok = same_bits(e, g) or (math.isfinite(e) and math.isfinite(g) and abs(g - e) <= allowed)
        delta = g - e if math.isfinite(e) and math.isfinite(g) else math.nan
        if math.isfinite(delta):
            deltas.append(abs(delta))
        if ok:
            if math.isfinite(delta):
                inside.append(delta)
        else:
            result.failures.append(StepFailure(s, e, g, delta, allowed))
    result.max_abs = max(deltas) if deltas else None
    result.compared = len(steps)
    if kind == "exact":
        if result.failures:
            result.status = "fail"
            result.message = f"{len(result.failures)} of {len(steps)} steps differ"
        return result
    result.allowed_failing = tol.failing_steps
    result.mean_residual = statistics.fmean(inside) if inside else 0.0
    result.mean_bound = tol.mean_residual
    problems = []
    if len(result.failures) > tol.failing_steps:
        problems.append(f"{len(result.failures)} of {len(steps)} steps outside the band (at most {tol.failing_steps})")
    if tol.mean_residual is not None and abs(result.mean_residual) > tol.mean_residual:
        problems.append(f"mean residual {result.mean_residual:+.4g} beyond +-{tol.mean_residual:g} (one-sided drift)")
    if problems:
        result.status, result.message = "fail", "; ".join(problems)
    return result
