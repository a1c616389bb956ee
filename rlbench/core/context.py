"""Everything a run needs, built once from a `RunConfig`: tokenizer, data, backends, manifest.

Inputs are validated here, before anything is written, so bad input never leaves a half-made
run directory behind. Backends are chosen by name; the embedded ones are the only ones so far.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

from rlbench import __version__
from rlbench.config import RunConfig
from rlbench.core.data import PromptCursor, load_dataset
from rlbench.core.model import build_model, file_digest, load_tokenizer, named_weights
from rlbench.core.protocols import RolloutEngine
from rlbench.core.reward import RewardInput, load_reward_fn
from rlbench.core.seeding import configure_determinism
from rlbench.core.types import Prompt
from rlbench.errors import BadInput
from rlbench.replay.digest import weights_digest
from rlbench.replay.rundir import SCHEMA, RunWriter

STAGES = ("data", "rollout", "reward", "advantage", "logprob", "train", "sync")
_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "megatron-core", "sglang", "sglang-router", "ray")


@dataclass
class Context:
    config: RunConfig
    tokenizer: object
    dataset: list[Prompt]
    cursor: PromptCursor
    prompt_ids: dict[int, tuple[int, ...]]
    stop_token_ids: tuple[int, ...]
    engine: RolloutEngine
    trainer: object | None
    reward_name: str
    reward_fn: Callable[[RewardInput], float]
    writer: RunWriter | None
    manifest: dict


def _versions() -> dict[str, str | None]:
    found = {"python": sys.version.split()[0], "rlbench": __version__}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _encode_prompts(tokenizer, dataset: list[Prompt]) -> dict[int, tuple[int, ...]]:
    """Each prompt rendered by the chat template and tokenised once, up front."""
    encoded = {}
    for prompt in dataset:
        ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        encoded[prompt.index] = tuple(int(t) for t in ids)
    return encoded


def build(config: RunConfig) -> Context:
    determinism = configure_determinism(config.threads, config.device)
    tokenizer = load_tokenizer(config.model.tokenizer)
    if tokenizer.eos_token_id is None:
        raise BadInput("tokenizer has no eos_token (the stop token)", path=config.model.tokenizer)
    dataset = load_dataset(config.data.path, config.data.prompt_key, config.data.label_key)
    reward_name, reward_fn = load_reward_fn(config.reward.verifier, config.reward.custom_rm_path)
    model = build_model(config.model.path, config.seed, config.model.dtype, config.device)
    vocab = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise BadInput(f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}",
                       path=config.model.tokenizer)

    from rlbench.core.rollout_hf import HFEngine
    from rlbench.core.trainer_torch import TorchTrainer

    engine = HFEngine(model, device=config.device)
    trainer = None
    if config.mode == "full":
        trainer = TorchTrainer(model, config.train, config.algo, config.rollout.temperature, config.seed, config.device)
    manifest = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": config.to_dict(),
        "seed": config.seed,
        "mode": config.mode,
        "stages": list(STAGES if config.mode == "full" else STAGES[:3]),
        "reward_fn": reward_name,
        "versions": _versions(),
        "platform": {"system": platform.system(), "machine": platform.machine(),
                     "platform": platform.platform(), "processor": platform.processor()},
        "device": config.device,
        "determinism": determinism,
        "hashes": {
            "model_config": file_digest(Path(config.model.path) / "config.json"),
            "initial_weights": weights_digest(named_weights(model)),
            "tokenizer": file_digest(Path(config.model.tokenizer)),
            "dataset": file_digest(Path(config.data.path)),
        },
    }
    manifest = json.loads(json.dumps(manifest))  # JSON-normal form (tuples become lists), as read back
    prompt_ids = _encode_prompts(tokenizer, dataset)
    writer = RunWriter(Path(config.out), manifest, record=config.record) if config.out else None
    cursor = PromptCursor(len(dataset), config.seed, config.data.prompts_per_step, config.data.shuffle)
    return Context(config, tokenizer, dataset, cursor, prompt_ids, (tokenizer.eos_token_id,), engine, trainer,
                   reward_name, reward_fn, writer, manifest)
