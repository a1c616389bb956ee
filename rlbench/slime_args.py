"""slime's own command-line arguments for the loop rlbench owns: a slime command line pasted after
`rlbench run` runs the same configuration.

Each argument of slime (THUDM/slime slime/utils/arguments.py, and Megatron-LM's that slime resets,
at commit 624b824a) that rlbench models is mapped onto the config field(s) that hold it, with
slime's conversion; an argument rlbench computes one way only is accepted at that value alone
(`--optimizer adam`); every other one is refused by name, never ignored (`--sglang-*` passes through
to the servers, as in slime). When any slime argument is given, the settings slime defines start from
slime's defaults, not rlbench's (input key "input", no chat template, one sample per prompt, lr 1e-6,
KL type k1, ...): `SLIME_DEFAULTS`. `rlbench run --print-config` shows what a command line resolves to.
slime's W&B and TensorBoard arguments (`TRACKING`) only say where the metrics also go: alone, they leave
rlbench's own settings and defaults as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from rlbench.errors import BadInput


@dataclass(frozen=True)
class SlimeArg:
    """One slime argument: how its value is read (`kind`), the config fields it sets, and what it means."""

    kind: str  # "int", "float", "str", "flag", "ints", "json"
    fields: tuple[str, ...]  # config fields it sets (dotted); () for the ones `resolve` computes
    help: str


def _arg(kind: str, *fields: str, help: str = "") -> SlimeArg:
    return SlimeArg(kind, fields, help)


ARGS: dict[str, SlimeArg] = {
    "--hf-checkpoint": _arg(
        "str", "model.path", "model.tokenizer", help="the Hugging Face model directory: its weights and its tokenizer"
    ),
    "--prompt-data": _arg("str", "data.path"),
    "--input-key": _arg("str", "data.prompt_key"),
    "--label-key": _arg("str", "data.label_key"),
    "--apply-chat-template": _arg("flag", "data.apply_chat_template"),
    "--apply-chat-template-kwargs": _arg("json", "data.chat_template_kwargs"),
    "--rollout-shuffle": _arg("flag", "data.shuffle"),
    "--rollout-batch-size": _arg("int", "data.prompts_per_step"),
    "--n-samples-per-prompt": _arg("int", "rollout.n_samples_per_prompt"),
    "--global-batch-size": _arg(
        "int",
        help="samples per optimizer step: train.minibatches = "
        "rollout_batch_size * n_samples_per_prompt / global_batch_size",
    ),
    "--num-steps-per-rollout": _arg("int", "train.minibatches"),
    "--num-rollout": _arg("int", "steps"),
    "--rollout-max-response-len": _arg("int", "rollout.max_new_tokens"),
    "--rollout-temperature": _arg("float", "rollout.temperature"),
    "--rollout-top-p": _arg("float", "rollout.top_p"),
    "--rollout-top-k": _arg("int", "rollout.top_k"),
    "--rollout-seed": _arg("int", "rollout.sampling_seed"),
    "--rollout-stop-token-ids": _arg("ints", "rollout.stop_token_ids"),
    "--seed": _arg("int", "seed"),
    "--lr": _arg("float", "train.lr"),
    "--weight-decay": _arg("float", "train.weight_decay"),
    "--adam-beta1": _arg("float", help="train.betas[0]"),
    "--adam-beta2": _arg("float", help="train.betas[1]"),
    "--adam-eps": _arg("float", "train.adam_eps"),
    "--clip-grad": _arg("float", "train.grad_clip"),
    "--micro-batch-size": _arg("int", "train.micro_batch_size"),
    "--use-dynamic-batch-size": _arg("flag", help="with --max-tokens-per-gpu: train.max_tokens_per_micro_batch"),
    "--max-tokens-per-gpu": _arg("int", help="train.max_tokens_per_micro_batch, under --use-dynamic-batch-size"),
    "--tensor-model-parallel-size": _arg("int", "tp"),
    "--save": _arg("str", "out", help="the run directory (its checkpoints/ hold the checkpoints)"),
    "--save-interval": _arg("int", "checkpoint_every"),
    "--advantage-estimator": _arg("str", "algo.advantage"),
    "--use-kl-loss": _arg("flag", help="with --kl-loss-coef: algo.kl_coef"),
    "--kl-loss-coef": _arg("float", help="algo.kl_coef, under --use-kl-loss"),
    "--kl-loss-type": _arg("str", "algo.kl_type"),
    "--kl-coef": _arg("float", help="slime's KL reward shaping: 0 only (rlbench does not model it)"),
    "--eps-clip": _arg("float", "algo.eps_clip"),
    "--eps-clip-high": _arg("float", "algo.eps_clip_high"),
    "--eps-clip-c": _arg("float", "algo.eps_clip_c"),
    "--entropy-coef": _arg("float", "algo.entropy_coef"),
    "--normalize-advantages": _arg("flag", "algo.normalize_advantages"),
    "--disable-grpo-std-normalization": _arg("flag", "algo.normalize_std"),
    "--calculate-per-token-loss": _arg("flag", "algo.per_token_loss"),
    "--use-tis": _arg("flag", "algo.use_tis"),
    "--value-clip": _arg("float", "algo.value_clip"),
    "--gamma": _arg("float", "algo.gamma"),
    "--lambd": _arg("float", "algo.lambd"),
    "--num-critic-only-steps": _arg("int", "algo.num_critic_only_steps"),
    "--megatron-config-path": _arg(
        "str",
        help="a YAML of per-role overrides (slime's): role critic's lr -> train.critic_lr, role actor's -> train.lr",
    ),
    "--tis-clip": _arg("float", "algo.tis_clip"),
    "--tis-clip-low": _arg("float", "algo.tis_clip_low"),
    "--rm-type": _arg("str", "reward.verifier", help="one of rlbench's built-in verifiers"),
    "--custom-rm-path": _arg(
        "str",
        "reward.custom_rm_path",
        help="slime's contract, async rm(args, sample) -> float (or rlbench's fn(sample: RewardInput) -> float)",
    ),
    "--group-rm": _arg("flag", "reward.group_rm", help="slime's batched reward: rm(args, samples) per group"),
    "--custom-generate-function-path": _arg(
        "str",
        "rollout.custom_generate_function_path",
        help="slime's contract, async generate(args, sample, sampling_params) (or rlbench's, core/generate.py)",
    ),
    "--sglang-server-concurrency": _arg("int", "rollout.sglang_server_concurrency"),
    "--recompute-granularity": _arg(
        "str", help="full: train.recompute (with --recompute-method uniform --recompute-num-layers 1, as Megatron asks)"
    ),
    "--optimizer-cpu-offload": _arg("flag", "train.optimizer_cpu_offload"),
    "--offload-rollout": _arg("flag", "rollout.offload"),
    "--update-weights-interval": _arg("int", "rollout.update_weights_interval"),
    "--update-weight-mode": _arg("str", "rollout.update_weight_mode", help="full, or delta (with --rollout sglang)"),
    "--update-weight-disk-dir": _arg("str", "rollout.weights_dir"),
    "--update-weight-local-checkpoint-dir": _arg("str", "rollout.local_checkpoint_dir"),
    "--update-weight-delta-encoding": _arg("str", "rollout.update_weight_delta_encoding"),
    "--update-weight-delta-checksum": _arg("str", "rollout.update_weight_delta_checksum"),
    # slime's add_wandb_arguments and add_tensorboard_arguments: where the metrics also go (core/trackers.py)
    "--use-wandb": _arg("flag", "tracking.use_wandb"),
    "--wandb-mode": _arg("str", "tracking.wandb_mode", help="online, offline or disabled"),
    "--wandb-dir": _arg("str", "tracking.wandb_dir"),
    "--wandb-project": _arg("str", "tracking.wandb_project"),
    "--wandb-team": _arg("str", "tracking.wandb_team"),
    "--wandb-group": _arg("str", "tracking.wandb_group"),
    "--disable-wandb-random-suffix": _arg("flag", help="tracking.wandb_random_suffix = false"),
    "--wandb-always-use-train-step": _arg("flag", "tracking.wandb_always_use_train_step"),
    "--use-tensorboard": _arg("flag", "tracking.use_tensorboard"),
    "--tb-project-name": _arg("str", "tracking.tb_project_name"),
    "--tb-experiment-name": _arg("str", "tracking.tb_experiment_name"),
}
# Arguments that say only where the metrics go: alone, they leave rlbench's own settings and defaults as they are.
TRACKING = tuple(name for name, spec in ARGS.items() if spec.fields[:1] and spec.fields[0].startswith("tracking.")) + (
    "--disable-wandb-random-suffix",
)

# slime's arguments refused with a reason of their own (any other unknown one: `_refusal`'s general line).
REFUSED = {
    "--wandb-key": "a secret is not written into the run's manifest: log in with `wandb login` or WANDB_API_KEY",
    "--wandb-host": "slime passes it to wandb.login with --wandb-key only: set WANDB_BASE_URL (and log in) instead",
    "--use-critic": "slime 624b824a has no such argument (its docs show one): --advantage-estimator ppo turns the "
    "critic on",
    "--wandb-run-id": "slime's primary process overwrites it with its new run's id; rlbench derives the id from the "
    "run directory, so that --resume continues the same W&B run",
}

# Accepted at the one value rlbench computes; any other value is refused.
ONLY = {
    "--optimizer": "adam",
    "--lr-decay-style": "constant",
    "--loss-type": "policy_loss",
    "--lr-warmup-iters": "0",
    "--recompute-method": "uniform",  # each layer recomputed on its own (--recompute-num-layers 1)
    "--recompute-num-layers": "1",
    "--update-weight-transport": "disk",  # the servers load from disk (rlbench's SGLang client); no NCCL broadcast
}

# What slime runs with when an argument is absent (slime/utils/arguments.py; Megatron-LM's optimizer defaults).
SLIME_DEFAULTS: dict[str, Any] = {
    "seed": 1234,
    "data.prompt_key": "input",
    "data.label_key": None,
    "data.apply_chat_template": False,
    "data.chat_template_kwargs": {},
    "data.shuffle": False,
    "rollout.n_samples_per_prompt": 1,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.top_k": -1,
    "rollout.sampling_seed": 42,
    "rollout.stop_token_ids": (),
    "train.lr": 1e-6,
    "train.weight_decay": 0.01,
    "train.betas": (0.9, 0.999),
    "train.adam_eps": 1e-8,
    "train.grad_clip": 1.0,
    "train.micro_batch_size": 1,
    "algo.advantage": "grpo",
    "algo.normalize_std": True,
    "algo.eps_clip": 0.2,
    "algo.kl_coef": 0.0,
    "algo.kl_type": "k1",
    "algo.entropy_coef": 0.0,
    "algo.gamma": 1.0,
    "algo.lambd": 1.0,
    "algo.value_clip": 0.2,
    "algo.num_critic_only_steps": 0,
}

# Without a value in slime, these have no default rlbench could stand in for: the command line must give them.
REQUIRED = ("--rollout-batch-size", "--rollout-max-response-len")


def is_slime(arg: str) -> bool:
    """An argument of slime's that this module reads (mapped, or accepted at one value)."""
    return arg.split("=", 1)[0] in ARGS or arg.split("=", 1)[0] in ONLY


