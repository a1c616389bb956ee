"""A run assembled and driven: everything it needs built once from a `RunConfig` (tokenizer, data, model,
backends, manifest: `build`), then its steps run in order (`run`).

This module sits above `core/` (the stages and what they read), `backends/` and `placement/`, since it is where
the choice between them is made. Inputs are validated here, before anything is written, so bad input never leaves
a half-made run directory behind. Which trainer and engine a run needs, and how each is made, is
backends/registry.py's to say; `build` makes them in this process, or has placement/ray.py make them in Ray
actors (`--placement ray`). A train-only run (and a replay) has no engine and no dataset: it reads a recording,
whose tokenizer and initial weights must be the ones this run has, else the comparison means nothing.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from rlbench import __version__
from rlbench.backends import registry
from rlbench.config import RunConfig, absolute_paths
from rlbench.core.context import Context, check_made_with
from rlbench.core.data import PromptCursor, encode_prompts, load_dataset
from rlbench.core.loop import (
    StepState,
    checkpoint,
    data,
    first_sync,
    record,
    recorded,
    reward,
    rollout,
    rollout_async,
    sync,
    timed,
    train_stages,
    verify,
)
from rlbench.core.pipeline import Pipeline
from rlbench.core.model import (
    build_model,
    file_digest,
    initial_weights,
    load_named_,
    load_safetensors,
    load_tokenizer,
    named_weights,
)
from rlbench.core.protocols import RolloutEngine, Trainer
from rlbench.core.reward import load_reward_fn
from rlbench.core import trackers
from rlbench.core.seeding import configure_determinism
from rlbench.core.types import Prompt
from rlbench.core.vocab import Vocab, model_vocab
from rlbench.errors import BadInput
from rlbench.rundir.digest import weights_digest
from rlbench.rundir.directory import RunDir, RunWriter, read_run
from rlbench.rundir.failpoints import hit
from rlbench.rundir.manifest import device_name, manifest
from rlbench.rundir.recording import finish_reasons, read_step
from rlbench.slime_rollout import slime_plugins

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rlbench.core.generate import GenerateEnv

STAGES = ("data", "rollout", "reward", "advantage", "logprob", "train", "sync")
# PPO with a critic: the critic's values before the advantage, its step after it (core/critic_stages.py)
PPO_STAGES = ("data", "rollout", "reward", "values", "advantage", "critic_train", "logprob", "train", "sync")
# The packages whose versions a run records: those it used. Every run uses these; a backend adds its own
# (registry.packages).
_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")


@dataclass
class RunResult:
    config: RunConfig
    manifest: dict
    history: list[dict]  # each step's metrics, with "step"
    wall_time: float
    start: int = 0


def run(
    config: RunConfig,
    on_step: Callable[[StepState], None] | None = None,
    *,
    start: int = 0,
    init_checkpoint: Path | None = None,
    expect: dict[int, dict] | None = None,
    write_from: int = 0,
    resume: bool = False,
    command: str | None = None,
) -> RunResult:
    """Run steps [start, config.steps). `command` is the command line that asked for the run (kept
    in the manifest, so a golden file can say how its values were made). `init_checkpoint` restores the trainer
    first; `expect` maps
    step -> checksums to verify (a mismatch raises Diverged); steps before `write_from` are verified
    but not written (resume recomputes committed steps). `on_step(state)` follows each step; when
    run() returns, every written step is committed to disk."""
    started = time.perf_counter()
    config = absolute_paths(config, keep=("out",))  # relative paths as the CLI's: against the working directory
    ctx = build(config, init_checkpoint=init_checkpoint, start=start, resume=resume, command=command)
    history = []
    pipe = Pipeline(ctx, config.steps) if config.rollout.async_mode != "off" else None
    try:
        trackers.attach(config, ctx.writer)  # W&B, TensorBoard: each step once committed (core/trackers.py)
        if ctx.engine is not None and ctx.trainer is not None:
            first_sync(ctx, start)
        if ctx.writer is not None and ctx.trainer is not None and start == 0 and not ctx.writer.has_checkpoint(0):
            checkpoint(ctx, 0)
        for step in range(start, config.steps):
            hit("step.start")
            state = StepState(step)
            with timed(state, "perf/step_time"):
                with timed(state, "perf/rollout_time"):
                    if pipe is not None:  # generated ahead, by the schedule (core/pipeline.py)
                        rollout_async(ctx, state, pipe)
                        reward(ctx, state)
                    elif ctx.engine is not None:
                        data(ctx, state)
                        rollout(ctx, state)
                        reward(ctx, state)
                    else:
                        recorded(ctx, state)
                if ctx.trainer is not None:
                    with timed(state, "perf/train_time"):
                        if pipe is not None:
                            pipe.start(step)  # the next groups generate on a thread while this step trains
                        train_stages(ctx, state)
                        if ctx.engine is not None:
                            if pipe is not None:
                                pipe.wait()  # as slime's sync waits for the generation in flight
                            sync(ctx, state)
            record(ctx, state, commit=step >= write_from)  # before verify: a diverging step is kept, for diff
            if expect is not None and step in expect:
                verify(expect[step], state)
            history.append({"step": step, **state.metrics})
            if on_step is not None:
                on_step(state)
    except BaseException:
        if ctx.writer is not None and ctx.writer.created and ctx.writer.commits == 0:
            ctx.writer.discard()  # failed before its first step: leave no half-made --out behind
        raise
    finally:  # an error or Ctrl-C still lands every step already handed to the writer
        if pipe is not None:
            pipe.close()  # before the engine closes under it
        if ctx.writer is not None:
            ctx.writer.close()
        if ctx.plugin_rollout is not None:
            ctx.plugin_rollout.close()
        if ctx.engine is not None:
            ctx.engine.close()
        if ctx.trainer is not None:
            ctx.trainer.close()
        if ctx.critic is not None:
            ctx.critic.close()
    return RunResult(config, ctx.manifest, history, time.perf_counter() - started, start)


def versions(config: RunConfig | None = None) -> dict[str, str | None]:
    """Python, rlbench and the packages the run uses (`config`'s backends), with their versions."""
    packages = list(_PACKAGES)
    if config is not None:
        packages += registry.packages(config)
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


def build(
    config: RunConfig,
    init_checkpoint: Path | None = None,
    start: int = 0,
    resume: bool = False,
    command: str | None = None,
) -> Context:
    """Everything the run needs, in order: every input is checked (devices, packages, the ranks the
    machine can place, the trainer's settings, the recording or the dataset and plugins, the model)
    before the trainer and engine are made in this process and the manifest is assembled; then the
    backends outside it (Ray actors, SGLang servers) start and the run directory is made, and a
    failure there stops what was started."""
    _check_device(config.device)
    registry.check_installed(config)
    trackers.check(config)
    registry.check_capacity(config)
    registry.check_trainer(config)
    determinism = configure_determinism(config.threads, config.device, config.deterministic)
    source = read_run(config.rollouts) if config.mode == "train-only" else None
    tokenizer = _tokenizer(config)
    recorded_ids = _check_recording(config, source, start) if source is not None else 0
    dataset, reward_name, reward_fn = _dataset_and_reward(config, source)
    generate_name, generate_fn = _generate_fn(config, source)
    plugin = slime_plugins(config, tokenizer, source)
    if plugin is not None:
        generate_name, generate_fn = "", None
        if plugin.reward is not None:  # slime's reward scores inside generate_and_rm, never in the reward stage
            reward_fn = None
    model, weights = _model(config, tokenizer, source, recorded_ids)
    initial_digest = weights_digest(named_weights(model))
    model_weights = _first_sync_reference(config, model, start)
    critic = registry.make_critic(config, model, init_checkpoint)  # torch: the trunk copied before its trainer's
    trainer, engine = _local_backends(config, model, start, init_checkpoint)
    if config.train.backend == "megatron":  # held by the trainer's ranks, beside the actor
        critic = registry.make_critic(config, model, init_checkpoint, trainer)
    made = _manifest(config, command, determinism, reward_name, weights, initial_digest, source, tokenizer)
    if critic is not None:  # what checkpoint 0's critic/ is held to (replay/checkpoints.py)
        made["hashes"]["initial_critic"] = weights_digest(critic.export_hf_weights())
    if plugin is not None:
        made["plugins"] = plugin.describe()
    elif generate_fn is not None:
        made["plugins"] = {"contract": "rlbench", "generate": generate_name}
    prompt_ids = _prompt_ids(config, tokenizer, dataset, model)
    cursor = (
        None
        if source is not None
        else PromptCursor(len(dataset), config.seed, config.data.prompts_per_step, config.data.shuffle)
    )
    trainer, engine, made, writer = _start(config, model, start, init_checkpoint, trainer, engine, made, resume, plugin)
    stop_token_ids = _stop_token_ids(config, tokenizer)
    generate_env = None if generate_fn is None else _generate_env(config, engine, tokenizer, stop_token_ids)
    return Context(
        config=config,
        tokenizer=tokenizer,
        dataset=dataset,
        cursor=cursor,
        prompt_ids=prompt_ids,
        stop_token_ids=stop_token_ids,
        engine=engine,
        trainer=trainer,
        reward_name=reward_name,
        reward_fn=reward_fn,
        writer=writer,
        manifest=made,
        group_size=config.rollout.n_samples_per_prompt,
        generate_fn=generate_fn,
        generate_name=generate_name,
        generate_env=generate_env,
        model_weights=model_weights,
        plugin_rollout=plugin,
        critic=critic,
    )


def _check_device(device: str) -> None:
    """A CUDA device the run names is there (BadInput before anything is loaded otherwise)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"no CUDA device: this torch ({torch.__version__}) sees none", field="device")
        if int(device.partition(":")[2] or 0) >= torch.cuda.device_count():
            raise BadInput(f"{device}: this machine has {torch.cuda.device_count()} CUDA device(s)", field="device")


def _tokenizer(config: RunConfig) -> PreTrainedTokenizerBase:
    """The run's tokenizer, which must have a stop token (its eos_token)."""
    tokenizer = load_tokenizer(config.model.tokenizer)
    if tokenizer.eos_token_id is None:
        raise BadInput("tokenizer has no eos_token (the stop token)", path=config.model.tokenizer)
    return tokenizer


def _check_recording(config: RunConfig, source: RunDir, start: int) -> int:
    """Train-only: the recording was made with this tokenizer, has committed steps 0..steps-1, and every
    step file from `start` on reads back whole, all verified before anything is written. Returns the
    highest token id it holds plus one (0 when it holds none), for the model's vocabulary to cover."""
    check_made_with(source, tokenizer=config.model.tokenizer)
    if source.steps[: config.steps] != list(range(config.steps)):
        raise BadInput(
            f"the recording's committed steps are not 0..{config.steps - 1}", path=source.root / "metrics.jsonl"
        )
    recorded_ids = 0
    for step in range(start, config.steps):
        tensors, meta = read_step(source.root, step)
        finish_reasons(source.root, step, meta["samples"])  # the rollout metrics are recomputed from them
        tokens = tensors["tokens"]
        recorded_ids = max(recorded_ids, int(tokens.max()) + 1 if tokens.numel() else 0)
    return recorded_ids


def _dataset_and_reward(config: RunConfig, source: RunDir | None) -> tuple[list[Prompt], str, Callable | None]:
    """The prompts and the verifier (its name and function); a train-only run has neither: its rewards
    are the recording's."""
    if source is not None:
        return [], "recorded", None
    if config.data.label_key is None and config.reward.custom_rm_path is None:
        raise BadInput(
            f"the built-in {config.reward.verifier!r} verifier scores a response against its row's label: "
            "name the label's key (--label-key) or give a reward function (--custom-rm-path)",
            field="data.label_key",
        )
    dataset = load_dataset(config.data.path, config.data.prompt_key, config.data.label_key)
    reward_name, reward_fn = load_reward_fn(config.reward.verifier, config.reward.custom_rm_path)
    return dataset, reward_name, reward_fn


def _generate_fn(config: RunConfig, source: RunDir | None) -> tuple[str, Callable | None]:
    """The custom generate function (its dotted path and the function), where the run generates and names one."""
    if source is not None or not config.rollout.custom_generate_function_path:
        return "", None
    from rlbench.core.generate import load_generate_fn

    return load_generate_fn(config.rollout.custom_generate_function_path)


def _model(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase, source: RunDir | None, recorded_ids: int
) -> tuple[PreTrainedModel, dict | None]:
    """The model the run starts from, and where its initial weights came from (the manifest's "weights").
    Its vocabulary must cover the tokenizer's tokens and (train-only) the recording's ids; a train-only
    run starts from the recording's initial weights."""
    model = build_model(config.model.path, config.seed, config.model.dtype, config.device, init=config.model.init)
    vocab = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise BadInput(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}", path=config.model.tokenizer
        )
    if source is not None and recorded_ids > vocab:
        raise BadInput(
            f"the recording holds token id {recorded_ids - 1}, outside the model's vocabulary ({vocab})",
            path=source.root / "rollouts",
        )
    weights = _initial_weights(model, source) or initial_weights(config.model.path, config.model.init, config.seed)
    return model, weights


