"""The backend interfaces, all in one file: rollout engine, trainer, reward function.

The embedded backends (`hf` engine, `torch` trainer) live in-tree; Megatron-core, SGLang and
Ray backends are imported lazily, only when chosen. The shapes here are for what comes next:
a trainer may span several ranks (megatron-core TP/DP: only rank 0 exports and records), and
an engine may be remote (SGLang over HTTP: it takes weights from disk, not from memory).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from rlbench.core.types import GenerateRequest, GenerateResult


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates samples and takes new weights. Must be batch-invariant: a request's result depends
    on the request (prompt, seed, parameters) and the weights, not on what else is in the batch."""

    engine_id: str

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]: ...

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Take Hugging Face-named tensors as weight version `version` (in-process: copied into the
        model; SGLang: written to disk, then /update_weights_from_disk on every server)."""

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """For each copy of the weights the engine holds (one in-process, one per server), its id ->
        tensor name -> checksum of (name, dtype, shape, bytes) (rundir/digest.py): what the weight-update
        check compares with the trainer's export."""

    def export_weights(self, holder: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The named tensors of one copy, to show where a checksum differs."""

    def close(self) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """Computes log-probs and takes optimizer steps. A multi-rank trainer (megatron) is held by rank
    0, which sends every call to all ranks and returns rank 0's result: only it exports weights,
    checkpoints and reports (`is_main`)."""

    is_main: bool

    def logprobs(
        self,
        tokens: torch.Tensor,
        reference: bool = False,
        lengths: torch.Tensor | None = None,
        per_sample: bool = False,
    ) -> torch.Tensor:
        """[n, L] log-prob of each token of right-padded `tokens` given its prefix, under the current
        (or the reference) policy; position 0 gets 0. `per_sample`: one sequence at a time at its
        own length (`lengths`), the batch-invariant forward true on-policy shares with the engine."""

    def train_step(self, batch: TrainBatch, step: int) -> TrainStats: ...

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """Full (gathered) weights under Hugging Face names; empty on ranks that are not main."""

    def save_checkpoint(self) -> dict[str, bytes | memoryview]:
        """The checkpoint's files (name -> their bytes, or a buffer holding them, made at the call: later steps
        do not change it); the run directory writes them atomically."""

    def load_checkpoint(self, directory: Path) -> None: ...

    def close(self) -> None:
        """Release what the trainer holds (a multi-rank trainer stops its rank processes)."""


class RewardFn(Protocol):
    """A verifier: `fn(sample) -> float`, called once per sample after generation."""

    def __call__(self, sample: RewardInput) -> float: ...


# Imported at the end: these modules import nothing from here, and the Protocols above name them.
from rlbench.core.algo import TrainBatch, TrainStats  # noqa: E402
from rlbench.core.reward import RewardInput  # noqa: E402
