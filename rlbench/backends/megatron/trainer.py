"""The megatron trainer (`--trainer megatron`): megatron-core GPTModel shards under tensor and data
parallelism, behind the same Trainer protocol as the torch trainer.

Each rank holds a `RankTrainer`: its GPTModel shard wrapped in megatron-core's
DistributedDataParallel, AdamW over the shard, and the torch trainer's own loss and step
(it subclasses TorchTrainer, so the two trainers differ only where Megatron does). Where:

- the forward is Megatron's; the logits are gathered over TP ranks, then the same algo.py;
- a data-parallel rank computes every dp-th micro-batch of a minibatch; the loss weights are
  fractions of the whole minibatch, so DDP sums the gradients (calculate_per_token_loss);
- gradients are finalised by megatron-core's `finalize_model_grads`: the DP all-reduce and,
  under TP, the all-reduce of the q/k-norm gradients, which each rank sees only for its own
  heads (skip it, and TP=2 parts from TP=1: tests/cpu/test_megatron_parallel.py);
- the gradient norm is taken over TP shards in float64 and clipped as torch's
  clip_grad_norm_ does. Hand-written: megatron-core's clip_grads builds its buffers with
  device="cuda" and has no CPU path;
- weights, per-parameter gradient digests and checkpoints go through Hugging Face names
  (convert.py), gathered to rank 0, so diff, replay and the engine see one naming.

`MegatronTrainer` is what the loop holds, on rank 0: it sends each call to every rank
(launch.py) and runs it on its own shard. The workers (worker.py: processes, or Ray actors under
`--placement ray`) start when it is made and join at its first call; `close()` stops them.

Checkpoints: per TP rank `model-tpNN.safetensors` and `optimizer-tpNN.safetensors` (Megatron
names, that rank's shard; data-parallel replicas are equal), `layout.json` (TP, DP, the model's
dims, the optimizer's settings, weight decay by param group included, and step counts), and
`model.safetensors`, the full weights under Hugging Face names that diff, train-only runs and
`check logprobs --recompute` read.
"""

from __future__ import annotations

import datetime
import json
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from rlbench.backends.megatron import faults, launch
from rlbench.backends.megatron import model as mmodel
from rlbench.backends.megatron.convert import Dims, hf_names, params, to_hf, to_megatron
from rlbench.backends.torch_trainer import TorchTrainer
from rlbench.backends.optimizer_state import (
    check_weight_decays,
    decay_groups,
    load_optimizer_state,
    optimizer_meta,
    optimizer_tensors,
)
from rlbench.config import TrainerSetup
from rlbench.core import algo, lm_head, tensor_file
from rlbench.core.model import load_model_config, load_named_, named_weights
from rlbench.errors import BadInput
from rlbench.rundir.digest import tensors_digest

LAYOUT = "rlbench.megatron-checkpoint/1"


def _import_megatron():
    """megatron-core, imported quietly (model.quiet says why)."""
    with mmodel.quiet():
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        from megatron.core import parallel_state
    return parallel_state


