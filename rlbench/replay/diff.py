"""diff: the first (step, stage) where two runs part, and where inside it and by how much.

Exact mode walks the steps both runs committed, stages in loop order, and stops at the first
checksum that differs. It then opens both sides' recordings at that step and localises the
difference: the sample and token (tokens, log-probs), the sample (rewards, advantages), the
minibatch (loss), the parameter (grads, weights, from per-parameter digests; values from
checkpoints when both have one after that step). With a tolerance (`atol`, `rtol`), checksums
cannot decide, so recorded values are compared numerically, |a - b| <= atol + rtol * |b|, and
stages without recorded values (grads, weights) fall back to the metrics that summarise them.

"No difference" speaks for everything: both sides must have a checksum for every stage of every
committed step, every recording is read and verified against its own digest and its run's
checksums before anything is compared (a corrupt or edited file is bad input, exit 2, never a
verdict), every committed checkpoint is held to the checksums its run recorded for it (checkpoints.py),
and both sides must have committed the same steps. The result counts what was compared and verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

import math

from rlbench.errors import BadInput
from rlbench.replay.integrity import open_run
from rlbench.replay.diff_extra import (
    schedule_difference,
    schedules_recorded,
    train_fields_difference,
    version_difference,
)
from rlbench.rundir import recording
from rlbench.replay.diff_layout import NOISE_GAP, ROUNDED_STAGES, layout_advice  # noqa: F401 (diff's names)
from rlbench.rundir.directory import CHECKSUM_KEYS, RunDir, step_name

TOKEN_STAGES = {
    "rollout_tokens": "tokens",
    "rollout_logprobs": "rollout_logprobs",
    "values": "values",  # PPO's critic
    "old_logprobs": "old_logprobs",
}
TOKEN_KEYS = (*TOKEN_STAGES.values(), "token_advantages", "returns")  # token-aligned: placed by sample and token
SAMPLE_STAGES = {"rewards": "rewards", "advantages": "advantages"}
# Stages with no recorded values: in tolerance mode their metric speaks for them. Stages with recorded
# values are compared on those values only: their metric is a mean of them, and a mean of signed
# values (the per-minibatch PPO losses) can cancel to near 0, where a relative tolerance means nothing.
METRIC_OF_STAGE = {
    "grads": "train/grad_norm",
    "weights": "train/grad_norm",
    "critic_grads": "train/critic-grad_norm",
    "critic_weights": "train/critic-grad_norm",
}


@dataclass
class Difference:
    step: int
    stage: str
    where: str  # "sample 3, token 17 (response token 2)", "parameter model.layers.0.mlp.up_proj.weight", ...
    a: object = None
    b: object = None
    max_abs: float | None = None
    count: int | None = None  # how many values differ
    max_rel: float | None = None  # the largest |a - b| / max(|a|, |b|) among them, where values were compared
    notes: list[str] = field(default_factory=list)


@dataclass
class DiffResult:
    a: str
    b: str
    steps_compared: list[int]
    stages_compared: list[str]  # the stages both runs record
    tolerance: tuple[float, float] | None
    first: Difference | None
    metrics_around: list[dict]  # [{"step", "metric", "a", "b"}] near the difference
    notes: list[str] = field(default_factory=list)
    comparisons: int = 0  # (step, stage) pairs compared before the verdict
    stages_only: dict[str, list[str]] = field(default_factory=dict)  # {"A": [...], "B": [...]}: not comparable
    recordings_verified: dict[str, int] = field(default_factory=dict)  # {"A": steps, "B": steps}
    checkpoints_verified: dict[str, list[int]] = field(default_factory=dict)  # {"A": [steps done, ...], "B": ...}
    advice: str | None = None  # what to run next, where the difference may be rounding (layout_advice)
    schedules_compared: int = 0  # steps whose training schedules (imported slime DP shards) were compared
    train_fields_compared: int = 0  # values of imported train dumps' other fields (kl, returns, ...) compared
    versions_compared: int = 0  # samples whose generating weights version both runs record, compared
    # With a tolerance: each value stage's largest |a - b| over every step compared ({stage: {"step", "where",
    # "max_abs", "max_rel"}}), whether or not it is within the tolerance; a stage equal bit for bit is left out.
    largest: dict[str, dict] = field(default_factory=dict)


def _load(run: RunDir, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    return recording.read_step(run.root, step)  # verified up front: any defect was reported before this


def _token_place(t: dict[str, torch.Tensor], flat_index: int) -> str:
    offsets = t["offsets"]
    sample = int(torch.searchsorted(offsets, torch.tensor(flat_index), right=True)) - 1
    within = flat_index - int(offsets[sample])
    prompt = int(t["prompt_lengths"][sample])
    part = f"response token {within - prompt}" if within >= prompt else "prompt"
    return f"sample {sample}, token {within} ({part})"


def _close(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float] | None) -> torch.Tensor:
    """Equal values always agree (0.0 and 0.0 with rtol=inf too), NaN agrees only with NaN; else within
    atol + rtol * |b| (an infinite tolerance admits every finite difference)."""
    if not (a.is_floating_point() or b.is_floating_point()):
        return a == b
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    if tol is None:
        return same
    atol, rtol = tol
    bound = atol + torch.where(b == 0, torch.zeros_like(b), rtol * b.abs())
    return same | ((a - b).abs() <= bound)


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
            sa = a[int(ta["offsets"][sample]) : int(ta["offsets"][sample + 1])]
            sb = b[int(tb["offsets"][sample]) : int(tb["offsets"][sample + 1])]
            m = min(len(sa), len(sb))
            token = next((i for i in range(m) if sa[i] != sb[i]), m)
            prompt = int(ta["prompt_lengths"][sample])
            part = f"response token {token - prompt}" if token >= prompt else "prompt"
            return Difference(
                step,
                stage,
                f"sample {sample}, token {token} ({part}); lengths {len(sa)} vs {len(sb)}",
                sa[token].item() if token < len(sa) else "(end)",
                sb[token].item() if token < len(sb) else "(end)",
            )
        return Difference(step, stage, f"sample count {len(lengths_a)} vs {len(lengths_b)}")
    if a.shape != b.shape:
        return Difference(step, stage, f"tensor '{key}' shape {tuple(a.shape)} vs {tuple(b.shape)}")
    same = _close(a, b, tol)
    if bool(same.all()):
        return None
    first = int((~same).nonzero()[0])
    delta = (a.double() - b.double()).abs()
    worst = int(delta.argmax())
    where = _token_place(ta, first) if key in TOKEN_KEYS else f"sample {first}"
    diff = Difference(
        step,
        stage,
        where,
        a[first].item(),
        b[first].item(),
        float(delta.max()),
        int((~same).sum()),
        _max_rel(a[~same], b[~same]) if a.is_floating_point() else None,
    )
    if worst != first:
        place = _token_place(ta, worst) if key in TOKEN_KEYS else f"sample {worst}"
        diff.notes.append(f"largest difference at {place}: {a[worst].item()!r} vs {b[worst].item()!r}")
    return diff


def _compare_params(run_a: RunDir, run_b: RunDir, step: int, stage: str, ma: dict, mb: dict) -> Difference:
    critic = stage.startswith("critic_")  # PPO's critic: its own digests and checkpoint files
    kind = "grads" if stage.endswith("grads") else "weights"
    record = "critic_param_digests" if critic else "param_digests"
    da = ma.get(record, {}).get(kind, {})
    db = mb.get(record, {}).get(kind, {})
    differing = [name for name in da if da.get(name) != db.get(name)]
    if not da or not db:
        return Difference(step, stage, "no per-parameter digests recorded")
    result = Difference(
        step, stage, f"parameter {differing[0]}" if differing else "no parameter differs", count=len(differing)
    )
    if len(differing) > 1:
        result.notes.append(
            f"{len(differing)} parameters differ: {', '.join(differing[:5])}{', ...' if len(differing) > 5 else ''}"
        )
    file = "critic/model.safetensors" if critic else "model.safetensors"
    ca = run_a.root / "checkpoints" / step_name(step + 1) / file
    cb = run_b.root / "checkpoints" / step_name(step + 1) / file
    if differing and ca.is_file() and cb.is_file():
        from rlbench.core.model import load_safetensors

        wa, wb = load_safetensors(ca), load_safetensors(cb)
        name = differing[0]
        delta = (wa[name].double() - wb[name].double()).abs()
        result.max_abs = float(delta.max())
        result.notes.append(
            f"weights after step {step}: {name} max |delta| {result.max_abs:.3e} at flat index {int(delta.argmax())}"
        )
    return result


def _stage_difference(run_a: RunDir, run_b: RunDir, step: int, stage: str, tol) -> Difference | None:
    """Look inside one stage of one step; None when it agrees (within tolerance)."""
    missing = [
        side for side, run in (("A", run_a), ("B", run_b)) if run.manifest.get("config", {}).get("record") is False
    ]
    if missing:  # checksums differ and values were not recorded: a summarising metric, or the stage alone
        if tol is not None and stage in METRIC_OF_STAGE:
            return None
        return Difference(step, stage, f"checksums differ; {' and '.join(missing)} recorded no values (--no-record)")
    (ta, ma), (tb, mb) = _load(run_a, step), _load(run_b, step)
    if stage == "data":
        return _compare_flat(step, stage, "prompt_index", ta, tb, None)
    if stage in TOKEN_STAGES:
        found = _compare_flat(step, stage, TOKEN_STAGES[stage], ta, tb, tol if stage != "rollout_tokens" else None)
        if found is None and stage == "rollout_tokens":
            found = _compare_flat(step, stage, "loss_mask", ta, tb, None)
        return found
    if stage == "advantages" and "token_advantages" in ta:  # PPO: per token, then the returns
        found = _compare_flat(step, stage, "token_advantages", ta, tb, tol)
        return found if found is not None else _compare_flat(step, stage, "returns", ta, tb, tol)
    if stage in SAMPLE_STAGES:
        return _compare_flat(step, stage, SAMPLE_STAGES[stage], ta, tb, tol)
    if stage in ("loss", "critic_loss"):
        found = _compare_flat(step, stage, VALUE_STAGES[stage], ta, tb, tol)
        if found is not None:
            found.where = found.where.replace("sample", "minibatch")
            found.notes = [note.replace("at sample", "at minibatch") for note in found.notes]
        return found
    if stage in ("grads", "weights", "critic_grads", "critic_weights"):
        return _compare_params(run_a, run_b, step, stage, ma, mb) if tol is None else None
    if stage == "engine_weights":  # no values recorded: only the checksum speaks
        return (
            Difference(step, stage, "engine weights differ while the trainer's agree: the sync stage")
            if tol is None
            else None
        )
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


def _tolerance(atol: float | None, rtol: float | None) -> tuple[float, float] | None:
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and (math.isnan(value) or value < 0):
            raise BadInput(f"expected a number >= 0, got {value!r}", field=name)
    return None if atol is None and rtol is None else (atol or 0.0, rtol or 0.0)


def _span(text: str, run_a: RunDir, run_b: RunDir) -> range:
    """--steps A:B: the steps both runs must have committed, and the only ones compared."""
    head, sep, tail = text.partition(":")
    try:
        first, last = int(head or 0), int(tail) if tail else min(len(run_a.steps), len(run_b.steps))
    except ValueError:
        first, last, sep = 0, 0, ""
    if not sep or not 0 <= first < last:
        raise BadInput(f"expected A:B with 0 <= A < B, got {text!r}", field="--steps")
    for side, run in (("A", run_a), ("B", run_b)):
        missing = [s for s in range(first, last) if s not in set(run.steps)]
        if missing:
            raise BadInput(
                f"{side} has not committed step(s) {missing[0]}..{missing[-1]} of {first}..{last - 1}",
                path=run.root / "metrics.jsonl",
                field="--steps",
            )
    return range(first, last)


# The stages a training schedule (DP layout, micro-batches) can change: where a different one is named first.
TRAIN_SIDE = CHECKSUM_KEYS[CHECKSUM_KEYS.index("values") :]  # values .. engine_weights


def diff(
    a: str | Path, b: str | Path, atol: float | None = None, rtol: float | None = None, steps: str | None = None
) -> DiffResult:
    """The first difference between runs A and B (None: none), over every step both committed, or over
    `steps` ("A:B") only; every other step either side committed makes them differ."""
    tol = _tolerance(atol, rtol)
    # Before --steps narrows the checksums: each run is verified whole, every recording and checkpoint held to its
    # run's own checksums (integrity.py). A damaged one is bad input (exit 2), not a difference (exit 1): its own
    # run's checksums expose it, whatever the other run holds.
    opened = {
        side: open_run(path, recordings="verify", checkpoints="verify", need_steps=False, need_recordings=False)
        for side, path in (("A", a), ("B", b))
    }
    run_a, run_b = opened["A"].run, opened["B"].run
    if not run_a.steps and not run_b.steps:
        raise BadInput("neither run has a committed step: nothing to compare", path=run_a.root / "metrics.jsonl")
    if steps is not None:
        span = _span(steps, run_a, run_b)
        for run in (run_a, run_b):
            run.metrics = [r for r in run.metrics if r["step"] in span]
            run.checksums = [r for r in run.checksums if r["step"] in span]
    verified = {side: o.recordings for side, o in opened.items()}
    sums_a = {row["step"]: row for row in run_a.checksums}
    sums_b = {row["step"]: row for row in run_b.checksums}
    keys_a, keys_b = run_a.checksum_keys, run_b.checksum_keys
    stages = [k for k in CHECKSUM_KEYS if k in keys_a and k in keys_b]
    only = {"A": [k for k in keys_a if k not in keys_b], "B": [k for k in keys_b if k not in keys_a]}
    steps = sorted(set(sums_a) & set(sums_b))
    notes = opened["A"].notes + opened["B"].notes
    notes += [
        f"{side} recorded no values (--no-record): its checksums were compared, not verified against recordings"
        for side, count in verified.items()
        if count == 0
    ]
    notes += [
        f"{side}: the rollout dumps' other sample fields (kept in each sample's `slime` metadata: its metadata, "
        "fields slime's Sample does not declare) are not compared"
        for side, run in (("A", run_a), ("B", run_b))
        if (run.manifest.get("imported") or {}).get("rollout_ids") is not None
    ]
    if not stages:
        raise BadInput(
            f"the runs share no stage (A: {', '.join(keys_a)}; B: {', '.join(keys_b)}): nothing to compare",
            path=run_b.root / "manifest.json",
            field="stages",
        )
    first, comparisons = None, 0
    schedules = schedules_recorded(run_a) and schedules_recorded(run_b)
    train_fields = versions = scheduled = 0
    for step in steps:
        # the step's JSON, read once for what diff compares beside the stages (runs made without recording: none)
        metas = (_load(run_a, step)[1], _load(run_b, step)[1]) if verified["A"] and verified["B"] else None
        found = schedule_difference(*metas) if schedules and metas else None
        scheduled += bool(schedules and metas and all(m.get("dp_shards") for m in metas))  # none: critic-only
        schedule = Difference(step, **found) if found else None
        found, compared = version_difference(*metas, step) if metas else (None, 0)
        versions += compared
        version = Difference(step, **found) if found else None
        for stage in stages:
            if schedule is not None and stage in TRAIN_SIDE:  # the cause, named before the numbers it changes
                first = schedule
                break
            if version is not None and stage == "rollout_tokens":  # another weights version sampled it
                first = version
                break
            if stage not in sums_a[step] or stage not in sums_b[step]:  # a PPO critic-only step: no actor stages
                if stage in sums_a[step] or stage in sums_b[step]:
                    side, other = ("A", "B") if stage in sums_a[step] else ("B", "A")
                    first = Difference(
                        step, stage, f"computed by {side} only ({other}'s actor did not train: a critic-only step)"
                    )
                    break
                continue
            comparisons += 1
            if sums_a[step][stage] == sums_b[step][stage]:
                continue  # equal bits: equal within any tolerance
            first = _stage_difference(run_a, run_b, step, stage, tol)
            if tol is not None and first is None and stage in METRIC_OF_STAGE:
                first = _metric_difference(run_a, run_b, step, stage, tol)
            if tol is None and first is None:  # the checksums say they differ, whatever the values shown say
                first = Difference(
                    step,
                    stage,
                    "checksums differ, though no recorded value that diff compares "
                    "does (another field, a dtype or a shape)",
                )
            if first is not None:
                break
        if first is None and schedule is not None:
            first = schedule
        if first is None and version is not None:  # no stage after it recorded (a run without its rollout)
            first = version
        if first is None and schedules and metas:  # what the train dumps hold beside the stages: kl, returns, ...
            found, compared = train_fields_difference(*metas, tol)
            first = Difference(step, **found) if found else None
            train_fields += compared
        if first is not None:
            break
    if first is None and set(sums_a) != set(sums_b):
        extra = sorted(set(sums_a) ^ set(sums_b))
        side = "A" if extra[0] in sums_a else "B"
        first = Difference(
            extra[0],
            "steps",
            f"step {extra[0]} is committed in {side} only (A committed "
            f"{len(sums_a)} steps, B {len(sums_b)}); the {len(steps)} both have agree",
        )
    around = _metrics_around(run_a, run_b, first.step) if first is not None else []
    return DiffResult(
        str(run_a.root),
        str(run_b.root),
        steps,
        stages,
        tol,
        first,
        around,
        notes,
        comparisons,
        only,
        verified,
        {side: o.checkpoints for side, o in opened.items()},
        layout_advice(run_a.manifest, run_b.manifest, first),
        scheduled,
        train_fields,
        versions,
        _largest(run_a, run_b, steps, stages, sums_a, sums_b) if tol is not None else {},
    )


VALUE_STAGES = {
    **{k: v for k, v in TOKEN_STAGES.items() if k != "rollout_tokens"},
    **SAMPLE_STAGES,
    "loss": "losses",
    "critic_loss": "critic_losses",
}


def _largest(run_a: RunDir, run_b: RunDir, steps: list[int], stages: list[str], sums_a: dict, sums_b: dict) -> dict:
    """Each value stage's largest |a - b| over the steps both runs committed (a stage whose checksums agree at
    every step is 0 there and left out): where it is, and how large, absolute and relative."""
    found: dict[str, dict] = {}
    for step in steps:
        differing = [k for k in stages if k in VALUE_STAGES and sums_a[step].get(k) != sums_b[step].get(k)]
        if not differing:
            continue
        (ta, _), (tb, _) = _load(run_a, step), _load(run_b, step)
        for stage in differing:
            key = "token_advantages" if stage == "advantages" and "token_advantages" in ta else VALUE_STAGES[stage]
            a, b = ta.get(key), tb.get(key)
            if a is None or b is None or a.shape != b.shape or not a.is_floating_point():
                continue
            delta = (a.double() - b.double()).abs()
            worst = int(delta.argmax())
            size = float(delta[worst])
            if stage not in found or size > found[stage]["max_abs"]:
                where = _token_place(ta, worst) if key in TOKEN_KEYS else f"sample {worst}"
                if stage in ("loss", "critic_loss"):
                    where = f"minibatch {worst}"
                scale = max(abs(float(a[worst])), abs(float(b[worst])))
                found[stage] = {
                    "step": step,
                    "where": where,
                    "max_abs": size,
                    "max_rel": size / scale if scale else None,
                }
    return found


def _metric_difference(run_a: RunDir, run_b: RunDir, step: int, stage: str, tol) -> Difference | None:
    key = METRIC_OF_STAGE[stage]
    va = next((r.get(key) for r in run_a.metrics if r["step"] == step), None)
    vb = next((r.get(key) for r in run_b.metrics if r["step"] == step), None)
    if va is None or vb is None:
        return None
    if bool(_close(torch.tensor(va, dtype=torch.float64), torch.tensor(vb, dtype=torch.float64), tol)):
        return None
    return Difference(
        step,
        stage,
        f"metric {key}",
        va,
        vb,
        abs(va - vb),
        1,
        _max_rel(torch.tensor([va], dtype=torch.float64), torch.tensor([vb], dtype=torch.float64)),
    )


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The largest |a - b| / max(|a|, |b|) over differing values (None where none is finite: NaN, inf)."""
    a, b = a.double(), b.double()
    rel = (a - b).abs() / torch.maximum(a.abs(), b.abs())
    rel = rel[rel.isfinite()]
    return float(rel.max()) if len(rel) else None
