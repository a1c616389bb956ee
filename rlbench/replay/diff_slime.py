"""What diff compares in imported slime runs beside the recorded stages (issue 37): the training schedule (DP
shards, micro-batches) of each step, and every other field the train dumps hold for each sample (kl, returns,
values, entropy, slime's normalised reward, the trainer's numbers on tokens outside the loss mask, per-token
advantages where they vary within a sample), kept by the import in each sample's `slime_train`."""

from __future__ import annotations

import math

from rlbench.rundir.directory import RunDir


def schedules_recorded(run: RunDir) -> bool:
    """Whether the run's steps record their training schedule: an import of slime's train dumps (DP shards)."""
    return bool((run.manifest.get("imported") or {}).get("train_format"))


def schedule_difference(run_a: RunDir, run_b: RunDir, step: int) -> dict | None:
    """Where two imported slime runs trained a step's samples differently: another DP layout, or other
    micro-batches on a DP rank (each a list of the samples' rollout positions), as diff.Difference's fields."""
    from rlbench.rundir.recording import read_step

    layouts = [read_step(run.root, step)[1].get("dp_shards") or [] for run in (run_a, run_b)]
    if layouts[0] == layouts[1]:
        return None
    if len(layouts[0]) != len(layouts[1]):
        return _found("schedule", f"DP layout: {len(layouts[0])} DP ranks in A, {len(layouts[1])} in B")
    for a, b in zip(*layouts):
        rank = a.get("data_parallel_rank")
        for key in ("partition", "micro_batch_indices", "num_microbatches", "global_batch_sizes"):
            if a.get(key) != b.get(key):
                return _found(
                    "schedule",
                    f"DP rank {rank}: {key} differs (the samples trained together, and so every number after them)",
                    a.get(key),
                    b.get(key),
                )
        for key in sorted((set(a) | set(b)) - {"rank", "data_parallel_rank", "sample_indices", "context_parallel"}):
            if a.get(key) != b.get(key):  # any other field a shard holds beside its samples
                return _found("schedule", f"DP rank {rank}: {key} differs", a.get(key), b.get(key))
    return None  # the same rows and micro-batches on every DP rank (which global ranks wrote them, and how, aside)


def train_fields_difference(run_a: RunDir, run_b: RunDir, step: int, tol: tuple[float, float] | None):
    """Each sample's other train-dump fields compared value by value (within the tolerance where one is given):
    (the first difference, as diff.Difference's fields, or None; how many values were compared)."""
    from rlbench.rundir.recording import read_step

    samples = [read_step(run.root, step)[1]["samples"] for run in (run_a, run_b)]
    compared = 0
    for k, (a, b) in enumerate(zip(*samples)):
        fields_a, fields_b = a.get("slime_train") or {}, b.get("slime_train") or {}
        for name in sorted(set(fields_a) | set(fields_b)):
            if name not in fields_a or name not in fields_b:
                side = "A" if name in fields_a else "B"
                return _found("train_fields", f"sample {k}: {name} is in {side}'s train dump only"), compared
            where, x, y, n = _first_unequal(fields_a[name], fields_b[name], tol)
            compared += n
            if where is not None:
                return _found("train_fields", f"sample {k}, {name}{where}", x, y), compared
    return None, compared


def _found(stage: str, where: str, a=None, b=None) -> dict:
    return {"stage": stage, "where": where, "a": a, "b": b}


def _first_unequal(x, y, tol, where: str = "") -> tuple[str | None, object, object, int]:
    """(where x and y first differ or None, the two values there, the numbers compared)."""
    if isinstance(x, list) and isinstance(y, list):
        n = 0
        for i, (u, v) in enumerate(zip(x, y)):
            found, a, b, m = _first_unequal(u, v, tol, f"{where}[{i}]")
            n += m
            if found is not None:
                return found, a, b, n
        if len(x) != len(y):
            return f"{where} (length {len(x)} in A, {len(y)} in B)", len(x), len(y), n
        return None, None, None, n
    if isinstance(x, dict) and isinstance(y, dict):
        n = 0
        for key in sorted(set(x) | set(y), key=str):
            found, a, b, m = _first_unequal(x.get(key), y.get(key), tol, f"{where}.{key}")
            n += m
            if found is not None:
                return found, a, b, n
        return None, None, None, n
    return (None if _agree(x, y, tol) else where), x, y, 1


def _agree(x, y, tol) -> bool:
    if x == y:
        return True
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
    if not numbers:
        return False
    if math.isnan(x) and math.isnan(y):
        return True
    return tol is not None and abs(x - y) <= tol[0] + (tol[1] * abs(y) if y != 0 else 0.0)
