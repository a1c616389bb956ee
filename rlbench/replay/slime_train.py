"""slime's train-side debug dumps, read whole and joined to the rollout dump of their rollout id (issue 37).

What slime writes (THUDM/slime 624b824a; tests/slime_dumps/NOTES.md has the history, with commits):

- `--save-debug-train-data`, format 2 (since 681b3adca): one file a rollout, `train_data/{rollout_id}.pt` under
  `--dump-details DIR`, written by one rank: `{"format_version": 2, "rollout_id", "rank", "samples": [...],
  "dp_shards": [...], "raw_reward"?}`. Each sample is a dict of what its DP rank trained on: `rollout_position`
  (its position in the rollout dump's `samples`), `sample_index` (the rollout dump's `index`),
  `data_parallel_rank`, and the train data's columns under their own (plural) names, per-token ones restored
  from context parallelism to the response length. `dp_shards` keeps each DP rank's layout: its rows
  (`partition`, `sample_indices`), `micro_batch_indices` (local rows per micro-batch), `num_microbatches` and
  `global_batch_sizes` (per optimizer step).
- format 1 (slime 2025-07 to 2026-08, Miles): a file per rank, read as format 2 would hold it by
  slime_train_v1.py.

Every field of a format-2 sample is used, kept or refused by name (SAMPLE_FIELDS); a field slime's writer does
not produce is kept and named. Loaded with torch.load(weights_only=True) as the rollout import loads its
dumps (slime.py `load_dump`'s refusal: what a pickle holds named from its opcodes, none run).

The join (`join`): every train sample to the rollout sample at its `rollout_position`, and each pair held
together: the index, the ids, the response length, the loss mask (slime zeroes a removed sample's), the engine's
log-probs; every DP shard present and its micro-batches covering its rows exactly once; every rollout sample
trained, except a trailing block the schedule dropped (slime keeps whole global batches: a note, not a finding);
the top-level `raw_reward`, the whole batch in the rollout dump's order, one value per rollout sample (the import
keeps each trained sample's value with its other train fields, where diff compares it).
A broken pair is a finding naming the rollout, the sample's position and index and what differs: never a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlbench.errors import BadInput
from rlbench.replay.pickled import load_torch_file

# What context parallelism splits: slime's _CONTEXT_PARALLEL_FIELDS (observability/train_data_utils.py, the fields
# format 2 restores), and Miles' ref_entropy (dashboard/dump_reader.py's _CP_SHARDED_FIELDS).
CP_FIELDS = (
    "rollout_log_probs",
    "teacher_log_probs",
    "log_probs",
    "ref_log_probs",
    "values",
    "advantages",
    "returns",
    "kl",
    "entropy",
    "opd_reverse_kl",
    "ref_entropy",
)
# Per-token fields, whose length is the sample's response length once restored from context parallelism.
PER_TOKEN = ("loss_masks", *[name for name in CP_FIELDS if name != "ref_entropy"])
# What each field of a format-2 sample is, and what rlbench does with it.
SAMPLE_FIELDS = {
    # the join
    "rollout_position": "used: the sample's position in the rollout dump (the join)",
    "sample_index": "used: held to the rollout dump's index",
    "data_parallel_rank": "used: the DP shard that trained it",
    # held to the rollout dump
    "tokens": "used: held to the rollout dump's tokens",
    "response_lengths": "used: held to the rollout dump's response_length",
    "total_lengths": "used: held to len(tokens)",
    "loss_masks": "used: held to the rollout dump's loss_mask (all 0 for a removed sample)",
    "rollout_log_probs": "used: held to the rollout dump's rollout_log_probs",
    # what the trainer computed
    "log_probs": "used: the trainer's log-probs before the update (old_logprobs)",
    "ref_log_probs": "used: the reference model's log-probs (ref_logprobs)",
    "advantages": "used: the advantage of each trained token",
    # kept in the sample's metadata
    "returns": "kept",
    "values": "kept (a critic's)",
    "kl": "kept",
    "entropy": "kept",
    "teacher_log_probs": "kept",
    "opd_reverse_kl": "kept",
    "rewards": "kept: the reward after slime's normalisation",
    "local_raw_reward": "kept: the raw reward",
    "truncated": "kept",
    "rollout_ids": "kept: the rollout execution the sample belongs to",
    "rollout_mask_sums": "kept: the rollout's trained-token total",
    "rollout_top_p_token_ids": "kept",
    "rollout_top_p_token_offsets": "kept",
    "round_number": "kept",
    "prompt": "kept",
    "source_names": "kept",
    # refused
    "multimodal_train_inputs": "refused: rlbench's models are text only",
    "rollout_routed_experts": "kept: routing replay (R3), not compared",
}
SHARD_FIELDS = ("rank", "data_parallel_rank", "sample_indices", "partition", "micro_batch_indices")


@dataclass
class TrainDump:
    """One rollout's train dump, format 2, checked field by field."""

    path: Path
    rollout_id: int
    rank: int
    samples: list[dict]
    shards: list[dict]
    raw_reward: list | None
    unknown: list[str] = field(default_factory=list)  # sample fields slime's writer does not produce: kept, named
    format_version: int = 2
    notes: list[str] = field(default_factory=list)  # how a format-1 dump was put together (context parallelism)


