"""`check logprobs`: the train-inference log-prob mismatch of a recorded run.

For every trained token (loss mask 1), delta = logp_trainer - logp_rollout, where logp_rollout
is what the engine reported when it sampled and logp_trainer is the trainer's log-prob of the
same token before the update: read from the recording (`old_logprobs`), or recomputed here with
the weights the engine sampled with. Those weights are known exactly for a rollout-only run
(they never change) and for a step that has a checkpoint (checkpoint s holds the weights before
step s); other steps are not recomputed, and the report says which were. A sample with a recorded
top-p nucleus (imported from slime) is recomputed renormalised over it, as slime's engine reported
and slime's trainer computes it: softmax over the nucleus and the sampled id, all else masked.

Not judged, and counted in the report: samples slime removed (`remove_sample`; not trained) and
samples whose engine reported no log-probs (the recording holds 0.0 there, never a log-prob).

Statistics (research.md, section 3): `train_rollout_logprob_abs_diff`, slime's metric of that name,
a per-sample mean (each sample's mean |delta| over its judged tokens, then the mean over samples:
slime's `sum_of_sample_mean` divided by the batch's sample count; slime counts a sample without
trained tokens as 0 there, here it is left out); `token_mean_abs`, the mean over all judged tokens
(what slime's metric is under --calculate-per-token-loss; the two part on samples of unequal
lengths); p99 and max |delta|; K3 KL E[exp(r) - r - 1] with r = delta; mean
exp(|delta|) (NeMo-RL calls > 1.05 unhealthy); and the k worst tokens with their step, sample,
position and the text around them. Thresholds make it a gate.

Token ids are held to the run's vocabulary (core/vocab.py): an id the model has no logit for is bad
input; a padded id (a logit the tokenizer has no text for) is judged like any other, shown as
`<padded id N>`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlbench.core.vocab import Vocab, run_vocab
from rlbench.errors import BadInput
from rlbench.rundir import recording
from rlbench.rundir.directory import step_name

STATS = ("train_rollout_logprob_abs_diff", "token_mean_abs", "p99_abs", "max_abs", "k3_kl", "mean_exp_abs")
GATE_OPTIONS = {
    "train_rollout_logprob_abs_diff": "--max-mean",
    "token_mean_abs": "--max-token-mean",
    "p99_abs": "--max-p99",
    "max_abs": "--max-abs",
    "k3_kl": "--max-k3",
    "mean_exp_abs": "--max-exp",
}


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
    samples: int = 0  # samples judged (with at least one judged token)
    removed: int = 0  # samples slime removed (remove_sample): not trained, not judged
    without_logprobs: int = 0  # samples whose engine reported no log-probs: not judged
    top_p: int = 0  # samples recomputed over their recorded top-p nucleus
    histogram: list[int] | None = None  # |delta| per bin, when edges were given (abs_histogram)
    # An async run's (--async): the statistics of the samples of each policy lag (steps between the weights that
    # generated a sample and those that train it), lag by lag; [] for an on-policy run
    per_lag: list[dict] = field(default_factory=list)


def statistics(delta: torch.Tensor, counts: list[int] | None = None) -> dict[str, float]:
    """The statistics of `delta`, the judged tokens of samples holding `counts` of them each, in order
    (None: one sample). A sample with no judged token is left out of the per-sample mean."""
    delta = delta.double()
    if delta.numel() == 0:
        return {k: 0.0 for k in STATS}
    abs_delta = delta.abs()
    sizes = torch.tensor([c for c in (counts if counts is not None else [delta.numel()]) if c], dtype=torch.int64)
    ends = torch.cumsum(sizes, 0)
    sums = torch.cat([abs_delta.new_zeros(1), torch.cumsum(abs_delta, 0)])  # float64 running sums
    per_sample = (sums[ends] - sums[ends - sizes]) / sizes  # each judged sample's mean |delta|
    # numpy's quantile (linear, as torch's): torch.quantile refuses more than 2**24 values, a few steps of a run
    with np.errstate(invalid="ignore"):  # infinite deltas: inf - inf in the interpolation, p99 NaN without a warning
        p99 = float(np.quantile(abs_delta.numpy(), 0.99))
    return {
        "train_rollout_logprob_abs_diff": float(per_sample.mean()),
        "token_mean_abs": float(abs_delta.mean()),
        "p99_abs": p99,
        "max_abs": float(abs_delta.max()),
        "k3_kl": float((torch.exp(delta) - delta - 1).mean()),
        "mean_exp_abs": float(torch.exp(abs_delta).mean()),
    }


def nucleus_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, nuclei: Sequence[Sequence[int]], temperature: float
) -> torch.Tensor:
    """log p(target) renormalised over each row's recorded top-p nucleus and the target itself, all
    other ids masked out after the temperature: slime's trainer under --rollout-top-p < 1
    (`_build_topp_keep_mask`), which is how its engine reported them. Rows of `logits` [R, V] predict
    `targets` [R]; an empty nucleus (a tool token's) keeps the target alone, log-prob 0."""
    scaled = logits.float()
    if temperature > 0:
        scaled = scaled / temperature
    keep = torch.zeros(scaled.shape, dtype=torch.bool, device=scaled.device)
    for row, ids in enumerate(nuclei):
        keep[row, torch.as_tensor(list(ids), dtype=torch.long)] = True
    keep[torch.arange(len(targets)), targets] = True
    logp = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1)