def _first_sync_reference(config: RunConfig, model: PreTrainedModel, start: int) -> dict[str, torch.Tensor] | None:
    """A copy of the weights the model was built with, which the trainer's first export must equal
    (loop.first_sync): in a full run from step 0 only."""
    if config.mode == "full" and start == 0:
        return {name: tensor.clone() for name, tensor in named_weights(model).items()}
    return None


def _local_backends(
    config: RunConfig, model: PreTrainedModel, start: int, init_checkpoint: Path | None
) -> tuple[Trainer | None, RolloutEngine | None]:
    """The trainer (restored from `init_checkpoint`, if given) and the embedded engine, where the run has
    them in this process (`--placement local`). The others start in `_start`, once every input is checked."""
    if init_checkpoint is not None and not (Path(init_checkpoint) / "state.json").is_file():
        raise BadInput("not a checkpoint (no state.json)", path=init_checkpoint)
    trainer = engine = None
    if config.placement.backend == "local" and registry.trains(config):
        trainer = registry.make_trainer(config, model)
        if init_checkpoint is not None:
            trainer.load_checkpoint(Path(init_checkpoint))
    if config.placement.backend == "local" and registry.rolls_out(config) and config.rollout.backend == "hf":
        engine = registry.make_hf_engine(config, model, start, config.device)
    return trainer, engine


