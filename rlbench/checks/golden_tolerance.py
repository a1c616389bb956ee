"""Golden-file tolerances: the per-metric families (exact, approx, median for perf/*), their defaults from a
run's own values, and `--tolerance` overrides. Read and written by golden.py; applied by golden_compare.py."""

from __future__ import annotations

import fnmatch
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlbench.errors import BadInput

KINDS = ("exact", "approx", "median")


@dataclass(frozen=True)
class Tolerance:
    """How one metric is compared in the approx tier (and, for `median`, in both tiers)."""

    kind: str = "approx"
    rtol: float = 0.0
    atol: float = 0.0
    failing_steps: int = 0
    mean_residual: float | None = None
    max_ratio: float | None = None
    window: tuple[int, int] | None = None
    family: str = "other"
    override: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        keys = {"exact": (), "approx": ("rtol", "atol", "failing_steps", "mean_residual"),
                "median": ("max_ratio", "window")}[self.kind]
        doc = {"kind": self.kind, **{k: getattr(self, k) for k in keys}, "family": self.family}
        if doc.get("window") is not None:
            doc["window"] = list(doc["window"])
        if self.override:
            doc["override"] = dict(self.override)
        return doc


# Default tolerances per metric family, first match wins. Losses follow Megatron-LM's
# approximate tier (rtol 0.05); the absolute floors keep near-zero policy losses comparable.
FAMILIES: tuple[tuple[str, tuple[str, ...], dict], ...] = (
    ("perf", ("perf/*", "iteration-time", "*-time", "*_time"), {"kind": "median", "max_ratio": 2.0}),
    ("log-prob mismatch", ("*logprob*",), {"rtol": 0.0, "atol": 1e-4}),
    ("losses", ("*loss*", "*ppo_kl*", "train/kl*"), {"rtol": 0.05, "atol": 1e-3}),
    ("rewards", ("*reward*",), {"rtol": 0.0, "atol": 0.1}),
    ("grad norms", ("*grad_norm*", "*grad-norm*"), {"rtol": 0.1, "atol": 1e-2}),
    ("lengths", ("*len/*", "*_len*", "*length*"), {"rtol": 0.1, "atol": 1.0}),
    ("fractions", ("*ratio*", "*frac*"), {"rtol": 0.0, "atol": 0.05}),
    ("other", ("*",), {"rtol": 0.05, "atol": 1e-6}),
)
_OVERRIDE_KEYS = {"kind": str, "rtol": float, "atol": float, "failing_steps": int, "mean_residual": float,
                  "max_ratio": float, "window": "range"}


def family_of(name: str) -> tuple[str, dict]:
    for family, patterns, spec in FAMILIES:
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return family, spec
    raise AssertionError("the last family matches every name")


