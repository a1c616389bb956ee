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
import re
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


def _number(value: Any, key: str, low: float, high: float, *, integer: bool = False, open_low: bool = False) -> None:
    """A finite number (an integer where `integer`) in [low, high] ((low, high] with `open_low`): every
    number a run is configured with is held to a sane range before anything runs on it."""
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if open_low else value >= low) and value <= high
    what = "an integer" if integer else "a finite number"
    _check(ok, key, f"{what} in {'(' if open_low else '['}{_bound(low)}, {_bound(high)}]", value)


def _bound(x: float) -> str:
    return "2**63 - 1" if x == 2**63 - 1 else f"{x:,}" if float(x).is_integer() else f"{x:g}"


def _text(value: Any, key: str, optional: bool = False) -> None:
    _check((isinstance(value, str) and "\x00" not in value) or (optional and value is None), key,
           "a string (without NUL)", value)


@dataclass(frozen=True)
class ModelConfig:
    """Where the model config (and optional weights) and the tokenizer live."""

    path: str = str(FIXTURES / "models" / "tiny-qwen3")
    tokenizer: str = str(FIXTURES / "tokenizers" / "qwen-tiny")
    dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        _text(self.path, "model.path")
        _text(self.tokenizer, "model.tokenizer")
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
        for key in ("path", "prompt_key", "label_key"):
            _text(getattr(self, key), f"data.{key}")
        _check(isinstance(self.shuffle, bool), "data.shuffle", "true or false", self.shuffle)
        _number(self.prompts_per_step, "data.prompts_per_step", 1, 100_000, integer=True)


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine and its sampling parameters. `hf`: the embedded engine, in-process.
    `sglang`: SGLang servers over HTTP (rlbench/backends/sglang/): an existing router
    (`sglang_router_url`), servers someone else runs (`external_engine_addrs`, with a router rlbench
    starts in front), or `num_engines` servers rlbench starts (`sglang_server`: sglang's own, or
    `rlbench serve`) with `[rollout.sglang]` / `--sglang-*` passed through to them."""

    backend: Literal["hf", "sglang"] = "hf"
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
    sglang_router_url: str | None = None  # an sglang-router someone else runs: its servers are its GET /workers
    external_engine_addrs: tuple[str, ...] = ()  # SGLang servers someone else runs (host:port or http://host:port)
    num_engines: int = 1  # else: the servers rlbench starts, and stops
    sglang_server: Literal["sglang", "rlbench"] = "sglang"  # what rlbench starts: sglang.launch_server, rlbench serve
    use_router: bool = True  # false: no router; the client spreads requests over the servers and retries elsewhere
    sglang: dict = field(default_factory=dict)  # --sglang-KEY VALUE: to the servers rlbench starts, as --KEY VALUE
    max_inflight: int = 256  # requests in flight at once
    request_timeout: float = 600.0  # seconds per HTTP request
    request_attempts: int = 5  # attempts of a request before the run stops (exit 2)
    verify_engine_weights: bool = True  # the weight-update check through /weights_checker (false for SGLang's own)
    weights_dir: str | None = None  # where weight versions are written for the servers to load (default: a temp dir)

    def __post_init__(self) -> None:
        _check(self.backend in ("hf", "sglang"), "rollout.backend", "one of: hf, sglang", self.backend)
        _number(self.n_samples_per_prompt, "rollout.n_samples_per_prompt", 1, 10_000, integer=True)
        _number(self.max_new_tokens, "rollout.max_new_tokens", 1, 100_000, integer=True)
        _number(self.temperature, "rollout.temperature", 0, 100)  # 0 = greedy
        if self.sampling_seed is not None:
            _number(self.sampling_seed, "rollout.sampling_seed", 0, 2**63 - 1, integer=True)
        _check(isinstance(self.true_on_policy, bool), "rollout.true_on_policy", "true or false", self.true_on_policy)
        _text(self.custom_generate_function_path, "rollout.custom_generate_function_path", optional=True)
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1, "rollout.top_k",
               "-1, 0 (both off) or a count >= 1", self.top_k)
        _number(self.top_p, "rollout.top_p", 0, 1, open_low=True)  # 1 = off
        _check(self.decode in ("batched", "per-sample"), "rollout.decode", "batched or per-sample", self.decode)
        _number(self.decode_batch_size, "rollout.decode_batch_size", 1, 100_000, integer=True)
        self._check_sglang()

    def _check_sglang(self) -> None:
        _text(self.sglang_router_url, "rollout.sglang_router_url", optional=True)
        _check(isinstance(self.external_engine_addrs, tuple) and all(
            isinstance(a, str) and a and "\x00" not in a for a in self.external_engine_addrs),
            "rollout.external_engine_addrs", "a list of host:port addresses", self.external_engine_addrs)
        _number(self.num_engines, "rollout.num_engines", 1, 4096, integer=True)
        _check(self.sglang_server in ("sglang", "rlbench"), "rollout.sglang_server", "sglang or rlbench",
               self.sglang_server)
        _check(isinstance(self.use_router, bool), "rollout.use_router", "true or false", self.use_router)
        _number(self.max_inflight, "rollout.max_inflight", 1, 100_000, integer=True)
        _number(self.request_timeout, "rollout.request_timeout", 0, 86_400, open_low=True)
        _number(self.request_attempts, "rollout.request_attempts", 1, 100, integer=True)
        _check(isinstance(self.verify_engine_weights, bool), "rollout.verify_engine_weights", "true or false",
               self.verify_engine_weights)
        _text(self.weights_dir, "rollout.weights_dir", optional=True)
        _check(isinstance(self.sglang, dict) and all(
            isinstance(k, str) and re.fullmatch(r"[a-z0-9][a-z0-9-]*", k) and (
                isinstance(v, (str, int, float, bool)) or (isinstance(v, list) and all(isinstance(x, (str, int, float))
                                                                                       for x in v)))
            for k, v in self.sglang.items()), "rollout.sglang",
            "server arguments as KEY = VALUE (KEY as on the server's command line, without --)", self.sglang)
        sglang = self.backend == "sglang"
        given = [name for name, on in (("sglang_router_url", self.sglang_router_url is not None),
                                       ("external_engine_addrs", bool(self.external_engine_addrs))) if on]
        _check(sglang or not given, f"rollout.{given[0] if given else ''}", "unset unless rollout.backend is sglang",
               "set")
        _check(len(given) < 2, "rollout.external_engine_addrs", "unset when rollout.sglang_router_url is set",
               self.external_engine_addrs)
        _check(not self.sglang or (sglang and not given), "rollout.sglang",
               "no server arguments unless rlbench starts the servers (rollout.backend sglang, no router url, "
               "no external addresses)", self.sglang)
        from rlbench.backends.sglang.fleet import OWNED, normalize_url  # a module without heavy imports

        for addr in self.external_engine_addrs:
            normalize_url(addr)
        if self.sglang_router_url is not None:
            normalize_url(self.sglang_router_url, "rollout.sglang_router_url")
        owned = [k for k in self.sglang if k in OWNED[self.sglang_server]]
        _check(not owned, "rollout.sglang",
               f"no arguments rlbench sets itself ({', '.join(OWNED[self.sglang_server])})", owned)
        _check(not (sglang and self.true_on_policy), "rollout.true_on_policy",
               "false with rollout.backend sglang (the server cannot run the trainer's forward)", self.true_on_policy)


@dataclass(frozen=True)
class PlacementConfig:
    """Where the pieces run. `local`: the trainer and the embedded engine in this process (the
    servers rlbench starts as processes of this machine). `ray`: the trainer and the rollout engines
    as Ray actors in one placement group, slime's shape (rlbench/placement/ray.py)."""

    backend: Literal["local", "ray"] = "local"
    ray_address: str | None = None  # an existing cluster ("auto", "HOST:6379", "ray://HOST:10001"); none: start one
    num_cpus: int | None = None  # the Ray instance rlbench starts: its logical CPUs (default: the machine's)

    def __post_init__(self) -> None:
        _check(self.backend in ("local", "ray"), "placement.backend", "local or ray", self.backend)
        _text(self.ray_address, "placement.ray_address", optional=True)
        if self.num_cpus is not None:
            _number(self.num_cpus, "placement.num_cpus", 1, 100_000, integer=True)
        _check(self.backend == "ray" or (self.ray_address is None and self.num_cpus is None),
               "placement.ray_address", "unset unless placement.backend is ray (--placement ray)",
               self.ray_address or self.num_cpus)