def sample_nuclei(tensors: dict[str, torch.Tensor], start: int, end: int) -> list[list[int]]:
    """The recorded nucleus of each token in tokens[start:end] (flat positions)."""
    ids, offsets = tensors["top_p_ids"], tensors["top_p_offsets"].tolist()
    return [ids[offsets[j] : offsets[j + 1]].tolist() for j in range(start, end)]


def sequence_nucleus_logprobs(
    model, ids: torch.Tensor, prompt: int, nuclei: list[list[int]], temperature: float
) -> torch.Tensor:
    """The response log-probs of one sequence (ids[prompt:]) at batch size 1, each renormalised over
    its nucleus; a first token with no prefix to predict it gets 0, as `token_logprobs` gives it."""
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
    return response_nucleus_logprobs(logits, ids, prompt, nuclei, temperature)


def response_nucleus_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, prompt: int, nuclei: list[list[int]], temperature: float
) -> torch.Tensor:
    """`sequence_nucleus_logprobs` from the sequence's logits [L, V] (float32 [L - prompt], on the CPU)."""
    first = max(prompt, 1)
    out = torch.zeros(len(ids) - prompt, dtype=torch.float32)
    if first < len(ids):
        out[first - prompt :] = nucleus_logprobs(
            logits[first - 1 : len(ids) - 1], ids[first:].to(logits.device), nuclei[first - prompt :], temperature
        ).cpu()
    return out


def verified_model(run, config) -> torch.nn.Module:
    """The run's model as it was built (on the CPU), held to the initial weights' digest the run recorded."""
    from rlbench.core.model import build_model

    model = build_model(config.model.path, config.seed, config.model.dtype, "cpu", init=config.model.init)
    recorded = (run.manifest.get("hashes") or {}).get("initial_weights")
    if recorded is not None:
        from rlbench.core.model import named_weights
        from rlbench.rundir.digest import weights_digest

        here = weights_digest(named_weights(model))
        if here != recorded:
            raise BadInput(
                f"the model's initial weights ({here[:12]}) are not the ones the run recorded "
                f"({recorded[:12]}): another model or seed",
                path=config.model.path,
            )
    return model


class _Recomputer:
    """Trainer log-probs with the exact weights a step sampled with, where those are known."""

    def __init__(self, run, config):
        from rlbench.backends.torch_trainer import TorchTrainer

        self.run = run
        self.rollout_only = run.manifest.get("mode") == "rollout-only"
        model = verified_model(run, config)
        self.trainer = TorchTrainer(model, config.train, config.algo, config.rollout.temperature, config.seed)
        self.temperature = config.rollout.temperature
        self.true_on_policy = config.rollout.true_on_policy
        self.loaded = None

    def logprobs(self, step: int, tensors: dict[str, torch.Tensor], samples: list[dict]) -> torch.Tensor | None:
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
        flat = recording.unpad(rows, tensors["offsets"])
        offsets, prompts = tensors["offsets"].tolist(), tensors["prompt_lengths"].tolist()
        for i, sample in enumerate(samples):
            if sample.get("top_p"):
                a, b = offsets[i], offsets[i + 1]
                nuclei = sample_nuclei(tensors, a + prompts[i], b)
                flat[a + prompts[i] : b] = sequence_nucleus_logprobs(
                    self.trainer.model, tensors["tokens"][a:b], prompts[i], nuclei, self.temperature
                )
        return flat


