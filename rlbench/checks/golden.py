"""Golden files: their format, reading (rlbench's and Megatron-LM's) and writing
(`golden update`). Tolerances are in golden_tolerance.py, the comparison (`check golden`) in golden_compare.py.

A golden file (schema `rlbench.golden/1`, JSON) holds:

- a header: the platform (`cpu-x86_64`, `cuda-x86_64` + the GPU model), the versions of torch,
  transformers, tokenizers and the engines, the determinism settings, the run's configuration
  identity and its sha256, the command that made the run, the reason of the last update and the
  history of every update;
- per metric, Megatron-LM's series `{start_step, end_step, step_interval, values}` (values keyed
  by step, non-finite values as the strings "nan", "inf", "-inf") and a `tolerance`.

Tiers. `exact` (the default, what CPU CI runs): every value equal bit for bit; refused (BadInput,
exit 2) when the platform, versions or determinism settings differ, since bits are then not
expected to agree. `approx` (asked for): each metric by its tolerance: `exact`, or `approx`
(|got - expected| <= atol + rtol * |expected| per step, at most `failing_steps` steps outside,
and |mean residual| <= `mean_residual` over the steps inside: a one-sided drift that stays
within the per-step band still fails), as Megatron-LM's approximate tier and TRL's invariant
tests do. `perf/*` is never compared exactly, in either tier: the run's median over a window of
steps may be at most `max_ratio` times the golden's (Megatron-LM compares iteration time so).

Both tiers refuse a run whose configuration identity differs from the golden's: a golden file
is one configuration's curve. The identity is the resolved config without its I/O settings
(out, steps, record, checkpoint_every, rollouts) and placement (device, threads, deterministic:
the platform and determinism checks cover them; [placement]; how requests reach SGLang servers),
with file paths replaced by the sha256 of their contents, so a checkout elsewhere, a longer run or
the same run on a GPU compares. Settings added later (tp, dp, [train.megatron], [rollout.sglang])
count only when set, so older files keep their identity.

Megatron-LM golden values files (`{"lm loss": {"start_step": 1, ...}}`, no header) are read as
golden input too: approx tier only, metric names mapped with `rename`, and Megatron's iteration
k compared with rlbench's step k - 1 (Megatron counts iterations from 1, rlbench steps from 0).
"""

from __future__ import annotations

import datetime
import fnmatch
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from rlbench.checks.golden_tolerance import (  # noqa: F401 - re-exported: golden files hold tolerances
    Tolerance, apply_override, default_tolerance, family_of, parse_override, read_tolerance)
from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir, atomic_write
from rlbench.rundir.jsonio import read_json

SCHEMA = "rlbench.golden/1"
# A run records the versions of the packages it used (rlbench/core/context.py `versions`). The exact
# tier needs them equal, except these, recorded only: rlbench's own changes are what the golden check is
# there to catch, and the others store or route values without computing them.
RECORDED_ONLY = ("python", "rlbench", "safetensors", "sglang-router", "ray")
# Left out of the configuration identity: I/O settings, and placement (device, threads, deterministic),
# which the exact tier checks as platform and determinism settings and the approx tier compares across.
IO_KEYS = ("out", "steps", "record", "checkpoint_every", "rollouts", "device", "threads", "deterministic",
           "placement")
# How requests reach the SGLang servers and how many there are: a request's result does not depend on
# them (its seed travels with it), so they are left out too.
TRANSPORT_KEYS = ("sglang_router_url", "external_engine_addrs", "num_engines", "sglang_server", "use_router",
                  "max_inflight", "request_timeout", "request_attempts", "verify_engine_weights", "weights_dir")
# Settings added after golden files were first made: left out of the identity at their neutral
# value, so the files made before them still name the same configuration.
LATER_KEYS = {("tp",): 1, ("dp",): 1, ("train", "megatron"): {}, ("rollout", "sglang"): {}}
PATH_KEYS = {("model", "path"): "model_config", ("model", "tokenizer"): "tokenizer", ("data", "path"): "dataset"}
TIERS = ("exact", "approx")


# --------------------------------------------------------------------------- golden files


@dataclass
class Series:
    start_step: int
    end_step: int
    step_interval: int
    values: dict[int, float]
    tolerance: Tolerance

    def to_json(self) -> dict:
        return {"start_step": self.start_step, "end_step": self.end_step, "step_interval": self.step_interval,
                "values": {str(s): num_out(v) for s, v in sorted(self.values.items())},
                "tolerance": self.tolerance.to_json()}


