"""diff: the first (step, stage) where two runs part, and where inside it and by how much.

Exact mode walks the steps both runs committed, stages in loop order, and stops at the first
checksum that differs. It then opens both sides' recordings at that step and localises the
difference: the sample and token (tokens, log-probs), the sample (rewards, advantages), the
minibatch (loss), the parameter (grads, weights, from per-parameter digests; values from
checkpoints when both have one after that step). With a tolerance (`atol`, `rtol`), checksums
cannot decide, so recorded values are compared numerically, |a - b| <= atol + rtol * |b|, and
stages without recorded values (grads, weights) fall back to the metrics that summarise them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlbench.core.context import STAGE_CHECKSUMS
from rlbench.errors import BadInput
from rlbench.rundir import recording
from rlbench.rundir.directory import RunDir, read_run, step_name

TOKEN_STAGES = {"rollout_tokens": "tokens", "rollout_logprobs": "rollout_logprobs", "old_logprobs": "old_logprobs"}
SAMPLE_STAGES = {"rewards": "rewards", "advantages": "advantages"}
# Stages with no recorded values: in tolerance mode their metric speaks for them. Stages with recorded
# values are compared on those values only: their metric is a mean of them, and a mean of signed
# values (the per-minibatch PPO losses) can cancel to near 0, where a relative tolerance means nothing.
METRIC_OF_STAGE = {"grads": "train/grad_norm", "weights": "train/grad_norm"}


@dataclass
class Difference:
    step: int
    stage: str
    where: str  # "sample 3, token 17 (response token 2)", "parameter model.layers.0.mlp.up_proj.weight", ...
    a: object = None
    b: object = None
    max_abs: float | None = None
    count: int | None = None  # how many values differ
    notes: list[str] = field(default_factory=list)


@dataclass
class DiffResult:
    a: str
    b: str
    steps_compared: list[int]
    stages_compared: list[str]
    tolerance: tuple[float, float] | None
    first: Difference | None
    metrics_around: list[dict]  # [{"step", "metric", "a", "b"}] near the difference
    notes: list[str] = field(default_factory=list)


def _load(run: RunDir, step: int) -> tuple[dict[str, torch.Tensor], dict] | None:
    try:
        return recording.read_step(run.root, step)
    except BadInput:
        return None


def _token_place(t: dict[str, torch.Tensor], flat_index: int) -> str:
    offsets = t["offsets"]
    sample = int(torch.searchsorted(offsets, torch.tensor(flat_index), right=True)) - 1
    within = flat_index - int(offsets[sample])
    prompt = int(t["prompt_lengths"][sample])
    part = f"response token {within - prompt}" if within >= prompt else "prompt"
    return f"sample {sample}, token {within} ({part})"


def _close(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float] | None) -> torch.Tensor:
    if tol is None or not (a.is_floating_point() or b.is_floating_point()):
        return a == b
    atol, rtol = tol
    return (a.double() - b.double()).abs() <= atol + rtol * b.double().abs()


def _compare_flat(step: int, stage: str, key: str, ta: dict, tb: dict, tol) -> Difference | None:
    """Locate the first differing value of a token- or sample-aligned tensor."""
    a, b = ta.get(key), tb.get(key)
    if a is None or b is None:
        return None
    if key == "tokens" and not torch.equal(ta["offsets"], tb["offsets"]):
        lengths_a, lengths_b = ta["offsets"].diff(), tb["offsets"].diff()
        n = min(len(lengths_a), len(lengths_b))
        sample = next((i for i in range(n) if lengths_a[i] != lengths_b[i]), n)
        if sample < n:  # same samples, other lengths: compare that sample's tokens
            sa = a[int(ta["offsets"][sample]): int(ta["offsets"][sample + 1])]
            sb = b[int(tb["offsets"][sample]): int(tb["offsets"][sample + 1])]
            m = min(len(sa), len(sb))
            token = next((i for i in range(m) if sa[i] != sb[i]), m)
            prompt = int(ta["prompt_lengths"][sample])
            return Difference(step, stage, f"sample {sample}, token {token} (response token {token - prompt}); "
                              f"lengths {len(sa)} vs {len(sb)}",
                              sa[token].item() if token < len(sa) else "(end)",
                              sb[token].item() if token < len(sb) else "(end)")
        return Difference(step, stage, f"sample count {len(lengths_a)} vs {len(lengths_b)}")
    if a.shape != b.shape:
        return Difference(step, stage, f"tensor '{key}' shape {tuple(a.shape)} vs {tuple(b.shape)}")
    same = _close(a, b, tol)
    if bool(same.all()):
        return None
    first = int((~same).nonzero()[0])
    delta = (a.double() - b.double()).abs()
    worst = int(delta.argmax())
    where = _token_place(ta, first) if key in TOKEN_STAGES.values() else f"sample {first}"
    diff = Difference(step, stage, where, a[first].item(), b[first].item(), float(delta.max()), int((~same).sum()))
    if worst != first:
        place = _token_place(ta, worst) if key in TOKEN_STAGES.values() else f"sample {worst}"
        diff.notes.append(f"largest difference at {place}: {a[worst].item()!r} vs {b[worst].item()!r}")
    return diff


def _compare_params(run_a: RunDir, run_b: RunDir, step: int, stage: str, ma: dict, mb: dict) -> Difference:
    kind = "grads" if stage == "grads" else "weights"
    da = ma.get("param_digests", {}).get(kind, {})
    db = mb.get("param_digests", {}).get(kind, {})
    differing = [name for name in da if da.get(name) != db.get(name)]
    if not da or not db:
        return Difference(step, stage, "no per-parameter digests recorded")
    result = Difference(step, stage, f"parameter {differing[0]}" if differing else "no parameter differs",
                        count=len(differing))
    if len(differing) > 1:
        result.notes.append(f"{len(differing)} parameters differ: {', '.join(differing[:5])}"
                            f"{', ...' if len(differing) > 5 else ''}")
    ca = run_a.root / "checkpoints" / step_name(step + 1) / "model.safetensors"
    cb = run_b.root / "checkpoints" / step_name(step + 1) / "model.safetensors"
    if differing and ca.is_file() and cb.is_file():
        from safetensors.torch import load_file

        wa, wb = load_file(str(ca)), load_file(str(cb))
        name = differing[0]
        delta = (wa[name].double() - wb[name].double()).abs()
        result.max_abs = float(delta.max())
        result.notes.append(f"weights after step {step}: {name} max |delta| {result.max_abs:.3e} at flat index "
                            f"{int(delta.argmax())}")
    return result


def _stage_difference(run_a: RunDir, run_b: RunDir, step: int, stage: str, tol) -> Difference | None:
    """Look inside one stage of one step; None when it agrees (within tolerance)."""
    la, lb = _load(run_a, step), _load(run_b, step)
    if la is None or lb is None:
        return Difference(step, stage, "no readable recording at this step on "
                          f"{'both sides' if la is None and lb is None else ('A' if la is None else 'B')}")
    (ta, ma), (tb, mb) = la, lb
    if stage == "data":
        return _compare_flat(step, stage, "prompt_index", ta, tb, None)
    if stage in TOKEN_STAGES:
        found = _compare_flat(step, stage, TOKEN_STAGES[stage], ta, tb, tol if stage != "rollout_tokens" else None)
        if found is None and stage == "rollout_tokens":
            found = _compare_flat(step, stage, "loss_mask", ta, tb, None)
        return found
    if stage in SAMPLE_STAGES:
        return _compare_flat(step, stage, SAMPLE_STAGES[stage], ta, tb, tol)
    if stage == "loss":
        found = _compare_flat(step, stage, "losses", ta, tb, tol)
        if found is not None:
            found.where = found.where.replace("sample", "minibatch")
        return found
    if stage in ("grads", "weights"):
        return _compare_params(run_a, run_b, step, stage, ma, mb) if tol is None else None
    if stage == "engine_weights":  # no values recorded: only the checksum speaks
        return Difference(step, stage, "engine weights differ while the trainer's agree: the sync stage") \
            if tol is None else None
    return Difference(step, stage, "differs")


def _metrics_around(run_a: RunDir, run_b: RunDir, step: int, radius: int = 2) -> list[dict]:
    rows_a = {r["step"]: r for r in run_a.metrics}
    rows_b = {r["step"]: r for r in run_b.metrics}
    out = []
    for s in range(step - radius, step + radius + 1):
        if s in rows_a and s in rows_b:
            for key in sorted(set(rows_a[s]) & set(rows_b[s])):
                shown = rows_a[s][key] != rows_b[s][key] or key in ("rollout/raw_reward", "train/loss")
                if key != "step" and not key.startswith("perf/") and shown:
                    out.append({"step": s, "metric": key, "a": rows_a[s][key], "b": rows_b[s][key]})
    return out


def diff(a: str | Path, b: str | Path, atol: float | None = None, rtol: float | None = None) -> DiffResult:
    run_a, run_b = read_run(a), read_run(b)
    tol = None if atol is None and rtol is None else (atol or 0.0, rtol or 0.0)
    sums_a = {row["step"]: row for row in run_a.checksums}
    sums_b = {row["step"]: row for row in run_b.checksums}
    steps = sorted(set(sums_a) & set(sums_b))
    stages = [s for s in STAGE_CHECKSUMS if any(s in sums_a[t] and s in sums_b[t] for t in steps)]
    notes = run_a.notes + run_b.notes
    if set(sums_a) != set(sums_b):
        notes.append(f"steps committed: A {len(sums_a)}, B {len(sums_b)}; compared the {len(steps)} both have")
    first = None
    for step in steps:
        for stage in stages:
            if stage not in sums_a[step] or stage not in sums_b[step]:
                continue
            if tol is None:
                if sums_a[step][stage] != sums_b[step][stage]:
                    first = _stage_difference(run_a, run_b, step, stage, None)
            else:
                first = _stage_difference(run_a, run_b, step, stage, tol)
                if first is None and stage in METRIC_OF_STAGE:
                    first = _metric_difference(run_a, run_b, step, stage, tol)
            if first is not None:
                break
        if first is not None:
            break
    around = _metrics_around(run_a, run_b, first.step) if first is not None else []
    return DiffResult(str(run_a.root), str(run_b.root), steps, stages, tol, first, around, notes)


def _metric_difference(run_a: RunDir, run_b: RunDir, step: int, stage: str, tol) -> Difference | None:
    key = METRIC_OF_STAGE[stage]
    va = next((r.get(key) for r in run_a.metrics if r["step"] == step), None)
    vb = next((r.get(key) for r in run_b.metrics if r["step"] == step), None)
    if va is None or vb is None:
        return None
    if bool(_close(torch.tensor(va, dtype=torch.float64), torch.tensor(vb, dtype=torch.float64), tol)):
        return None
    return Difference(step, stage, f"metric {key}", va, vb, abs(va - vb), 1)