class RankTrainer(TorchTrainer):
    """One rank's shard of the megatron trainer (see the module docstring); with PPO, its `critic` beside it
    (critic.py)."""

    CRITIC = False  # PPO's critic (critic.py's RankCritic): its names and its output layer

    def __init__(self, ranks: launch.Ranks, config: TrainerSetup, initial: dict[str, torch.Tensor]):
        ps = _import_megatron()
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        device = ranks.device
        mmodel.silence_runtime_warnings()
        if device == "cpu":
            from rlbench.backends.megatron import compat

            compat.apply()
        # Made within the setup timeout (a rank dead meanwhile is named then), then given megatron-core's
        # own 30 minutes; _global_process_group_list is megatron-core's record of the groups it made.
        minutes = int(launch.SETUP_TIMEOUT.total_seconds() // 60)
        ps.initialize_model_parallel(tensor_model_parallel_size=config.tp, distributed_timeout_minutes=minutes)
        launch.settle(ps._global_process_group_list or [], datetime.timedelta(minutes=30))
        self.ranks, self.tp, self.dp = ranks, config.tp, config.dp
        self.is_main = ranks.is_main
        self.tp_rank, self.dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
        self.tp_group, self.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        with torch.random.fork_rng(devices=[]):  # on the CPU it seeds this process's RNG: keep it as it was
            # Megatron's RNG tracker must exist; rlbench draws nothing from it
            model_parallel_cuda_manual_seed(config.seed)
        self.hf_config = load_model_config(config.model.path)
        self.dims = mmodel.dims_of(self.hf_config, config.tp, config.model.path, config.device)
        self.tconfig = mmodel.transformer_config(
            self.hf_config,
            self.dims,
            config.tp,
            config.deterministic,
            config.device,
            mmodel.overrides_of(config.train),
            config.model.dtype,
        )
        self.gpt = self._shard(initial, device)
        # bf16: gradients reduced and kept in fp32 buffers (main_grad), the masters' gradients (Megatron's mixed
        # precision: --accumulate-allreduce-grads-in-fp32)
        ddp = DistributedDataParallel(
            self.tconfig, DistributedDataParallelConfig(grad_reduce_in_fp32=config.model.dtype == "bfloat16"), self.gpt
        )
        reference = self._shard(initial, device) if config.algo.kl_coef > 0 else None
        super().__init__(ddp, config.train, config.algo, config.temperature, config.seed, device, reference)
        self.critic = None  # PPO's: critic.attach, right after this on every rank

    def _shard(self, initial: dict[str, torch.Tensor], device: str) -> torch.nn.Module:
        gpt = mmodel.build(self.hf_config, self.dims, self.tconfig, self.CRITIC).to(device)
        shard = to_megatron(initial, self.dims, self.tp, self.tp_rank, self.CRITIC)
        load_named_(gpt, shard, source="the initial weights")
        return gpt

    # -- where it differs from TorchTrainer --

    def recompute(self) -> None:
        """Set in the TransformerConfig (model.overrides_of): megatron-core recomputes each layer."""

    def master_source(self) -> tuple[torch.nn.Module, bool]:
        return self.gpt, False  # megatron-core's DDP holds each gradient in a fp32 buffer (`main_grad`)

    def model_logits(self, model: torch.nn.Module, ids: torch.Tensor, keep: int | None = None) -> torch.Tensor:
        # GPTModel computes every position's logits; the loss reads the last `keep`.
        logits = mmodel.logits(model, ids)
        return logits if keep is None else logits[:, -keep:]

    def token_terms(self, model, ids, keep=None, entropy=None):
        # GPTModel's output layer is its own (column-parallel under TP): its logits come whole, then algo's chunks
        return lm_head.from_logits(self.model_logits(model, ids, keep), ids, self.temperature, entropy)

    def train_micro_batches(self, lengths):
        return self._micro_batches(lengths)[self.dp_rank :: self.dp]

    def zero_grads(self) -> None:
        super().zero_grads()
        self.model.zero_grad_buffer()

    def finalize_grads(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        if faults.active("no-tp-grad-finalize"):
            self.model.finish_grad_sync()  # the data-parallel all-reduce only
        else:
            finalize_model_grads([self.model])
        for name, p in self.gpt.named_parameters():  # what megatron-core's own optimizers do
            if self.masters:  # mixed precision: the fp32 buffer is the fp32 master's gradient
                self.masters.params[name].grad = p.main_grad
            else:
                p.grad = p.main_grad

    def named_grads(self):  # gathered on the device: their checksums are computed there
        return self._full_hf({name: p.main_grad for name, p in self.gpt.named_parameters()}, cpu=False).items()

    def param_names(self) -> list[str]:
        return hf_names(self.dims, self.CRITIC)

    def clip_grads(self) -> float:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.gpt.parameters():
            if param_is_not_tensor_parallel_duplicate(p):  # replicated params count once
                total += p.main_grad.double().square().sum()
        dist.all_reduce(total, group=self.tp_group)
        norm = float(total) ** 0.5
        coef = min(self.train_config.grad_clip / (norm + 1e-6), 1.0)  # as torch.nn.utils.clip_grad_norm_
        for p in self.gpt.parameters():
            p.main_grad.mul_(coef)
        return norm

    def reduce_stats(self, losses: torch.Tensor, sums: dict) -> tuple[torch.Tensor, dict]:
        if self.dp == 1:
            return losses, sums
        packed = torch.tensor(list(sums.values()), dtype=torch.float64, device=self.device)
        losses = losses.to(self.device)
        dist.all_reduce(packed, group=self.dp_group)
        dist.all_reduce(losses, group=self.dp_group)
        return losses.cpu(), dict(zip(sums, packed.tolist()))

    # -- gathering to rank 0, export, checkpoints --

    def _tp_shards(self, tensors: dict[str, torch.Tensor], cpu: bool = True) -> list[dict[str, torch.Tensor]]:
        """Every TP rank's copy of `tensors` (same names and shapes on each), in rank order, on the CPU (or
        with `cpu=False`, on this rank's device)."""
        shards = [{} for _ in range(self.tp)]
        for name, t in tensors.items():
            t = t.detach().to(self.device).contiguous()  # NCCL gathers device tensors only
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t, group=self.tp_group)
            for shard, part in zip(shards, parts):
                shard[name] = part.cpu() if cpu else part
        return shards

    def _megatron_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.gpt.named_parameters()}

    def _full_hf(self, tensors: dict[str, torch.Tensor], cpu: bool = True) -> dict[str, torch.Tensor]:
        return to_hf(self._tp_shards(tensors, cpu), self.dims, self.CRITIC)

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """Full Hugging Face weights on this rank's device (a GPU run's checksums run there, and the engine copies
        them device to device; `--placement ray` packs them to the host itself)."""
        return self._full_hf(self._megatron_state(), cpu=False)

    def checkpoint_files(self) -> dict[str, bytes | memoryview]:
        named = self.masters.params if self.masters else dict(self.gpt.named_parameters())
        opt_tensors, meta = optimizer_tensors(self.optimizer, named), optimizer_meta(self.optimizer, named)
        if self.masters:  # mixed precision: the fp32 masters, shard by shard
            opt_tensors.update({f"master/{name}": p.detach() for name, p in named.items()})
        model_shards = self._tp_shards(self._megatron_state())
        opt_shards = self._tp_shards(opt_tensors)
        if not self.ranks.is_main:  # it took part in the gathers; only rank 0 writes
            return {}
        # each shard's optimizer tensors checksummed: a flipped bit in one is refused on load
        meta["shard_checksums"] = [tensors_digest(sorted(shard.items())) for shard in opt_shards]
        layout = {
            "format": LAYOUT,
            "tp": self.tp,
            "dp": self.dp,
            "dims": self.dims.to_json(),
            "params": {p.megatron: {"hf": list(p.hf), "kind": p.kind} for p in params(self.dims, self.CRITIC)},
            "optimizer": meta,
        }
        if self.CRITIC:
            layout["role"] = "critic"
        files = {
            "model.safetensors": tensor_file.encode(to_hf(model_shards, self.dims, self.CRITIC)),
            "layout.json": (json.dumps(layout, indent=1, sort_keys=True) + "\n").encode(),
        }
        for r in range(self.tp):
            files[f"model-tp{r:02d}.safetensors"] = tensor_file.encode(model_shards[r])
            files[f"optimizer-tp{r:02d}.safetensors"] = tensor_file.encode(opt_shards[r])
        return files

    def load_checkpoint(self, directory: Path) -> None:
        from rlbench.core.model import load_safetensors
        from rlbench.rundir.jsonio import read_json

        shard = directory / f"model-tp{self.tp_rank:02d}.safetensors"
        load_named_(self.gpt, {k: v.to(self.device) for k, v in load_safetensors(shard).items()}, source=shard)
        layout = read_json(directory / "layout.json")
        opt = directory / f"optimizer-tp{self.tp_rank:02d}.safetensors"
        scalars = (layout.get("optimizer") or {}).get("scalars") if isinstance(layout, dict) else None
        tensors = load_safetensors(opt)
        if self.masters:
            self.masters.load({k: v.to(self.device) for k, v in tensors.items()}, shard.parent, shard.name)
            tensors = {k: v for k, v in tensors.items() if not k.startswith("master/")}
        named = self.masters.params if self.masters else dict(self.gpt.named_parameters())
        load_optimizer_state(self.optimizer, named, tensors, scalars, self.device, opt)

    def close(self) -> None:
        ps = _import_megatron()
        ps.destroy_model_parallel()


