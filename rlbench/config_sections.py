"""The components of a run's configuration, one small frozen dataclass each (model, data, rollout, reward,
algorithm, trainer; placement: config_placement.py), each validated on construction; config.py composes them
into `RunConfig` and reads them from TOML and the command line. `setting(default, help)` declares a field with the
help its CLI option shows.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlbench.validate import check, number, text

# The defaults (tiny model config, tokenizers, task data) ship inside the package, so a plain
# `pip install` runs `rlbench run` as it comes; rlbench/fixtures/build.py makes them offline.
FIXTURES = Path(str(importlib.resources.files("rlbench") / "fixtures"))

# The server arguments rlbench sets itself, per server kind; a --sglang-* argument may not name them (a key
# among them: it would land in the manifest and on a command line every user of the machine can read).
OWNED = {
    "sglang": (
        "model-path",
        "tokenizer-path",
        "host",
        "port",
        "random-seed",
        "enable-deterministic-inference",
        "api-key",
        "admin-api-key",
    ),
    "rlbench": (
        "model-path",
        "tokenizer-path",
        "host",
        "port",
        "random-seed",
        "load-format",
        "dtype",
        "device",
        "threads",
        "decode",
        "decode-batch-size",
        "api-key",
        "admin-api-key",
    ),
}


def setting(default: Any, help: str) -> Any:
    """A config field with its help text: the one description of a setting, which the CLI option
    that sets it shows (rlbench/cli/options.py; tests/cpu/test_cli_config.py holds the two together)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    """Where the model (config.json and its weights) and the tokenizer live, and which weights a run starts from:
    `init = "checkpoint"` the directory's safetensors (one file, or its index's shards), `"random"` seeded random
    weights (a directory without any). Default: the warm-started fixture policy (models/tiny-qwen3-sft, built by
    rlbench/fixtures/warm_start.py); models/tiny-qwen3 with `init = "random"` is its shape drawn from the seed."""

    path: str = str(FIXTURES / "models" / "tiny-qwen3-sft")
    tokenizer: str = str(FIXTURES / "tokenizers" / "qwen-tiny")
    dtype: Literal["float32", "bfloat16", "float64"] = setting(
        "float32",
        "Parameter and compute dtype. float64: the CPU only, with the embedded engine (hf) and either trainer: the "
        "precision for TP/DP invariance checks, where float32's reduction-order noise (~1e-6 relative) hides bugs.",
    )
    init: Literal["checkpoint", "random"] = setting(
        "checkpoint",
        "Initial weights. checkpoint: the model directory's safetensors (one file, or the shards of its index). "
        "random: seeded random weights, for a directory without weights.",
    )

    def __post_init__(self) -> None:
        text(self.path, "model.path")
        text(self.tokenizer, "model.tokenizer")
        check(
            self.dtype in ("float32", "bfloat16", "float64"), "model.dtype", "float32, bfloat16 or float64", self.dtype
        )
        check(self.init in ("checkpoint", "random"), "model.init", "checkpoint or random", self.init)


@dataclass(frozen=True)
class DataConfig:
    """The prompt dataset (JSONL) and how many prompts a step takes."""

    path: str = str(FIXTURES / "data" / "parity.jsonl")
    prompt_key: str = "prompt"
    label_key: str | None = "label"  # none: rows without labels (slime's --label-key unset; a custom reward)
    shuffle: bool = True
    prompts_per_step: int = 16  # slime: rollout_batch_size (16 x 4: docs/design.md, "Why the default run learns")
    # true: each prompt through the tokenizer's chat template, with a generation prompt (a string is one user
    # message); false: a string prompt tokenised as it is, no special tokens added (slime without
    # --apply-chat-template, whose default that is)
    apply_chat_template: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)  # slime's --apply-chat-template-kwargs

    def __post_init__(self) -> None:
        for key in ("path", "prompt_key"):
            text(getattr(self, key), f"data.{key}")
        text(self.label_key, "data.label_key", optional=True)
        check(isinstance(self.shuffle, bool), "data.shuffle", "true or false", self.shuffle)
        number(self.prompts_per_step, "data.prompts_per_step", 1, 100_000, integer=True)
        check(
            isinstance(self.apply_chat_template, bool),
            "data.apply_chat_template",
            "true or false",
            self.apply_chat_template,
        )
        kwargs = self.chat_template_kwargs
        check(
            isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs),
            "data.chat_template_kwargs",
            "a table of keyword arguments for the chat template",
            kwargs,
        )