def _manifest(
    config: RunConfig,
    command: str | None,
    determinism: dict,
    reward_name: str,
    weights: dict | None,
    initial_digest: str,
    source: RunDir | None,
    tokenizer: PreTrainedTokenizerBase,
) -> dict:
    """The run's manifest (rundir/manifest.py lays it out), less the engines' server info, which `_start`
    adds once they are up. Its vocabulary: the model's and the tokenizer's sizes (core/vocab.py)."""
    line = PPO_STAGES if config.algo.advantage == "ppo" else STAGES
    stages = {"full": line, "rollout-only": line[:3], "train-only": ("recorded",) + line[3:-1]}[config.mode]
    hashes = {
        "model_config": file_digest(Path(config.model.path) / "config.json"),
        "initial_weights": initial_digest,
        "tokenizer": file_digest(Path(config.model.tokenizer)),
        "dataset": file_digest(Path(config.data.path)) if source is None else None,
    }
    return manifest(
        config,
        command=command,
        stages=stages,
        reward_fn=reward_name,
        versions=versions(config),
        device_name=device_name(config.device),
        determinism=determinism,
        weights=weights,
        hashes=hashes,
        vocab=Vocab(model_vocab(config.model.path), len(tokenizer)).as_manifest(),
        source=source,
    )


