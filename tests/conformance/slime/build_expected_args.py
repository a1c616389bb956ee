"""Build expected_args.json: what slime itself resolves a command line's arguments to, for the
settings `rlbench run` reads from a slime command line (rlbench/slime_args.py).

    python tests/conformance/slime/build_expected_args.py --slime /tmp/slime

`--slime` is a checkout of THUDM/slime (`git archive` of its repository); the commit is recorded in
the output. slime's own parser (get_slime_extra_args_provider) parses each case and slime's own
slime_validate_args derives the rest (eps_clip_high, global_batch_size, grpo_std_normalization).
Modules slime imports but these two functions do not use (sglang, httpx, wandb: not installable
here) are stubbed; Megatron-LM's optimizer arguments, which slime leaves to Megatron-LM's parser,
are added with Megatron-LM's defaults (megatron/training/arguments.py, NVIDIA/Megatron-LM commit
307dcf37: --weight-decay 0.01, --adam-beta1 0.9, --adam-beta2 0.999, --adam-eps 1e-08, --optimizer
adam, --lr-decay-style linear, --tensor-model-parallel-size 1; the recompute arguments unset, no
--optimizer-cpu-offload). Settings slime leaves unset stay None.
Run once; the JSON is committed and the tests read only it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import types
from pathlib import Path

from build_expected import commit_of, slime_parser  # a sibling script (these run as scripts)

OUT = Path(__file__).resolve().parent / "expected_args.json"
ROLES = Path(__file__).resolve().parent / "ppo_roles.yaml"  # relative in the JSON: the repository's file

BASE = [
    "--rollout-batch-size",
    "4",
    "--rollout-max-response-len",
    "4",
    "--num-rollout",
    "3",
    "--prompt-data",
    "data.jsonl",
]
CASES = {
    "defaults": BASE + ["--global-batch-size", "4"],
    "quick_start_grpo": [
        "--prompt-data",
        "data.jsonl",
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--apply-chat-template",
        "--rollout-shuffle",
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "8",
        "--num-steps-per-rollout",
        "1",
        "--global-batch-size",
        "32",
        "--rollout-max-response-len",
        "4",
        "--rollout-temperature",
        "1",
        "--advantage-estimator",
        "grpo",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.00",
        "--kl-loss-type",
        "low_var_kl",
        "--entropy-coef",
        "0.00",
        "--eps-clip",
        "0.2",
        "--eps-clip-high",
        "0.28",
        "--optimizer",
        "adam",
        "--lr",
        "1e-6",
        "--lr-decay-style",
        "constant",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.98",
    ],
    "reward_kl": BASE + ["--global-batch-size", "4", "--kl-coef", "0.01"],
    "kl_coef_without_use_kl_loss": BASE + ["--global-batch-size", "4", "--kl-loss-coef", "0.5"],
    "steps_per_rollout": BASE + ["--n-samples-per-prompt", "6", "--num-steps-per-rollout", "3"],
    "sampling": BASE
    + [
        "--global-batch-size",
        "2",
        "--rollout-temperature",
        "0.7",
        "--rollout-top-p",
        "0.9",
        "--rollout-top-k",
        "20",
        "--rollout-seed",
        "7",
        "--rollout-stop-token-ids",
        "5",
        "9",
        "--seed",
        "11",
    ],
    "algorithm": BASE
    + [
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "8",
        "--advantage-estimator",
        "reinforce_plus_plus_baseline",
        "--eps-clip",
        "0.3",
        "--eps-clip-c",
        "3.0",
        "--normalize-advantages",
        "--disable-grpo-std-normalization",
        "--calculate-per-token-loss",
        "--use-tis",
        "--tis-clip",
        "1.5",
        "--tis-clip-low",
        "0.5",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.02",
        "--kl-loss-type",
        "k2",
        "--apply-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--micro-batch-size",
        "2",
        "--clip-grad",
        "0.5",
        "--lr",
        "3e-4",
        "--adam-eps",
        "1e-6",
    ],
    "ppo": BASE
    + [
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "4",
        "--advantage-estimator",
        "ppo",
        "--value-clip",
        "0.3",
        "--gamma",
        "0.99",
        "--lambd",
        "0.95",
        "--num-critic-only-steps",
        "1",
        "--normalize-advantages",
    ],
    # slime's PPO test's layout: the critic's learning rate in a role's overrides (tests/test_qwen3_4B_ppo.py)
    "ppo_roles": BASE
    + [
        "--global-batch-size",
        "4",
        "--advantage-estimator",
        "ppo",
        "--lr",
        "1e-6",
        "--megatron-config-path",
        str(ROLES),
    ],
    "dynamic_batch_size": BASE
    + ["--global-batch-size", "4", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"],
    "max_tokens_without_dynamic_batch_size": BASE + ["--global-batch-size", "4", "--max-tokens-per-gpu", "4096"],
    "memory": BASE
    + [
        "--global-batch-size",
        "4",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
        "--optimizer-cpu-offload",
        "--offload-rollout",
    ],
}
KEYS = (
    "hf_checkpoint",
    "prompt_data",
    "input_key",
    "label_key",
    "apply_chat_template",
    "apply_chat_template_kwargs",
    "rollout_shuffle",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "global_batch_size",
    "num_steps_per_rollout",
    "num_rollout",
    "rollout_max_response_len",
    "rollout_temperature",
    "rollout_top_p",
    "rollout_top_k",
    "rollout_seed",
    "rollout_stop_token_ids",
    "seed",
    "lr",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "clip_grad",
    "micro_batch_size",
    "advantage_estimator",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
    "kl_coef",
    "eps_clip",
    "eps_clip_high",
    "eps_clip_c",
    "entropy_coef",
    "normalize_advantages",
    "grpo_std_normalization",
    "calculate_per_token_loss",
    "use_tis",
    "tis_clip",
    "tis_clip_low",
    "use_dynamic_batch_size",
    "max_tokens_per_gpu",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "optimizer_cpu_offload",
    "offload_rollout",
    "offload_train",
    "use_critic",
    "value_clip",
    "gamma",
    "lambd",
    "num_critic_only_steps",
)
MEGATRON = {
    "--weight-decay": (float, 0.01),
    "--adam-beta1": (float, 0.9),
    "--adam-beta2": (float, 0.999),
    "--adam-eps": (float, 1e-08),
    "--optimizer": (str, "adam"),
    "--lr-decay-style": (str, "linear"),
    "--tensor-model-parallel-size": (int, 1),
    "--recompute-granularity": (str, None),
    "--recompute-method": (str, None),
    "--recompute-num-layers": (int, None),
    "--optimizer-cpu-offload": (bool, False),  # a flag
}


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def _import_arguments(slime: Path):
    """slime.utils.arguments, with the modules it imports but cannot get here stubbed."""
    sys.path.insert(0, str(slime))
    for _ in range(50):
        try:
            return importlib.import_module("slime.utils.arguments")
        except ModuleNotFoundError as exc:
            parts = exc.name.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                sys.modules.setdefault(name, _Stub(name))
                sys.modules[name].__path__ = []
            for name in [n for n in sys.modules if n.startswith("slime")]:
                del sys.modules[name]
    raise RuntimeError("could not import slime.utils.arguments")


class _Megatron(argparse.Namespace):
    """Megatron-LM's attributes slime_validate_args reads and these cases do not set: None."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def resolve(arguments, argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    for name, (kind, default) in MEGATRON.items():
        if kind is bool:
            parser.add_argument(name, action="store_true", default=default)
        else:
            parser.add_argument(name, type=kind, default=default)
    arguments.get_slime_extra_args_provider()(parser)
    args = _Megatron(**vars(parser.parse_args(argv)))
    args.ref_load = tempfile.gettempdir()  # slime checks that a KL run's reference checkpoint exists
    arguments.slime_validate_args(args)
    out = {key: getattr(args, key) for key in KEYS}
    if args.megatron_config_path is not None:  # each role's arguments, as slime's placement group parses them
        out["role_lr"] = {
            role: arguments.parse_megatron_role_args(args, args.megatron_config_path, role=role).lr
            for role in ("actor", "critic")
        }
    return out


def _relative(argv: list[str]) -> list[str]:
    """The command line as committed: the role config by its path in the repository."""
    return [str(ROLES.relative_to(ROLES.parents[3])) if arg == str(ROLES) else arg for arg in argv]


def main() -> None:
    given = slime_parser(__doc__.splitlines()[0]).parse_args()
    commit = commit_of(given.slime, given.commit)
    arguments = _import_arguments(given.slime)
    cases = {name: {"argv": _relative(argv), "slime": resolve(arguments, argv)} for name, argv in CASES.items()}
    OUT.write_text(
        json.dumps(
            {"slime_commit": commit, "megatron_defaults": {k: v[1] for k, v in MEGATRON.items()}, "cases": cases},
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    print(f"wrote {OUT} ({len(cases)} cases, slime {commit[:12]})")


if __name__ == "__main__":
    main()
