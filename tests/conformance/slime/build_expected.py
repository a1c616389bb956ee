"""Build expected_algo.json from slime's own functions; run once, by hand, and commit its output:

    python tests/conformance/slime/build_expected.py --slime /tmp/slime --out tests/conformance/slime/expected_algo.json

`--slime` is a checkout of THUDM/slime (outside this repository); its commit is recorded in the output
(a tree without .git needs `--commit SHA`). Nothing of slime is copied: its modules are imported from
that path and called on fixed, seeded inputs, and only their inputs and outputs are written.

What slime is asked, each case its own arguments:
- reward cases: slime's group normalisation of rewards, `RolloutManager._post_process_rewards`
  (slime/ray/rollout.py) and the group_index-keyed `grpo_normalize_by_group_index`
  (slime/rollout/_fanout_test_helpers.py, which slime's own comment calls the right grouping for
  uneven groups), on equal, unequal, constant and one-sample groups;
- loss cases: one batch of 8 samples (ragged lengths, a loss-mask-0 span, a `remove_sample` sample)
  through `_convert_samples_to_train_data` (loss masks, rollout_mask_sums, normalised rewards),
  `compute_advantages_and_returns`, `loss_function` (policy_loss_function and its reducer) and
  `reduce_train_step_metrics` (the train/* values slime logs); for each: the per-sample advantages,
  the reported metrics, and the loss's gradient with respect to the logits, projected on two fixed
  directions (`grad_probes`: the sum of grad * cos(0.37 k + 0.71 t + 1.93 v), k = 1, 2).

Single-process shims (slime is written for a Megatron job): torch.compile is the identity (eager is
the same arithmetic, and inductor needs a compiler); modules slime imports but never calls here
(ray, sglang, httpx, ...) are placeholders (ray's always: ray.remote is the identity);
megatron's mpu answers as the one rank of every group; torch.distributed.all_reduce is the identity.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import math
import subprocess
import sys
import types
from argparse import Namespace
from pathlib import Path

import torch

SCHEMA = "rlbench.conformance.slime-algo/1"
# Imported by slime's modules at load and not called on the paths this script runs: placeholders where
# not installed, and ray always (its remote decorator would wrap the class whose methods are called here).
PLACEHOLDERS = (
    "ray",
    "sglang",
    "sglang_router",
    "httpx",
    "requests",
    "wandb",
    "tensorboard",
    "yaml",
    "pybase64",
    "aiohttp",
    "uvicorn",
    "fastapi",
)
READ = (
    "slime/utils/ppo_utils.py",
    "slime/backends/megatron_utils/loss.py",
    "slime/backends/megatron_utils/cp_utils.py",
    "slime/ray/rollout.py",
    "slime/rollout/_fanout_test_helpers.py",
    "slime/utils/distributed_utils.py",
    "slime/observability/train_metric_utils.py",
    "slime/utils/arguments.py",
)


# --------------------------------------------------------------------------- shims


class _Placeholder(types.ModuleType):
    """A module slime imports but this script never calls: every attribute is an inert class."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "remote":  # @ray.remote / @ray.remote(...): the class itself
            return lambda *a, **k: a[0] if len(a) == 1 and not k and callable(a[0]) else (lambda c: c)
        return type(name, (), {"__init__": lambda self, *a, **k: None})


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Placeholder(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def install_shims(slime: Path) -> None:
    torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
    missing = {name for name in PLACEHOLDERS if name == "ray" or importlib.util.find_spec(name) is None}
    sys.meta_path.insert(0, _PlaceholderFinder(missing))
    sys.path.insert(0, str(slime))
    from megatron.core import mpu

    one_rank = {
        "get_context_parallel_world_size": 1,
        "get_context_parallel_rank": 0,
        "is_pipeline_last_stage": True,
        "get_tensor_model_parallel_group": None,
        "get_tensor_model_parallel_rank": 0,
        "get_tensor_model_parallel_world_size": 1,
        "get_data_parallel_world_size": 1,
        "get_data_parallel_rank": 0,
        "get_data_parallel_group": None,
        "get_context_parallel_group": None,
    }
    for name, value in one_rank.items():
        setattr(mpu, name, lambda *a, _v=value, **k: _v)
    torch.distributed.all_reduce = lambda tensor, *a, **k: None  # one rank: the reduction is the value


# --------------------------------------------------------------------------- inputs

N, VOCAB = 8, 11
PROMPT_LENGTHS = [2, 3, 1, 2, 4, 2, 3, 1]
RESPONSE_LENGTHS = [5, 3, 7, 4, 6, 2, 5, 3]
TOOL_SPAN = (2, (2, 4))  # sample 2's response tokens 2..3 are a tool observation: loss mask 0
REMOVED = 5  # slime's remove_sample: trained on nothing, kept in its group's reward statistics


def _f32(t: torch.Tensor) -> list:
    return t.float().tolist()


def make_inputs() -> dict:
    """The loss cases' batch, seeded: token ids (each sample's first id is its index, so a test model
    can tell the samples apart), logits [T, V] of the packed batch, and per response token the old,
    reference and rollout log-probs around the policy's own, far enough apart that PPO, dual and TIS
    clipping, and low_var_kl's clamp, all engage somewhere."""
    gen = torch.Generator().manual_seed(20251125)
    total = [p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)]
    logits = torch.randn(sum(total), VOCAB, generator=gen) * 1.5
    samples, start = [], 0
    for i, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        ids = [i] + torch.randint(0, VOCAB, (p + r - 1,), generator=gen).tolist()
        rows = logits[start + p - 1 : start + p + r - 1]  # the rows predicting the response tokens
        own = torch.log_softmax(rows, -1).gather(-1, torch.tensor(ids[p:])[:, None])[:, 0]
        old = own + torch.randn(r, generator=gen) * 0.6
        ref = own + torch.randn(r, generator=gen) * 0.5
        rollout = old + torch.randn(r, generator=gen) * 0.5
        mask = [1] * r
        if i == TOOL_SPAN[0]:
            mask[TOOL_SPAN[1][0] : TOOL_SPAN[1][1]] = [0] * (TOOL_SPAN[1][1] - TOOL_SPAN[1][0])
        samples.append(
            {
                "tokens": ids,
                "prompt_length": p,
                "loss_mask": mask,
                "old_logprobs": _f32(old),
                "ref_logprobs": _f32(ref),
                "rollout_logprobs": _f32(rollout),
            }
        )
        start += p + r
    samples[0]["ref_logprobs"][1] += 4.0  # k3 of about 50 there: low_var_kl clamps it to 10
    rewards, groups = REWARD_LAYOUTS["equal"]
    for s, reward, group in zip(samples, rewards, groups):
        s["reward"], s["group"] = reward, group
    return {"vocab": VOCAB, "removed": REMOVED, "logits": _f32(logits), "samples": samples}