def _prompt_ids(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase, dataset: list[Prompt], model: PreTrainedModel
) -> dict[int, tuple[int, ...]]:
    """Each prompt's ids, each leaving room in the model's positions for max_new_tokens of response."""
    positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    data = config.data
    return encode_prompts(
        tokenizer,
        dataset,
        positions - config.rollout.max_new_tokens,
        data.path,
        data.chat_template_kwargs if data.apply_chat_template else None,
    )


def _start(
    config: RunConfig,
    model: PreTrainedModel,
    start: int,
    init_checkpoint: Path | None,
    trainer: Trainer | None,
    engine: RolloutEngine | None,
    made: dict,
    resume: bool,
    plugin=None,
) -> tuple[Trainer | None, RolloutEngine | None, dict, RunWriter | None]:
    """The backends outside this process (Ray actors under `--placement ray`, else the SGLang servers
    of `--rollout sglang`), the manifest completed with the engines' server info in JSON-normal form
    (tuples become lists, as read back), and the run directory (with --out). Whatever the run started
    is stopped again if anything here fails."""
    writer = None
    try:
        if config.placement.backend == "ray":
            from rlbench.placement.ray import place

            trainer, engine = place(config, model, start, init_checkpoint)
        elif registry.rolls_out(config) and config.rollout.backend == "sglang":
            engine = registry.open_sglang_engine(config)
        if engine is not None and hasattr(engine, "server_info"):
            made["engines"] = engine.server_info
        if plugin is not None:  # slime plugins: the engine behind /generate, their HTTP client
            plugin.start(engine)
        made = json.loads(json.dumps(made))
        if config.out:
            writer = RunWriter(Path(config.out), None if resume else made, record=config.record)
    except BaseException:
        for backend in (plugin, engine, trainer):
            if backend is not None:
                backend.close()
        raise
    return trainer, engine, made, writer


