"""PPO's critic under the megatron trainer (issue 56): each rank holds a `RankCritic` beside its `RankTrainer`, in
the same parallel layout (slime requires the critic's TP/PP/CP to be the actor's), as slime's critic role builds it
(slime/backends/megatron_utils/model_provider.py): the actor's GPTModel with its output layer a one-output
`ValueHead` (replicated on every TP rank, its output float32), the trunk loaded from the policy's initial weights
and the head drawn as core/critic.py draws it (the same weights as the torch trainer's critic, by the same names).

Its loss and step are the torch critic's (backends/critic_trainer.py `CriticLoss`) over the rank trainer's
machinery (megatron-core's DDP, its gradient finalisation, the TP-aware norm and clip, digests and checkpoints by
Hugging Face name); its values are computed on every rank, as the actor's log-probs are. `MegatronCritic` is what
the loop holds on rank 0: each call goes to every rank (the commands `critic_*` of trainer.dispatch). Its
checkpoint is the rank trainer's layout with `"role": "critic"`, in the run checkpoint's critic/.

slime's critic shares the actor's GPUs by taking turns (offload_train); here both live in each rank's process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlbench.backends.critic_trainer import CriticLoss, critic_settings
from rlbench.backends.megatron import model as mmodel
from rlbench.backends.megatron.trainer import RankTrainer, check_layout, check_layout_weight_decays
from rlbench.backends.torch_trainer import TorchTrainer
from rlbench.core import algo
from rlbench.core.critic import initial_weights

# what a rank critic shares with its rank's actor: the parallel state and the model's shape
SHARED = ("ranks", "tp", "dp", "is_main", "tp_rank", "dp_rank", "tp_group", "dp_group", "hf_config", "dims", "tconfig")


class RankCritic(CriticLoss, RankTrainer):
    """One rank's shard of the critic."""

    CRITIC = True

    def __init__(self, actor: RankTrainer, config, initial: dict[str, torch.Tensor]):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        for name in SHARED:
            setattr(self, name, getattr(actor, name))
        self.gpt = self._shard(initial_weights(initial, self.dims.hidden, config.seed), actor.device)
        ddp = DistributedDataParallel(
            self.tconfig, DistributedDataParallelConfig(grad_reduce_in_fp32=config.model.dtype == "bfloat16"), self.gpt
        )
        train, critic_algo = critic_settings(config.train, config.algo)
        TorchTrainer.__init__(self, ddp, train, critic_algo, 1.0, config.seed, actor.device)
        self.value_clip = config.algo.value_clip

    def _token_values(self, ids: torch.Tensor) -> torch.Tensor:
        return mmodel.token_values(self.model, ids)

    def close(self) -> None:
        """The actor's close ends the parallel state both hold."""

    def dispatch(self, op: str, meta: dict, tensors: dict[str, torch.Tensor]):
        """A `critic_*` command of rank 0's (trainer.dispatch) on this rank's critic."""
        if op == "critic_values":
            return self.values(tensors["tokens"], tensors.get("lengths"))
        if op == "critic_train_step":
            return self.train_step(algo.TrainBatch(**{"ref_logprobs": None, **tensors}), meta["step"])
        if op == "critic_export":
            return self.export_hf_weights()
        if op == "critic_checkpoint":
            return self.checkpoint_files()
        if op == "critic_load":
            return self.load_checkpoint(Path(meta["directory"]))
        raise AssertionError(f"unknown command {op!r}")


def attach(actor: RankTrainer, config, initial: dict[str, torch.Tensor]) -> None:
    """This rank's critic beside its actor, made right after it on every rank (its DDP's collectives in order)."""
    actor.critic = RankCritic(actor, config, initial)


class MegatronCritic:
    """The critic the loop holds (rank 0): each call goes to every rank through the megatron trainer."""

    def __init__(self, trainer):
        assert trainer._local is None, "the critic is made with its trainer, before the ranks start"
        self.trainer = trainer
        trainer.on_start.append(lambda local, initial: attach(local, trainer.config, initial))

    def values(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        given = {"tokens": tokens} if lengths is None else {"tokens": tokens, "lengths": lengths}
        return self.trainer._call("critic_values", {}, given)

    def train_step(self, batch: algo.TrainBatch, step: int) -> algo.TrainStats:
        tensors = {k: v for k, v in vars(batch).items() if v is not None}
        return self.trainer._call("critic_train_step", {"step": step}, tensors)

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        return self.trainer._call("critic_export")

    def save_checkpoint(self) -> dict[str, bytes | memoryview]:
        return self.trainer._call("critic_checkpoint")

    def load_checkpoint(self, directory: Path) -> None:
        """Checked now; loaded when the ranks start (after the actor's), or at once where they run."""
        check_layout(Path(directory), self.trainer.config.tp, self.trainer.dims, critic=True)
        check_layout_weight_decays(Path(directory), self.trainer.config.train.weight_decay)
        if self.trainer._local is None:
            self.trainer._critic_checkpoint = Path(directory)
        else:
            self.trainer._call("critic_load", {"directory": str(directory)})

    def close(self) -> None:
        """The trainer's close stops the ranks that hold it."""