@dataclass
class Join:
    """The pairs (train sample, rollout position) of one rollout and what did not hold."""

    rollout_id: int
    pairs: list[tuple[int, int]]  # (position in the train dump's samples, position in the rollout dump's)
    findings: list[str]
    notes: list[str]


def _ints(value) -> list[int] | None:
    if torch.is_tensor(value):
        return [int(x) for x in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return list(value)
    return None


def _floats(value) -> list[float] | None:
    if torch.is_tensor(value):
        return [float(x) for x in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return [float(x) for x in value]
    return None


def read_train_dump(path: Path) -> TrainDump:
    """A train dump file, its format named: format 2 read whole, format 1 refused by name (BadInput naming the
    file and the field otherwise)."""
    path = Path(path)
    dump = load_torch_file(path)
    if not isinstance(dump, dict):
        raise BadInput(f"expected a dict (slime's train dump), got {type(dump).__name__}", path=path)
    version = dump.get("format_version")
    if version is None and {"rollout_id", "rank", "rollout_data"} <= set(dump):
        raise BadInput(
            "a train dump of slime's format 1 (a file per rank, named {rollout_id}_{rank}.pt): give the "
            "--dump-details directory, whose train_data/ holds every rank's file",
            path=path,
            field="format_version",
        )
    if version != 2:
        raise BadInput(f"format_version {version!r}: rlbench reads slime's format 2", path=path, field="format_version")
    for key, kind in (("rollout_id", int), ("rank", int), ("samples", list), ("dp_shards", list)):
        if not isinstance(dump.get(key), kind) or isinstance(dump.get(key), bool):
            raise BadInput(f"expected {kind.__name__}, got {dump.get(key)!r:.60}", path=path, field=key)
    extra = sorted(set(dump) - {"format_version", "rollout_id", "rank", "samples", "dp_shards", "raw_reward"})
    if extra:
        raise BadInput(f"top-level keys slime's format 2 does not write: {', '.join(extra)}", path=path)
    unknown: set[str] = set()
    for i, sample in enumerate(dump["samples"]):
        check_sample(sample, path, i, unknown)
    for r, shard in enumerate(dump["dp_shards"]):
        _check_shard(shard, path, r)
    raw = dump.get("raw_reward")
    return TrainDump(path, dump["rollout_id"], dump["rank"], dump["samples"], dump["dp_shards"], raw, sorted(unknown))


def check_sample(sample, path: Path, i: int, unknown: set[str]) -> None:
    where = f"samples[{i}]"
    if not isinstance(sample, dict):
        raise BadInput(f"expected a dict, got {type(sample).__name__}", path=path, field=where)
    for key in ("rollout_position", "data_parallel_rank", "response_lengths"):
        value = sample.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadInput(f"expected an integer >= 0, got {value!r:.60}", path=path, field=f"{where}.{key}")
    if sample.get("multimodal_train_inputs") is not None:
        raise BadInput(SAMPLE_FIELDS["multimodal_train_inputs"], path=path, field=f"{where}.multimodal_train_inputs")
    index = sample.get("sample_index")  # slime's `sample.index`: None where the sample had none
    if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
        raise BadInput(f"expected an integer, got {index!r:.60}", path=path, field=f"{where}.sample_index")
    if _ints(sample.get("tokens")) is None:
        raise BadInput("expected the sample's token ids", path=path, field=f"{where}.tokens")
    n = sample["response_lengths"]
    for key in PER_TOKEN:
        if key not in sample or sample[key] is None:
            continue
        values = _floats(sample[key])
        if values is None or len(values) != n:
            got = "not numbers" if values is None else f"{len(values)} values"
            raise BadInput(
                f"expected {n} values (response_lengths), got {got}: a field left sliced by context parallelism?",
                path=path,
                field=f"{where}.{key}",
            )
    masks = sample.get("loss_masks")
    if masks is not None and _ints(masks) is None:
        raise BadInput(f"expected integers, got {masks!r:.60}", path=path, field=f"{where}.loss_masks")
    unknown.update(k for k in sample if k not in SAMPLE_FIELDS)


def _check_shard(shard, path: Path, r: int) -> None:
    where = f"dp_shards[{r}]"
    if not isinstance(shard, dict):
        raise BadInput(f"expected a dict, got {type(shard).__name__}", path=path, field=where)
    if not isinstance(shard.get("data_parallel_rank"), int):
        raise BadInput("expected an integer", path=path, field=f"{where}.data_parallel_rank")
    batches = shard.get("micro_batch_indices")
    if batches is not None and not (isinstance(batches, list) and all(_ints(b) is not None for b in batches)):
        raise BadInput("expected lists of row indices", path=path, field=f"{where}.micro_batch_indices")


def join(rollout_samples: list[dict], train: TrainDump) -> Join:
    """Each train sample paired with the rollout sample at its rollout_position, and everything the two files
    must agree on held (see the module docstring); what does not hold is a finding, by sample."""
    rid, findings, notes, pairs = train.rollout_id, [], [], []
    n = len(rollout_samples)
    seen: dict[int, int] = {}
    for k, sample in enumerate(train.samples):
        p = sample["rollout_position"]
        label = f"rollout {rid}, train sample {k} (rollout_position {p}, sample_index {sample.get('sample_index')})"
        if p >= n:
            findings.append(f"{label}: no such sample in the rollout dump ({n} samples)")
            continue
        if p in seen:
            findings.append(f"{label}: trained twice (also train sample {seen[p]})")
            continue
        seen[p] = k
        pairs.append((k, p))
        findings += _pair(label, sample, rollout_samples[p])
    findings += _shards(rid, train)
    raw = train.raw_reward.tolist() if torch.is_tensor(train.raw_reward) else train.raw_reward
    if raw is not None and (not isinstance(raw, (list, tuple)) or len(raw) != n):
        got = f"{len(raw)} values" if isinstance(raw, (list, tuple)) else type(raw).__name__
        findings.append(f"rollout {rid}: raw_reward holds {got}, expected one per rollout dump sample ({n})")
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        trailing = missing == list(range(n - len(missing), n))
        if trailing and seen:
            notes.append(
                f"rollout {rid}: the last {len(missing)} of {n} rollout samples were not trained (positions "
                f"{missing[0]}..{missing[-1]}): slime's schedule keeps whole global batches and drops the rest"
            )
        else:
            findings.append(
                f"rollout {rid}: rollout samples at positions {_span(missing)} (index "
                f"{_span([rollout_samples[p].get('index') for p in missing])}) are missing from the train dump"
            )
    return Join(rid, pairs, findings, notes)


def _span(values: list) -> str:
    return ", ".join(map(str, values[:8])) + (f" and {len(values) - 8} more" if len(values) > 8 else "")


def _first(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _pair(label: str, train: dict, rollout: dict) -> list[str]:
    out = []
    if "sample_index" in train and train["sample_index"] != rollout.get("index"):
        out.append(f"{label}: sample_index {train['sample_index']} != the rollout dump's index {rollout.get('index')}")
    tokens = _ints(train["tokens"])
    if tokens != rollout.get("tokens"):
        at = _first(tokens, list(rollout.get("tokens") or []))
        out.append(f"{label}: tokens differ from the rollout dump's at token {at}")
    n = train["response_lengths"]
    if n != rollout.get("response_length"):
        out.append(
            f"{label}: response_lengths {n} != the rollout dump's response_length {rollout.get('response_length')}"
        )
        return out
    if "total_lengths" in train and train["total_lengths"] != len(tokens):
        out.append(f"{label}: total_lengths {train['total_lengths']} != len(tokens) {len(tokens)}")
    if train.get("loss_masks") is not None:
        expected = rollout.get("loss_mask") or [1] * n
        if rollout.get("remove_sample"):
            expected = [0] * n
        at = _first(_ints(train["loss_masks"]), list(expected))
        if at is not None:
            out.append(f"{label}: loss_masks differ from the rollout dump's loss_mask at response token {at}")
    if train.get("rollout_log_probs") is not None and rollout.get("rollout_log_probs") is not None:
        got = torch.tensor(_floats(train["rollout_log_probs"]), dtype=torch.float32).tolist()
        want = torch.tensor([float(x) for x in rollout["rollout_log_probs"]], dtype=torch.float32).tolist()
        at = _first(got, want)
        if at is not None:
            out.append(
                f"{label}: rollout_log_probs differ from the rollout dump's at response token {at} "
                f"({got[at]!r} vs {want[at]!r})"
            )
    return out


def _shards(rid: int, train: TrainDump) -> list[str]:
    """Every DP rank 0..max present once, each holding the rows its samples say, its micro-batches covering them."""
    out = []
    ranks = [s["data_parallel_rank"] for s in train.shards]
    want = set(range(max([*ranks, *(s["data_parallel_rank"] for s in train.samples)], default=-1) + 1))
    if sorted(ranks) != sorted(want):
        absent = sorted(want - set(ranks))
        out.append(
            f"rollout {rid}: DP shard(s) {absent or 'repeated'} missing from dp_shards (present: {sorted(ranks)})"
        )
    for shard in train.shards:
        r = shard["data_parallel_rank"]
        rows = [s["rollout_position"] for s in train.samples if s["data_parallel_rank"] == r]
        partition = _ints(shard.get("partition"))
        if partition is not None and sorted(partition) != sorted(rows):
            out.append(f"rollout {rid}: DP rank {r}'s partition does not list the samples it trained")
        if not rows:
            out.append(f"rollout {rid}: DP rank {r} trained no sample in this dump (a shard's samples missing)")
        batches = shard.get("micro_batch_indices")
        if batches is not None:
            flat = sorted(i for b in batches for i in _ints(b))
            if flat != list(range(len(partition if partition is not None else rows))):
                out.append(f"rollout {rid}: DP rank {r}'s micro-batches do not cover its rows exactly once")
    return out