def check_layout(directory: Path, tp: int, dims: Dims, critic: bool = False) -> None:
    """Refuse (BadInput) a checkpoint this trainer (`critic`: its PPO critic) cannot load, before any rank is asked
    to."""
    path = directory / "layout.json"
    if not path.is_file():
        raise BadInput("not a megatron trainer checkpoint (no layout.json)", path=directory)
    try:
        layout = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"unreadable ({exc.__class__.__name__})", path=path) from None
    for key, want in (("format", LAYOUT), ("tp", tp), ("dims", dims.to_json()), ("role", "critic" if critic else None)):
        if layout.get(key) != want:
            raise BadInput(f"expected {want!r}, got {layout.get(key)!r}", path=path, field=key)
    for r in range(tp):
        for kind in ("model", "optimizer"):
            if not (directory / f"{kind}-tp{r:02d}.safetensors").is_file():
                raise BadInput(f"missing {kind}-tp{r:02d}.safetensors", path=directory)
    sums = (layout.get("optimizer") or {}).get("shard_checksums")  # written since issue 24: older ones have none
    if sums is not None:
        from rlbench.core.model import load_safetensors

        for r in range(tp):
            shard = directory / f"optimizer-tp{r:02d}.safetensors"
            tensors = load_safetensors(shard)
            if not isinstance(sums, list) or len(sums) != tp or sums[r] != tensors_digest(sorted(tensors.items())):
                raise BadInput(
                    "its tensors do not match the checksum layout.json holds for them "
                    "(optimizer.shard_checksums): the checkpoint was changed or damaged after it was "
                    "written",
                    path=shard,
                )
            _check_rounded(tensors, directory / f"model-tp{r:02d}.safetensors")