@dataclass
class Golden:
    path: Path
    format: str  # "rlbench" or "megatron"
    header: dict
    metrics: dict[str, Series]


def num_out(v: float):
    """A value as a golden file (and check golden's JSON report) writes it: a finite number as it is,
    NaN and the infinities as the strings "nan", "inf" and "-inf", which JSON has no numbers for."""
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _num_in(v, path: Path, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise BadInput(f"expected a number or \"nan\"/\"inf\"/\"-inf\", got {v!r}", path=path, field=where)
    if isinstance(v, str):
        if v.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
            raise BadInput(f"expected a number or \"nan\"/\"inf\"/\"-inf\", got {v!r}", path=path, field=where)
        return float(v)
    return float(v)


def _int_in(doc: dict, key: str, path: Path, where: str, minimum: int) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise BadInput(f"expected an integer >= {minimum}, got {v!r}", path=path, field=f"{where}.{key}")
    return v


def _series_in(doc, path: Path, where: str, offset: int) -> tuple[int, int, int, dict[int, float]]:
    """Megatron-LM's series shape, values a {step: value} object or a list over the grid."""
    if not isinstance(doc, dict):
        raise BadInput(f"expected an object with start_step, end_step, step_interval, values, got "
                       f"{type(doc).__name__}", path=path, field=where)
    start = _int_in(doc, "start_step", path, where, 0)
    end = _int_in(doc, "end_step", path, where, start)
    interval = _int_in(doc, "step_interval", path, where, 1)
    raw = doc.get("values")
    grid = range(start, end + 1, interval)
    if isinstance(raw, list):
        if len(raw) != len(grid):
            raise BadInput(f"{len(raw)} values for the {len(grid)} steps {start}..{end} every {interval}",
                           path=path, field=f"{where}.values")
        items = list(zip(grid, raw))
    elif isinstance(raw, dict):
        items = []
        for key, v in raw.items():
            try:
                step = int(key)
            except ValueError:
                raise BadInput(f"step {key!r} is not an integer", path=path, field=f"{where}.values") from None
            if step not in grid:
                raise BadInput(f"step {step} is off the series' grid {start}..{end} every {interval}",
                               path=path, field=f"{where}.values")
            items.append((step, v))
    else:
        raise BadInput(f"expected an object of step: value (or a list), got {type(raw).__name__}",
                       path=path, field=f"{where}.values")
    if not items:
        raise BadInput("no values", path=path, field=f"{where}.values")
    values = {step + offset: _num_in(v, path, f"{where}.values.{step}") for step, v in items}
    return start + offset, end + offset, interval, values


def is_megatron(doc) -> bool:
    return (isinstance(doc, dict) and "schema" not in doc and bool(doc)
            and all(isinstance(v, dict) and {"start_step", "end_step", "step_interval", "values"} <= set(v)
                    for v in doc.values()))


def load_golden(path: str | Path, rename: dict[str, str] | None = None) -> Golden:
    """Read and validate a golden file: rlbench's, or a Megatron-LM golden values file."""
    path = Path(path)
    if not path.is_file():
        raise BadInput("no such golden file" if not path.exists() else
                       "is a directory; give the golden file's path" if path.is_dir() else "not a file", path=path)
    doc = read_json(path)
    rename = rename or {}
    names = doc if is_megatron(doc) else doc.get("metrics") if isinstance(doc, dict) else None
    unknown = sorted(set(rename) - set(names if isinstance(names, dict) else {}))
    if isinstance(names, dict) and unknown:
        raise BadInput(f"{', '.join(map(repr, unknown))} matches no metric of {path} ({', '.join(names)})",
                       field="--rename")
    if is_megatron(doc):
        metrics = {}
        for name, series in doc.items():
            start, end, interval, values = _series_in(series, path, name, offset=-1)
            target = rename.get(name, name)
            steps = sorted(values)
            metrics[target] = Series(start, end, interval, values,
                                     default_tolerance(target, steps, [values[s] for s in steps]))
        platform = re.fullmatch(r"golden_values_(.+?)_(.+)\.json", path.name)
        header = {"platform": f"megatron:{platform.group(2)}" if platform else "megatron:unknown",
                  "versions": {}, "config": None, "config_hash": None, "command": None,
                  "reason": "Megatron-LM golden values file", "history": [],
                  "note": "Megatron-LM iteration k is compared with rlbench step k - 1"}
        return Golden(path, "megatron", header, metrics)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise BadInput(f"expected {SCHEMA!r} (or a Megatron-LM golden values file), got {got!r}", path=path,
                       field="schema")
    header, raw_metrics = doc.get("header"), doc.get("metrics")
    if not isinstance(header, dict):
        raise BadInput("expected an object", path=path, field="header")
    for key in ("platform", "versions", "history"):
        if key not in header:
            raise BadInput("missing", path=path, field=f"header.{key}")
    if not isinstance(header["versions"], dict):
        raise BadInput("expected an object", path=path, field="header.versions")
    if not isinstance(header["history"], list):
        raise BadInput("expected a list", path=path, field="header.history")
    if not isinstance(raw_metrics, dict) or not raw_metrics:
        raise BadInput("expected a non-empty object of metric: series", path=path, field="metrics")
    metrics = {}
    for name, series in raw_metrics.items():
        start, end, interval, values = _series_in(series, path, f"metrics.{name}", offset=0)
        steps = sorted(values)
        tol = read_tolerance(name, series.get("tolerance"), steps, [values[s] for s in steps], path,
                            f"metrics.{name}.tolerance")
        metrics[rename.get(name, name)] = Series(start, end, interval, values, tol)
    return Golden(path, "rlbench", header, metrics)


def platform_of(manifest: dict) -> str:
    device = str(manifest.get("device") or manifest.get("config", {}).get("device") or "cpu").split(":")[0]
    return f"{device}-{manifest.get('platform', {}).get('machine') or 'unknown'}"


def config_identity(manifest: dict) -> dict:
    """The run's configuration as far as it shapes the metrics: I/O settings dropped, file paths
    replaced by the sha256 of their contents (so another checkout compares), plus the initial
    weights' sha256."""
    config = json.loads(json.dumps(manifest.get("config", {})))
    for key in IO_KEYS:
        config.pop(key, None)
    for key in TRANSPORT_KEYS:
        config.get("rollout", {}).pop(key, None)
    for path, neutral in LATER_KEYS.items():
        *parents, key = path
        table = config
        for parent in parents:
            table = table.get(parent, {})
        if table.get(key, neutral) == neutral:
            table.pop(key, None)
    config.get("model", {}).pop("init", None)  # which weights: the initial weights' sha256 below says it exactly
    hashes = manifest.get("hashes", {})
    for (section, key), hash_name in PATH_KEYS.items():
        if key in config.get(section, {}):
            config[section][key] = f"sha256:{hashes.get(hash_name)}"
    config["initial_weights"] = f"sha256:{hashes.get('initial_weights')}"
    return config


def config_hash(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _versions(manifest: dict) -> dict:
    return dict(manifest.get("versions") or {})


def exact_versions(versions: dict) -> set[str]:
    """The packages whose versions the exact tier needs equal."""
    return set(versions) - set(RECORDED_ONLY)


def numerics_of(manifest: dict) -> dict:
    """What else decides a CPU run's bits (rlbench/numerics.py): compared in the exact tier."""
    from rlbench.numerics import platform_class

    device = str(manifest.get("device") or manifest.get("config", {}).get("device") or "cpu")
    return platform_class(manifest.get("numerics"), device)


def run_series(run: RunDir) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    for row in run.metrics:
        for name, value in row.items():
            if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            series.setdefault(name, {})[row["step"]] = float(value)
    return series


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def build_golden(run: RunDir, reason: str, command: str, previous: Golden | None = None,
                 overrides: list[tuple[str, dict]] = (), interval: int = 1) -> tuple[dict, dict]:
    """The golden document for `run` (and what changed against `previous`): every metric logged at
    every committed step, on a grid of `interval` steps; tolerances from the family defaults, with
    the overrides `previous` carried and the new ones applied. Returns (document, change summary)."""
    if not reason.strip():
        raise BadInput("give the reason for this update (it is kept in the file's history)", field="--reason")
    if not run.steps:
        raise BadInput("the run has no committed step", path=run.root / "metrics.jsonl")
    manifest = run.manifest
    identity = config_identity(manifest)
    metrics = {}
    for name, by_step in sorted(run_series(run).items()):
        steps = [s for s in run.steps[::interval]]
        if any(s not in by_step for s in steps):
            continue  # logged at some steps only: no series on a regular grid
        values = {s: by_step[s] for s in steps}
        tol = default_tolerance(name, steps, [values[s] for s in steps])
        if previous is not None and name in previous.metrics and previous.metrics[name].tolerance.override:
            tol = apply_override(tol, previous.metrics[name].tolerance.override, name, steps, "previous override")
        for glob, override in overrides:
            if fnmatch.fnmatchcase(name, glob):
                tol = apply_override(tol, override, name, steps, "--tolerance")
        metrics[name] = Series(steps[0], steps[-1], interval, values, tol)
    if not metrics:
        raise BadInput("no metric is logged at every committed step: nothing to make a golden series of",
                       path=run.root / "metrics.jsonl")
    for glob, _ in overrides:
        if not any(fnmatch.fnmatchcase(name, glob) for name in metrics):
            raise BadInput(f"{glob!r} matches no metric of the run ({', '.join(metrics)})", field="--tolerance")
    old = previous.metrics if previous is not None else {}
    changes = {
        "added": sorted(set(metrics) - set(old)),
        "removed": sorted(set(old) - set(metrics)),
        "changed": sorted(n for n in metrics if n in old and not same_series(old[n].values, metrics[n].values)),
        "tolerance_changed": sorted(n for n in metrics if n in old
                                    and old[n].tolerance.to_json() != metrics[n].tolerance.to_json()),
        "config_changed": previous is not None and previous.header.get("config_hash") != config_hash(identity),
        "platform_changed": previous is not None and (previous.header.get("platform") != platform_of(manifest)
                                                      or previous.header.get("numerics") != numerics_of(manifest)),
    }
    now = _now()
    entry = {"date": now, "reason": reason.strip(), "command": command, "run_command": manifest.get("command"),
             "run_created": manifest.get("created"), "platform": platform_of(manifest),
             "numerics": numerics_of(manifest),
             "versions": _versions(manifest), "config_hash": config_hash(identity),
             "steps": [run.steps[0], run.steps[-1]], **changes}
    history = list(previous.header.get("history", [])) if previous is not None else []
    header = {
        "platform": platform_of(manifest),
        "numerics": numerics_of(manifest),
        "device_name": manifest.get("device_name"),
        "versions": _versions(manifest),
        "determinism": manifest.get("determinism"),
        "mode": manifest.get("mode"),
        "config": identity,
        "config_hash": config_hash(identity),
        "command": manifest.get("command"),
        "reason": reason.strip(),
        "updated": now,
        "history": history + [entry],
    }
    doc = {"schema": SCHEMA, "header": header, "metrics": {n: s.to_json() for n, s in metrics.items()}}
    return doc, changes


def golden_file_name(name: str, manifest: dict) -> str:
    """Where a golden suite keeps entry `name`'s file, relative to the suite: `NAME.json` for a CPU run. A
    CUDA run's bits depend on the GPU model and the torch, CUDA and transformers builds, so its file is
    keyed to them, `NAME/<gpu>-torch<v>-cuda<v>-transformers<v>.json`: each GPU environment is checked
    against its own golden file, never skipped for another's."""
    if not str(manifest.get("device") or "cpu").startswith("cuda"):
        return f"{name}.json"
    versions = manifest.get("versions") or {}
    parts = [str(manifest.get("device_name"))] + [f"{p}{versions.get(p)}" for p in ("torch", "cuda", "transformers")]
    return f"{name}/{'-'.join(re.sub(r'[^a-z0-9.]+', '_', p.lower()).strip('_') for p in parts)}.json"


def write_golden(path: str | Path, doc: dict) -> None:
    path = Path(path)
    if path.is_dir():
        raise BadInput("is a directory; give the golden file's path", path=path)
    if not path.parent.is_dir():
        raise BadInput("its directory does not exist", path=path)
    atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode())


def same_series(a: dict[int, float], b: dict[int, float]) -> bool:
    """The same steps with the same values bit for bit (same_bits): `golden update` lists a metric whose
    series is not so as changed, and `check golden` notes when every compared series is so."""
    return a.keys() == b.keys() and all(same_bits(a[s], b[s]) for s in a)


def same_bits(a: float, b: float) -> bool:
    """Equal as logged: NaN equals NaN, and 0.0 is not -0.0."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
