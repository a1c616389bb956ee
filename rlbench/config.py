"""Run configuration: the components (config_sections.py, one small frozen dataclass each) composed into
`RunConfig`, read from its defaults, a TOML file and CLI overrides.

A config comes from the defaults, then a TOML file (`--config`), then CLI overrides.
Every value is validated once, on construction, and a bad one raises `BadInput` naming the
file and the key. The resolved config is written whole into the run's manifest.

One rule for relative paths (the fields named in PATH_KEYS): a TOML file's are relative to the file's folder, the
command line's to the working directory (`absolute_paths`, which rlbench.command applies), and either is recorded
absolute, so a later command that reads the recorded config finds the same path from any working directory.

TOML layout: one table per component, keys as the dataclass fields:

    seed = 1234
    steps = 60
    [rollout]
    n_samples_per_prompt = 8
    [train]
    lr = 0.003
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from rlbench.errors import BadInput
from rlbench.validate import check, check_async, check_memory, check_weight_sync, number, text
from rlbench.config_sections import AlgoConfig, DataConfig, ModelConfig, RewardConfig, TrainConfig, setting
from rlbench.config_rollout import RolloutConfig
from rlbench.config_placement import PlacementConfig
from rlbench.config_tracking import TrackingConfig

Mode = Literal["full", "rollout-only", "train-only"]
MODES = ("full", "rollout-only", "train-only")


@dataclass(frozen=True)
class RunConfig:
    """A whole run: the seed, the step count, the mode, where it is written, and the components."""

    # 0: a round number, not a chosen seed (docs/design.md, "Why the default run learns": how many seeds learn)
    seed: int = setting(0, "Master seed; every random draw is derived from it.")
    # 100: the default run learns parity from its warm start on most seeds by then (docs/benchmarks.md)
    steps: int = setting(100, "Number of steps (rollout ids).")
    mode: Mode = setting(
        "full",
        "full: the whole loop. rollout-only: generate, score and record; train nothing. train-only: train on "
        "--rollouts, start no engine.",
    )
    out: str | None = setting(None, "Run directory to create; must be new or empty.")
    rollouts: str | None = setting(
        None,
        "train-only: the run directory whose recorded rollouts are trained on (its model, data and sampling settings "
        "come along).",
    )
    record: bool = setting(
        True, "Write rollouts/, the recording (metrics, checksums and checkpoints are always written)."
    )
    checkpoint_every: int = 25
    threads: int = setting(1, "torch CPU threads, fixed and recorded (results depend on it).")
    device: str = setting("cpu", "cpu or cuda[:N].")
    deterministic: bool = setting(
        False,
        "On a GPU: slime's reproducibility recipe (deterministic algorithms, cuBLAS workspace, NCCL Ring, Megatron "
        "deterministic mode), recorded in the manifest. The CPU is always deterministic.",
    )
    tp: int = setting(
        1, "megatron: tensor-parallel ranks; rlbench starts tp * dp rank processes (gloo on the CPU, NCCL on GPUs)."
    )
    dp: int = setting(1, "megatron: data-parallel ranks.")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        number(self.seed, "seed", 0, 2**63 - 1, integer=True)
        number(self.steps, "steps", 1, 10_000_000, integer=True)
        check(self.mode in MODES, "mode", " or ".join(MODES), self.mode)
        text(self.out, "out", optional=True)
        text(self.rollouts, "rollouts", optional=True)
        check(isinstance(self.record, bool), "record", "true or false", self.record)
        check(
            (self.mode == "train-only") == (self.rollouts is not None),
            "rollouts",
            "a recording (--rollouts RUN_DIR) exactly when mode is train-only",
            self.rollouts,
        )
        number(self.checkpoint_every, "checkpoint_every", 1, 10_000_000, integer=True)
        check_run_wide(self)
        check_async(self.rollout)
        check_weight_sync(self.rollout)
        check_memory(self)
        check(
            self.rollout.async_mode == "off" or self.mode == "full",
            "rollout.async_mode",
            "off in a rollout-only or train-only run (generating ahead needs a trainer and an engine)",
            self.rollout.async_mode,
        )
        if self.model.dtype == "float64":  # the CPU invariance check's precision, run where it runs
            check(
                self.device == "cpu",
                "model.dtype",
                f"float32 or bfloat16 on {self.device} (float64 runs on the CPU only)",
                self.model.dtype,
            )
            check(
                self.rollout.backend == "hf" or self.mode == "train-only",
                "model.dtype",
                "float32 or bfloat16 with the sglang rollout (SGLang serves no float64; float64 runs with the "
                "embedded engine, hf)",
                self.model.dtype,
            )
        if self.train.backend != "megatron":
            check(
                self.tp == self.dp == 1,
                "tp",
                "1 unless train.backend is megatron (--trainer megatron)",
                (self.tp, self.dp),
            )
        else:
            check(
                not self.rollout.true_on_policy,
                "rollout.true_on_policy",
                "false with the megatron trainer (the engine cannot run its forward)",
                self.rollout.true_on_policy,
            )
            check(
                self.model.dtype in ("float32", "float64", "bfloat16"),
                "model.dtype",
                "float32, float64 or bfloat16 with the megatron trainer",
                self.model.dtype,
            )
            check(
                self.device == "cpu" or self.tp * self.dp == 1 or self.device == "cuda",
                "device",
                "cuda (rank r takes cuda:r) when the megatron trainer spans ranks",
                self.device,
            )
        check_ppo(self)
        batch = self.data.prompts_per_step * self.rollout.n_samples_per_prompt
        check(
            batch % self.train.minibatches == 0,
            "train.minibatches",
            f"a divisor of the step's sample count ({batch})",
            self.train.minibatches,
        )

    @property
    def samples_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.n_samples_per_prompt

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def trainer_setup(self) -> TrainerSetup:
        """What the run's trainer reads of this config, and nothing else."""
        return TrainerSetup(
            model=self.model,
            train=self.train,
            algo=self.algo,
            temperature=self.rollout.temperature,
            tp=self.tp,
            dp=self.dp,
            device=self.device,
            deterministic=self.deterministic,
            seed=self.seed,
            threads=self.threads,
        )

    def engine_setup(self) -> EngineSetup:
        """What the run's SGLang engine and the servers it starts read of this config, and nothing else."""
        return EngineSetup(
            model=self.model, rollout=self.rollout, seed=self.seed, device=self.device, threads=self.threads
        )


