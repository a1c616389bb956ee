"""Run configuration: one small frozen dataclass per component, composed into `RunConfig`.

A config comes from the defaults here, then a TOML file (`--config`), then CLI overrides.
Every value is validated once, on construction, and a bad one raises `BadInput` naming the
file and the key. The resolved config is written whole into the run's manifest.

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
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from rlbench.errors import BadInput

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "fixtures"

Mode = Literal["full", "rollout-only", "train-only"]
MODES = ("full", "rollout-only", "train-only")


def _check(ok: bool, key: str, expected: str, got: Any) -> None:
    if not ok:
        raise BadInput(f"expected {expected}, got {got!r}", field=key)


@dataclass(frozen=True)
class ModelConfig:
    """Where the model config (and optional weights) and the tokenizer live."""

    path: str = str(FIXTURES / "models" / "tiny-qwen3")
    tokenizer: str = str(FIXTURES / "tokenizers" / "qwen-tiny")
    dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        _check(self.dtype in ("float32", "bfloat16"), "model.dtype", "float32 or bfloat16", self.dtype)


@dataclass(frozen=True)
class DataConfig:
    """The prompt dataset (JSONL) and how many prompts a step takes."""

    path: str = str(FIXTURES / "data" / "parity.jsonl")
    prompt_key: str = "prompt"
    label_key: str = "label"
    shuffle: bool = True
    prompts_per_step: int = 4  # slime: rollout_batch_size (4 x 16 samples: see the README, "Why the default run learns")

    def __post_init__(self) -> None:
        _check(self.prompts_per_step >= 1, "data.prompts_per_step", "an integer >= 1", self.prompts_per_step)


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine and its sampling parameters."""

    backend: Literal["hf"] = "hf"
    n_samples_per_prompt: int = 16
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_k: int = -1  # SGLang's sampling_params.top_k: -1 (or 0) = every token
    top_p: float = 1.0  # SGLang's sampling_params.top_p: 1.0 = every token
    # The embedded engine's decode: "batched" (fixed-shape buckets) or "per-sample" (the reference,
    # one request at a time); both are batch-invariant (rlbench/backends/hf_engine.py).
    decode: Literal["batched", "per-sample"] = "batched"
    decode_batch_size: int = 64  # rows of every batched decode forward (fixed: padding fills it)
    sampling_seed: int | None = None  # slime's --rollout-seed: samples draw from it instead of the master seed
    # Report each token's log-prob from a teacher-forced forward of the whole sequence at batch
    # size 1, the forward the trainer's logprob stage then also uses: equal bits on both sides.
    true_on_policy: bool = False
    custom_generate_function_path: str | None = None  # multi-turn / agentic rollouts (rlbench/core/generate.py)

    def __post_init__(self) -> None:
        _check(self.backend in ("hf",), "rollout.backend", "one of: hf", self.backend)
        _check(self.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt", "an integer >= 1",
               self.n_samples_per_prompt)
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "an integer >= 1", self.max_new_tokens)
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "rollout.temperature",
               "a finite number >= 0 (0 = greedy)", self.temperature)
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "rollout.top_k", "-1, 0 (both off) or a count >= 1",
               self.top_k)
        _check(math.isfinite(self.top_p) and 0 < self.top_p <= 1, "rollout.top_p", "a number in (0, 1] (1 = off)",
               self.top_p)
        _check(self.decode in ("batched", "per-sample"), "rollout.decode", "batched or per-sample", self.decode)
        _check(self.decode_batch_size >= 1, "rollout.decode_batch_size", "an integer >= 1", self.decode_batch_size)
        _check(self.sampling_seed is None or (isinstance(self.sampling_seed, int) and 0 <= self.sampling_seed < 2**63),
               "rollout.sampling_seed", "an integer in [0, 2**63)", self.sampling_seed)


@dataclass(frozen=True)
class RewardConfig:
    """The verifier: a built-in one by name, or a function by dotted path (`--custom-rm-path`)."""

    verifier: str = "parity"
    custom_rm_path: str | None = None


@dataclass(frozen=True)
class AlgoConfig:
    """GRPO advantages, PPO-clip policy loss, optional KL to the initial (reference) policy, entropy."""

    advantage: Literal["grpo"] = "grpo"
    normalize_std: bool = True
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_type: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        _check(self.advantage == "grpo", "algo.advantage", "grpo", self.advantage)
        _check(self.eps_clip > 0, "algo.eps_clip", "a number > 0", self.eps_clip)
        _check(self.eps_clip_high > 0, "algo.eps_clip_high", "a number > 0", self.eps_clip_high)
        _check(self.kl_coef >= 0, "algo.kl_coef", "a number >= 0", self.kl_coef)
        _check(self.kl_type in ("k1", "k3"), "algo.kl_type", "k1 or k3", self.kl_type)
        _check(self.entropy_coef >= 0, "algo.entropy_coef", "a number >= 0", self.entropy_coef)


