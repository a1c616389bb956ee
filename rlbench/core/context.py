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

from rlbench import __version__, numerics
from rlbench.config import RunConfig
from rlbench.core.data import PromptCursor, load_dataset
from rlbench.core.model import build_model, file_digest, load_named_, load_safetensors, load_tokenizer, named_weights
from rlbench.core.protocols import RolloutEngine
from rlbench.core.reward import RewardInput, load_reward_fn
from rlbench.core.seeding import configure_determinism
from rlbench.core.types import Prompt
from rlbench.errors import BadInput
from rlbench.rundir.digest import weights_digest
from rlbench.rundir.recording import read_step
from rlbench.rundir.directory import SCHEMA, RunDir, RunWriter, read_run

STAGES = ("data", "rollout", "reward", "advantage", "logprob", "train", "sync")
# The packages whose versions a run records: those it used. Every run uses these; a backend adds its own.
_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
_BACKEND_PACKAGES = {("train", "megatron"): ("megatron-core",), ("rollout", "sglang"): ("sglang", "sglang-router"),
                     ("placement", "ray"): ("ray",)}


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
    model_weights: dict | None = None  # the weights the model was built with, until the first sync checks them


def versions(config: RunConfig | None = None) -> dict[str, str | None]:
    """Python, rlbench and the packages the run uses (`config`'s backends), with their versions."""
    packages = list(_PACKAGES)
    if config is not None:
        for (section, backend), extra in _BACKEND_PACKAGES.items():
            trains = section != "train" or getattr(config, "mode", "full") != "rollout-only"
            if trains and getattr(getattr(config, section, None), "backend", None) == backend:
                packages += extra
    found = {"python": sys.version.split()[0], "rlbench": __version__}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    if config is not None and str(getattr(config, "device", "cpu")).startswith("cuda"):
        import torch

        found["cuda"] = torch.version.cuda  # the CUDA build's kernels decide a GPU run's bits too
    return found


def _device_name(device: str) -> str | None:
    """The accelerator's model (results differ across GPU models); None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def _encode_prompts(tokenizer, dataset: list[Prompt], limit: int = 1 << 30,
                    source: str = "") -> dict[int, tuple[int, ...]]:
    """Each prompt rendered by the chat template and tokenised once, up front; one that leaves no room
    for the response in the model's context (`limit` tokens) is bad input."""
    encoded = {}
    for prompt in dataset:
        ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if len(ids) > limit:
            raise BadInput(f"prompt {prompt.index} renders to {len(ids)} tokens; with the response it must fit the "
                           f"model's {limit} + max_new_tokens positions", path=source)
        encoded[prompt.index] = tuple(int(t) for t in ids)
    return encoded


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
            raise BadInput(f"the recording in {run.root} was made with another {what} (sha256 {hashes[key][:12]}, "
                           f"this one is {here[:12]})", path=path)


def _initial_weights(model, source: RunDir | None) -> None:
    """Train-only: start from the recording's initial weights (its checkpoint 0, else its seed),
    and insist they are the ones it recorded."""
    if source is None:
        return
    first = source.root / "checkpoints" / "000000" / "model.safetensors"
    if first.is_file():
        load_named_(model, load_safetensors(first), source=first)
    recorded = source.manifest.get("hashes", {}).get("initial_weights")
    here = weights_digest(named_weights(model))
    if recorded is not None and recorded != here:
        raise BadInput(f"initial weights {here[:12]} are not the recording's ({recorded[:12]}): another model "
                       "or seed", path=source.root / "manifest.json", field="hashes.initial_weights")