@dataclass(frozen=True)
class RewardConfig:
    """The verifier: a built-in one by name, or a function by dotted path (`--custom-rm-path`)."""

    verifier: str = "parity"
    custom_rm_path: str | None = None

    def __post_init__(self) -> None:
        _text(self.verifier, "reward.verifier")
        _text(self.custom_rm_path, "reward.custom_rm_path", optional=True)


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
        _check(isinstance(self.normalize_std, bool), "algo.normalize_std", "true or false", self.normalize_std)
        _number(self.eps_clip, "algo.eps_clip", 0, 10, open_low=True)
        _number(self.eps_clip_high, "algo.eps_clip_high", 0, 10, open_low=True)
        _number(self.kl_coef, "algo.kl_coef", 0, 1000)
        _check(self.kl_type in ("k1", "k3"), "algo.kl_type", "k1 or k3", self.kl_type)
        _number(self.entropy_coef, "algo.entropy_coef", 0, 1000)


@dataclass(frozen=True)
class TrainConfig:
    """The trainer: AdamW, optimizer steps per rollout step, micro-batches, gradient clipping.
    `megatron` (the `[train.megatron]` table) passes through unchanged to megatron-core's
    TransformerConfig; only the megatron trainer reads it."""

    backend: Literal["torch", "megatron"] = "torch"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    minibatches: int = 4  # optimizer steps per rollout step (slime: n_samples / global_batch_size)
    micro_batch_size: int = 64  # also the no-grad log-prob pass: one forward for the default step
    grad_clip: float = 1.0
    megatron: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.backend in ("torch", "megatron"), "train.backend", "one of: torch, megatron", self.backend)
        _check(isinstance(self.megatron, dict), "train.megatron", "a table", self.megatron)
        _check(not self.megatron or self.backend == "megatron", "train.megatron",
               "no [train.megatron] settings unless train.backend is megatron", self.megatron)
        _number(self.lr, "train.lr", 0, 10, open_low=True)
        _number(self.weight_decay, "train.weight_decay", 0, 1)
        _check(isinstance(self.betas, tuple) and len(self.betas) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in self.betas),
            "train.betas", "two numbers in [0, 1)", self.betas)
        _number(self.adam_eps, "train.adam_eps", 0, 1, open_low=True)
        _number(self.minibatches, "train.minibatches", 1, 100_000, integer=True)
        _number(self.micro_batch_size, "train.micro_batch_size", 1, 100_000, integer=True)
        _number(self.grad_clip, "train.grad_clip", 0, 1e6, open_low=True)