def check_layout_weight_decays(directory: Path, weight_decay: float) -> None:
    """Refuse (BadInput naming layout.json) a checkpoint whose optimizer's param groups decay otherwise than this
    run's: Megatron's rule (torch_trainer.decay_groups) on the names and shapes of model-tp00.safetensors (its
    header only), checked on rank 0 before any rank loads."""
    from safetensors import SafetensorError, safe_open

    shard = directory / "model-tp00.safetensors"
    try:
        with safe_open(shard, "pt") as f:
            named = {name: torch.empty(f.get_slice(name).get_shape(), device="meta") for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise BadInput(
            f"corrupt or unreadable safetensors ({exc.__class__.__name__}: {str(exc)[:100]})", path=shard
        ) from None
    have = [group["weight_decay"] for group in decay_groups(named, weight_decay)]
    layout = json.loads((directory / "layout.json").read_text())  # check_layout read it already
    check_weight_decays(layout.get("optimizer"), have, directory / "layout.json", field="optimizer.param_groups")


def _check_rounded(optimizer: dict[str, torch.Tensor], path: Path) -> None:
    """In mixed precision (`master/NAME` in an optimizer shard) the model shard at `path` must be those masters
    rounded to its dtype: checked on rank 0 for every shard, so a damaged one is named before any rank loads."""
    from rlbench.core.model import load_safetensors

    masters = {k.removeprefix("master/"): v for k, v in optimizer.items() if k.startswith("master/")}
    if not masters:
        return
    weights = load_safetensors(path)
    for name, master in masters.items():
        if name not in weights or not torch.equal(master.to(weights[name].dtype), weights[name]):
            raise BadInput(
                f"'{name}' is not its fp32 master weight rounded to the model's dtype (the checkpoint "
                "was changed or damaged after it was written)",
                path=path,
            )


# -- commands: the same call on every rank --


def dispatch(trainer: RankTrainer, op: str, meta: dict, tensors: dict[str, torch.Tensor]):
    """Run one command of rank 0's on this rank's shard: rank 0 here, and every worker (worker.py)."""
    if op == "logprobs":
        return trainer.logprobs(tensors["tokens"], reference=meta["reference"])
    if op == "train_step":
        batch = algo.TrainBatch(**{"ref_logprobs": None, **tensors})
        return trainer.train_step(batch, meta["step"])
    if op == "export":
        return trainer.export_hf_weights()
    if op == "checkpoint":
        return trainer.checkpoint_files()
    if op == "load":
        return trainer.load_checkpoint(Path(meta["directory"]))
    if op.startswith("critic_"):  # PPO's critic (critic.py)
        return trainer.critic.dispatch(op, meta, tensors)
    raise AssertionError(f"unknown command {op!r}")


class MegatronTrainer:
    """The Trainer the loop holds (rank 0): each call goes to every rank, then runs on rank 0's shard."""

    is_main = True

    def __init__(self, hf_model: torch.nn.Module, config: TrainerSetup, workers=None):
        """`workers`: how ranks 1.. start (launch.spawn): processes of this machine unless given."""
        self.config = config
        self.hf_model = hf_model  # the initial weights: read when the ranks start
        # Every setting is checked before a worker starts (the run's build checked them already; a
        # trainer made some other way is held to the same), then the workers start importing while
        # the run goes on being built; they join at the first call. Dropped unused (a run refused
        # later while it is built), the trainer takes them down.
        mmodel.check(config)
        self.dims = mmodel.dims_of(load_model_config(config.model.path), config.tp, config.model.path, config.device)
        _import_megatron()
        self._pending = launch.spawn(config.tp * config.dp, config.device, workers)
        weakref.finalize(self, launch.kill, self._pending.workers, self._pending.watched)
        self._checkpoint: Path | None = None
        self._critic_checkpoint: Path | None = None  # PPO's critic's (critic.py), loaded after the actor's
        self.on_start: list = []  # f(rank 0's RankTrainer, the initial weights), right after it is made
        self._broken = False
        self._ranks: launch.Ranks | None = None
        self._local: RankTrainer | None = None

    def _call(self, op: str, meta: dict | None = None, tensors: dict[str, torch.Tensor] | None = None):
        if self._local is None:
            self._start()
        meta, tensors = meta or {}, tensors or {}
        try:
            launch.send(self._ranks, op, meta, tensors)
            return dispatch(self._local, op, meta, tensors)
        except Exception as exc:  # the others may be inside a collective this rank left: no more commands
            self._broken = True
            raise self._dead_rank(exc) or exc  # noqa: B904 - the collective's error stays the context
        except BaseException:
            self._broken = True
            raise

    def _dead_rank(self, exc: Exception) -> launch.RankDied | None:
        """The RankDied to raise where a worker died (the others stopped), else None: a failed collective
        waits a moment for the dead worker to show, any other failure looks once."""
        if self._ranks is None or self._ranks.world == 1:
            return None
        return launch.died(self._ranks, launch.DEATH_WAIT if launch.lost_peer(exc) else 0)

    def _start(self) -> None:
        self._ranks = launch.join(self._pending)
        initial = {name: t.detach().cpu() for name, t in named_weights(self.hf_model).items()}
        try:
            launch.send(self._ranks, "init", {"setup": self.config.to_dict()}, initial)
            self._local = RankTrainer(self._ranks, self.config, initial)
            for hook in self.on_start:
                hook(self._local, initial)
        except Exception as exc:
            self._broken = True
            error = self._dead_rank(exc)
            self.close()
            raise error or exc  # noqa: B904 - the collective's error stays the context
        except BaseException:
            self._broken = True
            self.close()
            raise
        if self._checkpoint is not None:
            self._call("load", {"directory": str(self._checkpoint)})
        if self._critic_checkpoint is not None:
            self._call("critic_load", {"directory": str(self._critic_checkpoint)})

    def logprobs(
        self,
        tokens: torch.Tensor,
        reference: bool = False,
        lengths: torch.Tensor | None = None,
        per_sample: bool = False,
    ) -> torch.Tensor:
        assert not per_sample, "true on-policy is refused with the megatron trainer (config.py)"
        return self._call("logprobs", {"reference": reference}, {"tokens": tokens})

    def train_step(self, batch: algo.TrainBatch, step: int) -> algo.TrainStats:
        tensors = {k: v for k, v in vars(batch).items() if v is not None}
        return self._call("train_step", {"step": step}, tensors)

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        return self._call("export")

    def save_checkpoint(self) -> dict[str, bytes | memoryview]:
        return self._call("checkpoint")

    def load_checkpoint(self, directory: Path) -> None:
        """Checked now; loaded when the ranks start (or at once, when they run)."""
        check_layout(Path(directory), self.config.tp, self.dims)
        check_layout_weight_decays(Path(directory), self.config.train.weight_decay)
        if self._local is None:
            self._checkpoint = Path(directory)
        else:
            self._call("load", {"directory": str(directory)})

    def close(self) -> None:
        if self._ranks is None:  # never joined: nothing to tell them
            launch.kill(self._pending.workers, self._pending.watched)
            return
        ranks, self._ranks = self._ranks, None
        if ranks.watched is not None:  # the workers' exits from here on are this close's doing
            ranks.watched.close()
        if self._broken:
            launch.kill(ranks.workers)
        else:
            try:
                launch.send(ranks, "stop", {}, {})
            except Exception:  # a worker is gone (its error is on stderr): stop the others
                launch.kill(ranks.workers)
        if self._local is not None:
            self._local.close()
            self._local = None
        launch.stop(ranks)