def _generate_env(
    config: RunConfig, engine: RolloutEngine | None, tokenizer: PreTrainedTokenizerBase, stop_token_ids: tuple[int, ...]
) -> GenerateEnv:
    """What a custom generate function samples through: the engine, with the run's sampling settings."""
    from rlbench.core.generate import GenerateEnv

    rollout = config.rollout
    return GenerateEnv(
        engine, tokenizer, rollout.max_new_tokens, rollout.temperature, stop_token_ids, rollout.top_k, rollout.top_p
    )


def _stop_token_ids(config: RunConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The tokenizer's eos, then the configured extra stops (each inside the vocabulary)."""
    extra = config.rollout.stop_token_ids
    outside = [t for t in extra if t >= len(tokenizer)]
    if outside:
        raise BadInput(
            f"token id {outside[0]} is outside the tokenizer's vocabulary ({len(tokenizer)})",
            field="rollout.stop_token_ids",
        )
    return tuple(dict.fromkeys((tokenizer.eos_token_id, *extra)))


def _initial_weights(model, source: RunDir | None) -> dict | None:
    """Train-only: start from the recording's initial weights (its checkpoint 0, else its seed),
    and insist they are the ones it recorded. Says where they came from when that is checkpoint 0."""
    if source is None:
        return None
    first = source.root / "checkpoints" / "000000" / "model.safetensors"
    loaded = None
    if first.is_file():
        load_named_(model, load_safetensors(first), source=first)
        loaded = {"init": "recording", "path": str(first.parent), "files": {first.name: file_digest(first)}}
    recorded = source.manifest.get("hashes", {}).get("initial_weights")
    here = weights_digest(named_weights(model))
    if recorded is not None and recorded != here:
        raise BadInput(
            f"initial weights {here[:12]} are not the recording's ({recorded[:12]}): another model or seed",
            path=source.root / "manifest.json",
            field="hashes.initial_weights",
        )
    return loaded
