"""A checkpoint holds everything the trainer's next step depends on: restoring it into a fresh
trainer (other initial weights, empty optimizer) and training on, matches training straight on."""

from __future__ import annotations

from rlbench.config import load_config
from rlbench.core.model import build_model
from rlbench.backends.torch_trainer import TorchTrainer
from rlbench.rundir.digest import weights_digest
from tests.helpers import train_batch, with_old_logprobs, write_files
from tests.conftest import RANDOM_INIT_MODEL


def _trainer(seed: int) -> TorchTrainer:
    # no KL term (the default's kl_coef is 0.1 since issue 52): these batches carry no reference log-probs (the
    # loop computes them), and a trainer's reference is the run's initial weights, which a resumed run rebuilds
    # from its config, not checkpoint state: the restored trainer here starts from other weights on purpose
    config = load_config(algo__kl_coef=0.0)
    return TorchTrainer(
        build_model(RANDOM_INIT_MODEL, master_seed=seed, init="random"), config.train, config.algo, 1.0, seed=0
    )


def test_restore_then_step_equals_straight_through(tmp_path):
    straight = _trainer(seed=1)
    straight.train_step(with_old_logprobs(straight, train_batch(0)), step=0)
    write_files(straight.save_checkpoint(), tmp_path / "ckpt")
    after_first = weights_digest(straight.export_hf_weights())
    straight.train_step(with_old_logprobs(straight, train_batch(1)), step=1)

    restored = _trainer(seed=2)
    assert weights_digest(restored.export_hf_weights()) != after_first
    restored.load_checkpoint(tmp_path / "ckpt")
    assert weights_digest(restored.export_hf_weights()) == after_first
    restored.train_step(with_old_logprobs(restored, train_batch(1)), step=1)
    assert weights_digest(restored.export_hf_weights()) == weights_digest(straight.export_hf_weights())


def test_without_optimizer_state_the_step_differs(tmp_path):
    """The check above can fail: restoring weights alone (fresh Adam moments) gives other weights."""
    from safetensors.torch import load_file

    from rlbench.core.model import load_named_

    straight = _trainer(seed=1)
    straight.train_step(with_old_logprobs(straight, train_batch(0)), step=0)
    write_files(straight.save_checkpoint(), tmp_path / "ckpt")
    straight.train_step(with_old_logprobs(straight, train_batch(1)), step=1)
    weights_only = _trainer(seed=2)
    load_named_(weights_only.model, load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    weights_only.train_step(with_old_logprobs(weights_only, train_batch(1)), step=1)
    assert weights_digest(weights_only.export_hf_weights()) != weights_digest(straight.export_hf_weights())
