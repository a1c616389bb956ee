"""A run's manifest (RUN/manifest.json): what made the run, assembled next to the run directory's schema.

The caller measures (the package versions, the device, the determinism settings, the hashes of the
inputs); `manifest` lays them out with the schema, the time, the whole config and the platform,
key by key in the order the file has always had. The engines' server info is added by the caller
once its servers are up, and RunWriter writes the result (directory.py).

Read back (directory.read_run, the one reader every command goes through), `check_sections` holds each
section to the type written here before any reader relies on it: a section of another type (`config.model`
a string, say) is one line naming the file and the field, exit 2, for every command alike.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from rlbench import numerics
from rlbench.errors import BadInput
from rlbench.rundir.algorithm import CHECKSUM
from rlbench.rundir.directory import SCHEMA

if TYPE_CHECKING:
    from rlbench.config import RunConfig
    from rlbench.rundir.directory import RunDir

# The manifest's own sections that are objects when written; null is read as absent (a run without them).
OBJECT_SECTIONS = ("versions", "platform", "determinism", "weights", "numerics", "hashes", "source", "engines")


def manifest(config: RunConfig, *, command: str | None, stages: tuple[str, ...], reward_fn: str,
             versions: dict[str, str | None], device_name: str | None, determinism: dict, weights: dict | None,
             hashes: dict[str, str | None], source: RunDir | None = None) -> dict:
    """The manifest of a run of `config`: `command` is the command line that asked for it, `stages` the
    loop's stages in its mode, `reward_fn` the verifier's name, `weights` where the initial weights came
    from (a checkpoint's files, or a seed), `hashes` the sha256 of its input files and the checksum (`checksum`,
    the algorithm every tensor checksum of the run uses) of its initial weights, `source` the recording a
    train-only run reads (None otherwise)."""
    made = {
        "schema": SCHEMA,
        "checksum": CHECKSUM,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "config": config.to_dict(),
        "seed": config.seed,
        "mode": config.mode,
        "stages": list(stages),
        "reward_fn": reward_fn,
        "versions": versions,
        "platform": {"system": platform.system(), "machine": platform.machine(),
                     "platform": platform.platform(), "processor": platform.processor()},
        "device": config.device,
        "device_name": device_name,
        "determinism": determinism,
        "weights": weights,
        "numerics": numerics.identity(),
        "hashes": hashes,
    }
    if source is not None:
        made["source"] = {"run": str(source.root), "steps": len(source.steps),
                          "created": source.manifest.get("created")}
    return made


def _config_tables() -> list[str]:
    """The config's tables, as `config.to_dict()` writes them: each section ("config.model") and each table
    inside one ("config.rollout.sglang")."""
    from rlbench.config import RunConfig

    tables, config = [], RunConfig()
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            tables.append(f"config.{section.name}")
            tables += [f"config.{section.name}.{f.name}" for f in dataclasses.fields(value)
                       if isinstance(getattr(value, f.name), dict)]
    return tables


def check_sections(made: dict, path: Path) -> None:
    """Every section of the manifest `made` (read from `path`) that is written as an object is one, or absent:
    BadInput naming the file and the field otherwise. The config's tables may not be null (a config always has
    them); the manifest's own sections may (older runs wrote some as null). Values inside are the readers'."""
    def refuse(field: str, got: object) -> BadInput:
        return BadInput(f"expected an object (a table), got {'null' if got is None else type(got).__name__}",
                        path=path, field=field)

    for key in OBJECT_SECTIONS:
        if made.get(key) is not None and not isinstance(made[key], dict):
            raise refuse(key, made[key])
    for field in _config_tables():
        node: object = made
        parts = field.split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and parts[-1] in node and not isinstance(node[parts[-1]], dict):
            raise refuse(field, node[parts[-1]])
