"""rlbench's algorithm options against slime's own functions: for every case of expected_algo.json
(written by build_expected.py from slime at the commit it records), rlbench's advantages, loss,
train/* metrics and loss gradient on the same inputs equal slime's within 1e-6, through rlbench/core/algo.py
and through the trainer; each option changes the result, on both sides; and each deliberate
difference (docs/design.md) is shown as a difference, with the value rlbench gives instead."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from rlbench.backends.torch_trainer import TorchTrainer
from rlbench.config import AlgoConfig, TrainConfig
from rlbench.core import algo, metrics, samples
from rlbench.rundir import recording
from tests.conformance.slime.build_expected import probes
from tests.helpers import TableLogits

EXPECTED = json.loads((Path(__file__).parent / "expected_algo.json").read_text())
INPUTS = EXPECTED["inputs"]
REWARD_CASES = {case["name"]: case for case in EXPECTED["reward_cases"]}
LOSS_CASES = {case["name"]: case for case in EXPECTED["loss_cases"]}


def algo_config(case: dict) -> AlgoConfig:
    """rlbench's options for a case: its changes from the base build_expected.loss_args maps to slime, which
    has no KL term (slime's default; rlbench's default kl_coef is 0.1 since issue 52), over rlbench's defaults."""
    return AlgoConfig(**{"kl_coef": 0.0, **case["options"]})


def close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-6 * max(1.0, abs(want))


def assert_close(got: list[float], want: list[float], what: str) -> None:
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if not close(g, w)]
    assert len(got) == len(want) and not bad, f"{what}: (index, rlbench, slime) {bad}"


def test_the_expectations_name_slime_and_its_commit():
    assert EXPECTED["schema"] == "rlbench.conformance.slime-algo/1"
    assert EXPECTED["slime"]["repository"] == "THUDM/slime" and len(EXPECTED["slime"]["commit"]) == 40
    assert len(REWARD_CASES) == len(EXPECTED["reward_cases"]) and len(LOSS_CASES) == len(EXPECTED["loss_cases"])


# --------------------------------------------------------------------------- reward normalisation


def rlbench_rewards(case: dict, groups=None) -> list[float]:
    layout = EXPECTED["reward_layouts"][case["layout"]]
    rewards = torch.tensor(layout["rewards"], dtype=torch.float32)
    ids = torch.tensor(layout["groups"]) if groups is None else groups
    return algo.normalised_rewards(rewards, ids, algo_config(case)).tolist()


def slime_values(case: dict) -> list[float]:
    return [float(v) for v in case["normalised"]]  # "nan" is written as a string


@pytest.mark.parametrize("name", [n for n, c in REWARD_CASES.items() if c["same"]])
def test_group_normalisation_is_slimes(name):
    case = REWARD_CASES[name]
    assert_close(rlbench_rewards(case), slime_values(case), name)


def test_consecutive_groups_by_size_are_the_same_as_by_id():
    """A live run passes the group size; a recording with group ids passes them: one result."""
    case = REWARD_CASES["grpo"]
    assert_close(rlbench_rewards(case, groups=4), slime_values(case), "by size")


# Where rlbench deliberately gives another value: what slime gives, and what rlbench gives instead.
def _by_group_index(case: dict) -> list[float]:
    return slime_values(REWARD_CASES["unequal_by_group_index"])


DIFFERENCES = {
    # slime's default groups by position (count == n * batch) or makes one group: rlbench groups by id
    "unequal_default_reshaped": _by_group_index,
    "unequal_default_one_group": _by_group_index,
    # float32 statistics of a constant group: slime pushes it by 0.06; rlbench's float64 gives exactly 0
    "constant_group": lambda case: [0.0, 0.0, 0.0] + slime_values(case)[3:],
    # the std of one sample is NaN in slime's group-index normalisation; rlbench gives that group 0
    "singleton_group": lambda case: slime_values(case)[:3] + [0.0],
}


def test_every_difference_is_listed():
    assert set(DIFFERENCES) == {n for n, c in REWARD_CASES.items() if not c["same"]}


