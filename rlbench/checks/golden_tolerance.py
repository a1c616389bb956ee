"""Golden-file tolerances: the per-metric families (exact, approx, median for perf/*), their defaults from a
run's own values, Megatron-LM's own tolerances for its golden values files, and `--tolerance` overrides. Read and
written by golden.py; applied by golden_compare.py."""

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
    min_ratio: float | None = None  # median: a lower bound too (Megatron-LM's iteration-time is two-sided)
    window: tuple[int, int] | None = None
    family: str = "other"
    override: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        keys = {
            "exact": (),
            "approx": ("rtol", "atol", "failing_steps", "mean_residual"),
            "median": ("max_ratio", "window"),
        }[self.kind]
        if self.kind == "median" and self.min_ratio is not None:
            keys = ("max_ratio", "min_ratio", "window")
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
_OVERRIDE_KEYS = {
    "kind": str,
    "rtol": float,
    "atol": float,
    "failing_steps": int,
    "mean_residual": float,
    "max_ratio": float,
    "min_ratio": float,
    "window": "range",
}

# Megatron-LM's approximate comparison, per metric of its golden values files: NVIDIA/Megatron-LM at
# d98e8a64ddf34856e74b24714e3bedb2f5a39553, tests/functional_tests/python_test_utils/
# test_pretraining_regular_pipeline.py `CHECK_THRESHOLDS` (each an `ApproximateTest(atol=0, rtol=...)`), applied by
# common.py `pipeline`: np.isclose(actual, golden, rtol, atol=0) per step, at most min(max(N // 100, 1), 50) of the
# N steps outside (none when N is 1), no mean-residual test. iteration-time is compared once, on the medians over
# a steady window (`_megatron_window`); memory per step, like the losses.
MEGATRON_RTOL = {
    "lm loss": 0.05,
    "mtp_1 loss": 0.05,
    "mtp_2 loss": 0.05,
    "total loss": 0.05,
    "num-zeros": 0.20,
    "mem-allocated-bytes": 0.05,
    "mem-max-allocated-bytes": 0.05,
    "generated_tokens": 0.05,
    "logprobs": 0.05,
    "iteration-time": 0.05,
}


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
    return Tolerance(
        kind="approx",
        rtol=rtol,
        atol=atol,
        failing_steps=min(max(n // 100, 1), 50) if n > 1 else 0,
        mean_residual=_round_sig(fraction * statistics.fmean(allowed)),
        family=family,
    )


def megatron_tolerance(name: str, steps: list[int], count: int) -> Tolerance | None:
    """Megatron-LM's tolerance for its metric `name` (None: its comparison has none). `steps`: the Megatron
    iterations the file holds a value at; `count`: how many steps the file lists, its "nan" ones included
    (Megatron's N: a "nan" step passes there when the run has no value either)."""
    rtol = MEGATRON_RTOL.get(name)
    if rtol is None:
        return None
    family = f"Megatron-LM {name}"
    if name == "iteration-time":
        # np.isclose(median_run, median_golden, rtol) for a positive golden median: within x(1 -+ rtol) of it
        return Tolerance(
            kind="median", max_ratio=1 + rtol, min_ratio=1 - rtol, window=_megatron_window(steps), family=family
        )
    # Megatron's allowance, but never every compared step: a "nan" step would pass there, it is not compared here
    failing = min(min(max(count // 100, 1), 50) if count > 1 else 0, max(len(steps) - 1, 0))
    return Tolerance(kind="approx", rtol=rtol, atol=0.0, failing_steps=failing, mean_residual=None, family=family)


def _megatron_window(steps: list[int]) -> tuple[int, int]:
    """Megatron-LM's steady window for iteration-time (common.py `pipeline`): iterations 5..20 when the last
    one with a value is at most 25, else 30..45; without a value inside, the first 4 at or after its start."""
    lo, hi = (5, 20) if steps and steps[-1] <= 25 else (30, 45)
    inside = [s for s in steps if lo <= s <= hi] or [s for s in steps if s >= lo][:4]
    return (inside[0], inside[-1]) if inside else (lo, hi)


def _perf_window(steps: list[int]) -> tuple[int, int]:
    skip = max(1, len(steps) // 10) if len(steps) > 2 else 0
    return steps[skip], steps[-1]


def _round_sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def parse_override(spec: str) -> tuple[str, dict]:
    """'METRIC-GLOB:key=value,key=value' (keys: kind, rtol, atol, failing_steps, mean_residual,
    max_ratio, min_ratio, window=A:B) -> (glob, {key: value})."""
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
        expected = {
            "range": "A:B with A <= B",
            str: f"one of {', '.join(KINDS)}",
            float: "a number >= 0",
            int: "an integer >= 0",
        }[kind]
        raise BadInput(f"{key}={value!r}: expected {expected}", field=where) from None


def apply_override(tol: Tolerance, override: dict, name: str, steps: list[int], where: str) -> Tolerance:
    if not override:
        return tol
    kind = override.get("kind", tol.kind)
    base = tol if kind == tol.kind else Tolerance(kind=kind, family=tol.family)
    if kind == "median" and base.max_ratio is None:
        base = replace(base, max_ratio=2.0, window=_perf_window(steps))
    fields = {k: v for k, v in override.items() if k != "kind"}
    allowed = {
        "exact": set(),
        "approx": {"rtol", "atol", "failing_steps", "mean_residual"},
        "median": {"max_ratio", "min_ratio", "window"},
    }[kind]
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
    override = {
        k: _coerce_override(k, v, f"{path}: {where}.override.{k}") for k, v in override.items() if k in _OVERRIDE_KEYS
    }
    tol = apply_override(default, given, name, steps, f"{path}: {where}")
    return replace(tol, family=str(doc.get("family", tol.family)), override=override)
