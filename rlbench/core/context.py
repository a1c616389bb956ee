"""Everything a run needs, built once from a `RunConfig`: tokenizer, data, backends, manifest.

Inputs are validated here, before anything is written, so bad input never leaves a half-made
run directory behind. Backends are chosen by name; the embedded ones are the only ones so far.
A train-only run (and a replay) has no engine and no dataset: it reads a recording, whose
tokenizer and initial weights must be the ones this run has, else the comparison means nothing.
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
from rlbench.core.model import build_model, file_digest, load_named_, load_tokenizer, named_weights
from rlbench.core.protocols import RolloutEngine
from rlbench.core.reward import RewardInput, load_reward_fn
from rlbench.core.seeding import configure_determinism
from rlbench.core.types import Prompt
from rlbench.errors import BadInput
from rlbench.rundir.digest import weights_digest
from rlbench.rundir.recording import read_step
from rlbench.rundir.directory import SCHEMA, RunDir, RunWriter, read_run

STAGES = ("data", "rollout", "reward", "advantage", "logprob", "train", "sync")
# What each step's checksums.jsonl line holds, in the order the loop computes them.
STAGE_CHECKSUMS = ("data", "rollout_tokens", "rollout_logprobs", "rewards", "advantages", "old_logprobs", "loss",
                   "grads", "weights", "engine_weights")
_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "megatron-core", "sglang", "sglang-router", "ray")


@dataclass
class Context:
    config: RunConfig
    tokenizer: object
    dataset: list[Prompt]
    cursor: PromptCursor | None
    prompt_ids: dict[int, tuple[int, ...]]
    stop_token_ids: tuple[int, ...]
    engine: RolloutEngine | None
    trainer: object | None
    reward_name: str
    reward_fn: Callable[[RewardInput], float] | None
    writer: RunWriter | None
    manifest: dict
    group_size: int
    generate_fn: Callable | None = None
    generate_name: str = ""
    generate_env: object | None = None


def _versions() -> dict[str, str | None]:
    found = {"python": sys.version.split()[0], "rlbench": __version__}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _device_name(device: str) -> str | None:
    """The accelerator's model (results differ across GPU models); None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def _encode_prompts(tokenizer, dataset: list[Prompt]) -> dict[int, tuple[int, ...]]:
    """Each prompt rendered by the chat template and tokenised once, up front."""
    encoded = {}
    for prompt in dataset:
        ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        encoded[prompt.index] = tuple(int(t) for t in ids)
    return encoded


def _check_source(source: RunDir, tokenizer_dir: Path) -> None:
    """A recording is trained on with the tokenizer it was made with, or not at all."""
    recorded = source.manifest.get("hashes", {}).get("tokenizer")
    here = file_digest(tokenizer_dir)
    if recorded is not None and recorded != here:
        raise BadInput(f"the recording in {source.root} was made with another tokenizer (sha256 {recorded[:12]}, "
                       f"this one is {here[:12]})", path=tokenizer_dir)


def _initial_weights(model, source: RunDir | None) -> None:
    """Train-only: start from the recording's initial weights (its checkpoint 0, else its seed),
    and insist they are the ones it recorded."""
    if source is None:
        return
    from safetensors.torch import load_file

    first = source.root / "checkpoints" / "000000" / "model.safetensors"
    if first.is_file():
        load_named_(model, load_file(str(first)), source=first)
    recorded = source.manifest.get("hashes", {}).get("initial_weights")
    here = weights_digest(named_weights(model))
    if recorded is not None and recorded != here:
        raise BadInput(f"initial weights {here[:12]} are not the recording's ({recorded[:12]}): another model "
                       "or seed", path=source.root / "manifest.json", field="hashes.initial_weights")