def parse(args: list[str]) -> dict[str, Any]:
    """slime's arguments from the command line's extra arguments, each read as slime's argparse reads it
    (flags take no value; --rollout-stop-token-ids takes one or more). Unknown arguments are refused."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        spec = ARGS.get(name)
        if spec is None and name not in ONLY:
            raise BadInput(_refusal(name), field="rlbench run")
        if name in out:
            raise BadInput(f"{name} is given twice", field="rlbench run")
        if spec is not None and spec.kind == "flag":
            if eq:
                raise BadInput(f"{name} is a flag: it takes no value", field="rlbench run")
            out[name], i = True, i + 1
            continue
        values = [inline] if eq else []
        i += 1
        while not eq and i < len(args) and not args[i].startswith("--"):
            values.append(args[i])
            i += 1
            if spec is None or spec.kind != "ints":
                break
        if not values:
            raise BadInput(f"{name} needs a value", field="rlbench run")
        out[name] = _value(name, spec, values)
    return out


def _value(name: str, spec: SlimeArg | None, values: list[str]) -> Any:
    if spec is None:  # accepted at one value only
        if values != [ONLY[name]]:
            raise BadInput(f"{name} {' '.join(values)}: rlbench computes {name} {ONLY[name]} only", field=name)
        return values[0]
    convert: Callable[[str], Any] = {"int": int, "float": float, "str": str, "ints": int, "json": json.loads}[spec.kind]
    try:
        parsed = [convert(v) for v in values]
    except (ValueError, json.JSONDecodeError):
        raise BadInput(f"expected {_EXPECTED[spec.kind]}, got {' '.join(values)!r}", field=name) from None
    if spec.kind == "json" and not isinstance(parsed[0], dict):
        raise BadInput(f"expected a JSON object, got {values[0]!r}", field=name)
    return tuple(parsed) if spec.kind == "ints" else parsed[0]


_EXPECTED = {"int": "an integer", "ints": "integers", "float": "a number", "json": "a JSON object", "str": "a value"}


def _refusal(name: str) -> str:
    if not name.startswith("--"):
        return f"unexpected argument {name!r}"
    if name in REFUSED:
        return f"{name} is not read: {REFUSED[name]}"
    return (
        f"no such option: {name} (neither rlbench's nor a slime argument rlbench models; slime's data, rollout, "
        "batch, algorithm, optimizer, W&B and TensorBoard arguments are read, --sglang-* passes through to the "
        "servers; "
        "see `rlbench run --help` and docs/usage.md)"
    )


def resolve(given: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any, dict[str, Any]]]]:
    """(the config fields the given slime arguments and slime's defaults set, as dotted path -> value;
    each given argument with its value and the fields it set), with slime's own rules: eps_clip_high
    defaults to eps_clip; one sample per prompt turns GRPO's std normalisation off; the global batch
    size follows from --num-steps-per-rollout or gives the optimizer steps per rollout; the KL loss
    coefficient counts only under --use-kl-loss. Arguments that only say where metrics go (TRACKING), given alone,
    set their fields and nothing else: rlbench's own run, logged to W&B or TensorBoard."""
    if given and set(given) <= set(TRACKING):
        explained = [(name, value, _tracking(name, value)) for name, value in given.items()]
        return {path: value for _, _, sets in explained for path, value in sets.items()}, explained
    missing = [name for name in REQUIRED if name not in given]
    if missing:
        raise BadInput(
            f"a slime command line needs {', '.join(missing)} (slime has no default rlbench could use)",
            field="rlbench run",
        )
    if "--num-rollout" not in given:
        raise BadInput(
            "a slime command line needs --num-rollout: the number of rollout steps (rlbench does not read --num-epoch)",
            field="rlbench run",
        )
    fields = dict(SLIME_DEFAULTS)
    explained: list[tuple[str, Any, dict[str, Any]]] = []
    # a role's overrides win over the command line's (slime applies them to a copy of its parsed arguments)
    for name, value in sorted(given.items(), key=lambda item: item[0] == "--megatron-config-path"):
        spec = ARGS.get(name)
        sets = {}
        if spec is not None and spec.fields:
            sets = {path: value for path in spec.fields}
        if name == "--hf-checkpoint":
            sets["model.init"] = "checkpoint"
        if name == "--disable-grpo-std-normalization":
            sets = {"algo.normalize_std": False}
        if name in TRACKING:
            sets = _tracking(name, value)
        if name == "--recompute-granularity":
            if value != "full":
                raise BadInput(f"{name} {value}: rlbench recomputes whole layers only (full)", field=name)
            sets = {"train.recompute": True}
        if name == "--megatron-config-path":
            sets = role_overrides(value)
        if name == "--tensor-model-parallel-size":
            sets["train.backend"] = "megatron" if value > 1 else fields.get("train.backend", "torch")
        fields.update(sets)
        explained.append((name, value, sets))
    _derived(given, fields, explained)
    return fields, explained