@pytest.mark.parametrize("name", sorted(DIFFERENCES))
def test_deliberate_differences_both_ways(name):
    """slime's value differs from rlbench's (by more than rounding), and rlbench's is the documented one."""
    case = REWARD_CASES[name]
    got, theirs = rlbench_rewards(case), slime_values(case)
    assert any(not (abs(g - t) <= 1e-3) for g, t in zip(got, theirs))  # NaN counts as a difference
    assert_close(got, DIFFERENCES[name](case), name)
    if name == "constant_group":
        assert got[:3] == [0.0, 0.0, 0.0] and theirs[0] == pytest.approx(0.0596, abs=1e-4)


# --------------------------------------------------------------------------- the loss


def flat_batch(case: dict) -> dict[str, torch.Tensor]:
    """The inputs as a step's flat recording tensors (the removed sample's mask all 0 where slime
    removed it), with the old and reference log-probs the logprob stage would add."""
    given = INPUTS["samples"]
    masks = [
        [0] * len(s["loss_mask"]) if case["removed"] and i == INPUTS["removed"] else s["loss_mask"]
        for i, s in enumerate(given)
    ]
    prompts = [s["tokens"][: s["prompt_length"]] for s in given]
    responses = [s["tokens"][s["prompt_length"] :] for s in given]
    tensors = recording.pack(
        prompts,
        responses,
        masks,
        [s["rollout_logprobs"] for s in given],
        list(range(len(given))),
        [s["group"] for s in given],
    )
    for key in ("old_logprobs", "ref_logprobs"):
        tensors[key] = (
            recording.pack(prompts, responses, masks, [s[key] for s in given], [0] * len(given), [0] * len(given))[
                "rollout_logprobs"
            ]
            * tensors["loss_mask"]
        )
    tensors["rewards"] = torch.tensor([s["reward"] for s in given], dtype=torch.float32)
    return tensors


