"""The components of a run's configuration, one small frozen dataclass each (model, data, rollout, reward,
algorithm, trainer; placement: config_placement.py), each validated on construction; config.py composes them
into `RunConfig` and reads them from TOML and the command line. `setting(default, help)` declares a field with the
help its CLI option shows.
"""

from __future__ import annotations

import importlib.resources
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlbench.validate import check, normalize_url, number, text

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
class RolloutConfig:
    """The rollout engine and its sampling parameters. `hf`: the embedded engine, in-process.
    `sglang`: SGLang servers over HTTP (rlbench/backends/sglang/): an existing router
    (`sglang_router_url`), servers someone else runs (`external_engine_addrs`, with a router rlbench
    starts in front), or `num_engines` servers rlbench starts (`sglang_server`: sglang's own, or
    `rlbench serve`) with `[rollout.sglang]` / `--sglang-*` passed through to them."""

    backend: Literal["hf", "sglang"] = setting(
        "hf",
        "Rollout engine. hf: embedded transformers, in-process. sglang: SGLang servers over their native HTTP API, "
        "through sglang-router (pip install '.[router]').",
    )
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 4  # the warm-started fixture answers "65 odd": 3 tokens and its stop token
    temperature: float = 1.0
    top_k: int = -1  # SGLang's sampling_params.top_k: -1 (or 0) = every token
    top_p: float = 1.0  # SGLang's sampling_params.top_p: 1.0 = every token
    stop_token_ids: tuple[int, ...] = ()  # stops besides the tokenizer's eos (slime --rollout-stop-token-ids)
    # The embedded engine's decode: "batched" (fixed-shape buckets) or "per-sample" (the reference,
    # one request at a time); both are batch-invariant (rlbench/backends/hf_engine.py).
    decode: Literal["batched", "per-sample"] = "batched"
    decode_batch_size: int = 64  # rows of every batched decode forward (fixed: padding fills it)
    cuda_graphs: bool = setting(
        True,
        "The embedded engine on a GPU: each batched decode forward is captured once per shape as a CUDA graph and "
        "replayed (one launch a token instead of a few a layer; the same kernels, so the same bits). false: launched "
        "kernel by kernel. No effect on the CPU.",
    )
    offload: bool = setting(
        False,
        "hf: the engine lets go of its GPU memory after each rollout (slime's --offload-rollout): its weights to host "
        "memory, its KV caches, graphs and prompt cache freed; back on its next use. The same bits.",
    )
    sampling_seed: int | None = None  # slime's --rollout-seed: samples draw from it instead of the master seed
    # Report each token's log-prob from a teacher-forced forward of the whole sequence at batch
    # size 1, the forward the trainer's logprob stage then also uses: equal bits on both sides.
    true_on_policy: bool = False
    custom_generate_function_path: str | None = setting(
        None,
        "Custom generate function by dotted path: slime's async generate(args, sample, sampling_params) (run against "
        "the engine behind SGLang's /generate, docs/usage.md \"Your slime plugins\"), or rlbench's "
        "fn(env, prompt, prompt_ids, seed) -> Trajectory.",
    )
    sglang_server_concurrency: int = setting(
        512, "slime's --sglang-server-concurrency: slime plugins generating at once (per engine of one GPU)."
    )
    sglang_router_url: str | None = setting(
        None, "sglang: an sglang-router someone else runs (its servers: GET /workers); rlbench starts nothing."
    )
    external_engine_addrs: tuple[str, ...] = setting(
        (),
        "sglang: servers rlbench does not own, host:port[,host:port...]; rlbench starts sglang-router in front of "
        "them.",
    )
    num_engines: int = setting(1, "sglang: how many servers rlbench starts (and stops), behind a router it starts.")
    sglang_server: Literal["sglang", "rlbench"] = setting(
        "sglang",
        "sglang: what rlbench starts. sglang: python -m sglang.launch_server (every other --sglang-KEY VALUE is "
        "passed to it as --KEY VALUE). rlbench: rlbench serve, the embedded engine behind the same API.",
    )
    use_router: bool = True  # false: no router; the client spreads requests over the servers and retries elsewhere
    sglang: dict = field(default_factory=dict)  # --sglang-KEY VALUE: to the servers rlbench starts, as --KEY VALUE
    max_inflight: int = 256  # requests in flight at once
    request_timeout: float = 600.0  # seconds per HTTP request
    request_attempts: int = 5  # attempts of a request before the run stops (exit 2)
    verify_engine_weights: bool = True  # the weight-update check through /weights_checker (false for SGLang's own)
    weights_dir: str | None = None  # where weight versions are written for the servers to load (default: a temp dir)
    async_mode: Literal["off", "one-step", "fully"] = setting(
        "off",
        "Generate ahead of training, deterministic by schedule. one-step: as slime's train_async "
        "(the next step generated while this one trains); fully: slime's fully-async worker bounded by max_staleness.",
    )
    max_staleness: int | None = setting(
        None, "fully: the most weight versions a trained sample may lag (0: on-policy)."
    )
    update_weights_interval: int = setting(1, "slime's --update-weights-interval: sync every N steps (async modes).")
    update_weight_mode: Literal["full", "delta"] = setting(
        "full", "sglang: each sync a full checkpoint, or slime's delta of what changed, pulled by /pull_weights."
    )
    update_weight_delta_encoding: Literal["xor", "overwrite"] = "xor"  # slime's --update-weight-delta-encoding
    update_weight_delta_checksum: Literal["xxh3-128", "blake3", "adler32"] = "xxh3-128"
    local_checkpoint_dir: str | None = None  # delta: the servers' host-local checkpoint (default: weights_dir/local)

    def __post_init__(self) -> None:
        check(self.backend in ("hf", "sglang"), "rollout.backend", "one of: hf, sglang", self.backend)
        number(self.n_samples_per_prompt, "rollout.n_samples_per_prompt", 1, 10_000, integer=True)
        number(self.max_new_tokens, "rollout.max_new_tokens", 1, 100_000, integer=True)
        number(self.temperature, "rollout.temperature", 0, 100)  # 0 = greedy
        if self.sampling_seed is not None:
            number(self.sampling_seed, "rollout.sampling_seed", 0, 2**63 - 1, integer=True)
        check(isinstance(self.true_on_policy, bool), "rollout.true_on_policy", "true or false", self.true_on_policy)
        text(self.custom_generate_function_path, "rollout.custom_generate_function_path", optional=True)
        number(self.sglang_server_concurrency, "rollout.sglang_server_concurrency", 1, 1_000_000, integer=True)
        check(
            isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
            "rollout.top_k",
            "-1, 0 (both off) or a count >= 1",
            self.top_k,
        )
        number(self.top_p, "rollout.top_p", 0, 1, open_low=True)  # 1 = off
        check(
            isinstance(self.stop_token_ids, tuple)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in self.stop_token_ids),
            "rollout.stop_token_ids",
            "a list of token ids",
            self.stop_token_ids,
        )
        check(self.decode in ("batched", "per-sample"), "rollout.decode", "batched or per-sample", self.decode)
        number(self.decode_batch_size, "rollout.decode_batch_size", 1, 100_000, integer=True)
        check(isinstance(self.cuda_graphs, bool), "rollout.cuda_graphs", "true or false", self.cuda_graphs)
        self._check_sglang()

    def _check_sglang(self) -> None:
        text(self.sglang_router_url, "rollout.sglang_router_url", optional=True)
        check(
            isinstance(self.external_engine_addrs, tuple)
            and all(isinstance(a, str) and a and "\x00" not in a for a in self.external_engine_addrs),
            "rollout.external_engine_addrs",
            "a list of host:port addresses",
            self.external_engine_addrs,
        )
        number(self.num_engines, "rollout.num_engines", 1, 4096, integer=True)
        check(
            self.sglang_server in ("sglang", "rlbench"),
            "rollout.sglang_server",
            "sglang or rlbench",
            self.sglang_server,
        )
        check(isinstance(self.use_router, bool), "rollout.use_router", "true or false", self.use_router)
        number(self.max_inflight, "rollout.max_inflight", 1, 100_000, integer=True)
        number(self.request_timeout, "rollout.request_timeout", 0, 86_400, open_low=True)
        number(self.request_attempts, "rollout.request_attempts", 1, 100, integer=True)
        check(
            isinstance(self.verify_engine_weights, bool),
            "rollout.verify_engine_weights",
            "true or false",
            self.verify_engine_weights,
        )
        text(self.weights_dir, "rollout.weights_dir", optional=True)
        check(
            isinstance(self.sglang, dict)
            and all(
                isinstance(k, str)
                and re.fullmatch(r"[a-z0-9][a-z0-9-]*", k)
                and (
                    isinstance(v, (str, int, float, bool))
                    or (isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v))
                )
                for k, v in self.sglang.items()
            ),
            "rollout.sglang",
            "server arguments as KEY = VALUE (KEY as on the server's command line, without --)",
            self.sglang,
        )
        sglang = self.backend == "sglang"
        given = [
            name
            for name, on in (
                ("sglang_router_url", self.sglang_router_url is not None),
                ("external_engine_addrs", bool(self.external_engine_addrs)),
            )
            if on
        ]
        check(
            sglang or not given, f"rollout.{given[0] if given else ''}", "unset unless rollout.backend is sglang", "set"
        )
        check(
            len(given) < 2,
            "rollout.external_engine_addrs",
            "unset when rollout.sglang_router_url is set",
            self.external_engine_addrs,
        )
        check(
            not self.sglang or (sglang and not given),
            "rollout.sglang",
            "no server arguments unless rlbench starts the servers (rollout.backend sglang, no router url, "
            "no external addresses)",
            self.sglang,
        )
        for addr in self.external_engine_addrs:
            normalize_url(addr)
        if self.sglang_router_url is not None:
            normalize_url(self.sglang_router_url, "rollout.sglang_router_url")
        owned = [k for k in self.sglang if k in OWNED[self.sglang_server]]
        check(
            not owned,
            "rollout.sglang",
            f"no arguments rlbench sets itself ({', '.join(OWNED[self.sglang_server])})",
            owned,
        )
        check(
            not (sglang and self.true_on_policy),
            "rollout.true_on_policy",
            "false with rollout.backend sglang (the server cannot run the trainer's forward)",
            self.true_on_policy,
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

    advantage: Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = setting(
        "grpo",
        "Advantage estimator (slime --advantage-estimator). grpo: group-normalised rewards, PPO-clip loss. "
        "gspo: the same advantages, the sequence's mean log-ratio as every token's ratio. cispo: the same "
        "advantages, loss -sg(clip(ratio)) * A * logp. reinforce_plus_plus: the reward; "
        "reinforce_plus_plus_baseline: the reward minus its group's mean (both need normalize_advantages, as in "
        "slime). PPO with a critic is not offered.",
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
    tis_clip: float = setting(2.0, "TIS: the weight's upper bound (slime --tis-clip).")
    tis_clip_low: float = setting(0.0, "TIS: the weight's lower bound (slime --tis-clip-low).")

    def __post_init__(self) -> None:
        estimators = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
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