def check_ppo(config: RunConfig) -> None:
    """PPO with a critic where it is built: the trainer in this process (torch, or megatron's rank 0 here), steps
    one after another."""
    ppo = config.algo.advantage == "ppo"
    check(
        config.train.critic_lr is None or ppo,
        "train.critic_lr",
        "unset unless algo.advantage is ppo (only a critic reads it)",
        config.train.critic_lr,
    )
    if not ppo:
        return
    check(
        config.placement.backend == "local",
        "algo.advantage",
        f"not ppo with placement {config.placement.backend} (the critic trains in this process: placement local)",
        config.algo.advantage,
    )
    check(
        config.rollout.async_mode == "off",
        "algo.advantage",
        "not ppo with an async rollout (not built yet: rollout.async_mode off)",
        config.algo.advantage,
    )


def check_run_wide(config) -> None:
    """The run-wide settings a RunConfig and a TrainerSetup both hold: torch threads, device, layout, determinism
    (validate.check and number: BadInput naming the first that is off)."""
    number(config.threads, "threads", 1, 1024, integer=True)
    check(
        isinstance(config.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", config.device) is not None,
        "device",
        "cpu, cuda or cuda:N",
        config.device,
    )
    number(config.tp, "tp", 1, 1024, integer=True)
    number(config.dp, "dp", 1, 1024, integer=True)
    check(isinstance(config.deterministic, bool), "deterministic", "true or false", config.deterministic)


@dataclass(frozen=True)
class TrainerSetup:
    """A trainer's own part of a run's config (torchtitan's components own their configs the same way): its
    sections (model, train, algo), the temperature its log-probs are taken at, and the run-wide settings each of
    its ranks needs (the TP x DP layout, device, determinism, seed, torch threads). `RunConfig.trainer_setup()`
    makes it from a checked config; the megatron trainer's ranks receive it (`to_dict`, then
    `setup_from_dict`), not the run's whole config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    temperature: float = 1.0
    tp: int = 1
    dp: int = 1
    device: str = "cpu"
    deterministic: bool = False
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        check_run_wide(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EngineSetup:
    """The SGLang engine's own part of a run's config: its sections (model, rollout) and the run-wide settings
    the servers it starts are given (seed, device, torch threads). `RunConfig.engine_setup()` makes it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int = 0
    device: str = "cpu"
    threads: int = 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def setup_from_dict(cls: type, table: Any, source: str | Path):
    """A TrainerSetup or EngineSetup from its `to_dict()` form, held to the types and ranges a TOML file is;
    `source` names where it came from for errors."""
    if not isinstance(table, dict):
        raise BadInput(f"expected an object, got {type(table).__name__}", path=source, field="setup")
    try:
        return _build(cls, table, "", Path("/"))
    except BadInput as exc:
        raise BadInput(f"setup.{exc}", path=source) from None


# The fields that hold a path, in whichever section: resolved against the TOML's folder, or the working directory.
PATH_KEYS = ("path", "tokenizer", "out", "rollouts", "weights_dir", "local_checkpoint_dir", "wandb_dir")
_NULLABLE = ("data.label_key",)  # string fields that may be unset (a manifest's null; TOML cannot say it)
_SECTION_CLASSES = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "algo": AlgoConfig,
    "train": TrainConfig,
    "placement": PlacementConfig,
    "tracking": TrackingConfig,
}


