"""rlbench's PPO arithmetic (rlbench/core/ppo.py) against slime's own functions: for every case of expected_ppo.json
(written by build_expected_ppo.py from slime at the commit it records), the same inputs through rlbench give slime's
advantages, returns and value loss.

GAE: rlbench computes in float64 by the backward recurrence. On float64 inputs it is vanilla_gae bit for bit and
chunked_gae (slime's ppo path, scans as matrix products) within 1e-6 (1.44e-15). On float32 inputs, as slime
runs it, slime's own rounding is the difference: the float32 cases are held to what float32 can promise of a
T-step scan, max(1e-6, T x 2^-24) relative (`python bench/ppo_conformance.py`: 1.8e-7 at 5 tokens, 1.4e-6 at 127
and 129, 2.2e-6 at 257)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlbench.core import algo, ppo

EXPECTED = json.loads((Path(__file__).parent / "expected_ppo.json").read_text())
BATCH = EXPECTED["batch"]
GAE = {case["name"]: case for case in EXPECTED["gae_cases"]}
BATCH_CASES = {case["name"]: case for case in EXPECTED["batch_cases"]}
LOSS_CASES = {case["name"]: case for case in EXPECTED["value_loss_cases"]}


def worst(got: torch.Tensor, want: list[float]) -> float:
    """The largest |got - want| / max(1, |want|)."""
    expected = torch.tensor(want, dtype=torch.float64)
    assert got.shape == expected.shape
    return float(((got.double() - expected).abs() / expected.abs().clamp(min=1)).max()) if len(want) else 0.0


def test_the_expectations_name_slime_and_its_commit():
    assert EXPECTED["schema"] == "rlbench.conformance.slime-ppo/1"
    assert EXPECTED["slime"]["repository"] == "THUDM/slime" and len(EXPECTED["slime"]["commit"]) == 40
    assert len(GAE) == 7 * 4 * 3 and len(BATCH_CASES) == 4 and len(LOSS_CASES) == 4


@pytest.mark.parametrize("name", list(GAE))
def test_gae_and_returns_are_slimes(name):
    case = GAE[name]
    inputs = EXPECTED["gae_inputs"][str(case["length"])]
    dtype = getattr(torch, case["dtype"])
    rewards = torch.tensor(inputs["rewards"], dtype=torch.float64).to(dtype)
    values = torch.tensor(inputs["values"], dtype=torch.float64).to(dtype)
    advantages, returns = ppo.gae([rewards], [values], case["gamma"], case["lambd"])
    if case["dtype"] == "float64":
        tolerance = 0.0 if case["function"] == "vanilla_gae" else 1e-6  # the same recurrence; scans as products
    else:
        tolerance = max(1e-6, case["length"] * 2**-24)
    assert worst(advantages[0], case["advantages"]) <= tolerance
    assert worst(returns[0], case["returns"]) <= tolerance


def _ppo_batch(case: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """rlbench's advantages and returns for a batch case, as its ppo path will compute them."""
    rewards = ppo.token_rewards(torch.tensor(BATCH["rewards"]), BATCH["response_lengths"])
    values = [torch.tensor(v, dtype=torch.float64).float() for v in case["values"]]
    advantages, returns = ppo.gae(rewards, values, case["gamma"], case["lambd"])
    if case["normalize_advantages"]:
        masks = [torch.tensor(m) for m in BATCH["loss_masks"]]
        advantages = ppo.whiten_tokens(advantages, masks)
    return advantages, returns


@pytest.mark.parametrize("name", list(BATCH_CASES))
def test_the_ppo_advantages_and_returns_of_a_batch_are_slimes(name):
    """compute_advantages_and_returns (ppo): the reward on the last response token (masked or not), GAE over
    float32 values, whitening over the trained tokens applied to all; a removed sample's tokens as the others'."""
    case = BATCH_CASES[name]
    advantages, returns = _ppo_batch(case)
    for i, length in enumerate(BATCH["response_lengths"]):
        bound = max(1e-6, length * 2**-24)  # slime's float32 scan, as above
        assert worst(advantages[i], case["advantages"][i]) <= bound, (i, advantages[i], case["advantages"][i])
        assert worst(returns[i], case["returns"][i]) <= bound


def test_whitening_changes_the_advantages_and_never_the_returns():
    plain, whitened = (BATCH_CASES[f"ppo-normalize{n}-g1.0-l1.0"] for n in (0, 1))
    assert plain["returns"] == whitened["returns"] and plain["advantages"] != whitened["advantages"]
    a, r = _ppo_batch(plain)
    b, s = _ppo_batch(whitened)
    assert all(torch.equal(x, y) for x, y in zip(r, s)) and not all(torch.equal(x, y) for x, y in zip(a, b))


def test_with_gamma_and_lambda_1_the_returns_are_the_reward_on_every_token():
    case = BATCH_CASES["ppo-normalize0-g1.0-l1.0"]
    for reward, returns in zip(BATCH["rewards"], case["returns"]):
        assert max(abs(x - reward) for x in returns) <= 1e-6
    _, ours = _ppo_batch(case)
    assert all(float((r - reward).abs().max()) <= 1e-6 for r, reward in zip(ours, BATCH["rewards"]))