def _tracking(name: str, value: Any) -> dict[str, Any]:
    if name == "--disable-wandb-random-suffix":
        return {"tracking.wandb_random_suffix": False}
    return {ARGS[name].fields[0]: value}


def _derived(given: dict[str, Any], fields: dict[str, Any], explained: list) -> None:
    """The fields slime computes from several arguments at once."""
    betas = (given.get("--adam-beta1", 0.9), given.get("--adam-beta2", 0.999))
    fields["train.betas"] = betas
    fields["algo.eps_clip_high"] = given.get("--eps-clip-high", fields["algo.eps_clip"])
    fields["algo.kl_coef"] = given.get("--kl-loss-coef", 0.0) if given.get("--use-kl-loss") else 0.0
    if given.get("--use-dynamic-batch-size") and given.get("--max-tokens-per-gpu") is None:
        raise BadInput(
            "max_tokens_per_gpu must be set when use_dynamic_batch_size is set (slime asserts the same)",
            field="--use-dynamic-batch-size",
        )
    # slime reads --max-tokens-per-gpu only under --use-dynamic-batch-size
    fields["train.max_tokens_per_micro_batch"] = (
        given["--max-tokens-per-gpu"] if given.get("--use-dynamic-batch-size") else None
    )
    samples = given["--rollout-batch-size"] * fields["rollout.n_samples_per_prompt"]
    steps, batch = given.get("--num-steps-per-rollout"), given.get("--global-batch-size")
    if steps is not None:
        if batch is not None and batch != samples // steps:
            raise BadInput(
                f"--global-batch-size {batch} is not rollout_batch_size * n_samples_per_prompt "
                f"// num_steps_per_rollout = {samples // steps} (slime asserts the same)",
                field="--global-batch-size",
            )
        fields["train.minibatches"] = steps
    elif batch is not None:
        if batch <= 0 or samples % batch:
            raise BadInput(
                f"--global-batch-size {batch} does not divide the step's {samples} samples "
                "(rollout_batch_size * n_samples_per_prompt)",
                field="--global-batch-size",
            )
        fields["train.minibatches"] = samples // batch
    else:
        raise BadInput("a slime command line needs --global-batch-size or --num-steps-per-rollout", field="rlbench run")
    _slime_rules(given, fields)
    if fields["rollout.n_samples_per_prompt"] == 1:
        fields["algo.normalize_std"] = False  # slime: one sample per prompt turns std normalisation off
    for name, _, sets in explained:
        if name in ("--adam-beta1", "--adam-beta2"):
            sets["train.betas"] = betas
        elif name in ("--use-kl-loss", "--kl-loss-coef"):
            sets["algo.kl_coef"] = fields["algo.kl_coef"]
        elif name in ("--use-dynamic-batch-size", "--max-tokens-per-gpu"):
            sets["train.max_tokens_per_micro_batch"] = fields["train.max_tokens_per_micro_batch"]
        elif name in ("--global-batch-size", "--num-steps-per-rollout"):
            sets["train.minibatches"] = fields["train.minibatches"]
        elif name == "--eps-clip":
            sets["algo.eps_clip_high"] = fields["algo.eps_clip_high"]


