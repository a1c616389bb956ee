"""The weights and models `check logprobs --attribute` computes its states with (attribution_run.py): the trainer's
weights of each version, read from the run's checkpoints and held to the checksums the run recorded, and the model
copies (the engine's dtype, the trainer's) they are loaded into."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from rlbench.backends.engine_numerics import DTYPES
from rlbench.rundir.directory import step_name


class Weights:
    """The trainer's weights of each version the attribution needs, read once each (the last few kept); version 0
    without a checkpoint is the model the run was built from (`initial()`, made only then). `prefetch` reads and
    verifies a checkpoint's in a thread while the forwards of a step run (the reading and hashing let go of the
    interpreter's lock). `seconds`: the time spent waiting for them."""

    def __init__(self, run, initial: Callable[[], dict[str, torch.Tensor]]):
        self.run, self.initial = run, initial
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.pending: dict[int, Future] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlbench-weights")
        self.seconds = 0.0

    def prefetch(self, version: int) -> None:
        """Start reading checkpoint `version`'s weights (a version without one: nothing); `get` waits for them."""
        if version not in self.kept and version not in self.pending and self.path(version).is_file():
            self.pending[version] = self.pool.submit(self._read, version)

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=True)

    def path(self, version: int) -> Path:
        return self.run.root / "checkpoints" / step_name(version) / "model.safetensors"

    def has(self, version: int) -> bool:
        return version == 0 or self.path(version).is_file()

    def get(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.kept:
            start = time.perf_counter()
            future = self.pending.pop(version, None)
            weights = future.result() if future is not None else self._read(version)
            if len(self.kept) >= 3:
                self.kept.pop(next(iter(self.kept)))
            self.kept[version] = weights
            self.seconds += time.perf_counter() - start
        return self.kept[version]

    def _read(self, version: int) -> dict[str, torch.Tensor]:
        from rlbench.core.model import load_safetensors
        from rlbench.replay.checkpoints import recorded_weights, verify_weights

        file = self.path(version)
        expected = recorded_weights(self.run, version) if file.is_file() else None
        if expected is not None:  # held to the weights checksum the run recorded for it (only what is read)
            return verify_weights(file.parent, version, expected)
        return load_safetensors(file) if file.is_file() else self.initial()


class ModelCopy:
    """A model (taken, not copied) in one dtype on the device, loaded with one set of weights at a time (by a key)."""

    def __init__(self, model: torch.nn.Module, dtype: str, device: str):
        self.model = model.to(device=device, dtype=DTYPES[dtype]).eval()
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