def test_whitening_with_no_trained_token_is_refused():
    from rlbench.errors import BadInput

    with pytest.raises(BadInput) as refused:
        ppo.whiten_tokens([torch.ones(3)], [torch.zeros(3)])
    assert refused.value.field == "algo.normalize_advantages"


@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_the_clipped_value_loss_and_its_clip_fraction_are_slimes(name):
    case = LOSS_CASES[name]
    flat = lambda key: torch.cat([torch.tensor(v, dtype=torch.float64).float() for v in case[key]])  # noqa: E731
    loss, clipped = ppo.value_loss_terms(flat("values"), flat("old_values"), flat("returns"), case["value_clip"])
    lengths = BATCH["response_lengths"]
    mask = torch.zeros(len(lengths), max(lengths))
    padded = [torch.zeros(len(lengths), max(lengths)) for _ in range(2)]
    for i, (m, part_loss, part_clip) in enumerate(
        zip(BATCH["loss_masks"], loss.split(lengths), clipped.split(lengths))
    ):
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        padded[0][i, : len(m)], padded[1][i, : len(m)] = part_loss, part_clip
    reduce = algo.reducer(mask, mask.sum() if case["per_token"] else None)
    # slime's reducers sum (the per-sample means; per token, the masked values), the caller scaling by the
    # micro-batch's share; rlbench's reducer gives the mean over samples or over the step's tokens
    scale = float(mask.sum()) if case["per_token"] else len(lengths)
    assert abs(float(reduce(padded[0])) * scale - case["loss"]) <= 1e-6 * max(1.0, abs(case["loss"]))
    assert abs(float(reduce(padded[1])) * scale - case["value_clipfrac"]) <= 1e-6
    assert 0 < case["value_clipfrac"] < 1 * scale  # some values moved past the clip, not all


# --------------------------------------------------------------------------- rlbench's own edges


def test_the_reward_sits_on_the_last_token_in_float64_and_an_empty_response_has_none():
    rows = ppo.token_rewards(torch.tensor([0.1, -2.0, 7.0], dtype=torch.float64), [3, 1, 0])
    assert [r.dtype for r in rows] == [torch.float64] * 3
    assert rows[0].tolist() == [0.0, 0.0, 0.1] and rows[1].tolist() == [-2.0] and rows[2].tolist() == []


def test_gae_refuses_rewards_and_values_that_do_not_pair_up():
    for rewards, values in (([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)]), ([torch.zeros(2)], [torch.zeros(3)])):
        with pytest.raises(ValueError, match="^gae: one reward and one value per response token$"):
            ppo.gae(rewards, values, 1.0, 1.0)
    assert ppo.gae([], [], 1.0, 1.0) == ([], [])


def test_gae_of_samples_of_other_lengths_is_each_alone():
    """Padding to the longest changes nothing: a short sample's terminal value is 0 as when it is alone."""
    short, long = (torch.tensor([0.5, -1.0]), torch.tensor([0.2, 0.1, 0.3, 0.9]))
    rewards = [torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0, -1.0])]
    together = ppo.gae(rewards, [short, long], 0.9, 0.8)
    for i, values in enumerate((short, long)):
        alone = ppo.gae([rewards[i]], [values], 0.9, 0.8)
        assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i])
    assert together[0][0].dtype == torch.float64


def test_whitening_message_bessel_at_two_tokens_and_eps_under_the_root():
    from rlbench.errors import BadInput

    with pytest.raises(BadInput) as refused:
        ppo.whiten_tokens([torch.ones(2)], [torch.zeros(2)])
    assert str(refused.value).endswith("no trained token in the step: there is nothing to whiten the advantages over")
    two = ppo.whiten_tokens([torch.tensor([1.0, 3.0, 100.0])], [torch.tensor([1, 1, 0])])[0]
    # mean 2, variance 1 over two tokens, 2 with Bessel's correction; the masked token whitened as well
    assert torch.allclose(two, (torch.tensor([1.0, 3.0, 100.0], dtype=torch.float64) - 2) / (2 + 1e-8) ** 0.5)
    same = ppo.whiten_tokens([torch.full((3,), 0.7)], [torch.ones(3)])[0]
    assert same.tolist() == [0.0, 0.0, 0.0]  # variance 0: (a - mean) / sqrt(eps)


def test_the_clip_fraction_counts_moves_past_the_clip_not_at_it_in_the_values_dtype():
    values, old, returns = torch.tensor([0.5, 0.75, 0.0]), torch.tensor([0.25, 0.25, 0.0]), torch.zeros(3)
    loss, clipped = ppo.value_loss_terms(values, old, returns, 0.25)
    assert clipped.dtype == values.dtype and clipped.tolist() == [0.0, 1.0, 0.0]
    # the larger of the clipped and unclipped errors: (0.5, 0.5 clipped) and (0.75 vs 0.5 clipped): 0.5625
    assert loss.tolist() == [0.25, 0.5625, 0.0]