def judged_samples(samples: list[dict]) -> tuple[list[bool], int, int]:
    """Which samples a check judges, and how many it leaves out as removed (slime's remove_sample) and as
    without engine log-probs (has_rollout_logprobs false): the recording's 0.0 there is no log-prob."""
    removed = [bool(s.get("remove_sample")) for s in samples]
    without = [s.get("has_rollout_logprobs") is False for s in samples]
    return (
        [not r and not w for r, w in zip(removed, without)],
        sum(removed),
        sum(w and not r for r, w in zip(removed, without)),
    )


def _gates(stats: dict[str, float], thresholds: dict[str, float], nonfinite: str) -> list[str]:
    failures = []
    for name, limit in thresholds.items():
        if not math.isfinite(stats[name]):  # a gate passes on finite numbers only
            failures.append(f"{name} is {stats[name]} ({nonfinite}): a gate passes only on finite numbers")
        elif stats[name] > limit:
            failures.append(f"{name} {stats[name]:.3g} > {limit:g}")
    return failures


def _check_thresholds(thresholds: dict[str, float | None] | None) -> dict[str, float]:
    thresholds = {k: v for k, v in (thresholds or {}).items() if v is not None}
    for name, limit in thresholds.items():
        if name not in GATE_OPTIONS:
            raise BadInput(f"no such statistic to gate on (one of {', '.join(STATS)})", field=name)
        if not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit >= 0):
            raise BadInput(f"expected a finite number >= 0, got {limit!r}", field=GATE_OPTIONS[name])
    return thresholds


