"""The weights and models `check logprobs --attribute` computes its states with (attribution_run.py): the trainer's
weights of each version, read from the run's checkpoints and held to the checksums the run recorded, and the model
copies (the engine's dtype, the trainer's) they are loaded into."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rlbench.backends.engine_numerics import DTYPES
from rlbench.rundir.directory import step_name


class Weights:
    """The trainer's weights of each version the attribution needs, read once each (the last few kept); version 0
    without a checkpoint is the model the run was built from (`initial()`, made only then). `seconds`: the time
    spent reading them."""

    def __init__(self, run, initial: Callable[[], dict[str, torch.Tensor]]):
        self.run, self.initial = run, initial
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.seconds = 0.0

    def path(self, version: int) -> Path:
        return self.run.root / "checkpoints" / step_name(version) / "model.safetensors"

    def has(self, version: int) -> bool:
        return version == 0 or self.path(version).is_file()

    def get(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.kept:
            start = time.perf_counter()
            from rlbench.core.model import load_safetensors
            from rlbench.replay.checkpoints import recorded_weights, verify_weights

            if len(self.kept) >= 3:
                self.kept.pop(next(iter(self.kept)))
            file = self.path(version)
            expected = recorded_weights(self.run, version) if file.is_file() else None
            if expected is not None:  # held to the weights checksum the run recorded for it (only what is read)
                self.kept[version] = verify_weights(file.parent, version, expected)
            else:
                self.kept[version] = load_safetensors(file) if file.is_file() else self.initial()
            self.seconds += time.perf_counter() - start
        return self.kept[version]


class ModelCopy:
    """A copy of the model in one dtype, loaded with one set of weights at a time (by a key)."""

    def __init__(self, model: torch.nn.Module, dtype: str, device: str):
        self.model = copy.deepcopy(model).to(device=device, dtype=DTYPES[dtype]).eval()
        self.model.requires_grad_(False)
        self.key = None

    def load(self, key, weights: Callable[..., dict[str, torch.Tensor]]) -> torch.nn.Module:
        """The model holding `weights(key)`, loaded unless it holds them already."""
        if key != self.key:
            from rlbench.core.model import load_named_

            load_named_(self.model, weights(key), source=str(key))
            self.key = key
        return self.model


def skeleton(path: str) -> torch.nn.Module:
    """The model of `path`'s config.json in float32, its weights allocated but not initialised (every use loads a
    version's first): the run's random or checkpoint initialisation is not paid again (seconds at a real size)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from rlbench.core.model import load_model_config

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(load_model_config(path), dtype=torch.float32, trust_remote_code=False)
    model.tie_weights()
    return model


def initial_weights(run, config) -> dict[str, torch.Tensor]:
    """The weights the run was built with (held to the initial weights' digest it recorded): version 0 where no
    checkpoint holds it (a rollout-only run, an import)."""
    from rlbench.checks.logprobs import verified_model
    from rlbench.core.model import named_weights

    return {k: v.detach().clone() for k, v in named_weights(verified_model(run, config)).items()}
