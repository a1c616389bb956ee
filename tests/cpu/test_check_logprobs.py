"""`check logprobs` reports the measured train-inference mismatch honestly, is exactly zero with
the true on-policy option, and gates with thresholds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlbench.checks.logprobs import check_logprobs, statistics
from rlbench.errors import BadInput
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


# ---------------------------------------------------------------- on a recording written by hand (no model)


def _recorded(root, steps, old_logprobs=True):
    """A run directory whose recordings hold the given per-step (trainer, rollout) log-probs of 2 samples of
    3 prompt + 2 response tokens each: only the response tokens are trained (loss mask 1)."""
    from rlbench.config import load_config
    from rlbench.rundir.directory import SCHEMA, RunWriter

    manifest = {"schema": SCHEMA, "config": load_config().to_dict(), "mode": "full", "stages": ["data"], "hashes": {}}
    writer = RunWriter(root, manifest, record=True)
    for step, (trainer, rollout) in enumerate(steps):
        mask = torch.tensor([0, 0, 0, 1, 1] * 2, dtype=torch.uint8)
        tensors = {"tokens": torch.tensor([1, 50, 51, 60, 61, 1, 52, 53, 62, 63]), "offsets": torch.tensor([0, 5, 10]),
                   "prompt_lengths": torch.tensor([3, 3]), "prompt_index": torch.tensor([0, 0]),
                   "group_index": torch.tensor([0, 0]), "loss_mask": mask, "rewards": torch.tensor([1.0, 0.0]),
                   "rollout_logprobs": torch.zeros(10).masked_scatter(mask.bool(), torch.tensor(rollout))}
        if old_logprobs:
            tensors["old_logprobs"] = torch.zeros(10).masked_scatter(mask.bool(), torch.tensor(trainer))
        writer.commit_step(step, tensors, [{}, {}], {"data": f"{step:064x}"}, {"train/loss": 0.0})
    writer.close()
    return root


def test_recorded_mismatch_statistics_worst_tokens_and_gates(tmp_path):
    run = _recorded(tmp_path / "r", [([-1.0, -2.0, -0.5, -0.25], [-1.0, -2.5, -0.5, -0.5]),
                                      ([-3.0, -1.0, -1.0, -1.0], [-3.0, -1.0, -1.125, -1.0])])
    report = check_logprobs(run, top=2, thresholds={"max_abs": 0.4, "mean_abs": 1.0, "p99_abs": None})
    assert (report.source, report.steps, report.tokens, report.notes) == ("recorded", [0, 1], 8, [])
    deltas = [0.0, 0.5, 0.0, 0.25, 0.0, 0.0, 0.125, 0.0]
    assert report.stats == statistics(torch.tensor(deltas, dtype=torch.float64))
    assert report.stats["max_abs"] == 0.5 and report.stats["mean_abs"] == pytest.approx(0.875 / 8)
    assert [(r["step"], r["tokens"], r["max_abs"]) for r in report.per_step] == [(0, 4, 0.5), (1, 4, 0.125)]
    assert report.thresholds == {"max_abs": 0.4, "mean_abs": 1.0}  # a gate of None is no gate
    assert report.failures == ["max_abs 0.5 > 0.4"]
    first, second = report.worst
    assert (first.step, first.sample, first.response_token, first.token_id) == (0, 0, 1, 61)
    assert (first.trainer, first.rollout, first.delta) == (-2.0, -2.5, 0.5)
    from rlbench.config import load_config
    from rlbench.core.model import load_tokenizer

    tok = load_tokenizer(load_config().model.tokenizer)  # the run's: the worst tokens are shown as text
    assert (first.text, first.context) == (tok.decode([61]), tok.decode([1, 50, 51, 60]))
    assert (second.step, second.sample, second.response_token, second.token_id, second.delta) == (0, 1, 1, 63, 0.25)
    assert check_logprobs(run, thresholds={"max_abs": 0.5}).failures == []  # at the gate is within it


def test_a_gate_passes_on_finite_numbers_only(tmp_path):
    run = _recorded(tmp_path / "r", [([-1.0, float("nan"), -0.5, -0.25], [-1.0, -2.5, -0.5, -0.5])])
    report = check_logprobs(run, thresholds={"mean_abs": 10.0})
    note = "1 non-finite log-prob deltas; the first at step 0, sample 0, response token 1 (trainer nan, rollout -2.5)"
    assert report.notes == [note]
    assert report.failures == [f"mean_abs is nan ({note}): a gate passes only on finite numbers"]
    for bad in (float("nan"), -1.0, float("inf"), "1"):
        with pytest.raises(BadInput, match="expected a finite number >= 0") as info:
            check_logprobs(run, thresholds={"max_abs": bad})
        assert info.value.field == "--max-abs"


def test_a_recording_without_trainer_logprobs_needs_recompute(tmp_path):
    run = _recorded(tmp_path / "r", [([-1.0] * 4, [-1.0] * 4)], old_logprobs=False)
    with pytest.raises(BadInput, match="holds no trainer log-probs .* use --recompute"):
        check_logprobs(run)
    empty = _recorded(tmp_path / "e", [])
    with pytest.raises(BadInput, match="no committed step to check"):
        check_logprobs(empty)


def test_recompute_uses_the_weights_the_engine_sampled_with(tmp_path):
    """A rollout-only recording whose rollout log-probs are the initial model's own (computed here, one sample
    at a time): recomputed, the mismatch is float noise. A full run without checkpoints has no exact weights."""
    from rlbench.config import load_config
    from rlbench.core.algo import sequence_logprobs
    from rlbench.core.model import build_model, named_weights
    from rlbench.rundir.digest import weights_digest

    config = load_config()
    model = build_model(config.model.path, config.seed, config.model.dtype, "cpu")
    ids = torch.tensor([1, 50, 51, 60, 61, 1, 52, 53, 62, 63])
    with torch.no_grad():
        own = torch.cat([sequence_logprobs(model, ids[a:b], config.rollout.temperature, "cpu") for a, b in ((0, 5), (5, 10))])
    mask = torch.tensor([0, 0, 0, 1, 1] * 2, dtype=torch.bool)
    run = _recorded(tmp_path / "r", [(own[mask].tolist(), own[mask].tolist())] * 2, old_logprobs=False)
    manifest_path = run / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "mode": "rollout-only",
                                         "hashes": {"initial_weights": weights_digest(named_weights(model))}}))
    report = check_logprobs(run, recompute=True)
    assert (report.source, report.steps, report.tokens, report.notes) == ("recomputed", [0, 1], 8, [])
    assert report.stats["max_abs"] < 1e-5
    manifest_path.write_text(json.dumps({**manifest, "mode": "rollout-only", "hashes": {"initial_weights": "0" * 64}}))
    with pytest.raises(BadInput, match="initial weights .* are not the ones the run recorded"):
        check_logprobs(run, recompute=True)
    manifest_path.write_text(json.dumps(manifest))  # a full run: weights change every step, and no checkpoint
    with pytest.raises(BadInput, match="no step could be recomputed"):
        check_logprobs(run, recompute=True)
