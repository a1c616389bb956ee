"""The embedded trainer (`torch`): the transformers model, AdamW, micro-batches, gradient clipping.

One rollout step of training is `minibatches` optimizer steps over a seeded permutation of
the step's samples; each optimizer step accumulates gradients over micro-batches of at most
`micro_batch_size` samples. Sequences are right-padded, so causal attention never lets a real
token see padding and no attention mask is needed. Checkpoints are safetensors + JSON.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from rlbench.config import AlgoConfig, TrainConfig
from rlbench.core import algo
from rlbench.core.model import load_named_, named_weights
from rlbench.core.seeding import generator
from rlbench.errors import BadInput
from rlbench.rundir import digest


def pad_right(sequences: Sequence[Sequence[int]], pad: int = 0) -> torch.Tensor:
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


class TorchTrainer:
    """The embedded trainer. The methods starting `_` with a one-line body are the places where the
    megatron trainer (backends/megatron/trainer.py), which reuses this loss and step, differs."""

    is_main = True

    def __init__(self, model: torch.nn.Module, train: TrainConfig, algo_config: AlgoConfig,
                 temperature: float, seed: int, device: str = "cpu", reference: torch.nn.Module | None = None):
        self.model = model.to(device)
        self.train_config, self.algo_config = train, algo_config
        self.temperature, self.seed, self.device = temperature, seed, device
        self.reference = None
        if algo_config.kl_coef > 0:
            reference = copy.deepcopy(model) if reference is None else reference
            self.reference = reference.eval().requires_grad_(False)
        # fused: its sqrt is the exact vector instruction; the for-loop AdamW calls torch.sqrt, which on
        # the CPU is MKL's VML and rounds differently on AMD and Intel (rlbench/numerics.py).
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=train.betas,
                                           eps=train.adam_eps, weight_decay=train.weight_decay, fused=True)

    def _micro_batches(self, n: int):
        size = self.train_config.micro_batch_size
        return [range(i, min(i + size, n)) for i in range(0, n, size)]

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor, reference: bool = False, lengths: torch.Tensor | None = None,
                 per_sample: bool = False) -> torch.Tensor:
        """[n, L] log-probs of each token given its prefix (position 0 gets 0), in micro-batches; with
        `per_sample`, one sequence at a time at its own length (true on-policy: the engine's forward)."""
        model = self.reference if reference else self.model
        model.eval()
        if per_sample:
            out = torch.zeros(tokens.shape, dtype=torch.float32)
            for i in range(tokens.shape[0]):
                n = int(lengths[i]) if lengths is not None else tokens.shape[1]
                out[i, :n] = algo.sequence_logprobs(model, tokens[i, :n], self.temperature, self.device)
            return out
        parts = []
        for mb in self._micro_batches(tokens.shape[0]):
            ids = tokens[mb.start: mb.stop].to(self.device)
            parts.append(algo.token_logprobs(self._logits(model, ids), ids, self.temperature).cpu())
        return torch.cat(parts)

    def _logits(self, model: torch.nn.Module, ids: torch.Tensor, keep: int | None = None) -> torch.Tensor:
        """Logits of the last `keep` positions of `ids` (None: all)."""
        return model(input_ids=ids, logits_to_keep=keep or 0, use_cache=False).logits  # a cache nothing reads

    def _train_micro_batches(self, n: int):
        """The micro-batches of a minibatch of `n` samples that this trainer (rank) computes."""
        return self._micro_batches(n)

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _finalize_grads(self) -> None:
        """After the micro-batches' backward passes, before the gradients are read."""

    def _named_grads(self):
        """(Hugging Face name, full gradient) of every parameter, in the model's order."""
        return ((name, p.grad) for name, p in self.model.named_parameters() if p.grad is not None)

    def _param_names(self) -> list[str]:
        return [name for name, _ in self.model.named_parameters()]

    def _clip_grads(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_config.grad_clip))

    def _reduce_stats(self, losses: torch.Tensor, sums: dict) -> tuple[torch.Tensor, dict]:
        """Every rank's share of the losses and metric sums, added up (one rank: as they are)."""
        return losses, sums

    def close(self) -> None:
        """Nothing to release in-process (a multi-rank trainer stops its ranks here)."""

    def train_step(self, batch: algo.TrainBatch, step: int) -> algo.TrainStats:
        cfg, acfg = self.train_config, self.algo_config
        n = batch.tokens.shape[0]
        if n % cfg.minibatches:  # never drop the samples that do not fit
            raise BadInput(f"step {step} has {n} samples, which do not split into {cfg.minibatches} equal minibatches",
                           field="train.minibatches")
        if acfg.use_tis and batch.rollout_logprobs is None:
            raise BadInput(f"step {step}: TIS needs the rollout log-probs, and the batch has none",
                           field="algo.use_tis")
        order = torch.randperm(n, generator=generator(self.seed, "minibatch", step))
        per_update = n // cfg.minibatches
        # every gradient's lanes stay on its device until the step's end: one copy to the host a step
        grads = digest.Digests([None, *self._param_names()])  # None: all of them, in order; a name: its own
        sums = dict.fromkeys(algo.loss_metric_names(acfg), 0.0)
        losses, grad_norms = [], []
        self.model.train()
        for update in range(cfg.minibatches):
            index = order[update * per_update: (update + 1) * per_update]
            # per-token loss: each micro-batch's masked sum over the whole minibatch's token count
            tokens = algo.token_denominator(batch.loss_mask[index]) if acfg.per_token_loss else None
            self._zero_grads()
            total = torch.zeros((), dtype=torch.float32)
            for mb in self._train_micro_batches(per_update):
                weight = 1.0 if tokens is not None else (mb.stop - mb.start) / per_update
                part = self._loss(batch, index[mb.start: mb.stop], weight=weight, sums=sums, tokens=tokens)
                part.backward()
                total += part.detach().cpu()
            self._finalize_grads()
            for name, grad in self._named_grads():
                grads.add(name, grad, None, name)
            grad_norms.append(self._clip_grads())
            self.optimizer.step()
            losses.append(total)
        losses, sums = self._reduce_stats(torch.stack(losses), sums)
        metrics = {f"train/{k}": v / cfg.minibatches for k, v in sums.items()}
        metrics["train/loss"] = float(losses.mean())
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        param_grads = grads.hexdigests()
        return algo.TrainStats(metrics=metrics, losses=losses, grads_digest=param_grads.pop(None),
                               param_grads=param_grads)

    def _loss(self, batch: algo.TrainBatch, index: torch.Tensor, weight: float, sums: dict,
              tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One micro-batch's share of the minibatch loss (times `weight`); adds its share of each metric
        to `sums`. `tokens`: the minibatch's token count, for the per-token loss (None: per-sample)."""
        acfg = self.algo_config
        mask = batch.loss_mask[index]
        columns = mask.any(dim=0).nonzero()[:, 0]
        first, width = (int(columns[0]), int(columns[-1]) + 1) if len(columns) else (1, 1)
        ids = batch.tokens[index, :width].to(self.device)
        mask = mask[:, :width].to(self.device)
        # Logits only where a loss token is predicted (positions first-1 .. width-1): the LM head,
        # log-softmax and entropy then run on the response span, not on every prompt position.
        logits = self._logits(self.model, ids, keep=width - first + 1)
        logp = algo.token_logprobs(logits, ids, self.temperature)
        if acfg.entropy_coef > 0:
            entropy = algo.token_entropy(logits, self.temperature, width)
        else:  # the metric only: no graph, so the backward skips a [n, L, vocab] entropy term times 0
            with torch.no_grad():
                entropy = algo.token_entropy(logits, self.temperature, width)
        given = {name: getattr(batch, name)[index, :width].to(self.device) if getattr(batch, name) is not None
                 else None for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs")}
        loss, terms = algo.policy_loss(logp, given["old_logprobs"], batch.advantages[index].to(self.device), mask,
                                       entropy, acfg, algo.reducer(mask, tokens), given["ref_logprobs"],
                                       given["rollout_logprobs"])
        for key, value in terms.items():
            sums[key] += float(value.detach()) * weight
        return loss * weight

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        return {name: t.to("cpu") for name, t in named_weights(self.model).items()}

    def save_checkpoint(self) -> dict[str, bytes]:
        """The checkpoint's files as bytes (the run directory writes them atomically)."""
        from safetensors.torch import save

        opt_tensors, meta = optimizer_state(self.optimizer, self.model)
        return {
            "model.safetensors": save({k: v.contiguous() for k, v in self.export_hf_weights().items()}),
            "optimizer.safetensors": save(opt_tensors),
            "optimizer.json": (json.dumps(meta, sort_keys=True, indent=1) + "\n").encode(),
        }

    def load_checkpoint(self, directory: Path) -> None:
        from rlbench.core.model import load_safetensors
        from rlbench.rundir.jsonio import read_json

        load_named_(self.model, load_safetensors(directory / "model.safetensors"), source=directory)
        meta = read_json(directory / "optimizer.json")
        scalars = meta.get("scalars") if isinstance(meta, dict) else None
        load_optimizer_state(self.optimizer, self.model, load_safetensors(directory / "optimizer.safetensors"),
                             scalars, self.device, directory)


def optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW's state as safetensors tensors (`field/param name`) and JSON (param groups, scalars)."""
    names = {id(p): name for name, p in model.named_parameters()}
    tensors, scalars = {}, {}
    for param, state in optimizer.state.items():
        name = names[id(param)]
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"{key}/{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{key}/{name}"] = float(value)
    meta = {"optimizer": "AdamW", "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                   for g in optimizer.param_groups], "scalars": scalars}
    return tensors, meta


def load_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                         scalars: object, device: str, source: Path) -> None:
    """The inverse of `optimizer_state`, every entry held to the model's parameters (BadInput naming `source`)."""
    if not isinstance(scalars, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                for v in scalars.values()):
        raise BadInput("optimizer state: expected {\"scalars\": {name: number}}", path=source)
    params = dict(model.named_parameters())
    for key, value in {**tensors, **scalars}.items():
        field, _, name = key.partition("/")
        if name not in params or field not in ("step", "exp_avg", "exp_avg_sq") or (
                torch.is_tensor(value) and value.shape != params[name].shape):
            raise BadInput(f"optimizer state {key!r} fits no parameter of the model", path=source)
        state = optimizer.state[params[name]]
        state[field] = value.to(device) if torch.is_tensor(value) else torch.tensor(float(value))