# --------------------------------------------------------------------------- reward cases

REWARD_LAYOUTS = {
    "equal": ([1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.75, 1.0], [0, 0, 0, 0, 1, 1, 1, 1]),  # the loss cases' too
    "unequal": ([1.0, 0.0, 0.5, 0.0, 0.0, 0.25, 1.0, 0.75], [0, 0, 0, 1, 1, 1, 1, 1]),
    "constant": ([0.9, 0.9, 0.9, 0.2, 0.5, 1.0], [0, 0, 0, 1, 1, 1]),
    "singleton": ([1.0, 0.0, 0.5, 0.75], [0, 0, 0, 1]),
}

# (name, layout, slime function, slime arguments, rlbench's options, whether rlbench gives the same)
REWARD_CASES = [
    ("grpo", "equal", "default", {"n_samples_per_prompt": 4, "rollout_batch_size": 2}, {}, True),
    (
        "grpo_no_std",
        "equal",
        "default",
        {"n_samples_per_prompt": 4, "rollout_batch_size": 2, "grpo_std_normalization": False},
        {"normalize_std": False},
        True,
    ),
    (
        "reinforce_plus_plus_baseline",
        "equal",
        "default",
        {"n_samples_per_prompt": 4, "rollout_batch_size": 2, "advantage_estimator": "reinforce_plus_plus_baseline"},
        {"advantage": "reinforce_plus_plus_baseline", "normalize_advantages": True},
        True,
    ),
    (
        "reinforce_plus_plus",
        "equal",
        "default",
        {"n_samples_per_prompt": 4, "rollout_batch_size": 2, "advantage_estimator": "reinforce_plus_plus"},
        {"advantage": "reinforce_plus_plus", "normalize_advantages": True},
        True,
    ),
    ("unequal_by_group_index", "unequal", "group_index", {}, {}, True),
    (
        "unequal_by_group_index_no_std",
        "unequal",
        "group_index",
        {"grpo_std_normalization": False},
        {"normalize_std": False},
        True,
    ),
    (
        "unequal_baseline_by_group_index",
        "unequal",
        "group_index",
        {"grpo_std_normalization": False},
        {"advantage": "reinforce_plus_plus_baseline", "normalize_advantages": True},
        True,
    ),
    # slime's default on uneven groups: a count of n_samples_per_prompt * rollout_batch_size is
    # reshaped into groups of n_samples_per_prompt regardless of group_index; any other count is one group
    ("unequal_default_reshaped", "unequal", "default", {"n_samples_per_prompt": 4, "rollout_batch_size": 2}, {}, False),
    (
        "unequal_default_one_group",
        "unequal",
        "default",
        {"n_samples_per_prompt": 3, "rollout_batch_size": 3},
        {},
        False,
    ),
    # float32 group statistics: a group of equal rewards is off by an ulp, divided by std + 1e-6 = 1e-6
    ("constant_group", "constant", "default", {"n_samples_per_prompt": 3, "rollout_batch_size": 2}, {}, False),
    # the std of one value is NaN in slime's group-index normalisation; rlbench gives the group 0
    ("singleton_group", "singleton", "group_index", {}, {}, False),
]