@dataclass(frozen=True)
class RewardConfig:
    """The verifier: a built-in one by name, or a function by dotted path (`--custom-rm-path`)."""

    verifier: str = "parity"
    custom_rm_path: str | None = setting(
        None,
        "Reward function by dotted path, package.module.function: slime's async rm(args, sample) -> float (with "
        "group_rm: rm(args, samples) -> list[float]), or rlbench's fn(sample: RewardInput) -> float; none: the "
        "built-in verifier.",
    )
    group_rm: bool = setting(False, "slime's --group-rm: the slime reward function scores each group in one call.")

    def __post_init__(self) -> None:
        text(self.verifier, "reward.verifier")
        text(self.custom_rm_path, "reward.custom_rm_path", optional=True)
        check(isinstance(self.group_rm, bool), "reward.group_rm", "true or false", self.group_rm)


@dataclass(frozen=True)
class AlgoConfig:
    """The estimator, the policy loss and its options, with slime's arithmetic (rlbench/core/algo.py);
    each field names the slime argument it is. Held to slime in tests/conformance/slime/."""

    advantage: Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"] = setting(
        "grpo",
        "Advantage estimator (slime --advantage-estimator). grpo: group-normalised rewards, PPO-clip loss. "
        "gspo: the same advantages, the sequence's mean log-ratio as every token's ratio. cispo: the same "
        "advantages, loss -sg(clip(ratio)) * A * logp. reinforce_plus_plus: the reward; "
        "reinforce_plus_plus_baseline: the reward minus its group's mean (both need normalize_advantages, as in "
        "slime). ppo: a critic (the policy's trunk under a one-output head) gives every response token a value; the "
        "advantages and returns are GAE's over the raw reward at the last response token (core/ppo.py), the critic "
        "trains first on the clipped value loss (torch trainer, in this process).",
    )
    normalize_std: bool = setting(
        True,
        "grpo, gspo, cispo: divide each group's centred rewards by the group's standard deviation (unbiased) + 1e-6 "
        "(slime: on unless --disable-grpo-std-normalization; the reinforce_plus_plus estimators ignore it, as in "
        "slime). Groups by each sample's group (slime's group_index), of any size; slime's default groups by position. "
        "In float64: a group of equal rewards gets exactly 0 where slime's float32 can push it (0.06 for three "
        "rewards of 0.9); a group of one sample gets 0 (slime: NaN).",
    )
    eps_clip: float = setting(0.2, "PPO clip: the ratio's lower bound is 1 - eps_clip (slime --eps-clip).")
    eps_clip_high: float = setting(
        0.2,
        "PPO clip: the ratio's upper bound is 1 + eps_clip_high (slime --eps-clip-high, whose default is --eps-clip).",
    )
    eps_clip_c: float | None = setting(
        None,
        "Dual-clip PPO (slime --eps-clip-c): where the advantage A < 0 a token's loss is at most -eps_clip_c * A; "
        "above 1. none: off. Refused with cispo, whose loss has no dual clip (slime ignores it there).",
    )
    kl_coef: float = setting(
        0.1,
        "KL-to-reference loss weight (slime --kl-loss-coef with --use-kl-loss; its --kl-coef reward shaping: not "
        "offered). 0: no reference model, no kl_loss metric. 0.1 (slime's: 0) keeps RL near the warm start.",
    )
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = setting(
        "k3",
        "KL estimator of the loss term (slime --kl-loss-type): k1 logp - ref; k2 (logp - ref)^2 / 2; k3 "
        "exp(ref - logp) - (ref - logp) - 1; low_var_kl k3 clamped to [-10, 10]. rlbench's default is k3; slime's "
        "is k1.",
    )
    entropy_coef: float = setting(
        0.0, "Weight of the entropy bonus: loss = pg_loss - entropy_coef * entropy (slime --entropy-coef)."
    )
    normalize_advantages: bool = setting(
        False,
        "Whiten the step's advantages over its trained tokens: mean 0, unbiased variance 1, eps 1e-8 (slime "
        "--normalize-advantages; required with the reinforce_plus_plus estimators). Computed in float64.",
    )
    per_token_loss: bool = setting(
        False,
        "Average the loss and the train/* metrics over a minibatch's trained tokens (slime "
        "--calculate-per-token-loss); false: over each sample's trained tokens, then over samples. A sample with "
        "no trained token counts in either denominator: as one token, or as one sample.",
    )
    use_tis: bool = setting(
        False,
        "Truncated importance sampling (slime --use-tis): each token's policy loss times clamp(exp(old log-prob - "
        "rollout log-prob), tis_clip_low, tis_clip); adds the metrics ois, tis, tis_clipfrac, tis_abs.",
    )
    gamma: float = setting(1.0, "ppo: GAE's discount (slime --gamma).")
    lambd: float = setting(1.0, "ppo: GAE's lambda (slime --lambd).")
    value_clip: float = setting(
        0.2, "ppo: the value loss's clip, absolute, of the new values around the step's old ones (slime --value-clip)."
    )
    num_critic_only_steps: int = setting(
        0,
        "ppo: the first steps train the critic alone; the actor neither scores nor trains, the engine keeps its "
        "weights (slime --num-critic-only-steps).",
    )
    tis_clip: float = setting(2.0, "TIS: the weight's upper bound (slime --tis-clip).")
    tis_clip_low: float = setting(0.0, "TIS: the weight's lower bound (slime --tis-clip-low).")

    def __post_init__(self) -> None:
        estimators = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
        check(self.advantage in estimators, "algo.advantage", f"one of: {', '.join(estimators)}", self.advantage)
        for key in ("normalize_std", "normalize_advantages", "per_token_loss", "use_tis"):
            check(isinstance(getattr(self, key), bool), f"algo.{key}", "true or false", getattr(self, key))
        number(self.eps_clip, "algo.eps_clip", 0, 10, open_low=True)
        number(self.eps_clip_high, "algo.eps_clip_high", 0, 10, open_low=True)
        if self.eps_clip_c is not None:
            number(self.eps_clip_c, "algo.eps_clip_c", 1, 1e6, open_low=True)
            check(
                self.advantage != "cispo",
                "algo.eps_clip_c",
                "unset with advantage cispo (its loss has no dual clip)",
                self.eps_clip_c,
            )
        number(self.kl_coef, "algo.kl_coef", 0, 1000)
        check(
            self.kl_type in ("k1", "k2", "k3", "low_var_kl"),
            "algo.kl_type",
            "one of: k1, k2, k3, low_var_kl",
            self.kl_type,
        )
        number(self.entropy_coef, "algo.entropy_coef", 0, 1000)
        check(
            self.normalize_advantages or not self.advantage.startswith("reinforce_plus_plus"),
            "algo.normalize_advantages",
            f"true with advantage {self.advantage} (slime requires --normalize-advantages with it)",
            self.normalize_advantages,
        )
        number(self.tis_clip, "algo.tis_clip", 0, 1e6, open_low=True)
        number(self.tis_clip_low, "algo.tis_clip_low", 0, self.tis_clip)
        number(self.gamma, "algo.gamma", 0, 1)
        number(self.lambd, "algo.lambd", 0, 1)
        number(self.value_clip, "algo.value_clip", 0, 1e6, open_low=True)
        number(self.num_critic_only_steps, "algo.num_critic_only_steps", 0, 10_000_000, integer=True)
        if self.advantage != "ppo":  # read by the critic's path only: set elsewhere, they would change nothing
            defaults = {"gamma": 1.0, "lambd": 1.0, "value_clip": 0.2, "num_critic_only_steps": 0}
            for key, default in defaults.items():
                check(
                    getattr(self, key) == default,
                    f"algo.{key}",
                    f"{default} unless algo.advantage is ppo (only the critic's path reads it; rlbench's "
                    "reinforce_plus_plus "
                    "takes gamma 1)",
                    getattr(self, key),
                )