def padded_logits(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    packed, offsets = torch.tensor(INPUTS["logits"]), tensors["offsets"]
    width = int((offsets[1:] - offsets[:-1]).max())
    out = torch.zeros(len(offsets) - 1, width, packed.shape[1])
    for i in range(len(offsets) - 1):
        a, b = int(offsets[i]), int(offsets[i + 1])
        out[i, : b - a] = packed[a:b]
    return out


@functools.cache
def rlbench_case(name: str) -> dict:
    """rlbench's advantages, loss, metrics and gradient probes for a case, through algo.py."""
    case = LOSS_CASES[name]
    config = algo_config(case)
    tensors = flat_batch(case)
    groups = torch.tensor([s["group"] for s in INPUTS["samples"]])
    advantages = algo.advantages(tensors["rewards"], groups, samples.token_counts(tensors), config)
    batch = samples.train_batch({**tensors, "advantages": advantages})
    width = batch.tokens.shape[1]
    mask, offsets = batch.loss_mask, tensors["offsets"]
    old, ref, rollout = (
        recording.padded(tensors[k], offsets, width) * mask
        for k in ("old_logprobs", "ref_logprobs", "rollout_logprobs")
    )
    logits = padded_logits(tensors).requires_grad_(True)
    logp = algo.token_logprobs(logits, batch.tokens, case["temperature"])
    entropy = algo.token_entropy(logits, case["temperature"])
    reduce = algo.reducer(mask, algo.token_denominator(mask) if config.per_token_loss else None)
    loss, terms = algo.policy_loss(logp, old, advantages, mask, entropy, config, reduce, ref, rollout)
    loss.backward()
    grad = torch.cat([logits.grad[i, : int(offsets[i + 1] - offsets[i])] for i in range(len(offsets) - 1)]).double()
    got = {
        "loss": float(loss.detach()),
        **{k: float(v.detach()) for k, v in terms.items()},
        "train_rollout_logprob_abs_diff": metrics.logprob_abs_diff(tensors, config.per_token_loss),
    }
    return {
        "advantages": advantages.tolist(),
        "metrics": got,
        "grad_probes": [float((grad * p).sum()) for p in probes(grad.shape[0])],
    }


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_loss_case_is_slimes(name):
    case = LOSS_CASES[name]
    got = rlbench_case(name)
    assert_close(got["advantages"], case["advantages"], "advantages")
    assert set(got["metrics"]) == set(case["metrics"])
    for key, want in case["metrics"].items():
        assert close(got["metrics"][key], want), (key, got["metrics"][key], want)
    assert_close(got["grad_probes"], case["grad_probes"], "gradient probes")


@pytest.mark.parametrize("name", sorted(n for n, c in LOSS_CASES.items() if c["trainer"]))
def test_trainer_metrics_are_slimes(name):
    """Through TorchTrainer in micro-batches of 3 (the per-token loss's denominator is the minibatch's),
    the train/* metrics of the step equal slime's."""
    case = LOSS_CASES[name]
    config = algo_config(case)
    tensors = flat_batch(case)
    batch = samples.train_batch({**tensors, "advantages": torch.tensor(case["advantages"])})
    width, offsets = batch.tokens.shape[1], tensors["offsets"]
    batch.old_logprobs, ref, rollout = (
        recording.padded(tensors[k], offsets, width) * batch.loss_mask
        for k in ("old_logprobs", "ref_logprobs", "rollout_logprobs")
    )
    batch.ref_logprobs = ref if config.kl_coef > 0 else None
    batch.rollout_logprobs = rollout if config.use_tis else None
    trainer = TorchTrainer(
        TableLogits(padded_logits(tensors)),
        TrainConfig(minibatches=1, micro_batch_size=3),
        config,
        case["temperature"],
        seed=0,
    )
    got = trainer.train_step(batch, step=0).metrics
    for key, want in case["metrics"].items():
        if key != "train_rollout_logprob_abs_diff":  # the logprob stage's (test_loss_case_is_slimes)
            assert close(got[f"train/{key}"], want), (key, got[f"train/{key}"], want)


# --------------------------------------------------------------------------- each option changes the result

# (case, the case it differs from by one option, the output that option changes)
OPTION_EFFECTS = [
    ("grpo_clip_high", "grpo", "loss"),
    ("grpo_no_std", "grpo", "advantages"),
    ("grpo_dual_clip", "grpo", "loss"),
    ("grpo_kl_k1", "grpo", "loss"),
    ("grpo_kl_k2", "grpo_kl_k1", "kl_loss"),
    ("grpo_kl_k3", "grpo_kl_k1", "kl_loss"),
    ("grpo_kl_low_var_kl", "grpo_kl_k3", "kl_loss"),
    ("grpo_entropy", "grpo", "loss"),
    ("grpo_temperature", "grpo", "loss"),
    ("grpo_normalize_advantages", "grpo", "advantages"),
    ("grpo_per_token", "grpo", "loss"),
    ("grpo_tis", "grpo", "loss"),
    ("grpo_tis_bounds", "grpo_tis", "loss"),
    ("gspo", "grpo", "loss"),
    ("gspo", "grpo", "grad_probes"),
    ("cispo", "grpo", "grad_probes"),
    ("gspo_per_token_dual_clip", "gspo", "loss"),
    ("cispo_wide", "cispo", "loss"),
    ("reinforce_plus_plus", "grpo_normalize_advantages", "advantages"),
    ("reinforce_plus_plus_baseline", "grpo_normalize_advantages", "advantages"),
    ("grpo_per_token_kl_tis", "grpo_per_token", "loss"),
]


def _output(result: dict, key: str) -> list[float]:
    value = result.get(key, result["metrics"].get(key))
    return value if isinstance(value, list) else [value]


@pytest.mark.parametrize("name, baseline, key", OPTION_EFFECTS)
def test_each_option_changes_the_result(name, baseline, key):
    """On slime's side and on rlbench's: a case that ignored its option would fail the comparison above."""
    for results in ((LOSS_CASES[name], LOSS_CASES[baseline]), (rlbench_case(name), rlbench_case(baseline))):
        one, other = (_output(r, key) for r in results)
        assert max(abs(a - b) for a, b in zip(one, other)) > 1e-4, (name, baseline, key)


def test_every_option_is_covered():
    """Each AlgoConfig field is set away from the cases' base (algo_config) by some case that OPTION_EFFECTS
    compares."""
    varied = {field for name, _, _ in OPTION_EFFECTS for field in LOSS_CASES[name]["options"]}
    # PPO's: gamma, lambd and value_clip varied in expected_ppo.json's cases against slime's GAE and value loss
    # (test_ppo.py); num_critic_only_steps is the loop's schedule (tests/cpu/test_ppo_run.py)
    ppo = {"gamma", "lambd", "value_clip", "num_critic_only_steps"}
    assert varied | ppo == set(AlgoConfig.__dataclass_fields__) and not varied & ppo
    assert math.isclose(LOSS_CASES["grpo_temperature"]["temperature"], 0.7)  # the rollout temperature too