def slime_args(**changes) -> Namespace:
    """slime's defaults (slime/utils/arguments.py) for the arguments these calls read."""
    args = dict(
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        reward_key=None,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        kl_coef=0.0,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        kl_loss_type="k1",
        use_unbiased_kl=False,
        entropy_coef=0.0,
        eps_clip=0.2,
        eps_clip_high=0.2,
        eps_clip_c=None,
        normalize_advantages=False,
        calculate_per_token_loss=False,
        use_tis=False,
        tis_clip=2.0,
        tis_clip_low=0.0,
        custom_tis_function_path=None,
        get_mismatch_metrics=False,
        use_rollout_logprobs=False,
        use_opsm=False,
        use_opd=False,
        custom_advantage_function_path=None,
        custom_pg_loss_reducer_function_path=None,
        gamma=1.0,
        lambd=1.0,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        log_probs_chunk_size=-1,
        allgather_cp=False,
        loss_type="policy_loss",
        recompute_loss_function=False,
    )
    args.update(changes)
    if args["n_samples_per_prompt"] == 1:  # as slime_validate_args
        args["grpo_std_normalization"] = False
    return Namespace(**args)


def _manager(args: Namespace):
    """What RolloutManager's reward and train-data methods read of `self`."""
    from slime.ray.rollout import RolloutManager

    manager = types.SimpleNamespace(
        args=args, custom_reward_post_process_func=None, custom_convert_samples_to_train_data_func=None
    )
    manager._post_process_rewards = lambda samples: RolloutManager._post_process_rewards(manager, samples)
    return manager, RolloutManager


def _plain(values: list[float]) -> list:
    return [v if math.isfinite(v) else str(v) for v in values]


def reward_case(name, layout, function, changes, options, same) -> dict:
    from slime.rollout._fanout_test_helpers import grpo_normalize_by_group_index
    from slime.utils.types import Sample

    rewards, groups = REWARD_LAYOUTS[layout]
    args = slime_args(**changes)
    samples = [Sample(group_index=g, index=i, reward=r) for i, (r, g) in enumerate(zip(rewards, groups))]
    if function == "default":
        manager, cls = _manager(args)
        _, normalised = cls._post_process_rewards(manager, samples)
        called = "slime.ray.rollout.RolloutManager._post_process_rewards"
    else:
        _, normalised = grpo_normalize_by_group_index(args, samples)
        called = "slime.rollout._fanout_test_helpers.grpo_normalize_by_group_index"
    return {
        "name": name,
        "layout": layout,
        "slime_function": called,
        "slime_args": changes,
        "options": options,
        "same": same,
        "normalised": _plain(normalised),
    }


# --------------------------------------------------------------------------- loss cases