def _slime_rules(given: dict[str, Any], fields: dict[str, Any]) -> None:
    """What slime_validate_args refuses, refused here in the same cases (slime/utils/arguments.py)."""
    if fields["rollout.temperature"] <= 0:
        raise BadInput(
            "slime requires --rollout-temperature > 0 (0 would be greedy decoding)", field="--rollout-temperature"
        )
    if given.get("--kl-coef", 0.0) != 0 and given.get("--kl-loss-coef", 0.0) != 0:
        raise BadInput(
            "only one of --kl-coef and --kl-loss-coef can be set (slime asserts the same)", field="--kl-coef"
        )
    if given.get("--kl-coef", 0.0) != 0:  # after slime's own refusal, as slime checks it first
        raise BadInput(
            f"--kl-coef {given['--kl-coef']:g}: slime's KL reward shaping (a per-token KL to the reference "
            "folded into REINFORCE++ returns) is not modelled by rlbench; only 0 is accepted",
            field="--kl-coef",
        )
    if fields["algo.advantage"] in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and not given.get(
        "--normalize-advantages"
    ):
        raise BadInput(
            f"--advantage-estimator {fields['algo.advantage']} needs --normalize-advantages (slime asserts the same)",
            field="--advantage-estimator",
        )
    if "--recompute-granularity" in given and not {"--recompute-method", "--recompute-num-layers"} <= set(given):
        raise BadInput(
            "--recompute-granularity full needs --recompute-method and --recompute-num-layers (megatron-core "
            "asserts the same)",
            field="--recompute-granularity",
        )
    if "train.critic_lr" in fields and fields["algo.advantage"] != "ppo":
        raise BadInput(
            "its role critic's overrides set PPO's critic, which only --advantage-estimator ppo has",
            field="--megatron-config-path",
        )
    if "--save-interval" in given and "--save" not in given:
        raise BadInput("--save-interval needs --save (slime asserts the same)", field="--save-interval")


