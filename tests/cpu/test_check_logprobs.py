"""`check logprobs` reports the measured train-inference mismatch honestly, is exactly zero with
the true on-policy option, and gates with thresholds."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from rlbench.checks.logprobs import (
    abs_histogram,
    check_logprobs,
    nucleus_logprobs,
    sequence_nucleus_logprobs,
    statistics,
)
from rlbench.errors import BadInput
from tests.conftest import RANDOM_INIT_MODEL, run_cli, word_level_tokenizer


def test_statistics_by_hand():
    delta = torch.tensor([0.1, -0.2, 0.0, 0.4], dtype=torch.float64)
    stats = statistics(delta)
    assert stats["token_mean_abs"] == stats["train_rollout_logprob_abs_diff"] == pytest.approx(0.175)  # one sample
    assert stats["max_abs"] == pytest.approx(0.4)
    assert stats["k3_kl"] == pytest.approx(sum(math.exp(r) - r - 1 for r in [0.1, -0.2, 0.0, 0.4]) / 4)
    assert stats["mean_exp_abs"] == pytest.approx(sum(math.exp(abs(r)) for r in [0.1, -0.2, 0.0, 0.4]) / 4)
    # p99 by hand, interpolating linearly between order statistics: |delta| sorted is 0, 0.1, 0.2, 0.4 and
    # the 99th percentile sits 0.99 * 3 = 2.97 places in, 97% of the way from 0.2 to 0.4
    assert stats["p99_abs"] == pytest.approx(0.2 + 0.97 * 0.2)
    # 0, 1, ..., 100 in some order, signs mixed: p99 is 99, mean 50, max 100
    spread = torch.tensor([(-1) ** k * float((37 * k) % 101) for k in range(101)], dtype=torch.float64)
    stats = statistics(spread)
    assert (stats["p99_abs"], stats["token_mean_abs"], stats["max_abs"]) == (
        pytest.approx(99.0),
        pytest.approx(50.0),
        100.0,
    )
    assert statistics(torch.zeros(0)) == {
        "train_rollout_logprob_abs_diff": 0.0,
        "token_mean_abs": 0.0,
        "p99_abs": 0.0,
        "max_abs": 0.0,
        "k3_kl": 0.0,
        "mean_exp_abs": 0.0,
    }


def test_slimes_per_sample_mean_and_the_token_mean_part_on_unequal_lengths():
    """slime's train_rollout_logprob_abs_diff: each sample's mean |delta|, then the mean over samples; the
    token mean weighs the long sample more. A sample with no judged token is left out of the per-sample mean."""
    delta = torch.tensor([0.1, -0.2, 0.0, 0.4], dtype=torch.float64)  # sample 0: 0.1; sample 1: -0.2, 0.0, 0.4
    stats = statistics(delta, [1, 0, 3])
    assert stats["train_rollout_logprob_abs_diff"] == pytest.approx((0.1 + 0.6 / 3) / 2)  # 0.15
    assert stats["token_mean_abs"] == pytest.approx(0.175)
    assert statistics(delta, [4]) == statistics(delta)


def test_default_mismatch_is_reported_as_measured(run_small, tmp_path):
    result = run_small("a", steps=3)
    report = check_logprobs(tmp_path / "a", top=5)
    assert report.source == "recorded" and report.steps == [0, 1, 2]
    # Not zero (decode with a KV cache vs a padded batched forward round differently), and small.
    assert 0 < report.stats["train_rollout_logprob_abs_diff"] < 1e-5 and report.stats["max_abs"] < 1e-4
    assert report.samples == 3 * 8 and report.removed == report.without_logprobs == 0
    for row, metrics in zip(report.per_step, result.history):
        # the run's metric under slime's name is one of the two means (slime's, once the loop computes it so)
        assert metrics["train/train_rollout_logprob_abs_diff"] in (
            pytest.approx(row["train_rollout_logprob_abs_diff"], rel=1e-5),
            pytest.approx(row["token_mean_abs"], rel=1e-5),
        )
    worst = report.worst[0]
    assert abs(worst.delta) == pytest.approx(report.stats["max_abs"])
    assert worst.response_token >= 0 and worst.context


def test_true_on_policy_is_exactly_zero(run_small, tmp_path):
    result = run_small("t", steps=3, rollout__true_on_policy=True)
    assert all(h["train/train_rollout_logprob_abs_diff"] == 0.0 for h in result.history)
    report = check_logprobs(tmp_path / "t")
    assert report.stats["train_rollout_logprob_abs_diff"] == 0.0 and report.stats["max_abs"] == 0.0
    assert report.stats["token_mean_abs"] == 0.0 and report.stats["k3_kl"] == 0.0


def test_recompute_on_a_rollout_only_run(run_small, tmp_path):
    run_small("ro", steps=2, mode="rollout-only")
    with pytest.raises(Exception, match="--recompute"):
        check_logprobs(tmp_path / "ro")
    report = check_logprobs(tmp_path / "ro", recompute=True)
    assert report.source == "recomputed" and report.steps == [0, 1]
    assert 0 < report.stats["max_abs"] < 1e-4
    run_small("rot", steps=2, mode="rollout-only", rollout__true_on_policy=True)
    assert check_logprobs(tmp_path / "rot", recompute=True).stats["max_abs"] == 0.0


def test_recompute_of_a_true_on_policy_run_scores_each_sample_alone_as_its_trainer_did(
    run_small, tmp_path, monkeypatch
):
    """On the CPU a sample alone and in a micro-batch give the same bits here, so the values cannot tell: the call
    can. The recomputer asks the trainer for the run's own batch composition."""
    from rlbench.backends.torch_trainer import TorchTrainer

    asked = []
    real = TorchTrainer.logprobs

    def spy(self, tokens, *args, **kwargs):
        asked.append(kwargs.get("per_sample"))
        return real(self, tokens, *args, **kwargs)

    monkeypatch.setattr(TorchTrainer, "logprobs", spy)
    for name, on_policy in (("alone", True), ("batched", False)):
        run_small(name, steps=1, mode="rollout-only", rollout__true_on_policy=on_policy)
        asked.clear()
        check_logprobs(tmp_path / name, recompute=True)
        assert asked == [on_policy]