KL = {"kl_coef": 0.1, "entropy_coef": 0.01}
# (name, rlbench AlgoConfig options, rollout temperature, whether a test also trains through TorchTrainer)
LOSS_CASES = [
    ("grpo", {}, 1.0, True),
    ("grpo_clip_high", {"eps_clip": 0.2, "eps_clip_high": 0.28}, 1.0, False),
    ("grpo_no_std", {"normalize_std": False}, 1.0, False),
    ("grpo_dual_clip", {"eps_clip_c": 1.5}, 1.0, False),
    ("grpo_kl_k1", {**KL, "kl_type": "k1"}, 1.0, False),
    ("grpo_kl_k2", {**KL, "kl_type": "k2"}, 1.0, False),
    ("grpo_kl_k3", {**KL, "kl_type": "k3"}, 1.0, False),
    ("grpo_kl_low_var_kl", {**KL, "kl_type": "low_var_kl"}, 1.0, False),
    ("grpo_entropy", {"entropy_coef": 0.05}, 1.0, False),
    ("grpo_temperature", {}, 0.7, False),
    ("grpo_normalize_advantages", {"normalize_advantages": True}, 1.0, False),
    ("grpo_per_token", {"per_token_loss": True}, 1.0, False),
    ("grpo_tis", {"use_tis": True}, 1.0, False),
    ("grpo_tis_bounds", {"use_tis": True, "tis_clip": 1.5, "tis_clip_low": 0.7}, 1.0, False),
    ("grpo_per_token_kl_tis", {"per_token_loss": True, "use_tis": True, **KL, "kl_type": "k3"}, 1.0, True),
    ("gspo", {"advantage": "gspo"}, 1.0, False),
    ("gspo_per_token_dual_clip", {"advantage": "gspo", "per_token_loss": True, "eps_clip_c": 1.5}, 1.0, False),
    ("cispo", {"advantage": "cispo", "eps_clip_high": 0.28}, 1.0, False),
    ("cispo_wide", {"advantage": "cispo", "eps_clip": 1.0, "eps_clip_high": 4.0, "per_token_loss": True}, 1.0, False),
    ("reinforce_plus_plus", {"advantage": "reinforce_plus_plus", "normalize_advantages": True}, 1.0, False),
    (
        "reinforce_plus_plus_baseline",
        {"advantage": "reinforce_plus_plus_baseline", "normalize_advantages": True, "use_tis": True},
        1.0,
        True,
    ),
]


def loss_args(options: dict, temperature: float) -> Namespace:
    """slime's arguments for rlbench's AlgoConfig options (the mapping each field's help names)."""
    o = {
        "advantage": "grpo",
        "normalize_std": True,
        "eps_clip": 0.2,
        "eps_clip_high": 0.2,
        "eps_clip_c": None,
        "kl_coef": 0.0,
        "kl_type": "k3",
        "entropy_coef": 0.0,
        "normalize_advantages": False,
        "per_token_loss": False,
        "use_tis": False,
        "tis_clip": 2.0,
        "tis_clip_low": 0.0,
        **options,
    }
    return slime_args(
        advantage_estimator=o["advantage"],
        grpo_std_normalization=o["normalize_std"],
        eps_clip=o["eps_clip"],
        eps_clip_high=o["eps_clip_high"],
        eps_clip_c=o["eps_clip_c"],
        use_kl_loss=o["kl_coef"] > 0,
        kl_loss_coef=o["kl_coef"],
        kl_loss_type=o["kl_type"],
        entropy_coef=o["entropy_coef"],
        normalize_advantages=o["normalize_advantages"],
        calculate_per_token_loss=o["per_token_loss"],
        use_tis=o["use_tis"],
        tis_clip=o["tis_clip"],
        tis_clip_low=o["tis_clip_low"],
        rollout_temperature=temperature,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
    )


def probes(total: int) -> torch.Tensor:
    t = torch.arange(total, dtype=torch.float64)[:, None]
    v = torch.arange(VOCAB, dtype=torch.float64)[None, :]
    return torch.stack([torch.cos(0.37 * k + 0.71 * t + 1.93 * v) for k in (1, 2)])


def loss_case(inputs: dict, name: str, options: dict, temperature: float, trainer: bool) -> dict:
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns, loss_function
    from slime.observability.rollout_data_utils import tensorize_rollout_data_for_training
    from slime.observability.train_metric_utils import reduce_train_step_metrics
    from slime.utils.types import Sample

    args = loss_args(options, temperature)
    # slime asserts that no sample is fully masked in reinforce_plus_plus's returns: keep the sample there
    remove = not options.get("advantage", "").startswith("reinforce_plus_plus") or options["advantage"].endswith(
        "baseline"
    )
    samples = [
        Sample(
            group_index=s["group"],
            index=i,
            tokens=list(s["tokens"]),
            response_length=len(s["tokens"]) - s["prompt_length"],
            reward=s["reward"],
            loss_mask=list(s["loss_mask"]),
            rollout_log_probs=list(s["rollout_logprobs"]),
            remove_sample=remove and i == inputs["removed"],
            status=Sample.Status.COMPLETED,
        )
        for i, s in enumerate(inputs["samples"])
    ]
    manager, cls = _manager(args)
    data = cls._convert_samples_to_train_data(manager, samples)
    data["total_lengths"] = [len(t) for t in data["tokens"]]
    tensorize_rollout_data_for_training(data)
    rollout = {
        **data,
        "log_probs": [torch.tensor(s["old_logprobs"]) for s in inputs["samples"]],
        "ref_log_probs": [torch.tensor(s["ref_logprobs"]) for s in inputs["samples"]],
    }
    compute_advantages_and_returns(args, rollout)

    logits = torch.tensor(inputs["logits"])[None].requires_grad_(True)
    batch = {**rollout, "unconcat_tokens": rollout["tokens"]}
    loss, normalizer, log = loss_function(args, batch, num_microbatches=1, step_global_batch_size=N, logits=logits)
    (loss / normalizer).backward()  # Megatron divides the per-token loss's gradients by the token count
    metrics = reduce_train_step_metrics(
        [log],
        calculate_per_token_loss=args.calculate_per_token_loss,
        step_global_batch_size=N,
        cp_size=1,
        dp_with_cp_group=None,
    )
    grad = logits.grad[0].double()
    return {
        "name": name,
        "options": options,
        "temperature": temperature,
        "removed": remove,
        "trainer": trainer,
        "slime_args": {k: v for k, v in vars(args).items() if k in SLIME_OPTION_ARGS},
        "advantages": per_sample(rollout["advantages"], rollout["loss_masks"]),
        "metrics": metrics,
        "grad_probes": [float((grad * p).sum()) for p in probes(grad.shape[0])],
    }