@dataclass(frozen=True)
class TrainConfig:
    """The trainer: AdamW, optimizer steps per rollout step, micro-batches, gradient clipping.
    `megatron` (the `[train.megatron]` table) passes through unchanged to megatron-core's
    TransformerConfig; only the megatron trainer reads it."""

    backend: Literal["torch", "megatron"] = setting(
        "torch",
        "Trainer. torch: embedded transformers model + AdamW. megatron: megatron-core GPTModel, TP/DP ranks (pip "
        "install '.[megatron]'); [train.megatron] in --config passes through to its TransformerConfig.",
    )
    lr: float = 3e-4  # from the warm start: 1e-3 unlearns the copied number (docs/benchmarks.md)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    minibatches: int = 8  # optimizer steps per rollout step (slime: n_samples / global_batch_size)
    micro_batch_size: int = 64  # also the no-grad log-prob pass: one forward for the default step
    max_tokens_per_micro_batch: int | None = setting(
        None,
        "Micro-batches sized by tokens (slime's --use-dynamic-batch-size --max-tokens-per-gpu): a minibatch's samples "
        "packed first-fit by length, each micro-batch at most this many tokens (a longer sample alone); also the "
        "log-prob pass. None: micro_batch_size samples each.",
    )
    grad_clip: float = 1.0
    critic_lr: float | None = setting(
        None,
        "ppo: the critic's learning rate (slime: `lr` in a --megatron-config-path role critic's overrides); unset: "
        "train.lr, as slime's critic copies the actor's arguments. Its other optimizer settings are train's.",
    )
    recompute: bool = setting(
        False,
        "Each decoder layer's activations recomputed in the backward instead of kept (slime's --recompute-granularity "
        "full --recompute-method uniform --recompute-num-layers 1): less memory, one more forward; the same bits.",
    )
    optimizer_cpu_offload: bool = setting(
        False,
        "torch trainer: fp32 master weights, their gradients and AdamW's state in host memory, the update on the CPU "
        "(Megatron's --optimizer-cpu-offload): the GPU holds the model in its dtype only. A GPU run's bits change.",
    )
    megatron: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(self.backend in ("torch", "megatron"), "train.backend", "one of: torch, megatron", self.backend)
        check(isinstance(self.megatron, dict), "train.megatron", "a table", self.megatron)
        check(
            not self.megatron or self.backend == "megatron",
            "train.megatron",
            "no [train.megatron] settings unless train.backend is megatron",
            self.megatron,
        )
        number(self.lr, "train.lr", 0, 10, open_low=True)
        number(self.weight_decay, "train.weight_decay", 0, 1)
        check(
            isinstance(self.betas, tuple)
            and len(self.betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in self.betas),
            "train.betas",
            "two numbers in [0, 1)",
            self.betas,
        )
        number(self.adam_eps, "train.adam_eps", 0, 1, open_low=True)
        number(self.minibatches, "train.minibatches", 1, 100_000, integer=True)
        number(self.micro_batch_size, "train.micro_batch_size", 1, 100_000, integer=True)
        if self.max_tokens_per_micro_batch is not None:
            number(self.max_tokens_per_micro_batch, "train.max_tokens_per_micro_batch", 1, 2**31 - 1, integer=True)
        number(self.grad_clip, "train.grad_clip", 0, 1e6, open_low=True)
        if self.critic_lr is not None:
            number(self.critic_lr, "train.critic_lr", 0, 10, open_low=True)