def test_recompute_on_a_full_run_uses_exact_checkpoints(run_small, tmp_path):
    run_small("a", steps=3)  # checkpoints after 0 and 2 steps (and 3, the end)
    report = check_logprobs(tmp_path / "a", recompute=True)
    assert report.steps == [0, 2] and "no exact weights for steps [1]" in report.notes[0]
    recorded = {row["step"]: row for row in check_logprobs(tmp_path / "a").per_step}
    for row in report.per_step:  # recomputed with the same forward: the recorded numbers again
        assert row["train_rollout_logprob_abs_diff"] == recorded[row["step"]]["train_rollout_logprob_abs_diff"]


def test_gates_through_the_cli(run_small, tmp_path):
    run_small("a", steps=2)
    loose = run_cli("check", "logprobs", str(tmp_path / "a"), "--max-mean", "0.1", "--max-exp", "1.05", "--json")
    assert loose.returncode == 0, loose.stderr
    assert json.loads(loose.stdout)["failures"] == []
    tight = run_cli("check", "logprobs", str(tmp_path / "a"), "--max-abs", "1e-12", "--json")
    assert tight.returncode == 1
    assert json.loads(tight.stdout)["failures"][0].startswith("max_abs")


# ---------------------------------------------------------------- on a recording written by hand (no model)


def _samples(prompts=(3, 3), response=2):
    """Two samples' token ids: `prompts[s]` prompt ids (1, then 50...) and `response` response ids (60 + response * s
    on: 60, 61 and 62, 63 for 2)."""
    return [
        [1, *range(50 + (p - 1) * s, 50 + (p - 1) * s + p - 1)][:p]
        + list(range(60 + response * s, 60 + response * (s + 1)))
        for s, p in enumerate(prompts)
    ]


def _recorded(
    root, steps, old_logprobs=True, prompts=(3, 3), config=None, meta=({}, {}), trained=None, top_p=None, **manifest
):
    """A run directory whose recordings hold the given per-step (trainer, rollout) log-probs of the trained tokens
    of 2 samples of `prompts` prompt tokens + response tokens: `trained` is each sample's response loss mask
    (default: 2 response tokens, both trained), prompts are not. `meta`: the two samples' JSON. `top_p`: each
    token's recorded nucleus (a list per token of both samples). A rollout-only run unless `mode` says otherwise:
    a full run's checkpoints are the test's to write (_checkpoint), as every reader holds a full run to those its
    schedule wrote."""
    from rlbench.core.loop import recorded_checksums
    from rlbench.rundir.algorithm import CHECKSUM
    from rlbench.rundir.directory import SCHEMA, RunWriter

    manifest = {
        "schema": SCHEMA,
        "checksum": CHECKSUM,
        "config": config or _config(),
        "mode": "rollout-only",
        "stages": ["data"],
        "hashes": {},
        **manifest,
    }
    writer = RunWriter(root, manifest, record=True)
    trained = trained or ((1, 1), (1, 1))
    samples = _samples(prompts, len(trained[0]))
    for step, (trainer, rollout) in enumerate(steps):
        mask = torch.tensor(
            [0] * prompts[0] + list(trained[0]) + [0] * prompts[1] + list(trained[1]), dtype=torch.uint8
        )
        tensors = {
            "tokens": torch.tensor(samples[0] + samples[1]),
            "offsets": torch.tensor([0, len(samples[0]), len(samples[0]) + len(samples[1])]),
            "prompt_lengths": torch.tensor(prompts),
            "prompt_index": torch.tensor([0, 0]),
            "group_index": torch.tensor([0, 0]),
            "loss_mask": mask,
            "rewards": torch.tensor([1.0, 0.0]),
            "rollout_logprobs": torch.zeros(len(mask)).masked_scatter(mask.bool(), torch.tensor(rollout)),
        }
        if old_logprobs is True or (old_logprobs and old_logprobs[step]):  # a tuple: per step
            tensors["old_logprobs"] = torch.zeros(len(mask)).masked_scatter(mask.bool(), torch.tensor(trainer))
        if top_p is not None:
            tensors["top_p_ids"] = torch.tensor([i for ids in top_p for i in ids], dtype=torch.int64)
            tensors["top_p_offsets"] = torch.tensor([0, *itertools.accumulate(len(ids) for ids in top_p)])
        sums = recorded_checksums(tensors)
        keys = ("data", "old_logprobs") if "logprob" in manifest["stages"] else ("data",)
        checksums = {key: sums[key] for key in keys if key in sums}
        writer.commit_step(step, tensors, [dict(m) for m in meta], checksums, {"train/loss": 0.0})
    writer.close()
    return root


def test_recorded_mismatch_statistics_worst_tokens_and_gates(tmp_path):
    run = _recorded(
        tmp_path / "r",
        [([-1.0, -2.0, -0.5, -0.25], [-1.0, -2.5, -0.5, -0.5]), ([-3.0, -1.0, -1.0, -1.0], [-3.0, -1.0, -1.125, -1.0])],
    )
    report = check_logprobs(run, top=2, thresholds={"max_abs": 0.4, "token_mean_abs": 1.0, "p99_abs": None})
    assert (report.run, report.source, report.steps, report.tokens, report.notes) == (
        str(run),
        "recorded",
        [0, 1],
        8,
        [],
    )
    deltas = [0.0, 0.5, 0.0, 0.25, 0.0, 0.0, 0.125, 0.0]
    assert report.stats == statistics(torch.tensor(deltas, dtype=torch.float64), [2, 2, 2, 2])
    assert report.stats["max_abs"] == 0.5 and report.stats["token_mean_abs"] == pytest.approx(0.875 / 8)
    assert [(r["step"], r["tokens"], r["samples"], r["max_abs"]) for r in report.per_step] == [
        (0, 4, 2, 0.5),
        (1, 4, 2, 0.125),
    ]
    assert report.thresholds == {"max_abs": 0.4, "token_mean_abs": 1.0}  # a gate of None is no gate
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
    report = check_logprobs(run, thresholds={"train_rollout_logprob_abs_diff": 10.0})
    note = "1 non-finite log-prob deltas; the first at step 0, sample 0, response token 1 (trainer nan, rollout -2.5)"
    assert report.notes == [note]
    assert report.failures == [f"train_rollout_logprob_abs_diff is nan ({note}): a gate passes only on finite numbers"]
    later = _recorded(tmp_path / "later", [([-1.0] * 4, [-1.0] * 4), ([-1.0, -1.0, float("inf"), -1.0], [-1.0] * 4)])
    assert check_logprobs(later).notes == [
        "1 non-finite log-prob deltas; the first at step 1, sample 1, response token 0 (trainer inf, rollout -1.0)"
    ]
    for bad in (float("nan"), -1.0, float("inf"), "1"):
        with pytest.raises(BadInput, match="expected a finite number >= 0") as info:
            check_logprobs(run, thresholds={"max_abs": bad})
        assert info.value.field == "--max-abs"