def _coerce(value: Any, default: Any, key: str) -> Any:
    """Check a TOML value against the type of the field's default (TOML has no tuples or None); a
    field whose default is None holds a string (paths, plugins) unless it is a seed."""
    if isinstance(default, bool):
        check(isinstance(value, bool), key, "true or false", value)
    elif isinstance(default, int):
        check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
    elif isinstance(default, float):
        check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number", value)
        value = float(value)
    elif default == () and key.endswith("_ids"):  # a list of any length: token ids
        check(
            isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
            key,
            "a list of integers",
            value,
        )
        value = tuple(value)
    elif default == ():  # a list of any length: strings (addresses)
        check(
            isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value), key, "a list of strings", value
        )
        value = tuple(value)
    elif isinstance(default, tuple):
        check(isinstance(value, (list, tuple)) and len(value) == len(default), key, f"a list of {len(default)}", value)
        value = tuple(_coerce(v, d, key) for v, d in zip(value, default))
    elif isinstance(default, str):
        text(value, key, optional=key in _NULLABLE)
    elif isinstance(default, dict):
        check(isinstance(value, dict), key, "a table", value)
    elif default is None and value is None:  # unset (a manifest's JSON null; TOML has no null)
        pass
    elif default is None and key in ("algo.eps_clip_c", "train.critic_lr"):  # a number or unset
        check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number", value)
        value = float(value)
    elif default is None and (
        key.endswith("seed")
        or key.endswith("num_cpus")
        or key in ("train.max_tokens_per_micro_batch", "rollout.max_staleness")
    ):  # an integer or unset
        check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
    elif default is None:
        text(value, key)
    return value


def _build(cls: type, table: dict, prefix: str, base_dir: Path) -> Any:
    known = {f.name: f for f in fields(cls)}
    defaults = cls()
    kwargs = {}
    if cls is ModelConfig and "path" in table and "init" not in table:
        kwargs["init"] = "checkpoint"  # a model of one's own is its weights; random weights only when asked
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            raise BadInput(f"unknown key (known: {', '.join(sorted(known))})", field=dotted)
        if key in _SECTION_CLASSES and prefix == "":
            check(isinstance(value, dict), dotted, "a table", value)
            kwargs[key] = _build(_SECTION_CLASSES[key], value, f"{key}.", base_dir)
            continue
        value = _coerce(value, getattr(defaults, key), dotted)
        if key in PATH_KEYS and isinstance(value, str):
            value = str((base_dir / value).resolve()) if not Path(value).is_absolute() else value
        kwargs[key] = value
    return cls(**kwargs)


