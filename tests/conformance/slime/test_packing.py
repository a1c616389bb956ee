"""Token-sized micro-batches (`train.max_tokens_per_micro_batch`, slime's `--use-dynamic-batch-size
--max-tokens-per-gpu`) pack a minibatch's samples as slime's own `first_fit_pack` does: expected_packing.json,
written by build_expected_packing.py from slime's slime/utils/seqlen_balancing.py at the commit it records."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rlbench.backends.torch_trainer import TorchTrainer
from rlbench.config import load_config
from rlbench.core.model import build_model
from tests.conftest import RANDOM_INIT_MODEL

EXPECTED = json.loads((Path(__file__).parent / "expected_packing.json").read_text())


@pytest.fixture(scope="module")
def model():
    return build_model(RANDOM_INIT_MODEL, master_seed=1, init="random")


@pytest.mark.parametrize("case", EXPECTED["cases"], ids=lambda c: f"{len(c['lengths'])}x{c['max_tokens']}")
def test_micro_batches_are_slimes_first_fit_bins(model, case):
    config = load_config()
    train = dataclasses.replace(config.train, max_tokens_per_micro_batch=case["max_tokens"])
    trainer = TorchTrainer(model, train, config.algo, 1.0, seed=0)
    assert [list(mb) for mb in trainer._micro_batches(case["lengths"])] == case["bins"]
