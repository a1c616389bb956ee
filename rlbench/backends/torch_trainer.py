"""The embedded trainer (`torch`): the transformers model, AdamW, micro-batches, gradient clipping.

One rollout step of training is `minibatches` optimizer steps over a seeded permutation of
the step's samples; each optimizer step accumulates gradients over micro-batches of at most
`micro_batch_size` samples. Sequences are right-padded, so causal attention never lets a real
token see padding and no attention mask is needed. Checkpoints are safetensors + JSON.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from rlbench.config import AlgoConfig, TrainConfig
from rlbench.core import algo
from rlbench.core.model import load_named_, named_weights
from rlbench.core.seeding import generator
from rlbench.rundir import digest


def pad_right(sequences: Sequence[Sequence[int]], pad: int = 0) -> torch.Tensor:
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


class TorchTrainer:
    is_main = True

    def __init__(self, model: torch.nn.Module, train: TrainConfig, algo_config: AlgoConfig,
                 temperature: float, seed: int, device: str = "cpu"):
        self.model = model.to(device)
        self.train_config, self.algo_config = train, algo_config
        self.temperature, self.seed, self.device = temperature, seed, device
        self.reference = None
        if algo_config.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=train.betas,
                                           eps=train.adam_eps, weight_decay=train.weight_decay)

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
            parts.append(algo.token_logprobs(model(input_ids=ids).logits, ids, self.temperature).cpu())
        return torch.cat(parts)

    def train_step(self, batch: algo.TrainBatch, step: int) -> algo.TrainStats:
        cfg, acfg = self.train_config, self.algo_config
        n = batch.tokens.shape[0]
        order = torch.randperm(n, generator=generator(self.seed, "minibatch", step))
        per_update = n // cfg.minibatches
        grads_hash = hashlib.sha256()
        per_param = {name: hashlib.sha256() for name, _ in self.model.named_parameters()}
        sums = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "entropy_loss": 0.0, "kl_loss": 0.0}
        losses, grad_norms = [], []
        self.model.train()
        for update in range(cfg.minibatches):
            index = order[update * per_update: (update + 1) * per_update]
            self.optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), dtype=torch.float32)
            for mb in self._micro_batches(per_update):
                part = self._loss(batch, index[mb.start: mb.stop], weight=(mb.stop - mb.start) / per_update, sums=sums)
                part.backward()
                total += part.detach().cpu()
            for name, param in self.model.named_parameters():
                if param.grad is not None:
                    digest.update(grads_hash, name, param.grad)
                    digest.update(per_param[name], name, param.grad)
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)))
            self.optimizer.step()
            losses.append(total)
        metrics = {f"train/{k}": v / cfg.minibatches for k, v in sums.items()}
        if acfg.kl_coef == 0:
            del metrics["train/kl_loss"]
        metrics["train/loss"] = float(torch.stack(losses).mean())
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        return algo.TrainStats(metrics=metrics, losses=torch.stack(losses), grads_digest=grads_hash.hexdigest(),
                               param_grads={name: h.hexdigest() for name, h in per_param.items()})

    def _loss(self, batch: algo.TrainBatch, index: torch.Tensor, weight: float, sums: dict) -> torch.Tensor:
        """One micro-batch's share of the minibatch loss; adds its share of each metric to `sums`."""
        acfg = self.algo_config
        mask = batch.loss_mask[index]
        columns = mask.any(dim=0).nonzero()[:, 0]
        first, width = (int(columns[0]), int(columns[-1]) + 1) if len(columns) else (1, 1)
        ids = batch.tokens[index, :width].to(self.device)
        mask = mask[:, :width].to(self.device)
        # Logits only where a loss token is predicted (positions first-1 .. width-1): the LM head,
        # log-softmax and entropy then run on the response span, not on every prompt position.
        logits = self.model(input_ids=ids, logits_to_keep=width - first + 1).logits
        logp = algo.token_logprobs(logits, ids, self.temperature)
        old = batch.old_logprobs[index, :width].to(self.device)
        pg_loss, clipfrac, ppo_kl = algo.ppo_clip_loss(logp, old, batch.advantages[index].to(self.device), mask,
                                                       acfg.eps_clip, acfg.eps_clip_high)
        if acfg.entropy_coef > 0:
            entropy = algo.sample_mean(algo.token_entropy(logits, self.temperature, width), mask)
            loss = pg_loss - acfg.entropy_coef * entropy
        else:  # the metric only: no graph, so the backward skips a [n, L, vocab] entropy term times 0
            with torch.no_grad():
                entropy = algo.sample_mean(algo.token_entropy(logits, self.temperature, width), mask)
            loss = pg_loss
        kl = torch.zeros(())
        if batch.ref_logprobs is not None:
            kl = algo.sample_mean(algo.kl_penalty(logp, batch.ref_logprobs[index, :width].to(self.device),
                                                  acfg.kl_type), mask)
            loss = loss + acfg.kl_coef * kl
        for key, value in (("pg_loss", pg_loss), ("pg_clipfrac", clipfrac), ("ppo_kl", ppo_kl),
                           ("entropy_loss", entropy), ("kl_loss", kl)):
            sums[key] += float(value.detach()) * weight
        return loss * weight

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        return {name: t.to("cpu") for name, t in named_weights(self.model).items()}

    def save_checkpoint(self) -> dict[str, bytes]:
        """The checkpoint's files as bytes (the run directory writes them atomically)."""
        from safetensors.torch import save

        names = {id(p): name for name, p in self.model.named_parameters()}
        opt_tensors, opt_scalars = {}, {}
        for param, state in self.optimizer.state.items():
            name = names[id(param)]
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    opt_tensors[f"{key}/{name}"] = value.detach().cpu().contiguous()
                else:
                    opt_scalars[f"{key}/{name}"] = float(value)
        meta = {"optimizer": "AdamW", "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                       for g in self.optimizer.param_groups],
                "scalars": opt_scalars}
        return {
            "model.safetensors": save({k: v.contiguous() for k, v in self.export_hf_weights().items()}),
            "optimizer.safetensors": save(opt_tensors),
            "optimizer.json": (json.dumps(meta, sort_keys=True, indent=1) + "\n").encode(),
        }

    def load_checkpoint(self, directory: Path) -> None:
        from safetensors.torch import load_file

        load_named_(self.model, load_file(str(directory / "model.safetensors")), source=directory)
        tensors = load_file(str(directory / "optimizer.safetensors"))
        meta = json.loads((directory / "optimizer.json").read_text())
        params = dict(self.model.named_parameters())
        for key, value in {**tensors, **meta["scalars"]}.items():
            field, name = key.split("/", 1)
            state = self.optimizer.state[params[name]]
            state[field] = value.to(self.device) if torch.is_tensor(value) else torch.tensor(value)