def absolute_paths(config: RunConfig, keep: tuple[str, ...] = ()) -> RunConfig:
    """`config` with each relative path (PATH_KEYS) resolved against the working directory: what the command line
    gave (a TOML file's are absolute already). `keep`: top-level fields left as given."""

    def resolved(obj, skip=()):
        changes = {
            f.name: str(Path(value).resolve())
            for f in fields(obj)
            if f.name in PATH_KEYS and f.name not in skip
            for value in [getattr(obj, f.name)]
            if isinstance(value, str) and not Path(value).is_absolute()
        }
        return dataclasses.replace(obj, **changes) if changes else obj

    sections = {name: resolved(getattr(config, name)) for name in _SECTION_CLASSES}
    return dataclasses.replace(resolved(config, keep), **sections)


def file_keys(path: str | Path) -> set[str]:
    """The dotted keys a TOML config file sets (`rollout.temperature`); empty for a file that does not
    parse (load_config says why)."""
    try:
        table = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return set()
    return {
        f"{section}.{key}" if isinstance(value, dict) else section
        for section, value in table.items()
        for key in (value if isinstance(value, dict) else [None])
    }


def load_config(path: str | Path | None = None, **overrides: Any) -> RunConfig:
    """Defaults, then the TOML file at `path` (relative paths in it are relative to the file), then
    `overrides` (top-level fields, or `section__field` for a component's field)."""
    config = RunConfig()
    if path is not None:
        path = Path(path)
        try:
            table = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise BadInput("config file not found", path=path) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"cannot read config file ({exc.__class__.__name__})", path=path) from None
        except tomllib.TOMLDecodeError as exc:
            raise BadInput(f"invalid TOML ({exc})", path=path) from None
        except RecursionError:
            raise BadInput("invalid TOML: nested too deeply", path=path) from None
        try:
            config = _build(RunConfig, table, "", path.parent)
        except BadInput as exc:
            raise BadInput(str(exc), path=path) from None
    return apply_overrides(config, **overrides)


class _Null:
    """An override that sets a field to None (an override of None means "not given")."""

    def __repr__(self) -> str:
        return "NULL"


NULL = _Null()


def apply_overrides(config: RunConfig, **overrides: Any) -> RunConfig:
    """Set top-level fields (`seed=1`) or component fields (`rollout__temperature=0.0`); None means not
    given, `NULL` sets a field to None."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        value = None if value is NULL else value
        if "__" in key:
            section, name = key.split("__", 1)
            nested.setdefault(section, {})[name] = value
        else:
            top[key] = value
    model = nested.get("model", {})
    if "path" in model and "init" not in model:
        model["init"] = "checkpoint"  # as in a TOML file: a model path given means its weights
    for section, changes in nested.items():
        top[section] = dataclasses.replace(getattr(config, section), **changes)
    return dataclasses.replace(config, **top) if top else config


def config_from_dict(table: Any, source: str | Path) -> RunConfig:
    """A RunConfig from its `to_dict()` form, as a manifest holds it; `source` names the file for errors.
    Held to the same types and ranges as a TOML file (its paths are absolute already)."""
    if not isinstance(table, dict):
        raise BadInput(f"expected an object, got {type(table).__name__}", path=source, field="config")
    model = table.get("model")
    if isinstance(model, dict) and "init" not in model and isinstance(model.get("path"), str):
        # Written before model.init existed: the run loaded model.safetensors where there was one, else
        # drew random weights (rlbench read no other layout then). Read back as what it did.
        weights = (Path(model["path"]) / "model.safetensors").is_file()
        table = {**table, "model": {**model, "init": "checkpoint" if weights else "random"}}
    try:
        return _build(RunConfig, table, "", Path("/"))
    except BadInput as exc:
        raise BadInput(f"config.{exc}", path=source) from None