def build(config: RunConfig, init_checkpoint: Path | None = None, start: int = 0, resume: bool = False,
          command: str | None = None) -> Context:
    if config.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"no CUDA device: this torch ({torch.__version__}) sees none", field="device")
        if int(config.device.partition(":")[2] or 0) >= torch.cuda.device_count():
            raise BadInput(f"{config.device}: this machine has {torch.cuda.device_count()} CUDA device(s)",
                           field="device")
    _check_installed(config)
    determinism = configure_determinism(config.threads, config.device, config.deterministic)
    source = read_run(config.rollouts) if config.mode == "train-only" else None
    tokenizer = load_tokenizer(config.model.tokenizer)
    if tokenizer.eos_token_id is None:
        raise BadInput("tokenizer has no eos_token (the stop token)", path=config.model.tokenizer)
    if source is not None:
        check_made_with(source, tokenizer=config.model.tokenizer)
        if source.steps[:config.steps] != list(range(config.steps)):
            raise BadInput(f"the recording's committed steps are not 0..{config.steps - 1}",
                           path=source.root / "metrics.jsonl")
        recorded_ids = 0
        for step in range(start, config.steps):  # every file verified before anything is written
            tokens = read_step(source.root, step)[0]["tokens"]
            recorded_ids = max(recorded_ids, int(tokens.max()) + 1 if tokens.numel() else 0)
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
    if source is not None and recorded_ids > vocab:
        raise BadInput(f"the recording holds token id {recorded_ids - 1}, outside the model's vocabulary ({vocab})",
                       path=source.root / "rollouts")
    _initial_weights(model, source)
    initial_digest = weights_digest(named_weights(model))

    model_weights = None
    if config.mode == "full" and start == 0:  # what the trainer's first export must equal (loop.first_sync)
        model_weights = {name: tensor.clone() for name, tensor in named_weights(model).items()}
    if init_checkpoint is not None and not (Path(init_checkpoint) / "state.json").is_file():
        raise BadInput("not a checkpoint (no state.json)", path=init_checkpoint)
    trainer = engine = None
    if config.placement.backend == "local" and config.mode in ("full", "train-only"):
        trainer = _local_trainer(config, model)
        if init_checkpoint is not None:
            trainer.load_checkpoint(Path(init_checkpoint))
    if config.placement.backend == "local" and config.mode != "train-only" and config.rollout.backend == "hf":
        from rlbench.backends.hf_engine import HFEngine

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
        "versions": versions(config),
        "platform": {"system": platform.system(), "machine": platform.machine(),
                     "platform": platform.platform(), "processor": platform.processor()},
        "device": config.device,
        "device_name": _device_name(config.device),
        "determinism": determinism,
        "numerics": numerics.identity(),
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
    positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    prompt_ids = _encode_prompts(tokenizer, dataset, positions - config.rollout.max_new_tokens, config.data.path)
    cursor = None if source is not None else PromptCursor(len(dataset), config.seed, config.data.prompts_per_step,
                                                           config.data.shuffle)
    writer = None
    try:  # the processes, actors and servers started from here on are stopped again if anything fails
        trainer, engine = _remote_backends(config, model, start, init_checkpoint, trainer, engine)
        if engine is not None and hasattr(engine, "server_info"):
            manifest["engines"] = engine.server_info
        manifest = json.loads(json.dumps(manifest))  # JSON-normal form (tuples become lists), as read back
        if config.out:
            writer = RunWriter(Path(config.out), None if resume else manifest, record=config.record)
    except BaseException:
        for backend in (engine, trainer):
            if backend is not None:
                backend.close()
        raise
    context = Context(config, tokenizer, dataset, cursor, prompt_ids, (tokenizer.eos_token_id,), engine, trainer,
                      reward_name, reward_fn, writer, manifest, config.rollout.n_samples_per_prompt,
                      generate_fn, generate_name, model_weights=model_weights)
    if generate_fn is not None:
        from rlbench.core.generate import GenerateEnv

        context.generate_env = GenerateEnv(engine, tokenizer, config.rollout.max_new_tokens,
                                           config.rollout.temperature, context.stop_token_ids,
                                           config.rollout.top_k, config.rollout.top_p)
    return context


def _check_installed(config: RunConfig) -> None:
    """What `config` needs is installed here: say so before anything is loaded or started."""
    import importlib.util

    rollout = config.rollout
    needs = []
    if rollout.backend == "sglang" and config.mode != "train-only":
        needs.append(("aiohttp", "rollout.backend", "pip install '.[router]'"))
        if rollout.use_router and not rollout.sglang_router_url:
            needs.append(("sglang_router", "rollout.use_router", "pip install '.[router]'"))
        if not (rollout.sglang_router_url or rollout.external_engine_addrs):
            needs.append(("sglang", "rollout.sglang_server", 'pip install "sglang[all]"; sglang_server = "rlbench" '
                          "(--sglang-server rlbench) starts rlbench serve instead") if rollout.sglang_server == "sglang"
                         else ("starlette", "rollout.sglang_server", "pip install '.[serve]'"))
    if config.placement.backend == "ray":
        needs.append(("ray", "placement.backend", "pip install '.[ray]'"))
    for module, field, how in needs:
        if importlib.util.find_spec(module) is None:
            raise BadInput(f"the {module} package is not installed here ({how})", field=field)


def _local_trainer(config: RunConfig, model, workers=None):
    """The trainer in this process (the megatron trainer's other ranks are processes it starts, or
    `workers`: launch.spawn says what they may be)."""
    if config.train.backend == "megatron":
        from rlbench.backends.megatron.trainer import MegatronTrainer

        return MegatronTrainer(model, config, workers)  # checks its settings, starts its other ranks
    from rlbench.backends.torch_trainer import TorchTrainer

    return TorchTrainer(model, config.train, config.algo, config.rollout.temperature, config.seed, config.device)


def _remote_backends(config: RunConfig, model, start: int, init_checkpoint: Path | None, trainer, engine):
    """The backends that live outside this process: Ray actors (`--placement ray`) and SGLang servers.
    Started last, once every input has been checked."""
    if config.placement.backend == "ray":
        from rlbench.placement.ray import place

        return place(config, model, start, init_checkpoint)
    if config.mode != "train-only" and config.rollout.backend == "sglang":
        from rlbench.backends.sglang.engine import open_engine

        engine = open_engine(config)
    return trainer, engine
