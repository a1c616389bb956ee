"""The embedded trainer (`torch`): the transformers model, AdamW, micro-batches, gradient clipping.

One rollout step of training is `minibatches` optimizer steps over a seeded permutation of
the step's samples; each optimizer step accumulates gradients over micro-batches: of at most
`micro_batch_size` samples, or, with `max_tokens_per_micro_batch`, packed first-fit by the samples'
lengths as slime's `--use-dynamic-batch-size --max-tokens-per-gpu` packs them (each micro-batch is
then padded to its longest sample). Sequences are right-padded, so causal attention never lets a
real token see padding and no attention mask is needed. Checkpoints are safetensors + JSON.

A model in bf16 (or fp16) trains in mixed precision as Megatron's optimizer does it: the forward
and backward run in the model's dtype, each micro-batch's gradients are added into fp32 gradients of
fp32 master weights, AdamW's state and update are fp32, and after each optimizer step the model's
parameters are the masters rounded to its dtype (`MasterWeights`). A float32 model trains as it is.

Memory (slime's and Megatron's settings): `train.recompute` recomputes each decoder layer's activations in the
backward (transformers' gradient checkpointing, non-reentrant: the same bits); `train.optimizer_cpu_offload` keeps
the fp32 masters, their gradients and AdamW's state in host memory (a float32 model gets host masters too): each
micro-batch's gradients are copied to pinned host buffers as the backward makes them and added there in fp32 (the
same arithmetic as on the device), clipping and the fused AdamW update run on the CPU, and the rounded masters are
copied back to the model.

Weight decay follows Megatron's rule, which slime trains with: biases and 1-D parameters (norms) take
none, every other parameter takes `train.weight_decay` (`decay_groups`: two AdamW param groups).

Every embedding row trains, the pad id's too, as in megatron-core's embedding (slime's trainer): transformers
builds the embedding with `padding_idx = pad_token_id`, which withholds the gradient of the pad id's input
lookups from its row, so a policy that samples its pad id would train differently here (`train_every_row`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Protocol
from pathlib import Path

import torch

from rlbench.config import AlgoConfig, TrainConfig
from rlbench.core import algo, lm_head, tensor_file
from rlbench.core.model import load_named_, named_weights
from rlbench.core.seeding import generator
from rlbench.errors import BadInput
from rlbench.rundir import digest
from rlbench.backends.master_weights import MasterWeights, total_norm
from rlbench.backends.optimizer_state import (
    decay_groups,
    check_weight_decays,
    optimizer_tensors,
    optimizer_meta,
    load_optimizer_state,
)


def pad_right(sequences: Sequence[Sequence[int]], pad: int = 0) -> torch.Tensor:
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


class TrainerHooks(Protocol):
    """The steps of `TorchTrainer.train_step` a subclass may replace: the megatron rank trainer
    (backends/megatron/trainer.py) overrides each of these for its sharded model and its process groups; the
    step's order and arithmetic around them stay TorchTrainer's."""

    def recompute(self) -> None: ...  # train.recompute: the model's layers recomputed in the backward
    def master_source(self) -> tuple[torch.nn.Module, bool]: ...  # the module whose parameters the fp32 masters copy
    def model_logits(self, model: torch.nn.Module, ids: torch.Tensor, keep: int | None = None) -> torch.Tensor: ...
    def token_terms(self, model, ids, keep=None, entropy=None): ...  # log-probs (and entropies) of ids
    def train_micro_batches(self, lengths: Sequence[int]): ...  # this rank's micro-batches of a minibatch
    def zero_grads(self) -> None: ...
    def finalize_grads(self) -> None: ...  # after a minibatch's backward: reductions across ranks
    def named_grads(self): ...  # the gradients to checksum, by parameter name
    def param_names(self) -> list[str]: ...
    def clip_grads(self) -> torch.Tensor | float: ...  # returns the norm before clipping
    def optimizer_step(self) -> None: ...
    def reduce_stats(self, losses: torch.Tensor, sums: dict) -> tuple[torch.Tensor, dict]: ...  # across ranks


class TorchTrainer:
    """The embedded trainer. The methods starting `_` with a one-line body are the places where the
    megatron trainer (backends/megatron/trainer.py), which reuses this loss and step, differs."""

    is_main = True

    def __init__(
        self,
        model: torch.nn.Module,
        train: TrainConfig,
        algo_config: AlgoConfig,
        temperature: float,
        seed: int,
        device: str = "cpu",
        reference: torch.nn.Module | None = None,
    ):
        self.model = train_every_row(model.to(device))
        if train.recompute:
            self.recompute()
        host = train.optimizer_cpu_offload
        self.masters = MasterWeights(*self.master_source(), host=host) if host or _low_precision(self.model) else None
        self.optimizer_device = "cpu" if host else device  # where AdamW's state lives
        self.train_config, self.algo_config = train, algo_config
        self.temperature, self.seed, self.device = temperature, seed, device
        self.reference = None
        if algo_config.kl_coef > 0:
            reference = copy.deepcopy(model) if reference is None else reference
            self.reference = reference.eval().requires_grad_(False)
        # fused: its sqrt is the exact vector instruction; the for-loop AdamW calls torch.sqrt, which on
        # the CPU is MKL's VML and rounds differently on AMD and Intel (rlbench/numerics.py).
        named = self.masters.params if self.masters else dict(model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            decay_groups(named, train.weight_decay),
            lr=train.lr,
            betas=train.betas,
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
            fused=True,
        )

    def recompute(self) -> None:
        """`train.recompute`: transformers' gradient checkpointing (the megatron trainer's TransformerConfig
        recomputes instead)."""
        enable_recompute(self.model)

    def master_source(self) -> tuple[torch.nn.Module, bool]:
        """The module whose parameters get fp32 masters in mixed precision, and whether the masters take the
        gradients through hooks (the megatron trainer's come from megatron-core's fp32 gradient buffers)."""
        return self.model, True

    def _micro_batches(self, lengths: Sequence[int]) -> list[Sequence[int]]:
        """Positions 0..len(lengths)-1 in micro-batches: `micro_batch_size` at a time, or first-fit packed
        by length under `max_tokens_per_micro_batch` (slime's rule: a longer sample sits alone)."""
        n, cap = len(lengths), self.train_config.max_tokens_per_micro_batch
        if cap is None:
            size = self.train_config.micro_batch_size
            return [range(i, min(i + size, n)) for i in range(0, n, size)]
        bins: list[list[int]] = []
        sums: list[int] = []
        for position, length in enumerate(lengths):
            fit = next((j for j, total in enumerate(sums) if total + length <= cap), None)
            if fit is None:
                bins.append([position])
                sums.append(length)
            else:
                bins[fit].append(position)
                sums[fit] += length
        return bins

    @torch.no_grad()
    def logprobs(
        self,
        tokens: torch.Tensor,
        reference: bool = False,
        lengths: torch.Tensor | None = None,
        per_sample: bool = False,
    ) -> torch.Tensor:
        """[n, L] log-probs of each token given its prefix (position 0 gets 0), in micro-batches; with
        `per_sample`, one sequence at a time at its own length (true on-policy: the engine's forward)."""
        model = self.reference if reference else self.model
        model.eval()
        if per_sample:
            out = torch.zeros(tokens.shape, dtype=torch.float32)
            for i in range(tokens.shape[0]):
                n = int(lengths[i]) if lengths is not None else tokens.shape[1]
                out[i, :n] = algo.sequence_logprobs(model, tokens[i, :n], self.temperature, self.device).float()
            return out
        out = torch.zeros(tokens.shape, dtype=torch.float32)
        real = _lengths(tokens, lengths)
        for mb in self._micro_batches(real.tolist()):
            rows = torch.as_tensor(list(mb))
            # token-sized micro-batches are cut to their longest row; sample-sized ones keep the batch's width
            trim = self.train_config.max_tokens_per_micro_batch is not None
            width = int(real[rows].max()) if trim else tokens.shape[1]
            ids = tokens[rows, :width].to(self.device)
            # recorded as float32 (a float64 run computes them in float64 and records them rounded)
            out[rows, :width] = self.token_terms(model, ids)[0].float().cpu()
        return out

    def model_logits(self, model: torch.nn.Module, ids: torch.Tensor, keep: int | None = None) -> torch.Tensor:
        """Logits of the last `keep` positions of `ids` (None: all)."""
        return model(input_ids=ids, logits_to_keep=keep or 0, use_cache=False).logits  # a cache nothing reads

    def token_terms(
        self, model: torch.nn.Module, ids: torch.Tensor, keep: int | None = None, entropy: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n, L] log-probs of `ids` from the logits of their last `keep` positions (None: all), and their entropies
        where asked (lm_head.head_logprobs: the LM head and log-softmax chunked together)."""
        return lm_head.head_logprobs(model, ids, self.temperature, keep, entropy)

    def train_micro_batches(self, lengths: Sequence[int]):
        """The micro-batches (positions in the minibatch) of a minibatch of samples of these lengths that
        this trainer (rank) computes."""
        return self._micro_batches(lengths)

    def zero_grads(self) -> None:
        if self.masters and self.masters.host:
            self.masters.zero()  # host gradients' buffers kept (MasterWeights.settle)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self.masters:
            self.model.zero_grad(set_to_none=True)

    def finalize_grads(self) -> None:
        """After the micro-batches' backward passes, before the gradients are read."""

    def named_grads(self):
        """(Hugging Face name, full gradient) of every parameter, in the model's order (the fp32 master
        gradients in mixed precision: what the optimizer steps with)."""
        named = self.masters.params.items() if self.masters else self.model.named_parameters()
        return ((name, p.grad) for name, p in named if p.grad is not None)

    def param_names(self) -> list[str]:
        return [name for name, _ in self.model.named_parameters()]

    def clip_grads(self) -> torch.Tensor | float:
        """Clip the gradients; their norm before clipping (a device tensor: read at the step's end)."""
        params = list(self.masters.params.values() if self.masters else self.model.parameters())
        if self.masters and self.masters.host:  # torch's clip_grad_norm_, without its multiply by 1.0 (no bit moves)
            norm = total_norm([p.grad for p in params if p.grad is not None])
            if float(self.train_config.grad_clip / (norm + 1e-6)) < 1.0:
                torch.nn.utils.clip_grads_with_norm_(params, self.train_config.grad_clip, norm)
            return norm
        return torch.nn.utils.clip_grad_norm_(params, self.train_config.grad_clip)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        if self.masters:
            self.masters.copy_to_model()

    def reduce_stats(self, losses: torch.Tensor, sums: dict) -> tuple[torch.Tensor, dict]:
        """Every rank's share of the losses and metric sums, added up (one rank: as they are)."""
        return losses, sums

    def close(self) -> None:
        """Nothing to release in-process (a multi-rank trainer stops its ranks here)."""

    def train_step(self, batch: algo.TrainBatch, step: int) -> algo.TrainStats:
        cfg, acfg = self.train_config, self.algo_config
        n = batch.tokens.shape[0]
        if acfg.use_tis and batch.rollout_logprobs is None:
            raise BadInput(
                f"step {step}: TIS needs the rollout log-probs, and the batch has none", field="algo.use_tis"
            )
        if batch.rollouts is not None:
            return self._train_rollouts(batch, step)
        if n % cfg.minibatches:  # never drop the samples that do not fit
            raise BadInput(
                f"step {step} has {n} samples, which do not split into {cfg.minibatches} equal minibatches",
                field="train.minibatches",
            )
        order = torch.randperm(n, generator=generator(self.seed, "minibatch", step))
        per_update = n // cfg.minibatches
        minibatches = [order[update * per_update : (update + 1) * per_update] for update in range(cfg.minibatches)]
        return self._updates(batch, minibatches, None)

    def _train_rollouts(self, batch: algo.TrainBatch, step: int) -> algo.TrainStats:
        """A step whose samples share rollouts (a slime fan-out): the rollouts shuffled and split into equal
        minibatches, each minibatch the samples of its rollouts (slime's build_dp_schedule: a step holds whole
        rollouts), the loss a mean over its rollouts (algo.rollout_reducer)."""
        cfg = self.train_config
        ids, inverse = torch.unique(batch.rollouts, return_inverse=True)
        if len(ids) % cfg.minibatches:
            raise BadInput(
                f"step {step} has {len(ids)} rollouts, which do not split into {cfg.minibatches} equal minibatches",
                field="train.minibatches",
            )
        order = torch.randperm(len(ids), generator=generator(self.seed, "minibatch", step))
        per_update = len(ids) // cfg.minibatches
        minibatches = []
        for update in range(cfg.minibatches):
            chosen = torch.zeros(len(ids), dtype=torch.bool)
            chosen[order[update * per_update : (update + 1) * per_update]] = True
            minibatches.append(chosen[inverse].nonzero()[:, 0])
        if self.algo_config.per_token_loss:  # the per-token loss is a token mean whatever the rollouts
            return self._updates(batch, minibatches, None)
        denominators = algo.rollout_denominators(batch.loss_mask, batch.rollouts)
        return self._updates(batch, minibatches, (denominators, per_update))

    def _updates(self, batch: algo.TrainBatch, minibatches: list[torch.Tensor], rollouts) -> algo.TrainStats:
        """One optimizer update per minibatch (sample positions); `rollouts`: (each sample's rollout token total,
        rollouts per minibatch) where samples share rollouts, else None."""
        cfg, acfg = self.train_config, self.algo_config
        # every gradient's lanes stay on its device until the step's end: one copy to the host a step
        grads = digest.Digests([None, *self.param_names()])  # None: all of them, in order; a name: its own
        # Metric sums and losses stay on the device until the step's end: no wait for the GPU mid-step.
        # float64 sums: the same arithmetic as adding Python floats, in the same order.
        sums = {name: torch.zeros((), dtype=torch.float64, device=self.device) for name in self._metric_names()}
        losses, grad_norms = [], []
        lengths = _lengths(batch.tokens, batch.lengths)
        # a minibatch's loss adds up in float32, or in float64 in a float64 run (then recorded rounded to float32)
        wide = torch.promote_types(next(self.model.parameters()).dtype, torch.float32)
        self.model.train()
        for index in minibatches:
            per_update = len(index)
            # per-token loss: each micro-batch's masked sum over the whole minibatch's token count
            tokens = algo.token_denominator(batch.loss_mask[index]) if acfg.per_token_loss else None
            self.zero_grads()
            total = torch.zeros((), dtype=wide, device=self.device)
            for mb in self.train_micro_batches(lengths[index].tolist()):
                rows = index[list(mb)]
                if rollouts is not None:  # the micro-batch's share of the mean over the minibatch's rollouts
                    shared = (rollouts[0][rows], rollouts[1])
                    part = self._loss(batch, rows, weight=1.0, sums=sums, rollouts=shared)
                else:
                    weight = 1.0 if tokens is not None else len(mb) / per_update
                    part = self._loss(batch, rows, weight=weight, sums=sums, tokens=tokens)
                part.backward()
                if self.masters:
                    self.masters.flush()  # host masters: this micro-batch's gradients, added on the host
                total += part.detach()
            if self.masters and self.masters.host:
                self.masters.settle()
            self.finalize_grads()
            grads.add_all((name, grad, (None, name)) for name, grad in self.named_grads())
            grad_norms.append(self.clip_grads())
            self.optimizer_step()
            losses.append(total)
        sums = {name: float(value) for name, value in sums.items()}
        losses, sums = self.reduce_stats(torch.stack(losses).cpu(), sums)
        metrics = {f"train/{k}": v / cfg.minibatches for k, v in sums.items()}
        metrics["train/loss"] = float(losses.mean())
        metrics["train/grad_norm"] = sum(float(norm) for norm in grad_norms) / len(grad_norms)
        param_grads = grads.hexdigests()
        return algo.TrainStats(
            metrics=metrics, losses=losses.float(), grads_digest=param_grads.pop(None), param_grads=param_grads
        )

    def _metric_names(self) -> tuple[str, ...]:
        """The train/* metrics `_loss` adds its shares of (the critic's trainer reports others)."""
        return algo.loss_metric_names(self.algo_config)

    def _loss(
        self,
        batch: algo.TrainBatch,
        index: torch.Tensor,
        weight: float,
        sums: dict,
        tokens: torch.Tensor | None = None,
        rollouts: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """One micro-batch's share of the minibatch loss (times `weight`); adds its share of each metric
        to `sums`. `tokens`: the minibatch's token count, for the per-token loss (None: per-sample);
        `rollouts`: these samples' rollout token totals and the minibatch's rollout count (algo.rollout_reducer)."""
        acfg = self.algo_config
        mask = batch.loss_mask[index]
        columns = mask.any(dim=0).nonzero()[:, 0]
        first, width = (int(columns[0]), int(columns[-1]) + 1) if len(columns) else (1, 1)
        ids = batch.tokens[index, :width].to(self.device)
        mask = mask[:, :width].to(self.device)
        # Logits only where a loss token is predicted (positions first-1 .. width-1): the LM head,
        # log-softmax and entropy then run on the response span, not on every prompt position.
        # the entropy as a metric only (no bonus): no graph, so the backward skips a [n, L, vocab] term times 0
        logp, entropy = self.token_terms(
            self.model, ids, keep=width - first + 1, entropy="loss" if acfg.entropy_coef > 0 else "metric"
        )
        given = {
            name: getattr(batch, name)[index, :width].to(self.device) if getattr(batch, name) is not None else None
            for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs")
        }
        loss, terms = algo.policy_loss(
            logp,
            given["old_logprobs"],
            (batch.advantages[index, :width] if batch.advantages.dim() == 2 else batch.advantages[index]).to(
                self.device
            ),
            mask,
            entropy,
            acfg,
            algo.reducer(mask, tokens)
            if rollouts is None
            else algo.rollout_reducer(mask, rollouts[0].to(self.device, mask.dtype), rollouts[1]),
            given["ref_logprobs"],
            given["rollout_logprobs"],
        )
        for key, value in terms.items():
            sums[key] += value.detach().double() * weight
        return loss * weight

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """The model's weights by Hugging Face name, where they live (on the GPU for a GPU run: checksums run
        there and the engine copies from them device to device). Views of the parameters: read them before the
        next optimizer step."""
        return {name: t.detach() for name, t in named_weights(self.model).items()}

    def save_checkpoint(self) -> dict[str, bytes | memoryview]:
        """The checkpoint's files (the run directory writes them atomically); in mixed precision the fp32 masters
        are kept as the optimizer state's `master/NAME` tensors. Each tensor is copied once, from where it lives
        into its file's buffer (core/tensor_file.py)."""
        named = self.masters.params if self.masters else dict(self.model.named_parameters())
        held = optimizer_tensors(self.optimizer, named)  # where they live: checksummed there, copied from there
        if self.masters:
            held.update({f"master/{name}": p.detach() for name, p in named.items()})
        meta = optimizer_meta(self.optimizer, named)
        # read back by load_checkpoint: a flipped bit in the optimizer state (or a master weight) is refused
        meta["tensors_checksum"] = digest.tensors_digest(sorted(held.items()))
        return {
            "model.safetensors": tensor_file.encode(self.export_hf_weights()),
            "optimizer.safetensors": tensor_file.encode(held),
            "optimizer.json": (json.dumps(meta, sort_keys=True, indent=1) + "\n").encode(),
        }

    def load_checkpoint(self, directory: Path) -> None:
        from rlbench.core.model import load_safetensors
        from rlbench.rundir.jsonio import read_json

        meta = read_json(directory / "optimizer.json")
        check_weight_decays(
            meta, [group["weight_decay"] for group in self.optimizer.param_groups], directory / "optimizer.json"
        )
        load_named_(self.model, load_safetensors(directory / "model.safetensors"), source=directory)
        scalars = meta.get("scalars") if isinstance(meta, dict) else None
        tensors = load_safetensors(directory / "optimizer.safetensors")
        expected = meta.get("tensors_checksum") if isinstance(meta, dict) else None
        if expected is not None and expected != digest.tensors_digest(sorted(tensors.items())):
            raise BadInput(
                "its tensors do not match the checksum optimizer.json holds for them (tensors_checksum): "
                "the checkpoint was changed or damaged after it was written",
                path=directory / "optimizer.safetensors",
            )
        if self.masters:
            self.masters.load(tensors, directory)
        named = self.masters.params if self.masters else dict(self.model.named_parameters())
        load_optimizer_state(self.optimizer, named, tensors, scalars, self.optimizer_device, directory)


def train_every_row(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with no padding index on its embeddings: the pad id's row takes its lookups' gradient (megatron-core's
    embedding has none; the forward is the same either way)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            module.padding_idx = None
    return model


def enable_recompute(model: torch.nn.Module) -> None:
    """Each decoder layer's activations recomputed in the backward (transformers' gradient checkpointing,
    non-reentrant: it recomputes the same forward, so the gradients keep their bits)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise BadInput(
            f"{type(model).__name__} does not support recomputing its layers (transformers' gradient checkpointing)",
            field="train.recompute",
        )
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.23's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _low_precision(model: torch.nn.Module) -> bool:
    return any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())


def _lengths(tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Each row's real length (the padded width where a batch does not say)."""
    return lengths if lengths is not None else torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long)