def build(config: RunConfig, init_checkpoint: Path | None = None, start: int = 0, resume: bool = False,
          command: str | None = None) -> Context:
    determinism = configure_determinism(config.threads, config.device)
    source = read_run(config.rollouts) if config.mode == "train-only" else None
    tokenizer = load_tokenizer(config.model.tokenizer)
    if tokenizer.eos_token_id is None:
        raise BadInput("tokenizer has no eos_token (the stop token)", path=config.model.tokenizer)
    if source is not None:
        _check_source(source, Path(config.model.tokenizer))
        if source.steps[:config.steps] != list(range(config.steps)):
            raise BadInput(f"the recording's committed steps are not 0..{config.steps - 1}",
                           path=source.root / "metrics.jsonl")
        for step in range(start, config.steps):  # every file verified before anything is written
            read_step(source.root, step)
        dataset, reward_name, reward_fn = [], "recorded", None
    else:
        dataset = load_dataset(config.data.path, config.data.prompt_key, config.data.label_key)
        reward_name, reward_fn = load_reward_fn(config.reward.verifier, config.reward.custom_rm_path)
    generate_name, generate_fn = "", None
    if source is None and config.rollout.custom_generate_function_path:
        from rlbench.core.generate import load_generate_fn

        generate_name, generate_fn = load_generate_fn(config.rollout.custom_generate_function_path)
    model = build_model(config.model.path, config.seed, config.model.dtype, config.device)
    vocab = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise BadInput(f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}",
                       path=config.model.tokenizer)
    _initial_weights(model, source)
    initial_digest = weights_digest(named_weights(model))

    from rlbench.backends.hf_engine import HFEngine
    from rlbench.backends.torch_trainer import TorchTrainer

    trainer = None
    if config.mode in ("full", "train-only"):
        trainer = TorchTrainer(model, config.train, config.algo, config.rollout.temperature, config.seed, config.device)
        if init_checkpoint is not None:
            if not (Path(init_checkpoint) / "state.json").is_file():
                raise BadInput("not a checkpoint (no state.json)", path=init_checkpoint)
            trainer.load_checkpoint(Path(init_checkpoint))
    engine = None
    if config.mode != "train-only":
        engine = HFEngine(model, device=config.device, true_on_policy=config.rollout.true_on_policy,
                          decode=config.rollout.decode, batch_size=config.rollout.decode_batch_size)
        engine.weight_version = start
    stages = {"full": STAGES, "rollout-only": STAGES[:3], "train-only": ("recorded",) + STAGES[3:6]}[config.mode]
    manifest = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "config": config.to_dict(),
        "seed": config.seed,
        "mode": config.mode,
        "stages": list(stages),
        "reward_fn": reward_name,
        "versions": _versions(),
        "platform": {"system": platform.system(), "machine": platform.machine(),
                     "platform": platform.platform(), "processor": platform.processor()},
        "device": config.device,
        "device_name": _device_name(config.device),
        "determinism": determinism,
        "hashes": {
            "model_config": file_digest(Path(config.model.path) / "config.json"),
            "initial_weights": initial_digest,
            "tokenizer": file_digest(Path(config.model.tokenizer)),
            "dataset": file_digest(Path(config.data.path)) if source is None else None,
        },
    }
    if source is not None:
        manifest["source"] = {"run": str(source.root), "steps": len(source.steps),
                              "created": source.manifest.get("created")}
    manifest = json.loads(json.dumps(manifest))  # JSON-normal form (tuples become lists), as read back
    prompt_ids = _encode_prompts(tokenizer, dataset)
    writer = None
    if config.out:
        writer = RunWriter(Path(config.out), None if resume else manifest, record=config.record)
    cursor = None if source is not None else PromptCursor(len(dataset), config.seed, config.data.prompts_per_step,
                                                           config.data.shuffle)
    context = Context(config, tokenizer, dataset, cursor, prompt_ids, (tokenizer.eos_token_id,), engine, trainer,
                      reward_name, reward_fn, writer, manifest, config.rollout.n_samples_per_prompt,
                      generate_fn, generate_name)
    if generate_fn is not None:
        from rlbench.core.generate import GenerateEnv

        context.generate_env = GenerateEnv(engine, tokenizer, config.rollout.max_new_tokens,
                                           config.rollout.temperature, context.stop_token_ids,
                                           config.rollout.top_k, config.rollout.top_p)
    return context
