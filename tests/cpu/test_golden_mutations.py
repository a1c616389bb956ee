"""The golden suite must be able to fail: small deliberate changes to the loop's code, each
caught by `check golden` against golden/default.json in the exact tier; the unchanged loop passes.

Each mutation patches code, not the config, as a regression would: the run's configuration
identity stays the golden's, so the check compares metrics (exit 1) rather than refusing another
configuration (exit 2).
"""

from __future__ import annotations

import json

import pytest
import torch

from rlbench.checks.golden import load_golden
from rlbench.checks.golden_compare import compare
from rlbench.config import load_config
from rlbench import session
from rlbench.core import algo, loop, samples
from rlbench.rundir.directory import read_run
from tests.conftest import REPO

SUITE = json.loads((REPO / "golden" / "suite.json").read_text())
GOLDEN = REPO / "golden" / "default.json"


def _lr_times_1_01(monkeypatch):
    adamw = torch.optim.AdamW

    def mutated(params, lr, **kwargs):
        return adamw(params, lr=lr * 1.01, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", mutated)


def _population_std(monkeypatch):
    """GRPO normalised by the population std (ddof 0) instead of the sample std."""

    def mutated(rewards, group_size, normalize_std=True, eps=1e-6):
        grouped = rewards.view(-1, group_size).double()
        centered = grouped - grouped.mean(dim=1, keepdim=True)
        if normalize_std and group_size > 1:
            centered = centered / (grouped.std(dim=1, keepdim=True, correction=0) + eps)
        return centered.reshape(-1).to(rewards.dtype)

    monkeypatch.setattr(algo, "grpo_advantages", mutated)


def _sampling_seed(monkeypatch):
    derive = loop.derive_seed

    def mutated(master, purpose, *path):
        return derive(master + 1 if purpose == "sample" else master, purpose, *path)

    monkeypatch.setattr(loop, "derive_seed", mutated)


def _drop_one_loss_mask_token(monkeypatch):
    """The last response token of the first sample of each step leaves the loss mask."""
    train_batch = samples.train_batch

    def mutated(tensors):
        batch = train_batch(tensors)
        last = int(batch.loss_mask[0].nonzero().max())
        batch.loss_mask[0, last] = 0.0
        return batch

    monkeypatch.setattr(samples, "train_batch", mutated)


MUTATIONS = {
    "none": None,
    "lr x1.01": _lr_times_1_01,
    "advantage normalisation": _population_std,
    "sampling seed": _sampling_seed,
    "dropped loss-mask token": _drop_one_loss_mask_token,
}


def _golden_run(tmp_path):
    args = SUITE["default"]
    assert args == ["--steps", "10"], "this test runs golden/default.json's suite entry in-process"
    config = load_config(steps=10, out=str(tmp_path / "run"))
    session.run(config)
    return read_run(tmp_path / "run")


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutation_is_caught(tmp_path, monkeypatch, mutation):
    if MUTATIONS[mutation] is not None:
        MUTATIONS[mutation](monkeypatch)
    report = compare(_golden_run(tmp_path), load_golden(GOLDEN), "exact", ignore=["perf/*"])
    if mutation == "none":
        assert report.ok, [(m.name, m.message) for m in report.failed]
        # every metric of golden/default.json compared but its 3 perf/*: 12, train/kl_loss among them since the
        # default's kl_coef is 0.1 (issue 52)
        assert len(report.metrics) == 12
        return
    assert not report.ok, f"the golden check missed the mutation {mutation!r}"
    failing_steps = sorted({f.step for m in report.failed for f in m.failures})
    assert failing_steps and failing_steps[0] <= 1  # caught at once, not only late in the run
    assert all(m.kind == "exact" for m in report.failed)