def default_tolerance(name: str, steps: list[int], values: list[float]) -> Tolerance:
    """The family's tolerance, made concrete for this series.

    failing_steps: Megatron-LM's min(max(N // 100, 1), 50) (none for a single step).
    mean_residual: a fraction of the mean per-step allowance, min(0.5, 2 / sqrt(N)): noise that
    fills the band averages out towards 0 as N grows, a one-sided drift does not.
    window (perf): the steps after the first tenth (at least the first step is warm-up).
    """
    family, spec = family_of(name)
    n = len(steps)
    if spec.get("kind") == "median":
        return Tolerance(kind="median", max_ratio=spec["max_ratio"], window=_perf_window(steps), family=family)
    rtol, atol = spec["rtol"], spec["atol"]
    allowed = [atol + rtol * abs(v) for v in values if math.isfinite(v)] or [atol]
    fraction = min(0.5, 2 / math.sqrt(n)) if n else 0.5
    return Tolerance(kind="approx", rtol=rtol, atol=atol, failing_steps=min(max(n // 100, 1), 50) if n > 1 else 0,
                     mean_residual=_round_sig(fraction * statistics.fmean(allowed)), family=family)


def _perf_window(steps: list[int]) -> tuple[int, int]:
    skip = max(1, len(steps) // 10) if len(steps) > 2 else 0
    return steps[skip], steps[-1]


def _round_sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def parse_override(spec: str) -> tuple[str, dict]:
    """'METRIC-GLOB:key=value,key=value' (keys: kind, rtol, atol, failing_steps, mean_residual,
    max_ratio, window=A:B) -> (glob, {key: value})."""
    where = "--tolerance"
    glob, _, body = spec.partition(":")  # metric names have no ':'; a window value (A:B) may
    if not glob or not body:
        raise BadInput(f"expected METRIC:key=value[,key=value], got {spec!r}", field=where)
    out = {}
    for item in body.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _OVERRIDE_KEYS:
            raise BadInput(f"{item!r}: expected key=value with key one of {', '.join(_OVERRIDE_KEYS)}", field=where)
        out[key] = _coerce_override(key, value.strip(), where)
    return glob, out


def _coerce_override(key: str, value, where: str):
    kind = _OVERRIDE_KEYS[key]
    try:
        if kind == "range":
            if isinstance(value, list) and len(value) == 2:
                a, b = (int(v) for v in value)
            else:
                a, b = (int(v) for v in str(value).split(":"))
            if a > b:
                raise ValueError
            return (a, b)
        if kind is str:
            if value not in KINDS:
                raise ValueError
            return value
        if key == "mean_residual" and (value is None or value == "none"):
            return None  # no mean-residual test
        if isinstance(value, bool):
            raise ValueError
        number = kind(value)
        if isinstance(value, float) and kind is int and number != value:
            raise ValueError
        if not math.isfinite(number) or number < 0:
            raise ValueError
        return number
    except (TypeError, ValueError):
        expected = {"range": "A:B with A <= B", str: f"one of {', '.join(KINDS)}", float: "a number >= 0",
                    int: "an integer >= 0"}[kind]
        raise BadInput(f"{key}={value!r}: expected {expected}", field=where) from None


def apply_override(tol: Tolerance, override: dict, name: str, steps: list[int], where: str) -> Tolerance:
    if not override:
        return tol
    kind = override.get("kind", tol.kind)
    base = tol if kind == tol.kind else Tolerance(kind=kind, family=tol.family)
    if kind == "median" and base.max_ratio is None:
        base = replace(base, max_ratio=2.0, window=_perf_window(steps))
    fields = {k: v for k, v in override.items() if k != "kind"}
    allowed = {"exact": set(), "approx": {"rtol", "atol", "failing_steps", "mean_residual"},
               "median": {"max_ratio", "window"}}[kind]
    wrong = sorted(set(fields) - allowed)
    if wrong:
        raise BadInput(f"{name}: {', '.join(wrong)} does not apply to a {kind} tolerance", field=where)
    return replace(base, **fields, override={**tol.override, **override})


def read_tolerance(name: str, doc, steps: list[int], values: list[float], path: Path, where: str) -> Tolerance:
    """A metric's tolerance as a golden file holds it (None: the default for its values), checked field by field."""
    default = default_tolerance(name, steps, values)
    if doc is None:
        return default
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS:
        raise BadInput(f"expected an object with kind one of {', '.join(KINDS)}", path=path, field=where)
    unknown = sorted(set(doc) - set(_OVERRIDE_KEYS) - {"family", "override"})
    if unknown:
        raise BadInput(f"unknown key(s) {', '.join(unknown)}", path=path, field=where)
    given = {k: _coerce_override(k, v, f"{path}: {where}.{k}") for k, v in doc.items() if k in _OVERRIDE_KEYS}
    override = doc.get("override") or {}
    if not isinstance(override, dict):
        raise BadInput("expected an object", path=path, field=f"{where}.override")
    override = {k: _coerce_override(k, v, f"{path}: {where}.override.{k}") for k, v in override.items()
                if k in _OVERRIDE_KEYS}
    tol = apply_override(default, given, name, steps, f"{path}: {where}")
    return replace(tol, family=str(doc.get("family", tol.family)), override=override)