@dataclass(frozen=True)
class RunConfig:
    """A whole run: the seed, the step count, the mode, where it is written, and the components."""

    seed: int = 1234
    steps: int = 85  # the default run learns parity by about step 80 (README, "Why the default run learns")
    mode: Mode = "full"
    out: str | None = None
    rollouts: str | None = None  # train-only: the run directory whose recording is trained on
    record: bool = True  # write rollouts/ (the recording); metrics and checksums are always written
    checkpoint_every: int = 25
    threads: int = 1
    device: str = "cpu"
    deterministic: bool = False  # on a GPU: slime's reproducibility recipe (the CPU is always deterministic)
    tp: int = 1  # megatron trainer: tensor-parallel ranks
    dp: int = 1  # megatron trainer: data-parallel ranks (rlbench starts tp * dp rank processes)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self) -> None:
        _number(self.seed, "seed", 0, 2**63 - 1, integer=True)
        _number(self.steps, "steps", 1, 10_000_000, integer=True)
        _check(self.mode in MODES, "mode", " or ".join(MODES), self.mode)
        _text(self.out, "out", optional=True)
        _text(self.rollouts, "rollouts", optional=True)
        _check(isinstance(self.record, bool), "record", "true or false", self.record)
        _check((self.mode == "train-only") == (self.rollouts is not None), "rollouts",
               "a recording (--rollouts RUN_DIR) exactly when mode is train-only", self.rollouts)
        _number(self.checkpoint_every, "checkpoint_every", 1, 10_000_000, integer=True)
        _number(self.threads, "threads", 1, 1024, integer=True)
        _check(isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None, "device",
               "cpu, cuda or cuda:N", self.device)
        _number(self.tp, "tp", 1, 1024, integer=True)
        _number(self.dp, "dp", 1, 1024, integer=True)
        _check(isinstance(self.deterministic, bool), "deterministic", "true or false", self.deterministic)
        if self.train.backend != "megatron":
            _check(self.tp == self.dp == 1, "tp", "1 unless train.backend is megatron (--trainer megatron)",
                   (self.tp, self.dp))
        else:
            _check(not self.rollout.true_on_policy, "rollout.true_on_policy",
                   "false with the megatron trainer (the engine cannot run its forward)", self.rollout.true_on_policy)
            _check(self.model.dtype == "float32", "model.dtype", "float32 with the megatron trainer", self.model.dtype)
            _check(self.device == "cpu" or self.tp * self.dp == 1 or self.device == "cuda", "device",
                   "cuda (rank r takes cuda:r) when the megatron trainer spans ranks", self.device)
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
                    "reward": RewardConfig, "algo": AlgoConfig, "train": TrainConfig, "placement": PlacementConfig}