def test_a_recording_without_trainer_logprobs_needs_recompute(tmp_path):
    run = _recorded(tmp_path / "r", [([-1.0] * 4, [-1.0] * 4)], old_logprobs=False)
    with pytest.raises(BadInput) as info:
        check_logprobs(run)
    assert (
        str(info.value) == f"{run}: the recording holds no trainer log-probs (a rollout-only or imported run); "
        "use --recompute"
    )
    empty = _recorded(tmp_path / "e", [])
    with pytest.raises(BadInput) as info:
        check_logprobs(empty)
    assert str(info.value) == f"{empty / 'metrics.jsonl'}: no committed step: nothing to judge (undetermined)"


def test_a_ppo_runs_critic_only_steps_are_named_and_not_judged(tmp_path):
    ppo = _config(algo={"advantage": "ppo", "num_critic_only_steps": 1})
    steps = [([-1.0] * 4, [-1.0] * 4), ([-1.0, -2.0, -0.5, -0.25], [-1.0, -2.5, -0.5, -0.5])]
    run = _recorded(tmp_path / "r", steps, old_logprobs=(False, True), config=ppo, stages=["data", "logprob"])
    report = check_logprobs(run)
    assert report.steps == [1] and report.tokens == 4 and report.stats["max_abs"] == 0.5
    assert report.notes == ["steps [0] not judged: PPO's critic-only steps, where the actor computes no log-probs"]
    alone = _recorded(tmp_path / "a", steps[:1], old_logprobs=(False,), config=ppo, stages=["data", "logprob"])
    with pytest.raises(BadInput) as info:
        check_logprobs(alone)
    assert str(info.value) == (
        f"{alone}: undetermined: steps [0] are PPO's critic-only steps, where the actor computes no log-probs "
        "(--recompute computes them)"
    )
    grpo = _recorded(tmp_path / "g", steps, old_logprobs=(False, True), stages=["data"])  # no logprob stage
    with pytest.raises(BadInput, match="holds no trainer log-probs"):
        check_logprobs(grpo)


def test_recompute_uses_the_weights_the_engine_sampled_with(tmp_path):
    """A rollout-only recording whose rollout log-probs are the initial model's own (computed here, one sample
    at a time): recomputed, the mismatch is float noise. A full run without checkpoints has no exact weights."""
    from rlbench.config import load_config
    from rlbench.core.algo import sequence_logprobs
    from rlbench.core.model import build_model, named_weights
    from rlbench.rundir.digest import weights_digest

    config = load_config()
    model = build_model(config.model.path, config.seed, config.model.dtype, "cpu", init=config.model.init)
    ids = torch.tensor([1, 50, 51, 60, 61, 1, 52, 53, 62, 63])
    with torch.no_grad():
        own = torch.cat(
            [sequence_logprobs(model, ids[a:b], config.rollout.temperature, "cpu") for a, b in ((0, 5), (5, 10))]
        )
    mask = torch.tensor([0, 0, 0, 1, 1] * 2, dtype=torch.bool)
    run = _recorded(tmp_path / "r", [(own[mask].tolist(), own[mask].tolist())] * 2, old_logprobs=False)
    manifest_path = run / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(
        json.dumps(
            {**manifest, "mode": "rollout-only", "hashes": {"initial_weights": weights_digest(named_weights(model))}}
        )
    )
    report = check_logprobs(run, recompute=True)
    assert (report.source, report.steps, report.tokens, report.notes) == ("recomputed", [0, 1], 8, [])
    assert report.stats["max_abs"] < 1e-5
    manifest_path.write_text(json.dumps({**manifest, "mode": "rollout-only", "hashes": {"initial_weights": "0" * 64}}))
    with pytest.raises(BadInput) as info:
        check_logprobs(run, recompute=True)
    here = weights_digest(named_weights(model))[:12]
    assert (
        str(info.value) == f"{config.model.path}: the model's initial weights ({here}) are not the ones the run "
        "recorded (000000000000): another model or seed"
    )
    # a full run: weights change every step; one without the checkpoint its first step wrote is damaged
    manifest_path.write_text(json.dumps({**manifest, "mode": "full"}))
    with pytest.raises(BadInput) as info:
        check_logprobs(run, recompute=True)
    assert info.value.path == str(run / "checkpoints" / "000000") and "is not there" in str(info.value)
    _checkpoint(run, 0, named_weights(model))  # checkpoint 0 holds step 0's weights; --steps 1 asks for another
    with pytest.raises(BadInput) as info:
        check_logprobs(run, recompute=True, steps=[1])
    assert (
        str(info.value) == f"{run / 'checkpoints'}: no step could be recomputed (no checkpoint holds the weights "
        "any step sampled with)"
    )


