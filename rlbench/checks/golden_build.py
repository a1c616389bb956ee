"""Golden files written (`rlbench golden update`, golden/regenerate.py): built from a run directory's metrics,
header and history, named by platform and versions, and written atomically. Their format and reading:
golden.py.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import re
from pathlib import Path

from rlbench.checks.golden import (
    SCHEMA,
    Golden,
    Series,
    run_versions,
    config_hash,
    config_identity,
    numerics_of,
    platform_of,
    run_series,
    same_series,
)
from rlbench.checks.golden_tolerance import (  # noqa: F401 - re-exported: golden files hold tolerances
    Tolerance,
    apply_override,
    default_tolerance,
    family_of,
    megatron_tolerance,
    parse_override,
    read_tolerance,
)
from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir
from rlbench.rundir.writes import atomic_write


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def build_golden(
    run: RunDir,
    reason: str,
    command: str,
    previous: Golden | None = None,
    overrides: list[tuple[str, dict]] = (),
    interval: int = 1,
) -> tuple[dict, dict]:
    """The golden document for `run` (and what changed against `previous`): every metric logged at
    every committed step from its first (the actor's start after PPO's critic-only steps), on a grid of `interval`
    steps; tolerances from the family defaults, with
    the overrides `previous` carried and the new ones applied. Returns (document, change summary)."""
    if not reason.strip():
        raise BadInput("give the reason for this update (it is kept in the file's history)", field="--reason")
    if not run.steps:
        raise BadInput("the run has no committed step", path=run.root / "metrics.jsonl")
    manifest = run.manifest
    identity = config_identity(manifest)
    metrics = {}
    for name, by_step in sorted(run_series(run).items()):
        # from the first grid step it is logged at (the actor's metrics after PPO's critic-only steps), every one
        steps = [s for s in run.steps[::interval] if s >= min(by_step)]
        if not steps or any(s not in by_step for s in steps):
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
        raise BadInput(
            "no metric is logged at every committed step: nothing to make a golden series of",
            path=run.root / "metrics.jsonl",
        )
    for glob, _ in overrides:
        if not any(fnmatch.fnmatchcase(name, glob) for name in metrics):
            raise BadInput(f"{glob!r} matches no metric of the run ({', '.join(metrics)})", field="--tolerance")
    old = previous.metrics if previous is not None else {}
    changes = {
        "added": sorted(set(metrics) - set(old)),
        "removed": sorted(set(old) - set(metrics)),
        "changed": sorted(n for n in metrics if n in old and not same_series(old[n].values, metrics[n].values)),
        "tolerance_changed": sorted(
            n for n in metrics if n in old and old[n].tolerance.to_json() != metrics[n].tolerance.to_json()
        ),
        "config_changed": previous is not None and previous.header.get("config_hash") != config_hash(identity),
        "platform_changed": previous is not None
        and (
            previous.header.get("platform") != platform_of(manifest)
            or previous.header.get("numerics") != numerics_of(manifest)
        ),
    }
    now = _now()
    entry = {
        "date": now,
        "reason": reason.strip(),
        "command": command,
        "run_command": manifest.get("command"),
        "run_created": manifest.get("created"),
        "platform": platform_of(manifest),
        "numerics": numerics_of(manifest),
        "versions": run_versions(manifest),
        "config_hash": config_hash(identity),
        "steps": [run.steps[0], run.steps[-1]],
        **changes,
    }
    history = list(previous.header.get("history", [])) if previous is not None else []
    header = {
        "platform": platform_of(manifest),
        "numerics": numerics_of(manifest),
        "device_name": manifest.get("device_name"),
        "versions": run_versions(manifest),
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
    try:
        atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode())
    except BaseException:  # the old file stands; leave no half-written temporary (atomic_write's name) beside it
        path.with_name(f".{path.name}.tmp").unlink(missing_ok=True)
        raise
