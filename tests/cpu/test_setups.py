"""Each backend takes its own part of the config (issue 35): the trainer a TrainerSetup, the SGLang engine an
EngineSetup; only the registry, which chooses the backends, reads a RunConfig."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlbench.config import EngineSetup, TrainerSetup, load_config, setup_from_dict
from rlbench.errors import BadInput

BACKENDS = Path(__file__).resolve().parents[2] / "rlbench" / "backends"


def test_no_backend_but_the_registry_names_the_run_config():
    naming = sorted(
        str(p.relative_to(BACKENDS))
        for p in BACKENDS.rglob("*.py")
        if re.search(r"\bRunConfig\b|config_from_dict", p.read_text())
    )
    assert naming == ["registry.py"]


def test_the_setups_carry_the_run_configs_values_and_round_trip():
    config = load_config(seed=5, tp=1, threads=2, rollout__temperature=0.7, train__lr=0.01)
    trainer = config.trainer_setup()
    assert (trainer.model, trainer.train, trainer.algo) == (config.model, config.train, config.algo)
    assert (trainer.temperature, trainer.seed, trainer.threads, trainer.tp, trainer.dp) == (0.7, 5, 2, 1, 1)
    assert setup_from_dict(TrainerSetup, trainer.to_dict(), "here") == trainer
    engine = config.engine_setup()
    assert (engine.model, engine.rollout, engine.seed, engine.device) == (config.model, config.rollout, 5, "cpu")
    assert setup_from_dict(EngineSetup, engine.to_dict(), "here") == engine


@pytest.mark.parametrize(
    "change, named", [({"rollout": {}}, "setup.rollout"), ({"tp": 0}, "tp"), ({"train": {"lr": "x"}}, "setup.train.lr")]
)
def test_a_setup_that_is_not_one_is_refused_by_name(change, named):
    table = {**load_config().trainer_setup().to_dict(), **change}
    with pytest.raises(BadInput, match=re.escape(named)):
        setup_from_dict(TrainerSetup, table, "the init command")
