"""A slime or Miles `--dump-details` directory: what it holds, what is read, kept or named as not read (issue 37).

- rollout_data/{id}.pt (training) and eval_{id}.pt (evaluation: skipped and counted); train_data/{id}.pt (format
  2) or {id}_{rank}.pt (format 1, a file per rank); tokenizer/ (the run's tokenizer, saved by slime's data source).
- Miles (radixark/miles since 44a33ac14, 2026-07-22) writes sidecars beside the rollout dump. trajectory/{id}.jsonl
  holds the conversation of each sample that had one (`metadata["messages"]`), which Miles then pops from the
  sample before its .pt is saved: rlbench puts it back where Miles took it from, each row joined by
  `sample_index` to the sample's `index`, its copies of the sample's `group_index`, `status` and `prompt` held to
  the .pt's (`reward` too, where a number). dashboard_columns/*.parquet (a copy of the .pt's per-token columns for
  Miles' dashboard), events/, dashboard/ and policy_loss_debug/ are named in a note and not read.
"""

from __future__ import annotations

from pathlib import Path

from rlbench.errors import BadInput
from rlbench.rundir.jsonio import parse_json, read_bytes

NOT_READ = {
    "dashboard_columns": "Miles' parquet copy of the rollout dumps' per-token columns",
    "events": "Miles' event log",
    "dashboard": "Miles' dashboard telemetry",
    "policy_loss_debug": "Miles' per-call policy-loss dumps",
}


def dump_directory(directory: Path) -> tuple[list[Path], dict[int, list[Path]], list[str]]:
    """A `--dump-details` directory's training rollout dumps (rollout_data/{id}.pt), its train dumps by rollout
    id (train_data/{id}.pt, slime's format 2; or format 1's file per rank, train_data/{id}_{rank}.pt, in rank
    order), and notes on what was skipped (evaluation dumps). A rollout id with train dumps in both formats is
    refused: which to read is not for rlbench to guess."""
    rollouts = directory / "rollout_data"
    if not rollouts.is_dir():
        raise BadInput("not a slime --dump-details directory (no rollout_data/)", path=directory)
    files = sorted(rollouts.glob("*.pt"))
    evals = [f for f in files if f.stem.startswith("eval_")]
    numbered = []
    for f in (directory / "train_data").glob("*.pt"):
        parts = f.stem.split("_")
        if len(parts) <= 2 and all(part.isdecimal() for part in parts):  # {id}.pt, or format 1's {id}_{rank}.pt
            numbered.append(([int(part) for part in parts], f))
    train: dict[int, list[Path]] = {}
    for (rollout_id, *_), f in sorted(numbered):  # by number: rank 10 after rank 9, {id}.pt before {id}_0.pt
        train.setdefault(rollout_id, []).append(f)
    both = [str(rid) for rid, paths in train.items() if "_" not in paths[0].stem and "_" in paths[-1].stem]
    if both:
        raise BadInput(
            f"rollout {', '.join(both)}: train dumps in both of slime's formats, {{id}}.pt (format 2) and "
            "{id}_{rank}.pt (format 1): two slime versions' dumps in one directory? keep one",
            path=directory / "train_data",
        )
    notes = [f"{len(evals)} evaluation dumps (rollout_data/eval_<id>.pt) skipped: not training data"] if evals else []
    if not (directory / "train_data").is_dir():
        notes.append("no train_data/: the rollout side only")
    for name, what in NOT_READ.items():
        if (directory / name).exists():
            notes.append(f"{name}/ ({what}) not read")
    return [f for f in files if f not in evals], train, notes


def restore_trajectories(directory: Path, loaded: list[tuple[dict, Path]]) -> list[str]:
    """Miles' trajectory/{id}.jsonl put back into each rollout dump's samples (`metadata["messages"]`, where Miles
    took it from), checked row by row against the sample it names; notes say what was restored."""
    restored = 0
    for dump, _ in loaded:
        path = directory / "trajectory" / f"{dump['rollout_id']}.jsonl"
        if not path.is_file():
            continue
        by_index = {s.get("index"): s for s in dump["samples"] if isinstance(s, dict)}
        for number, line in enumerate(read_bytes(path).splitlines(), 1):
            where = f"line {number}"
            row = parse_json(line, path, f"JSON on {where}")
            if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                raise BadInput(f"{where}, messages: expected an object with a list of messages", path=path)
            extra = sorted(set(row) - {"sample_index", "group_index", "status", "reward", "prompt", "messages"})
            if extra:
                raise BadInput(f"{where}: fields Miles' trajectory rows do not hold: {', '.join(extra)}", path=path)
            index = row.get("sample_index")
            sample = by_index.get(index) if type(index) is int else None  # a sample's index is an int
            if sample is None:
                raise BadInput(
                    f"{where}, sample_index: {index!r} is no sample of rollout_data/{dump['rollout_id']}.pt", path=path
                )
            for key in ("group_index", "status", "prompt") + (("reward",) if row.get("reward") is not None else ()):
                if row.get(key) != sample.get(key):
                    raise BadInput(
                        f"{where}, {key}: {row.get(key)!r:.60} differs from the sample's in the rollout dump "
                        f"({sample.get(key)!r:.60})",
                        path=path,
                    )
            metadata = sample.setdefault("metadata", {})
            if not isinstance(metadata, dict) or "messages" in metadata:
                raise BadInput(f"{where}, messages: the sample already holds metadata.messages", path=path)
            metadata["messages"] = row["messages"]
            restored += 1
    return (
        [f"Miles' trajectory/ conversations of {restored} samples put back in their metadata.messages"]
        if restored
        else []
    )