def check_logprobs(
    run_dir: str | Path,
    top: int = 10,
    thresholds: dict[str, float] | None = None,
    recompute: bool = False,
    edges: Sequence[float] | None = None,
    steps: Sequence[int] | None = None,
    per_step: bool = True,
) -> LogprobReport:
    """Every judged token's |trainer - rollout| log-prob over the run (or over `steps`, a subset of its
    committed steps), read a step at a time: statistics (overall, and per step unless `per_step` is
    false), the `top` worst tokens in their context, the gates, and with `edges` a histogram of |delta|
    (`abs_histogram`)."""
    from rlbench.core.context import check_made_with
    from rlbench.core.model import load_tokenizer
    from rlbench.replay.replay import source_config

    thresholds = _check_thresholds(thresholds)
    from rlbench.replay.integrity import open_run

    run = open_run(
        run_dir,
        recordings="verify",
        checkpoints="verify" if recompute else "present",  # --recompute loads them
        need_steps=True,
        need_recordings=True,
    ).run
    config = source_config(run)
    check_made_with(run, tokenizer=config.model.tokenizer, model=config.model.path if recompute else None)
    recomputer = _Recomputer(run, config) if recompute else None
    try:
        tokenizer = load_tokenizer(config.model.tokenizer)
    except BadInput:
        tokenizer = None
    vocab = run_vocab(run.manifest, run.root / "manifest.json", tokenizer)
    deltas, counts, candidates, rows, skipped, nonfinite, critic_only = [], [], [], [], [], None, []
    by_lag: dict[int, tuple[list, list]] = {}
    left_out = {"removed": 0, "without_logprobs": 0, "top_p": 0}
    wanted = run.steps if steps is None else [s for s in run.steps if s in set(steps)]
    if not wanted:
        raise BadInput(
            f"undetermined: none of the steps asked for is committed (the run committed {len(run.steps)})",
            field="--steps",
        )
    for step in wanted:
        tensors, meta = recording.read_step(run.root, step)
        if vocab is not None:
            vocab.check(tensors, run.root / "rollouts" / f"{step_name(step)}.safetensors")
        if recomputer is not None:
            trainer = recomputer.logprobs(step, tensors, meta["samples"])
        else:
            trainer = tensors.get("old_logprobs")
            # a run whose stages record them lacks them only on PPO's critic-only steps (the others are held to
            # their checksums as they are read: replay/integrity.py)
            if trainer is None and "old_logprobs" in run.checksum_keys:
                critic_only.append(step)
                continue
            if trainer is None:
                raise BadInput(
                    "the recording holds no trainer log-probs (a rollout-only or imported run); use --recompute",
                    path=run.root,
                )
        if trainer is None:
            skipped.append(step)
            continue
        judged, removed, without = judged_samples(meta["samples"])
        left_out["removed"] += removed
        left_out["without_logprobs"] += without
        left_out["top_p"] += sum(bool(s.get("top_p")) for s in meta["samples"]) if recomputer is not None else 0
        offsets = tensors["offsets"]
        mask = tensors["loss_mask"].bool()
        for i in (i for i, ok in enumerate(judged) if not ok):
            mask[int(offsets[i]) : int(offsets[i + 1])] = False
        delta = (trainer - tensors["rollout_logprobs"]).double()[mask]
        running = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(mask, 0)])
        step_counts = (running[offsets[1:]] - running[offsets[:-1]]).tolist()
        index = mask.nonzero().squeeze(-1)
        deltas.append(delta)
        counts.append(step_counts)
        _by_lag(by_lag, meta["samples"], delta, step_counts)
        candidates += _candidates(step, tensors, index, trainer, delta, top)
        if nonfinite is None and not bool(delta.isfinite().all()):
            nonfinite = (step, tensors, index, trainer, delta)
        rows.append(
            {
                "step": step,
                "tokens": int(delta.numel()),
                "samples": sum(c > 0 for c in step_counts),
                **(statistics(delta, step_counts) if per_step else {}),
            }
        )
    if not deltas and critic_only:
        raise BadInput(
            f"undetermined: steps {critic_only} are PPO's critic-only steps, where the actor computes no log-probs "
            "(--recompute computes them)",
            path=run.root,
        )
    if not deltas:
        raise BadInput(
            "no step could be recomputed (no checkpoint holds the weights any step sampled with)",
            path=run.root / "checkpoints",
        )
    everything = torch.cat(deltas)
    if not everything.numel():
        raise BadInput(
            f"undetermined: no trained token with engine log-probs to judge ({left_out['removed']} samples "
            f"removed, {left_out['without_logprobs']} without engine log-probs)",
            path=run.root,
        )
    all_counts = [c for step_counts in counts for c in step_counts]
    stats = statistics(everything, all_counts)
    worst = _worst(candidates, top, tokenizer, vocab)
    first_nonfinite = _nonfinite(nonfinite, int((~everything.isfinite()).sum()))
    notes = (
        [f"recomputed steps {[row['step'] for row in rows]}; no exact weights for steps {skipped}"] if skipped else []
    )
    if critic_only:
        notes.append(f"steps {critic_only} not judged: PPO's critic-only steps, where the actor computes no log-probs")
    notes += _left_out_notes(left_out)
    if first_nonfinite:
        notes.append(first_nonfinite)
    histogram = None
    if edges is not None:
        histogram = abs_histogram(everything, edges)
    return LogprobReport(
        str(run.root),
        "recomputed" if recompute else "recorded",
        [row["step"] for row in rows],
        int(everything.numel()),
        stats,
        rows,
        worst,
        thresholds,
        _gates(stats, thresholds, first_nonfinite),
        notes,
        sum(c > 0 for c in all_counts),
        **left_out,
        histogram=histogram,
        per_lag=[
            {"lag": lag, "tokens": sum(c), "samples": sum(n > 0 for n in c), **statistics(torch.cat(d), c)}
            for lag, (d, c) in sorted(by_lag.items())
        ],
    )


def _by_lag(by_lag: dict, samples: list[dict], delta: torch.Tensor, counts: list[int]) -> None:
    """Each judged sample's deltas under its policy lag (its recorded `async.lag`), where the run records one."""
    lags = [(s.get("async") or {}).get("lag") for s in samples]
    if all(lag is None for lag in lags):
        return
    for lag, piece, n in zip(lags, torch.split(delta, counts), counts):
        if n:
            pieces, sizes = by_lag.setdefault(lag, ([], []))
            pieces.append(piece)
            sizes.append(n)