# What rlbench reads of a --megatron-config-path role's overrides: the learning rate (slime's PPO test sets the
# critic's); slime ignores the GPU counts (placement follows the command line). Any other key is refused by name.
ROLE_FIELDS = {"actor": {"lr": "train.lr"}, "critic": {"lr": "train.critic_lr"}}
ROLE_IGNORED = ("num_nodes", "num_gpus_per_node")


def role_overrides(path: str) -> dict[str, Any]:
    """The fields a slime --megatron-config-path YAML sets, read as slime's parse_megatron_role_args reads it: a
    top-level `megatron` list, at most one entry per role (actor, critic), its `overrides` (or `args`); a string
    value coerced to the number it stands for (YAML's safe_load reads 1e-5 as a string)."""
    import yaml

    file = Path(path)
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except OSError as exc:
        raise BadInput(f"cannot read it ({exc.strerror})", path=file, field="--megatron-config-path") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"not YAML ({str(exc).splitlines()[0]})", path=file, field="--megatron-config-path") from None
    entries = raw.get("megatron") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise BadInput(
            "expected a top-level 'megatron' list, e.g. megatron: [{name: default, role: actor, overrides: {...}}] "
            "(slime asserts the same)",
            path=file,
            field="megatron",
        )
    fields: dict[str, Any] = {}
    for role, known in ROLE_FIELDS.items():
        found = [entry for entry in entries if entry.get("role") == role]
        if len(found) > 1:
            raise BadInput(f"at most one entry with role {role} (slime asserts the same)", path=file, field="megatron")
        overrides = (found[0].get("overrides") or found[0].get("args") or {}) if found else {}
        if not isinstance(overrides, dict):
            raise BadInput("expected a mapping of argument names", path=file, field=f"megatron[role={role}].overrides")
        for key, value in overrides.items():
            if key in ROLE_IGNORED:
                continue
            if key not in known:
                raise BadInput(
                    f"{key} is not read (rlbench reads {', '.join(known)} of a role's overrides; the {role}'s other "
                    "settings are the command line's, as slime's role inherits them)",
                    path=file,
                    field=f"megatron[role={role}].overrides.{key}",
                )
            try:
                if isinstance(value, bool):
                    raise ValueError
                fields[known[key]] = float(value)
            except (TypeError, ValueError):
                raise BadInput(
                    f"expected a number, got {value!r}", path=file, field=f"megatron[role={role}].overrides.{key}"
                ) from None
    return fields