SLIME_OPTION_ARGS = (
    "advantage_estimator",
    "grpo_std_normalization",
    "eps_clip",
    "eps_clip_high",
    "eps_clip_c",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
    "entropy_coef",
    "normalize_advantages",
    "calculate_per_token_loss",
    "use_tis",
    "tis_clip",
    "tis_clip_low",
    "rollout_temperature",
)


def per_sample(advantages: list[torch.Tensor], masks: list[torch.Tensor]) -> list[float]:
    """Each sample's advantage: the value its trained tokens share (checked equal), or its first
    token's where it has none."""
    out = []
    for adv, mask in zip(advantages, masks):
        trained = adv[mask.bool()]
        values = trained if trained.numel() else adv[:1]
        assert float((values - values[0]).abs().max()) <= 1e-6 * max(1.0, abs(float(values[0]))), adv
        out.append(float(values[0]))
    return out


# --------------------------------------------------------------------------- main


def commit_of(slime: Path, given: str | None) -> str:
    if given:
        return given
    try:  # the checkout's own commit, not that of a repository it happens to sit in
        top, commit = subprocess.run(
            ["git", "-C", str(slime), "rev-parse", "--show-toplevel", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        if Path(top).resolve() == slime.resolve():
            return commit
    except (OSError, subprocess.CalledProcessError, ValueError):
        pass
    raise SystemExit(f"{slime} is not a git checkout of slime: give its commit with --commit")


def slime_parser(description: str) -> argparse.ArgumentParser:
    """The generator scripts' command line: --slime (a checkout of THUDM/slime) and --commit (its commit, where it
    is not a git checkout; `commit_of` reads it otherwise)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--slime", required=True, type=Path, help="a checkout of THUDM/slime")
    parser.add_argument("--commit", help="slime's commit, where --slime is not a git checkout")
    return parser


def shimmed_slime(description: str) -> tuple[argparse.Namespace, str]:
    """A generator's start: its command line (--slime, --commit, --out), slime's commit, the shims installed, one
    thread. Returns the arguments and the commit."""
    parser = slime_parser(description)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    commit = commit_of(args.slime, args.commit)
    install_shims(args.slime.resolve())
    torch.set_num_threads(1)
    return args, commit


def header(schema: str, commit: str, read: tuple[str, ...], generator: str) -> dict:
    """What an expected-values document says of where it came from."""
    return {
        "schema": schema,
        "slime": {"repository": "THUDM/slime", "commit": commit, "read": list(read)},
        "generator": generator,
        "torch": torch.__version__,
    }


def main() -> int:
    args, commit = shimmed_slime(__doc__.splitlines()[0])
    inputs = make_inputs()
    document = {
        **header(SCHEMA, commit, READ, "tests/conformance/slime/build_expected.py"),
        "inputs": inputs,
        "reward_layouts": {k: {"rewards": r, "groups": g} for k, (r, g) in REWARD_LAYOUTS.items()},
        "reward_cases": [reward_case(*case) for case in REWARD_CASES],
        "loss_cases": [loss_case(inputs, *case) for case in LOSS_CASES],
    }
    args.out.write_text(json.dumps(document, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {len(REWARD_CASES)} reward cases, {len(LOSS_CASES)} loss cases, slime {commit[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
