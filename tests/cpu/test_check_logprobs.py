"""`check logprobs` reports the measured train-inference mismatch honestly, is exactly zero with
the true on-policy option, and gates with thresholds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlbench.checks.logprobs import check_logprobs, statistics
from tests.conftest import run_cli


def test_statistics_by_hand():
    delta = torch.tensor([0.1, -0.2, 0.0, 0.4], dtype=torch.float64)
    stats = statistics(delta)
    assert stats["mean_abs"] == pytest.approx(0.175)
    assert stats["max_abs"] == pytest.approx(0.4)
    assert stats["k3_kl"] == pytest.approx(sum(math.exp(r) - r - 1 for r in [0.1, -0.2, 0.0, 0.4]) / 4)
    assert stats["mean_exp_abs"] == pytest.approx(sum(math.exp(abs(r)) for r in [0.1, -0.2, 0.0, 0.4]) / 4)
    # p99 by hand, interpolating linearly between order statistics: |delta| sorted is 0, 0.1, 0.2, 0.4 and
    # the 99th percentile sits 0.99 * 3 = 2.97 places in, 97% of the way from 0.2 to 0.4
    assert stats["p99_abs"] == pytest.approx(0.2 + 0.97 * 0.2)
    # 0, 1, ..., 100 in some order, signs mixed: p99 is 99, mean 50, max 100
    spread = torch.tensor([(-1) ** k * float((37 * k) % 101) for k in range(101)], dtype=torch.float64)
    stats = statistics(spread)
    assert (stats["p99_abs"], stats["mean_abs"], stats["max_abs"]) == (pytest.approx(99.0), pytest.approx(50.0), 100.0)
    assert statistics(torch.zeros(0)) == {"mean_abs": 0.0, "p99_abs": 0.0, "max_abs": 0.0, "k3_kl": 0.0,
                                          "mean_exp_abs": 0.0}


def test_default_mismatch_is_reported_as_measured(run_small, tmp_path):
    result = run_small("a", steps=3)
    report = check_logprobs(tmp_path / "a", top=5)
    assert report.source == "recorded" and report.steps == [0, 1, 2]
    # Not zero (decode with a KV cache vs a padded batched forward round differently), and small.
    assert 0 < report.stats["mean_abs"] < 1e-5 and report.stats["max_abs"] < 1e-4
    for row, metrics in zip(report.per_step, result.history):
        assert row["mean_abs"] == pytest.approx(metrics["train/train_rollout_logprob_abs_diff"], rel=1e-5)
    worst = report.worst[0]
    assert abs(worst.delta) == pytest.approx(report.stats["max_abs"])
    assert worst.response_token >= 0 and worst.context


def test_true_on_policy_is_exactly_zero(run_small, tmp_path):
    result = run_small("t", steps=3, rollout__true_on_policy=True)
    assert all(h["train/train_rollout_logprob_abs_diff"] == 0.0 for h in result.history)
    report = check_logprobs(tmp_path / "t")
    assert report.stats["mean_abs"] == 0.0 and report.stats["max_abs"] == 0.0 and report.stats["k3_kl"] == 0.0


def test_recompute_on_a_rollout_only_run(run_small, tmp_path):
    run_small("ro", steps=2, mode="rollout-only")
    with pytest.raises(Exception, match="--recompute"):
        check_logprobs(tmp_path / "ro")
    report = check_logprobs(tmp_path / "ro", recompute=True)
    assert report.source == "recomputed" and report.steps == [0, 1]
    assert 0 < report.stats["max_abs"] < 1e-4
    run_small("rot", steps=2, mode="rollout-only", rollout__true_on_policy=True)
    assert check_logprobs(tmp_path / "rot", recompute=True).stats["max_abs"] == 0.0


def test_recompute_on_a_full_run_uses_exact_checkpoints(run_small, tmp_path):
    run_small("a", steps=3)  # checkpoints after 0 and 2 steps (and 3, the end)
    report = check_logprobs(tmp_path / "a", recompute=True)
    assert report.steps == [0, 2] and "no exact weights for steps [1]" in report.notes[0]
    recorded = {row["step"]: row for row in check_logprobs(tmp_path / "a").per_step}
    for row in report.per_step:  # recomputed with the same forward: the recorded numbers again
        assert row["mean_abs"] == recorded[row["step"]]["mean_abs"]


def test_gates_through_the_cli(run_small, tmp_path):
    run_small("a", steps=2)
    loose = run_cli("check", "logprobs", str(tmp_path / "a"), "--max-mean", "0.1", "--max-exp", "1.05", "--json")
    assert loose.returncode == 0, loose.stderr
    assert json.loads(loose.stdout)["failures"] == []
    tight = run_cli("check", "logprobs", str(tmp_path / "a"), "--max-abs", "1e-12", "--json")
    assert tight.returncode == 1
    assert json.loads(tight.stdout)["failures"][0].startswith("max_abs")
