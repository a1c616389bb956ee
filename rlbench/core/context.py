"""What the loop's stages read (`Context`: a run's inputs, its backends and where it records), and the check
that a recording is read with the tokenizer and model it was made with. `rlbench.session.build` makes a
Context; the stages (core/loop.py) take it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbench.config import RunConfig
from rlbench.core.data import PromptCursor
from rlbench.core.model import file_digest
from rlbench.core.protocols import RolloutEngine, Trainer
from rlbench.core.reward import RewardInput
from rlbench.core.types import Prompt
from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir, RunWriter

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rlbench.core.generate import GenerateEnv, Trajectory


@dataclass(kw_only=True)
class Context:
    """What the loop reads, made once by `build`: the run's inputs, its backends, and where it records."""

    config: RunConfig
    tokenizer: PreTrainedTokenizerBase
    dataset: list[Prompt]  # empty in a train-only run, which reads a recording instead
    cursor: PromptCursor | None  # which prompts each step takes; None in a train-only run
    prompt_ids: dict[int, tuple[int, ...]]  # each prompt's rendered ids, by its index
    stop_token_ids: tuple[int, ...]
    engine: RolloutEngine | None  # None in a train-only run
    trainer: Trainer | None  # None in a rollout-only run
    reward_name: str
    reward_fn: Callable[[RewardInput], float] | None  # None where the rewards are recorded
    writer: RunWriter | None  # None without --out
    manifest: dict
    group_size: int
    generate_fn: Callable[..., Trajectory] | None = None
    generate_name: str = ""
    generate_env: GenerateEnv | None = None
    # slime plugins (rlbench/slime_rollout.py): rollout(step, prompts, prompt_ids) -> (samples, groups not trained)
    plugin_rollout: Any = None
    # The weights the model was built with, until the first sync checks the trainer's export against them.
    model_weights: dict[str, torch.Tensor] | None = None
    # The digests (whole, per tensor) of the weights last synced: what the engine holds until the next sync.
    synced: tuple[str, dict[str, str]] | None = None
    # PPO's critic (backends/critic_trainer.py), trained before the actor each step; None without one
    critic: Any = None


def check_made_with(run: RunDir, tokenizer: str | Path | None = None, model: str | Path | None = None) -> None:
    """A recording is read with the tokenizer and model it was made with, or not at all: each one given
    is held to the sha256 its manifest recorded (BadInput naming the file when another one is given)."""
    hashes = run.manifest.get("hashes") or {}
    for what, path, key in (("tokenizer", tokenizer, "tokenizer"), ("model config", model, "model_config")):
        if path is None or not isinstance(hashes.get(key), str):
            continue
        path = Path(path) / "config.json" if key == "model_config" else Path(path)
        here = file_digest(path) if path.exists() else "missing"
        if here != hashes[key]:
            raise BadInput(
                f"the recording in {run.root} was made with another {what} (sha256 {hashes[key][:12]}, "
                f"this one is {here[:12]})",
                path=path,
            )