def abs_histogram(delta: torch.Tensor, edges: Sequence[float]) -> list[int]:
    """Counts of |delta| per bin: exactly 0, then (edges[i], edges[i+1]] for the ascending positive `edges`
    (the first bin (0, edges[0]]), then above the last edge; not-finite deltas count in the last bin."""
    magnitude = delta.double().abs()
    finite = magnitude[magnitude.isfinite()]
    positive = finite[finite > 0]
    bins = torch.bucketize(positive, torch.tensor(list(edges), dtype=torch.float64))
    counts = torch.bincount(bins, minlength=len(edges) + 1).tolist()
    counts[-1] += int(magnitude.numel() - finite.numel())
    return [int((finite == 0).sum())] + counts


def _left_out_notes(left_out: dict[str, int]) -> list[str]:
    notes = []
    if left_out["removed"]:
        notes.append(f"{left_out['removed']} samples removed by slime (remove_sample): not trained, not judged")
    if left_out["without_logprobs"]:
        notes.append(f"{left_out['without_logprobs']} samples without engine log-probs: not judged")
    if left_out["top_p"]:
        notes.append(f"{left_out['top_p']} samples recomputed over their recorded top-p nucleus")
    return notes


def _nonfinite(first, total: int) -> str:
    """'' when every delta is finite, else how many are not and where the first one is."""
    if not total:
        return ""
    step, tensors, index, trainer, delta = first
    pos = int(index[int((~delta.isfinite()).nonzero()[0])])
    offsets = tensors["offsets"]
    sample = int(torch.searchsorted(offsets, torch.tensor(pos), right=True)) - 1
    token = pos - int(offsets[sample]) - int(tensors["prompt_lengths"][sample])
    return (
        f"{total} non-finite log-prob deltas; the first at step {step}, sample {sample}, response token {token} "
        f"(trainer {float(trainer[pos])}, rollout {float(tensors['rollout_logprobs'][pos])})"
    )


def _candidates(
    step: int, tensors: dict, index: torch.Tensor, trainer: torch.Tensor, delta: torch.Tensor, top: int
) -> list[tuple]:
    """This step's `top` largest |delta| (ties: the earlier token first), each as (|delta|, step, sample,
    response token, token id, the 8 ids before it, trainer, rollout): the run's worst tokens are the
    largest of these, so no step's tensors outlive its turn, and only those are decoded."""
    order = torch.argsort(delta.abs(), descending=True, stable=True)[:top]
    offsets = tensors["offsets"]
    out = []
    for k in order.tolist():
        pos = int(index[k])
        sample = int(torch.searchsorted(offsets, torch.tensor(pos), right=True)) - 1
        start = int(offsets[sample])
        out.append(
            (
                float(delta[k].abs()),
                step,
                sample,
                pos - start - int(tensors["prompt_lengths"][sample]),
                int(tensors["tokens"][pos]),
                tensors["tokens"][max(start, pos - 8) : pos].tolist(),
                float(trainer[pos]),
                float(tensors["rollout_logprobs"][pos]),
            )
        )
    return out


def _worst(candidates: list[tuple], top: int, tokenizer, vocab: Vocab | None) -> list[WorstToken]:
    """The `top` largest |delta| of the run, in step and token order among equals (NaN first, as argsort);
    a padded id (no text: core/vocab.py) shows as `<padded id N>`."""
    order = torch.argsort(torch.tensor([c[0] for c in candidates], dtype=torch.float64), descending=True, stable=True)[
        :top
    ]
    # no vocabulary only without a tokenizer (run_vocab): the ids as they are
    decode = (lambda ids: vocab.text(tokenizer, ids)) if vocab is not None else (lambda ids: str(ids))
    out = []
    for k in order.tolist():
        _, step, sample, token, token_id, context, trainer, rollout = candidates[k]
        out.append(
            WorstToken(
                step,
                sample,
                token,
                token_id,
                decode([token_id]),
                decode(context),
                trainer,
                rollout,
                float(torch.tensor(trainer) - torch.tensor(rollout)),
            )
        )
    return out