@dataclass(frozen=True)
class TrainConfig:
    """The trainer: AdamW, optimizer steps per rollout step, micro-batches, gradient clipping."""

    backend: Literal["torch"] = "torch"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    minibatches: int = 4  # optimizer steps per rollout step (slime: n_samples / global_batch_size)
    micro_batch_size: int = 64  # also the no-grad log-prob pass: one forward for the default step
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _check(self.backend in ("torch",), "train.backend", "one of: torch", self.backend)
        _check(self.lr > 0 and math.isfinite(self.lr), "train.lr", "a finite number > 0", self.lr)
        _check(self.weight_decay >= 0, "train.weight_decay", "a number >= 0", self.weight_decay)
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "train.betas",
               "two numbers in [0, 1)", self.betas)
        _check(self.minibatches >= 1, "train.minibatches", "an integer >= 1", self.minibatches)
        _check(self.micro_batch_size >= 1, "train.micro_batch_size", "an integer >= 1", self.micro_batch_size)
        _check(self.grad_clip > 0, "train.grad_clip", "a number > 0", self.grad_clip)


@dataclass(frozen=True)
class RunConfig:
    """A whole run: the seed, the step count, the mode, where it is written, and the components."""

    seed: int = 1234
    steps: int = 100
    mode: Mode = "full"
    out: str | None = None
    rollouts: str | None = None  # train-only: the run directory whose recording is trained on
    record: bool = True  # write rollouts/ (the recording); metrics and checksums are always written
    checkpoint_every: int = 25
    threads: int = 1
    device: str = "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        _check(0 <= self.seed < 2**63, "seed", "an integer in [0, 2**63)", self.seed)
        _check(self.steps >= 1, "steps", "an integer >= 1", self.steps)
        _check(self.mode in MODES, "mode", " or ".join(MODES), self.mode)
        _check((self.mode == "train-only") == (self.rollouts is not None), "rollouts",
               "a recording (--rollouts RUN_DIR) exactly when mode is train-only", self.rollouts)
        _check(self.checkpoint_every >= 1, "checkpoint_every", "an integer >= 1", self.checkpoint_every)
        _check(self.threads >= 1, "threads", "an integer >= 1", self.threads)
        _check(self.device == "cpu" or self.device.startswith("cuda"), "device", "cpu or cuda[:N]", self.device)
        batch = self.data.prompts_per_step * self.rollout.n_samples_per_prompt
        _check(batch % self.train.minibatches == 0, "train.minibatches",
               f"a divisor of the step's sample count ({batch})", self.train.minibatches)

    @property
    def samples_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.n_samples_per_prompt

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


_SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig,
                    "reward": RewardConfig, "algo": AlgoConfig, "train": TrainConfig}


def _coerce(value: Any, default: Any, key: str) -> Any:
    """Check a TOML value against the type of the field's default (TOML has no tuples or None)."""
    if isinstance(default, bool):
        _check(isinstance(value, bool), key, "true or false", value)
    elif isinstance(default, int):
        _check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
    elif isinstance(default, float):
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number", value)
        value = float(value)
    elif isinstance(default, tuple):
        _check(isinstance(value, list) and len(value) == len(default), key, f"a list of {len(default)}", value)
        value = tuple(_coerce(v, d, key) for v, d in zip(value, default))
    elif isinstance(default, str):
        _check(isinstance(value, str), key, "a string", value)
    elif default is None:
        _check(isinstance(value, (str, int)) and not isinstance(value, bool), key, "a string or integer", value)
    return value


def _build(cls: type, table: dict, prefix: str, base_dir: Path) -> Any:
    known = {f.name: f for f in fields(cls)}
    defaults = cls()
    kwargs = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            raise BadInput(f"unknown key (known: {', '.join(sorted(known))})", field=dotted)
        if key in _SECTION_CLASSES and prefix == "":
            _check(isinstance(value, dict), dotted, "a table", value)
            kwargs[key] = _build(_SECTION_CLASSES[key], value, f"{key}.", base_dir)
            continue
        value = _coerce(value, getattr(defaults, key), dotted)
        if key in ("path", "tokenizer", "out", "rollouts") and isinstance(value, str):
            value = str((base_dir / value).resolve()) if not Path(value).is_absolute() else value
        kwargs[key] = value
    return cls(**kwargs)


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
        try:
            config = _build(RunConfig, table, "", path.parent)
        except BadInput as exc:
            raise BadInput(str(exc), path=path) from None
    return apply_overrides(config, **overrides)


def apply_overrides(config: RunConfig, **overrides: Any) -> RunConfig:
    """Set top-level fields (`seed=1`) or component fields (`rollout__temperature=0.0`); None means unset."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if "__" in key:
            section, name = key.split("__", 1)
            nested.setdefault(section, {})[name] = value
        else:
            top[key] = value
    for section, changes in nested.items():
        top[section] = dataclasses.replace(getattr(config, section), **changes)
    return dataclasses.replace(config, **top) if top else config


def config_from_dict(table: dict, source: str | Path) -> RunConfig:
    """A RunConfig from its `to_dict()` form, as a manifest holds it; `source` names the file for errors."""
    try:
        sections = {}
        for key, cls in _SECTION_CLASSES.items():
            if key in table:
                defaults = cls()
                sections[key] = cls(**{name: tuple(value) if isinstance(getattr(defaults, name, None), tuple) else value
                                       for name, value in table[key].items()})
        top = {k: v for k, v in table.items() if k not in _SECTION_CLASSES}
        return RunConfig(**top, **sections)
    except TypeError as exc:
        raise BadInput(f"config not understood ({exc})", path=source, field="config") from None
    except BadInput as exc:
        raise BadInput(str(exc), path=source) from None
