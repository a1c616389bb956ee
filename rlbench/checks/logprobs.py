"""`check logprobs`: the train-inference log-prob mismatch of a recorded run.

For every trained token (loss mask 1), delta = logp_trainer - logp_rollout, where logp_rollout
is what the engine reported when it sampled and logp_trainer is the trainer's log-prob of the
same token before the update: read from the recording (`old_logprobs`), or recomputed here with
the weights the engine sampled with. Those weights are known exactly for a rollout-only run
(they never change) and for a step that has a checkpoint (checkpoint s holds the weights before
step s); other steps are not recomputed, and the report says which were.

Statistics over all tokens (research.md, section 3): mean, p99 and max |delta|; K3 KL
E[exp(r) - r - 1] with r = delta; mean exp(|delta|) (NeMo-RL calls > 1.05 unhealthy); and the
k worst tokens with their step, sample, position and the text around them. Thresholds make it
a gate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlbench.errors import BadInput
from rlbench.rundir import recording
from rlbench.rundir.directory import read_run, step_name

STATS = ("mean_abs", "p99_abs", "max_abs", "k3_kl", "mean_exp_abs")
GATE_OPTIONS = {"mean_abs": "--max-mean", "p99_abs": "--max-p99", "max_abs": "--max-abs", "k3_kl": "--max-k3",
                "mean_exp_abs": "--max-exp"}


@dataclass
class WorstToken:
    step: int
    sample: int
    response_token: int
    token_id: int
    text: str
    context: str
    trainer: float
    rollout: float
    delta: float


@dataclass
class LogprobReport:
    run: str
    source: str  # "recorded" or "recomputed"
    steps: list[int]
    tokens: int
    stats: dict[str, float]
    per_step: list[dict]
    worst: list[WorstToken]
    thresholds: dict[str, float]
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def statistics(delta: torch.Tensor) -> dict[str, float]:
    delta = delta.double()
    if delta.numel() == 0:
        return {k: 0.0 for k in STATS}
    abs_delta = delta.abs()
    # numpy's quantile (linear, as torch's): torch.quantile refuses more than 2**24 values, a few steps of a run
    with np.errstate(invalid="ignore"):  # infinite deltas: inf - inf in the interpolation, p99 NaN without a warning
        p99 = float(np.quantile(abs_delta.numpy(), 0.99))
    return {
        "mean_abs": float(abs_delta.mean()),
        "p99_abs": p99,
        "max_abs": float(abs_delta.max()),
        "k3_kl": float((torch.exp(delta) - delta - 1).mean()),
        "mean_exp_abs": float(torch.exp(abs_delta).mean()),
    }


class _Recomputer:
    """Trainer log-probs with the exact weights a step sampled with, where those are known."""

    def __init__(self, run, config):
        from rlbench.core.model import build_model
        from rlbench.backends.torch_trainer import TorchTrainer

        self.run = run
        self.rollout_only = run.manifest.get("mode") == "rollout-only"
        model = build_model(config.model.path, config.seed, config.model.dtype, "cpu", init=config.model.init)
        recorded = (run.manifest.get("hashes") or {}).get("initial_weights")
        if recorded is not None:
            from rlbench.core.model import named_weights
            from rlbench.rundir.digest import weights_digest

            here = weights_digest(named_weights(model))
            if here != recorded:
                raise BadInput(f"the model's initial weights ({here[:12]}) are not the ones the run recorded "
                               f"({recorded[:12]}): another model or seed", path=config.model.path)
        self.trainer = TorchTrainer(model, config.train, config.algo, config.rollout.temperature, config.seed)
        self.true_on_policy = config.rollout.true_on_policy
        self.loaded = None

    def logprobs(self, step: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        from rlbench.core.samples import train_batch

        ckpt = self.run.root / "checkpoints" / step_name(0 if self.rollout_only else step)
        if not (ckpt / "model.safetensors").is_file():
            if not self.rollout_only:
                return None
        elif self.loaded != ckpt:
            from rlbench.core.model import load_named_, load_safetensors

            load_named_(self.trainer.model, load_safetensors(ckpt / "model.safetensors"), source=ckpt)
            self.loaded = ckpt
        batch = train_batch({**tensors, "advantages": torch.zeros(tensors["rewards"].shape)})
        rows = self.trainer.logprobs(batch.tokens, per_sample=self.true_on_policy)
        return recording.unpad(rows, tensors["offsets"])


def check_logprobs(run_dir: str | Path, top: int = 10, thresholds: dict[str, float] | None = None,
                   recompute: bool = False) -> LogprobReport:
    from rlbench.core.context import check_made_with
    from rlbench.core.model import load_tokenizer
    from rlbench.replay.replay import source_config

    thresholds = {k: v for k, v in (thresholds or {}).items() if v is not None}
    for name, limit in thresholds.items():
        if name not in GATE_OPTIONS:
            raise BadInput(f"no such statistic to gate on (one of {', '.join(STATS)})", field=name)
        if not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit >= 0):
            raise BadInput(f"expected a finite number >= 0, got {limit!r}", field=GATE_OPTIONS[name])
    run = read_run(run_dir)
    if not run.steps:
        raise BadInput("no committed step to check", path=run.root / "metrics.jsonl")
    config = source_config(run)
    check_made_with(run, tokenizer=config.model.tokenizer, model=config.model.path if recompute else None)
    recomputer = _Recomputer(run, config) if recompute else None
    try:
        tokenizer = load_tokenizer(config.model.tokenizer)
    except BadInput:
        tokenizer = None
    deltas, places, per_step, skipped = [], [], [], []
    for step in run.steps:
        tensors, _ = recording.read_step(run.root, step)
        if tokenizer is not None:
            recording.check_ids(tensors, len(tokenizer), run.root / "rollouts" / f"{step_name(step)}.safetensors",
                                "the run's tokenizer")
        if recomputer is not None:
            trainer = recomputer.logprobs(step, tensors)
        else:
            trainer = tensors.get("old_logprobs")
            if trainer is None:
                raise BadInput("the recording holds no trainer log-probs (a rollout-only or imported run); "
                               "use --recompute", path=run.root)
        if trainer is None:
            skipped.append(step)
            continue
        mask = tensors["loss_mask"].bool()
        delta = (trainer - tensors["rollout_logprobs"]).double()[mask]
        index = mask.nonzero().squeeze(-1)
        deltas.append(delta)
        places.append((step, tensors, index, trainer))
        per_step.append({"step": step, "tokens": int(delta.numel()), **statistics(delta)})
    if not deltas:
        raise BadInput("no step could be recomputed (no checkpoint holds the weights any step sampled with)",
                       path=run.root / "checkpoints")
    everything = torch.cat(deltas)
    stats = statistics(everything)
    worst = _worst(places, deltas, top, tokenizer)
    nonfinite = _nonfinite(places, deltas)
    failures = []
    for name, limit in thresholds.items():
        if not math.isfinite(stats[name]):  # a gate passes on finite numbers only
            failures.append(f"{name} is {stats[name]} ({nonfinite}): a gate passes only on finite numbers")
        elif stats[name] > limit:
            failures.append(f"{name} {stats[name]:.3g} > {limit:g}")
    notes = [f"recomputed steps {[p[0] for p in places]}; no exact weights for steps {skipped}"] if skipped else []
    if nonfinite:
        notes.append(nonfinite)
    return LogprobReport(str(run.root), "recomputed" if recompute else "recorded", [p[0] for p in places],
                         int(everything.numel()), stats, per_step, worst, thresholds, failures, notes)


def _nonfinite(places, deltas) -> str:
    """'' when every delta is finite, else how many are not and where the first one is."""
    total = sum(int((~d.isfinite()).sum()) for d in deltas)
    if not total:
        return ""
    part = next(i for i, d in enumerate(deltas) if not bool(d.isfinite().all()))
    step, tensors, index, _ = places[part]
    pos = int(index[int((~deltas[part].isfinite()).nonzero()[0])])
    offsets = tensors["offsets"]
    sample = int(torch.searchsorted(offsets, torch.tensor(pos), right=True)) - 1
    token = pos - int(offsets[sample]) - int(tensors["prompt_lengths"][sample])
    return (f"{total} non-finite log-prob deltas; the first at step {step}, sample {sample}, response token {token} "
            f"(trainer {float(places[part][3][pos])}, rollout {float(tensors['rollout_logprobs'][pos])})")


def _worst(places, deltas, top: int, tokenizer) -> list[WorstToken]:
    flat = torch.cat([d.abs() for d in deltas])
    order = torch.argsort(flat, descending=True, stable=True)[:top]
    bounds = torch.cumsum(torch.tensor([0] + [d.numel() for d in deltas]), 0)
    out = []
    for k in order.tolist():
        part = int(torch.searchsorted(bounds, torch.tensor(k), right=True)) - 1
        step, tensors, index, trainer = places[part]
        pos = int(index[k - int(bounds[part])])
        offsets = tensors["offsets"]
        sample = int(torch.searchsorted(offsets, torch.tensor(pos), right=True)) - 1
        start = int(offsets[sample])
        token_id = int(tensors["tokens"][pos])
        decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: str(ids))
        context = decode(tensors["tokens"][max(start, pos - 8): pos].tolist())
        out.append(WorstToken(step, sample, pos - start - int(tensors["prompt_lengths"][sample]), token_id,
                              decode([token_id]), context, float(trainer[pos]), float(tensors["rollout_logprobs"][pos]),
                              float(trainer[pos] - tensors["rollout_logprobs"][pos])))
    return out
