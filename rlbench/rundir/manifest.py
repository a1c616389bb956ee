"""A run's manifest (RUN/manifest.json): what made the run, assembled next to the run directory's schema.

The caller measures (the package versions, the device, the determinism settings, the hashes of the
inputs); `manifest` lays them out with the schema, the time, the whole config and the platform,
key by key in the order the file has always had. The engines' server info is added by the caller
once its servers are up, and RunWriter writes the result (directory.py).

Read back, sections.py holds each section to the type written here.
"""

from __future__ import annotations

import datetime
import platform
from typing import TYPE_CHECKING

from rlbench import numerics
from rlbench.rundir.algorithm import CHECKSUM, SCHEMA

if TYPE_CHECKING:
    from rlbench.config import RunConfig
    from rlbench.rundir.directory import RunDir


def manifest(
    config: RunConfig,
    *,
    command: str | None,
    stages: tuple[str, ...],
    reward_fn: str,
    versions: dict[str, str | None],
    device_name: str | None,
    determinism: dict,
    weights: dict | None,
    hashes: dict[str, str | None],
    vocab: dict[str, int] | None = None,
    source: RunDir | None = None,
) -> dict:
    """The manifest of a run of `config`: `command` is the command line that asked for it, `stages` the
    loop's stages in its mode, `reward_fn` the verifier's name, `weights` where the initial weights came
    from (a checkpoint's files, or a seed), `hashes` the sha256 of its input files and the checksum (`checksum`,
    the algorithm every tensor checksum of the run uses) of its initial weights, `vocab` the model's and the
    tokenizer's vocabulary sizes (core/vocab.py: which token ids are valid, which decode), `source` the
    recording a train-only run reads (None otherwise)."""
    made = {
        "schema": SCHEMA,
        "checksum": CHECKSUM,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "config": config.to_dict(),
        "seed": config.seed,
        "mode": config.mode,
        "stages": list(stages),
        "reward_fn": reward_fn,
        "versions": versions,
        "platform": {
            "system": platform.system(),
            "machine": platform.machine(),
            "platform": platform.platform(),
            "processor": platform.processor(),
        },
        "device": config.device,
        "device_name": device_name,
        "determinism": determinism,
        "weights": weights,
        "numerics": numerics.identity(),
        "hashes": hashes,
        "vocab": vocab,
    }
    if source is not None:
        made["source"] = {
            "run": str(source.root),
            "steps": len(source.steps),
            "created": source.manifest.get("created"),
        }
    return made


def device_name(device: str) -> str | None:
    """The accelerator's model (results differ across GPU models); None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(device))