def _coerce(value: Any, default: Any, key: str) -> Any:
    """Check a TOML value against the type of the field's default (TOML has no tuples or None); a
    field whose default is None holds a string (paths, plugins) unless it is a seed."""
    if isinstance(default, bool):
        _check(isinstance(value, bool), key, "true or false", value)
    elif isinstance(default, int):
        _check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
    elif isinstance(default, float):
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number", value)
        value = float(value)
    elif default == ():  # a list of any length: strings (addresses)
        _check(isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value), key, "a list of strings",
               value)
        value = tuple(value)
    elif isinstance(default, tuple):
        _check(isinstance(value, (list, tuple)) and len(value) == len(default), key, f"a list of {len(default)}", value)
        value = tuple(_coerce(v, d, key) for v, d in zip(value, default))
    elif isinstance(default, str):
        _text(value, key)
    elif isinstance(default, dict):
        _check(isinstance(value, dict), key, "a table", value)
    elif default is None and value is None:  # unset (a manifest's JSON null; TOML has no null)
        pass
    elif default is None and (key.endswith("seed") or key.endswith("num_cpus")):
        _check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
    elif default is None:
        _text(value, key)
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
        if key in ("path", "tokenizer", "out", "rollouts", "weights_dir") and isinstance(value, str):
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
        except RecursionError:
            raise BadInput("invalid TOML: nested too deeply", path=path) from None
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


def config_from_dict(table: Any, source: str | Path) -> RunConfig:
    """A RunConfig from its `to_dict()` form, as a manifest holds it; `source` names the file for errors.
    Held to the same types and ranges as a TOML file (its paths are absolute already)."""
    if not isinstance(table, dict):
        raise BadInput(f"expected an object, got {type(table).__name__}", path=source, field="config")
    try:
        return _build(RunConfig, table, "", Path("/"))
    except BadInput as exc:
        raise BadInput(f"config.{exc}", path=source) from None