def test_p99_of_more_values_than_torch_quantile_takes():
    """torch.quantile refuses more than 2**24 values: a few steps of a real run. 2% of them 1, the rest 0."""
    delta = torch.zeros(2**24 + 1, dtype=torch.float64)
    delta[: delta.numel() // 50] = -1.0
    assert statistics(delta)["p99_abs"] == 1.0


def test_worst_tokens_ten_by_default_ties_in_recording_order(tmp_path):
    run = _recorded(tmp_path / "r", [([-1.0] * 4, [-1.5] * 4)] * 6)  # 24 tokens, each 0.5 apart
    worst = check_logprobs(run).worst
    assert [(w.step, w.sample, w.response_token) for w in worst] == [
        (step, sample, token) for step in range(3) for sample in (0, 1) for token in (0, 1)
    ][:10]


def test_gates_at_zero_and_on_statistics_that_exist(tmp_path):
    """A gate of 0 asks for no mismatch at all (true on-policy); a gate on a statistic there is not is bad input."""
    same = _recorded(tmp_path / "same", [([-1.0] * 4, [-1.0] * 4)])
    assert check_logprobs(same, thresholds={"max_abs": 0, "k3_kl": 0.0}).failures == []
    apart = _recorded(tmp_path / "apart", [([-1.0] * 4, [-1.0, -1.5, -1.0, -1.0])])
    assert check_logprobs(apart, thresholds={"max_abs": 0}).failures == ["max_abs 0.5 > 0"]
    with pytest.raises(BadInput) as info:
        check_logprobs(same, thresholds={"p50_abs": 1.0})
    assert (info.value.field, str(info.value)) == (
        "p50_abs",
        "p50_abs: no such statistic to gate on (one of train_rollout_logprob_abs_diff, token_mean_abs, "
        "p99_abs, max_abs, k3_kl, mean_exp_abs)",
    )


def _config(**sections):
    """The default config as a dict, with some settings of some sections changed: _config(model={...})."""
    from rlbench.config import load_config

    config = load_config().to_dict()
    return {**config, **{name: {**config[name], **values} for name, values in sections.items()}}


def test_a_run_is_read_with_the_tokenizer_and_model_it_was_made_with(tmp_path):
    """The manifest's hashes: the tokenizer's is checked always, the model config's when the log-probs are
    recomputed with that model."""
    steps = [([-1.0] * 4, [-1.0] * 4)]
    other_tokenizer = _recorded(tmp_path / "t", steps, hashes={"tokenizer": "ab" * 32})
    with pytest.raises(BadInput, match=r"was made with another tokenizer \(sha256 abababababab, this one is "):
        check_logprobs(other_tokenizer)
    other_model = _recorded(tmp_path / "m", steps, hashes={"model_config": "cd" * 32})
    assert check_logprobs(other_model).steps == [0]  # the model is not used
    with pytest.raises(BadInput, match=r"was made with another model config \(sha256 cdcdcdcdcdcd, this one is "):
        check_logprobs(other_model, recompute=True)


def test_token_ids_are_held_to_the_runs_model_vocabulary_and_the_tokenizer_shows_the_worst_tokens(tmp_path):
    """core/vocab.py: an id is valid below the model's vocabulary (the manifest's, else the model's config.json:
    the fixture's 314); one the tokenizer has no text for (a padded id) shows as such."""
    steps = [([-1.0, -2.0, -1.0, -1.0], [-1.0, -2.5, -1.0, -1.0])]
    word_level_tokenizer().save_pretrained(tmp_path / "tok")
    config = _config(model={"tokenizer": str(tmp_path / "tok")})
    small = _recorded(tmp_path / "small", steps, config=config, vocab={"model": 63, "tokenizer": 4})
    with pytest.raises(BadInput) as info:
        check_logprobs(small)
    assert (
        str(info.value) == f"{small / 'rollouts' / '000000.safetensors'}: tokens: token id 63 is outside the "
        "model's vocabulary (63 ids; the tokenizer has 4)"
    )
    [worst] = check_logprobs(_recorded(tmp_path / "padded", steps, config=config), top=1).worst
    assert (worst.token_id, worst.text, worst.context) == (
        61,
        "<padded id 61>",
        "odd<padded id 50><padded id 51><padded id 60>",
    )
    # a run whose tokenizer is gone: the ids themselves are shown
    gone = _recorded(tmp_path / "gone", steps, config=_config(model={"tokenizer": str(tmp_path / "gone-tokenizer")}))
    [worst] = check_logprobs(gone, top=1).worst
    assert (worst.token_id, worst.text, worst.context) == (61, "[61]", "[1, 50, 51, 60]")


def test_worst_tokens_context_is_the_eight_ids_before_within_the_sample(tmp_path):
    from rlbench.config import load_config
    from rlbench.core.model import load_tokenizer

    tok = load_tokenizer(load_config().model.tokenizer)
    run = _recorded(tmp_path / "long", [([-1.0, -2.0, -1.0, -1.0], [-1.0, -2.5, -1.0, -1.0])], prompts=(10, 3))
    [worst] = check_logprobs(run, top=1).worst
    assert (worst.sample, worst.response_token, worst.context) == (0, 1, tok.decode([52, 53, 54, 55, 56, 57, 58, 60]))
    # a sample with an empty prompt: its first token is its own, not the sample's before it
    run = _recorded(tmp_path / "empty", [([-1.0, -1.0, float("nan"), -1.0], [-1.0, -1.0, -2.5, -1.0])], prompts=(3, 0))
    report = check_logprobs(run, top=1)
    assert report.notes == [
        "1 non-finite log-prob deltas; the first at step 0, sample 1, response token 0 (trainer nan, rollout -2.5)"
    ]
    assert (report.worst[0].sample, report.worst[0].response_token, report.worst[0].context) == (1, 0, "")


# ---------------------------------------------------------------- recomputed with the checkpoints' weights


def _weights(model, shift):
    """The model's weights moved by `shift` times a seeded noise: another policy, as after some training."""
    from rlbench.core.model import named_weights

    g = torch.Generator().manual_seed(3)
    return {name: w + shift * torch.randn(w.shape, generator=g) for name, w in named_weights(model).items()}


def _every(checkpoint_every: int, steps: int) -> dict:
    return {"checkpoint_every": checkpoint_every, "steps": steps}


def _checkpoint(run, step, weights):
    from safetensors.torch import save_file

    (run / "checkpoints" / f"{step:06d}").mkdir(parents=True)
    save_file(weights, str(run / "checkpoints" / f"{step:06d}" / "model.safetensors"))
    (run / "checkpoints" / f"{step:06d}" / "state.json").write_text(json.dumps({"steps_done": step}))


def _sampled_with(model, weights, temperature):
    """Each sample's response log-probs under `weights`, one sample at a time (as the engine computes them)."""
    from rlbench.core.algo import sequence_logprobs
    from rlbench.core.model import load_named_

    load_named_(model, weights)
    with torch.no_grad():  # each sample's last two ids are its response
        rows = [sequence_logprobs(model, torch.tensor(ids), temperature, "cpu") for ids in _samples()]
    return [x for row in rows for x in row[-2:].tolist()]


def test_recompute_on_a_full_run_loads_each_steps_checkpoint(tmp_path):
    """Checkpoints 0 and 2 hold the weights steps 0 and 2 sampled with (other ones each): those steps are
    recomputed with them, to float noise; step 1 has none and is left out, and said so."""
    from rlbench.config import load_config
    from rlbench.core.model import build_model

    config = load_config()
    model = build_model(config.model.path, config.seed, config.model.dtype, "cpu", init=config.model.init)
    first, third = _weights(model, 0.0), _weights(model, 0.05)
    rollout = [
        _sampled_with(model, first, config.rollout.temperature),
        [-1.0] * 4,
        _sampled_with(model, third, config.rollout.temperature),
    ]
    # a full run stopped after 3 of 4 steps, a checkpoint every 2: checkpoints 0 and 2 are all it wrote
    run = _recorded(
        tmp_path / "r", [(r, r) for r in rollout], old_logprobs=False, mode="full", config=_config() | _every(2, 4)
    )
    _checkpoint(run, 0, first)
    _checkpoint(run, 2, third)
    report = check_logprobs(run, recompute=True)
    assert (report.steps, report.notes) == ([0, 2], ["recomputed steps [0, 2]; no exact weights for steps [1]"])
    assert [row["max_abs"] < 1e-5 for row in report.per_step] == [True, True]


def test_recompute_with_checkpoint_0_for_every_step_of_a_rollout_only_run(monkeypatch, tmp_path):
    """Its weights never change: checkpoint 0 holds them (here other weights than the seed's, as from an imported
    checkpoint), loaded once, whatever other checkpoint is there. True on-policy: recomputed one sample at a time,
    the engine's own forward, so the mismatch is exactly 0."""
    from rlbench.config import load_config
    from rlbench.core import model as model_module

    # the run's model drawn from the seed (the default reads its weights from a file): the only weights files the
    # check reads are then the run's checkpoints
    seeded = {"path": str(RANDOM_INIT_MODEL), "init": "random"}
    config = load_config(model__path=seeded["path"], model__init="random")
    model = model_module.build_model(config.model.path, config.seed, config.model.dtype, "cpu", init=config.model.init)
    sampled_with = _weights(model, 0.05)
    rollout = _sampled_with(model, sampled_with, config.rollout.temperature)
    run = _recorded(
        tmp_path / "r",
        [(rollout, rollout)] * 2,
        old_logprobs=False,
        mode="rollout-only",
        config=_config(model=seeded, rollout={"true_on_policy": True}),
    )
    _checkpoint(run, 0, sampled_with)
    _checkpoint(run, 1, _weights(model, 0.1))
    loads, load = [], model_module.load_safetensors
    monkeypatch.setattr(model_module, "load_safetensors", lambda path: loads.append(path) or load(path))
    report = check_logprobs(run, recompute=True)
    assert (report.steps, report.notes, report.stats["max_abs"]) == ([0, 1], [], 0.0)
    assert loads == [run / "checkpoints" / "000000" / "model.safetensors"]


def test_a_checkpoint_that_is_not_the_runs_model_is_bad_input_naming_it(tmp_path):
    """A checkpoint whose tensors do not fit the run's model (another model's, or cut short): one line naming
    the checkpoint, not the model directory or a bare 'weights'."""
    from rlbench.config import load_config
    from rlbench.core.model import build_model

    config = load_config()
    model = build_model(config.model.path, config.seed, config.model.dtype, "cpu", init=config.model.init)
    weights = _weights(model, 0.0)
    run = _recorded(tmp_path / "r", [([-1.0] * 4, [-1.0] * 4)], old_logprobs=False)
    del weights["model.norm.weight"]
    _checkpoint(run, 0, weights)
    with pytest.raises(BadInput, match="weight names do not match the model") as info:
        check_logprobs(run, recompute=True)
    assert info.value.path == str(run / "checkpoints" / "000000")


def test_an_infinite_delta_makes_p99_nan_without_a_warning():
    """inf - inf inside numpy's interpolation is NaN: the statistics say so (as mean and max do for a NaN), and
    numpy's 'invalid value' warning is not let out (under -W error it would be an internal error)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = statistics(torch.tensor([math.inf, 1.0, math.inf, -2.0], dtype=torch.float64))
    assert math.isnan(stats["p99_abs"]) and stats["max_abs"] == math.inf


# ---------------------------------------------------------------- what an import from slime marks per sample


def test_removed_samples_and_samples_without_engine_logprobs_are_not_judged_but_counted(tmp_path):
    """Sample 1's deltas are large; marked removed (slime's remove_sample) or without engine log-probs (the
    recording's 0.0 is no log-prob), it is left out, and the report counts and names it. Unmarked, it is judged."""
    steps = [([-1.0, -1.0, -1.0, -1.0], [-1.0, -1.25, -3.0, -3.0])]
    judged = check_logprobs(_recorded(tmp_path / "all", steps))
    assert (judged.samples, judged.tokens, judged.stats["max_abs"]) == (2, 4, 2.0)
    for flag, count, note in (
        ({"remove_sample": True}, "removed", "1 samples removed by slime (remove_sample): not trained, not judged"),
        ({"has_rollout_logprobs": False}, "without_logprobs", "1 samples without engine log-probs: not judged"),
    ):
        report = check_logprobs(
            _recorded(tmp_path / count, steps, meta=({"has_rollout_logprobs": True}, flag)), thresholds={"max_abs": 0.5}
        )
        assert (report.samples, report.tokens, getattr(report, count), report.notes) == (1, 2, 1, [note])
        assert report.stats["max_abs"] == 0.25 and report.failures == []
    nothing = _recorded(tmp_path / "none", steps, meta=({"has_rollout_logprobs": False}, {"remove_sample": True}))
    with pytest.raises(BadInput) as info:
        check_logprobs(nothing, thresholds={"max_abs": 0.5})
    assert (
        str(info.value) == f"{nothing}: undetermined: no trained token with engine log-probs to judge (1 samples "
        "removed, 1 without engine log-probs)"
    )
    res = run_cli("check", "logprobs", str(tmp_path / "removed"), "--max-mean", "0.2")  # sample 0 alone: 0.125
    assert res.returncode == 0 and "1 samples removed by slime" in res.stderr and "of 1 samples" in res.stdout
    res = run_cli("check", "logprobs", str(tmp_path / "all"), "--max-mean", "0.2", "--json")  # (0.125 + 2) / 2
    assert res.returncode == 1 and json.loads(res.stdout)["failures"] == ["train_rollout_logprob_abs_diff 1.06 > 0.2"]


def test_the_token_mean_gates_under_its_own_option(tmp_path):
    run = _recorded(tmp_path / "r", [([-1.0, -1.0, -1.0, -1.0], [-1.0, -1.5, -1.0, -1.0])])  # 0.5 in one of 4
    res = run_cli("check", "logprobs", str(run), "--max-token-mean", "0.1", "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["failures"] == ["token_mean_abs 0.125 > 0.1"]
    assert run_cli("check", "logprobs", str(run), "--max-mean", "0.25").returncode == 0  # per sample: 0.25, 0


def test_nucleus_logprobs_by_hand():
    """Renormalised over the nucleus and the target itself, after the temperature; an empty nucleus keeps
    the target alone (slime's tool tokens: log-prob 0)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    got = nucleus_logprobs(logits, torch.tensor([1, 3, 2]), [[3], [2, 3], []], 2.0)
    expected = [0.5 - math.log(math.exp(0.5) + math.exp(1.5)), 1.5 - math.log(math.exp(1.0) + math.exp(1.5)), 0.0]
    assert got.tolist() == pytest.approx(expected, abs=1e-6)
    full = torch.log_softmax(logits[0] / 2.0, -1)[1]
    assert nucleus_logprobs(logits[:1], torch.tensor([1]), [[0, 1, 2, 3]], 2.0)[0] == pytest.approx(float(full))


def test_an_async_runs_mismatch_is_split_by_each_samples_recorded_lag(tmp_path):
    """Each sample's deltas go to the lag its JSON records (`async.lag`), over every step; a run that records no
    lag has no per-lag table."""
    steps = [
        ([-1.0, -2.0, -0.5, -0.25], [-1.0, -2.5, -0.5, -0.5]),
        ([-3.0, -1.0, -1.0, -1.0], [-3.0, -1.0, -1.125, -1.0]),
    ]
    run = _recorded(tmp_path / "lagged", steps, meta=({"async": {"lag": 2}}, {"async": {"lag": 0}}))
    report = check_logprobs(run, top=1)
    # delta = trainer - rollout: sample 0 (lag 2) 0, 0.5 then 0, 0; sample 1 (lag 0) 0, 0.25 then 0.125, 0
    f64 = torch.float64
    assert report.per_lag == [
        {"lag": 0, "tokens": 4, "samples": 2, **statistics(torch.tensor([0.0, 0.25, 0.125, 0.0], dtype=f64), [2, 2])},
        {"lag": 2, "tokens": 4, "samples": 2, **statistics(torch.tensor([0.0, 0.5, 0.0, 0.0], dtype=f64), [2, 2])},
    ]
    assert check_logprobs(_recorded(tmp_path / "sync", steps), top=1).per_lag == []


def _model():
    from rlbench.config import load_config
    from rlbench.core.model import build_model

    config = load_config()
    return build_model(config.model.path, config.seed, config.model.dtype, "cpu", init=config.model.init)


def _by_hand(model, ids, prompt, nuclei, temperature):
    """The reference: each of ids[prompt:]'s log-prob given its prefix, over its nucleus and itself (None: over
    every id), from one plain forward; the first id of a sequence has no prefix and gets 0."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double() / temperature
    out = []
    for j in range(prompt, len(ids)):
        nucleus = nuclei[j - prompt] if nuclei is not None else range(logits.shape[-1])
        keep = sorted(set(nucleus) | {ids[j]})
        out.append(0.0 if j == 0 else float(logits[j - 1, ids[j]] - torch.logsumexp(logits[j - 1, keep], 0)))
    return out


# ---------------------------------------------------------------- the histogram of |delta| (recordings by hand)


def test_histogram_counts_exact_zeros_then_bins_closed_above_then_the_rest_with_the_non_finite():
    """abs_histogram: |delta| == 0 first, then (0, e0], (e0, e1], ..., then above the last edge, where the
    non-finite deltas count too; every bin is there, empty or not; edges are compared in float64."""
    delta = torch.tensor([0.0, -0.0, 0.25, -0.5, 0.5, 1.0, 3.0, -math.inf, math.nan], dtype=torch.float64)
    assert abs_histogram(delta, [0.5, 1.0, 2.0]) == [2, 3, 1, 0, 3]
    assert abs_histogram(torch.tensor([0.25]), [0.5, 1.0]) == [0, 1, 0, 0]
    assert abs_histogram(torch.tensor([1.0, -1.0, 0.0]), [2.0]) == [1, 2, 0]
    # 0.7 is in (0.1, 0.7]; float32's 0.7 is 0.69999999, which would put it above
    assert abs_histogram(torch.tensor([0.7, 0.1], dtype=torch.float64), [0.1, 0.7]) == [0, 1, 1, 0]


# ---------------------------------------------------------------- counted over samples, steps and lags


def _unequal(root, **kwargs):
    """2 steps; sample 0 trains both response tokens, sample 1 only its second, both of policy lag 1.
    delta = trainer - rollout: step 0 0.5, 0.25 | 1.0; step 1 0, 0 | 0.125."""
    steps = [([-1.0] * 3, [-1.5, -1.25, -2.0]), ([-1.0] * 3, [-1.0, -1.0, -1.125])]
    meta = ({"async": {"lag": 1}}, {"async": {"lag": 1}})
    return _recorded(root, steps, trained=((1, 1), (0, 1)), meta=meta, **kwargs)


def test_per_sample_means_weigh_samples_of_unequal_lengths_alike_in_every_table(tmp_path):
    """slime's train_rollout_logprob_abs_diff is the mean of each sample's mean |delta| overall, per step and per
    lag, the token mean each token alike; a sample of one judged token counts as a sample; with edges, the
    histogram of every judged |delta|."""
    report = check_logprobs(_unequal(tmp_path / "r"), edges=[0.25, 0.5])
    # sample means: step 0 0.375, 1.0; step 1 0, 0.125
    assert (report.tokens, report.samples) == (6, 4)
    assert report.stats["train_rollout_logprob_abs_diff"] == pytest.approx(1.5 / 4)
    assert report.stats["token_mean_abs"] == pytest.approx(1.875 / 6)
    assert [(r["step"], r["tokens"], r["samples"]) for r in report.per_step] == [(0, 3, 2), (1, 3, 2)]
    assert [r["train_rollout_logprob_abs_diff"] for r in report.per_step] == pytest.approx([1.375 / 2, 0.125 / 2])
    assert [r["token_mean_abs"] for r in report.per_step] == pytest.approx([1.75 / 3, 0.125 / 3])
    [lag] = report.per_lag
    assert (lag["lag"], lag["tokens"], lag["samples"]) == (1, 6, 4)
    assert (lag["train_rollout_logprob_abs_diff"], lag["token_mean_abs"]) == (
        pytest.approx(0.375),
        pytest.approx(0.3125),
    )
    assert report.histogram == [2, 2, 1, 1]  # |delta| 0, 0 | 0.25, 0.125 | 0.5 | 1.0


def test_without_per_step_statistics_the_rows_count_only_and_no_edges_no_histogram(tmp_path):
    """per_step=False: each step's row holds its counts only; without edges there is no histogram."""
    report = check_logprobs(_unequal(tmp_path / "r"), per_step=False)
    assert report.per_step == [{"step": 0, "tokens": 3, "samples": 2}, {"step": 1, "tokens": 3, "samples": 2}]
    assert report.stats["train_rollout_logprob_abs_diff"] == pytest.approx(0.375) and report.histogram is None


def test_samples_left_out_are_counted_over_every_step_and_not_as_judged(tmp_path):
    """Removed samples and samples without engine log-probs add up over the steps, and no step counts them judged."""
    steps = [([-1.0] * 4, [-1.5, -1.0, -3.0, -3.0])] * 2
    removed = check_logprobs(_recorded(tmp_path / "removed", steps, meta=({}, {"remove_sample": True})))
    assert (removed.removed, removed.without_logprobs, removed.samples, removed.tokens) == (2, 0, 2, 4)
    assert [r["samples"] for r in removed.per_step] == [1, 1]
    assert removed.notes == ["2 samples removed by slime (remove_sample): not trained, not judged"]
    without = check_logprobs(_recorded(tmp_path / "without", steps, meta=({}, {"has_rollout_logprobs": False})))
    assert (without.removed, without.without_logprobs, without.samples) == (0, 2, 2)
    assert without.notes == ["2 samples without engine log-probs: not judged"]


def test_the_first_non_finite_delta_named_is_the_runs_first(tmp_path):
    """With non-finite deltas in several steps, the note names the earliest one, and counts them all."""
    nan = float("nan")
    steps = [([-1.0, -1.0, nan, -1.0], [-1.0] * 4), ([-1.0, nan, -1.0, -1.0], [-1.0] * 4)]
    assert check_logprobs(_recorded(tmp_path / "r", steps)).notes == [
        "2 non-finite log-prob deltas; the first at step 0, sample 1, response token 0 (trainer nan, rollout -1.0)"
    ]


def test_steps_asked_for_narrow_the_check_and_none_committed_is_undetermined(tmp_path):
    """`steps` keeps the committed steps asked for; asking for none of them is bad input on --steps."""
    run = _unequal(tmp_path / "r")
    assert check_logprobs(run, steps=[1, 5]).steps == [1]
    with pytest.raises(BadInput) as info:
        check_logprobs(run, steps=[5])
    assert (info.value.field, str(info.value)) == (
        "--steps",
        "--steps: undetermined: none of the steps asked for is committed (the run committed 2)",
    )


# ---------------------------------------------------------------- what of the run the check verifies


def test_a_run_made_without_recordings_is_refused(tmp_path):
    """A run made with --no-record holds nothing to judge, even where files are there: refused, saying so."""
    run = _recorded(tmp_path / "r", [([-1.0] * 4, [-1.0] * 4)], config={**_config(), "record": False})
    with pytest.raises(BadInput, match="made with --no-record"):
        check_logprobs(run)


def test_checkpoints_are_verified_when_recompute_loads_them_and_only_then(tmp_path):
    """Checkpoint 0 of a full run holds other weights than the initial ones its manifest records: read as recorded
    the run is judged (no checkpoint is read); recomputed, it is refused, naming the checkpoint."""
    from rlbench.core.model import named_weights
    from rlbench.rundir.digest import weights_digest

    model = _model()
    run = _recorded(
        tmp_path / "r",
        [([-1.0] * 4, [-1.0] * 4)],
        mode="full",
        config=_config() | _every(2, 4),
        hashes={"initial_weights": weights_digest(named_weights(model))},
    )
    _checkpoint(run, 0, _weights(model, 0.05))
    assert check_logprobs(run).stats["max_abs"] == 0.0
    with pytest.raises(BadInput, match="the weights do not match manifest.json's hashes.initial_weights") as info:
        check_logprobs(run, recompute=True)
    assert info.value.path == str(run / "checkpoints" / "000000" / "model.safetensors")


def test_ids_are_held_to_the_tokenizers_vocabulary_when_the_models_config_cannot_be_read(tmp_path):
    """No vocab section and no model config.json: the tokenizer alone (4 ids) bounds the ids, and the recording
    holding ids up to 63 is bad input naming the file; with no tokenizer either, the worst tokens show their ids."""
    word_level_tokenizer().save_pretrained(tmp_path / "tok")
    steps = [([-1.0, -2.0, -1.0, -1.0], [-1.0, -2.5, -1.0, -1.0])]
    config = _config(model={"path": str(tmp_path / "no-model"), "tokenizer": str(tmp_path / "tok")})
    run = _recorded(tmp_path / "tok-only", steps, config=config)
    with pytest.raises(BadInput, match="token id 63 is outside the model's vocabulary") as info:
        check_logprobs(run)
    assert (info.value.path, info.value.field) == (str(run / "rollouts" / "000000.safetensors"), "tokens")
    config = _config(model={"path": str(tmp_path / "no-model"), "tokenizer": str(tmp_path / "no-tok")})
    [worst] = check_logprobs(_recorded(tmp_path / "neither", steps, config=config), top=1).worst
    assert (worst.token_id, worst.text, worst.context) == (61, "[61]", "[1, 50, 51, 60]")


def test_worst_tokens_of_equal_mismatch_keep_recording_order_in_a_long_step(tmp_path):
    """24 tokens of one step, every delta 0.5: the worst 24 are in recording order (sample, then token), which an
    unstable sort of that many ties does not keep."""
    run = _recorded(tmp_path / "r", [([-1.0] * 24, [-1.5] * 24)], trained=((1,) * 12, (1,) * 12))
    worst = check_logprobs(run, top=24).worst
    assert [(w.sample, w.response_token) for w in worst] == [(s, t) for s in (0, 1) for t in range(12)]


# ---------------------------------------------------------------- nucleus (top-p) log-probs


def test_nucleus_logprobs_scale_by_a_positive_temperature_only_on_the_logits_device():
    """t > 0 divides the logits (t = 0.5 doubles them); t = 0, greedy, leaves them as they are; the mask is made
    where the logits are (here the meta device, as it would be a GPU)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    half = nucleus_logprobs(logits, torch.tensor([1]), [[2]], 0.5)
    assert half.tolist() == pytest.approx([2.0 - math.log(math.exp(2.0) + math.exp(4.0))], abs=1e-6)
    greedy = nucleus_logprobs(logits, torch.tensor([1]), [[2]], 0.0)
    assert greedy.tolist() == pytest.approx([1.0 - math.log(math.exp(1.0) + math.exp(2.0))], abs=1e-6)
    meta = nucleus_logprobs(torch.zeros(2, 5, device="meta"), torch.tensor([1, 2], device="meta"), [[0], [3]], 1.0)
    assert (meta.device.type, meta.shape) == ("meta", (2,))


def test_a_sequences_nucleus_logprobs_predict_each_response_token_from_its_prefix():
    """ids[prompt:] each over its own nucleus; a first token with no prefix gets 0, and with no response token
    there is nothing to compute."""
    model, ids = _model(), [1, 62, 63, 64]
    nuclei = [[5, 62], [7, 9], [63, 64, 100], [2]]
    for prompt in (0, 1, 2):
        got = sequence_nucleus_logprobs(model, torch.tensor(ids), prompt, nuclei[prompt:], 0.5)
        assert got.dtype == torch.float32
        assert got.tolist() == pytest.approx(_by_hand(model, ids, prompt, nuclei[prompt:], 0.5), abs=1e-5)
    assert sequence_nucleus_logprobs(model, torch.tensor(ids), 4, [], 0.5).tolist() == []


def test_recompute_renormalises_a_top_p_sample_over_its_recorded_nucleus_on_every_step(tmp_path):
    """A rollout-only run of 2 steps at temperature 0.5: sample 0 sampled from every id, sample 1 (`top_p`) from
    its recorded nuclei; the engine's log-probs, worked out here from one plain forward, are what recomputing gives
    (float noise), and each step's top-p sample is counted. Read as recorded, nothing is recomputed or counted."""
    model = _model()
    first, second = _samples((3, 1))  # [1, 50, 51, 60, 61], [1, 62, 63]
    nuclei = [[5, 62], [7, 9]]  # sample 1's response tokens; 63 is not in its nucleus, and counts all the same
    rollout = _by_hand(model, first, 3, None, 0.5) + _by_hand(model, second, 1, nuclei, 0.5)
    trainer = [rollout[0], rollout[1] - 0.5, rollout[2], rollout[3]]
    run = _recorded(
        tmp_path / "r",
        [(trainer, rollout)] * 2,
        prompts=(3, 1),
        config=_config(rollout={"temperature": 0.5}),
        meta=({}, {"top_p": True}),
        top_p=[[]] * 6 + nuclei,
    )
    recomputed = check_logprobs(run, recompute=True)
    assert (recomputed.steps, recomputed.tokens, recomputed.top_p) == ([0, 1], 8, 2)
    assert recomputed.notes == ["2 samples recomputed over their recorded top-p nucleus"]
    assert recomputed.stats["max_abs"] < 1e-5
    recorded = check_logprobs(run)
    assert (recorded.top_p, recorded.notes, recorded.stats["max_abs"]) == (0, [], pytest.approx(0.5))
