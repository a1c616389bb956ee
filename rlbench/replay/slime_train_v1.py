"""slime's format-1 train dumps (a file per rank) read as one format-2 dump would hold them (issue 37).

Format 1 (slime ed2f3a999, 2025-07-23, to 681b3adca^, 2026-08-12; Miles, miles-rl 0.0.2 and main): every rank
of the actor writes `{rollout_id}_{rank}.pt`, `{"rollout_id", "rank", "rollout_data": {column: [...]}}`, and
Miles since 62a66297b (2026-08-17) adds `cp_rank`, `cp_size` and `qkv_format`. A rank's rows are its DP
shard's, with no positions: they join the rollout dump by `sample_indices` <-> `index`. Tensor-parallel ranks
write equal copies; stages before the last pipeline stage lack what the trainer computes (`log_probs` and the
rest); with context parallelism each rank holds its slice of every field CP splits (CP_FIELDS): two chunks of
megatron's load-balanced (zigzag) split of the sequence, megatron's rank order putting CP ranks in global-rank
order within a DP shard (slime's `cp_utils.get_logits_and_tokens_offset_with_cp`, `slice_log_prob_with_cp`).

How the files of one rollout are put together (`read_train_dump_v1`):

- ranks holding the same rows (`sample_indices`) are one DP shard, DP shards in the order of their lowest rank;
- within a shard, each rank's CP rank is the one it recorded (Miles), or, where none is recorded (slime), told
  from the slices themselves: ranks holding equal slices of the first CP field every rank holds
  (`rollout_log_probs` in practice) are copies of one CP rank, numbered in rank order; no slice shorter than its
  response means no context parallelism. Either way the slices must fit the split's widths exactly, and the
  reassembled `rollout_log_probs` are then held to the rollout dump's by the join, so a wrong inference is a
  finding, never a silent mix;
- each field is read from the first rank (in rank order) of each CP rank that holds it (the last pipeline stage
  for what the trainer computes), slices reassembled to the response length; ranks of one CP rank that both hold
  `log_probs` and disagree are a finding (tensor-parallel copies are equal).

What cannot be put together is a finding naming the rollout and the ranks; a file that is not format 1 is bad
input naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlbench.errors import BadInput
from rlbench.replay.pickled import load_torch_file
from rlbench.replay.slime_train import CP_FIELDS, TrainDump, check_sample

V1_KEYS = {"rollout_id", "rank", "rollout_data", "cp_rank", "cp_size", "qkv_format"}  # Miles adds the last three
INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
V1_LAYOUT = ("micro_batch_indices", "num_microbatches", "global_batch_sizes")
V1_WHOLE_BATCH = ("raw_reward",)  # the whole rollout batch, in the rollout dump's order, on every rank


def cp_spans(total: int, response: int, cp_rank: int, cp_size: int, padded: int | None = None) -> list[tuple]:
    """The response positions [start, stop) that CP rank `cp_rank` of `cp_size` holds, in its slice's order: the
    two chunks of the zigzag split of the sequence (chunk size from the total length, or from the padded length
    under qkv_format bshd), shifted by one because position t's log-prob comes from the logits at t - 1."""
    prompt = total - response
    size = ((padded if padded is not None else total) + 2 * cp_size - 1) // (2 * cp_size)
    spans = []
    for lo, hi in (
        (cp_rank * size, (cp_rank + 1) * size),
        ((2 * cp_size - cp_rank - 1) * size, (2 * cp_size - cp_rank) * size),
    ):
        start, stop = max(lo, prompt - 1), min(hi, total - 1)
        if start < stop:
            spans.append((start - (prompt - 1), stop - (prompt - 1)))
    return spans


def assemble(chunks: list, total: int, response: int, padded: int | None = None) -> torch.Tensor | None:
    """One value per response token from each CP rank's slice (`chunks[cp_rank]`); None where a slice's width is
    not its rank's share or the shares do not cover the response exactly once."""
    cp_size = len(chunks)
    first = chunks[0] if torch.is_tensor(chunks[0]) else torch.tensor(chunks[0], dtype=torch.float32)
    out = torch.zeros(response, dtype=first.dtype)
    covered = torch.zeros(response, dtype=torch.int32)
    for cp_rank, chunk in enumerate(chunks):
        chunk = chunk if torch.is_tensor(chunk) else torch.tensor(chunk, dtype=first.dtype)
        taken = 0
        for start, stop in cp_spans(total, response, cp_rank, cp_size, padded):
            if taken + stop - start > len(chunk):
                return None
            out[start:stop] = chunk[taken : taken + stop - start].to(first.dtype)
            covered[start:stop] += 1
            taken += stop - start
        if taken != len(chunk):
            return None
    return out if bool((covered == 1).all()) else None


def read_train_dump_v1(paths: list[Path], rollout_samples: list[dict], findings: list[str]) -> TrainDump:
    """A rollout's format-1 train dump, its files in rank order, read as one format-2 dump would hold it (the
    module docstring says how); what cannot be put together is appended to `findings`."""
    files = [_read_file(path) for path in paths]
    rollout_id = files[0][1]["rollout_id"]
    shards: dict[tuple, list] = {}
    for item in files:
        shards.setdefault(item[3], []).append(item)
    position = {s.get("index"): p for p, s in enumerate(rollout_samples)}
    samples, layout, raw, notes = [], [], None, []
    groups = sorted(shards.items(), key=lambda kv: min(h[1]["rank"] for h in kv[1]))
    for dp_rank, (indices, holders) in enumerate(groups):
        holders = sorted(holders, key=lambda h: h[1]["rank"])
        ranks = [h[1]["rank"] for h in holders]
        label = f"rollout {rollout_id}, DP shard of ranks {ranks}"
        merged = _merge(holders, label, findings)
        if merged is None:
            continue
        chosen, data, cp = merged
        n = len(data["response_lengths"])
        # slime's format-2 writer's rule (train_data_utils._is_per_sample): a column of one entry per row is the
        # samples'; any other field stays with the shard's layout
        per_row = {k: _per_row(v, n) for k, v in data.items() if k not in V1_LAYOUT and k not in V1_WHOLE_BATCH}
        columns = {k: data[k] for k, rows in per_row.items() if rows}
        other = {k: data[k] for k, rows in per_row.items() if not rows and k != "sample_indices"}
        for row in range(n):
            index = indices[row]
            if index not in position:
                findings.append(
                    f"rollout {rollout_id}, rank {chosen[1]['rank']} row {row} (sample_index {index}): no sample of "
                    "that index in the rollout dump"
                )
                continue
            sample = {k: v[row] for k, v in columns.items() if k != "sample_indices"}
            sample.update(rollout_position=position[index], sample_index=index, data_parallel_rank=dp_rank)
            samples.append(sample)
        raw = data.get("raw_reward", raw)
        layout.append(
            {
                "rank": chosen[1]["rank"],
                "data_parallel_rank": dp_rank,
                "sample_indices": list(indices),
                "partition": [position.get(i) for i in indices],
                **{k: data.get(k) for k in V1_LAYOUT},
                **other,
                **({"context_parallel": cp} if cp else {}),
            }
        )
    cps = [shard["context_parallel"] for shard in layout if "context_parallel" in shard]
    if cps:
        notes.append(
            f"rollout {rollout_id}: context parallelism {cps[0]['size']} reassembled in {len(cps)} DP shards, CP "
            f"ranks {', '.join(str(cp['ranks']) for cp in cps)} ({cps[0]['how']})"
        )
    samples.sort(key=lambda s: s["rollout_position"])
    unknown: set[str] = set()
    for i, sample in enumerate(samples):
        check_sample(sample, paths[0], i, unknown)
    return TrainDump(paths[0], rollout_id, files[0][1]["rank"], samples, layout, raw, sorted(unknown), 1, notes)


def _read_file(path: Path) -> tuple:
    dump = load_torch_file(path)
    if not isinstance(dump, dict) or not {"rollout_id", "rank", "rollout_data"} <= set(dump):
        raise BadInput("expected {'rollout_id', 'rank', 'rollout_data'} (slime's format 1)", path=path)
    extra = sorted(set(dump) - V1_KEYS)
    if extra:
        raise BadInput(f"top-level keys format 1 does not write: {', '.join(extra)}", path=path)
    for key in ("cp_rank", "cp_size"):
        value = dump.get(key)
        if key in dump and (not isinstance(value, int) or isinstance(value, bool) or value < (key == "cp_size")):
            raise BadInput(f"expected an integer >= {int(key == 'cp_size')}, got {value!r:.40}", path=path, field=key)
    if dump.get("qkv_format", "thd") not in ("thd", "bshd"):
        raise BadInput(f"expected 'thd' or 'bshd', got {dump['qkv_format']!r:.40}", path=path, field="qkv_format")
    data = dump["rollout_data"]
    if not isinstance(data, dict) or not isinstance(data.get("response_lengths"), list):
        raise BadInput("expected a dict of columns with response_lengths", path=path, field="rollout_data")
    indices = data.get("sample_indices")
    if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
        raise BadInput(
            "expected every row's Sample.index: format 1 joins by it (a sample without one cannot be joined)",
            path=path,
            field="rollout_data.sample_indices",
        )
    for name in CP_FIELDS:
        column = data.get(name)
        bad = next((r for r, row in enumerate(column) if not _numbers(row)), None) if isinstance(column, list) else None
        if bad is not None:
            raise BadInput(
                f"expected each row a 1-D tensor or list of numbers (a value per token), row {bad} is "
                f"{_kind(column[bad])}",
                path=path,
                field=f"rollout_data.{name}",
            )
    if dump.get("qkv_format") == "bshd" and (dump.get("cp_size") or 1) > 1 and "max_seq_lens" not in data:
        raise BadInput(
            "qkv_format bshd splits the padded length, and no rollout_data.max_seq_lens says what it was",
            path=path,
            field="qkv_format",
        )
    return path, dump, data, tuple(indices)


def _numbers(row) -> bool:
    if torch.is_tensor(row):
        return row.dim() == 1 and (row.dtype.is_floating_point or row.dtype in INTEGER_DTYPES)
    return isinstance(row, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row)


def _kind(row) -> str:
    if torch.is_tensor(row):
        return f"a {row.dim()}-D {str(row.dtype).removeprefix('torch.')} tensor"
    return f"{row!r:.40}"


def _cp_layout(holders: list, label: str, findings: list[str]) -> tuple[int, list[int], str] | None:
    """(CP size, each holder's CP rank, how it was known) for one DP shard's ranks; None (a finding) where the
    ranks cannot be told apart."""
    recorded = [h for h in holders if "cp_size" in h[1]]
    if recorded:
        sizes = {h[1]["cp_size"] for h in recorded}
        if len(recorded) != len(holders) or len(sizes) != 1:
            findings.append(f"{label}: the ranks record different context-parallel sizes ({sorted(sizes)} or none)")
            return None
        return sizes.pop(), [h[1].get("cp_rank", 0) for h in holders], "recorded by the ranks (cp_rank)"
    sliced = any(
        isinstance(col := h[2].get(f), list) and any(len(v) != n for v, n in zip(col, h[2]["response_lengths"]))
        for h in holders
        for f in CP_FIELDS
    )
    if not sliced:
        return 1, [0] * len(holders), ""
    probe = next((f for f in CP_FIELDS if all(isinstance(h[2].get(f), list) for h in holders)), None)
    if probe is None:
        findings.append(
            f"{label}: fields are sliced by context parallelism and no field every rank holds tells its CP ranks apart"
        )
        return None
    slices, ranks = [], []
    for h in holders:
        column = h[2][probe]
        match = next((k for k, other in enumerate(slices) if _equal(column, other)), None)
        if match is None:
            match = len(slices)
            slices.append(column)
        ranks.append(match)
    return len(slices), ranks, f"inferred: ranks with equal {probe} slices are one CP rank, in rank order"


def _merge(holders: list, label: str, findings: list[str]) -> tuple | None:
    """One DP shard's columns at the response length from its ranks' files: (the file whose columns are read,
    the columns, the context-parallel layout or None)."""
    layout = _cp_layout(holders, label, findings)
    if layout is None:
        return None
    size, cp_ranks, how = layout
    by_cp = [[h for h, c in zip(holders, cp_ranks) if c == r] for r in range(size)]
    missing = [r for r in range(size) if not by_cp[r]]
    if missing or max(cp_ranks) >= size:
        findings.append(f"{label}: context-parallel ranks {missing or sorted(set(cp_ranks))} of {size} missing")
        return None
    for copies in by_cp:
        computed = [h for h in copies if h[2].get("log_probs") is not None]
        for other in computed[1:]:
            if not _same(computed[0][2], other[2]):
                findings.append(
                    f"{label}: ranks {computed[0][1]['rank']} and {other[1]['rank']} hold the same rows and disagree "
                    "(tensor-parallel copies should be equal)"
                )
    chosen = next((h for h in by_cp[0] if h[2].get("log_probs") is not None), by_cp[0][0])
    data = dict(chosen[2])
    if size == 1:
        return chosen, data, None
    lengths = data["response_lengths"]
    totals = data.get("total_lengths") or [len(t) for t in data["tokens"]]
    padded = data.get("max_seq_lens") if chosen[1].get("qkv_format") == "bshd" else None
    for name in CP_FIELDS:
        parts = [next((h[2][name] for h in copies if h[2].get(name) is not None), None) for copies in by_cp]
        if all(p is None for p in parts):
            continue
        if any(p is None for p in parts):
            findings.append(
                f"{label}: {name} held by CP ranks {[r for r, p in enumerate(parts) if p is not None]} of {size} only"
            )
            return None
        rows = []
        for row in range(len(lengths)):
            whole = assemble(
                [p[row] for p in parts],
                int(totals[row]),
                int(lengths[row]),
                None if padded is None else int(padded[row]),
            )
            if whole is None:
                findings.append(f"{label}: {name} of row {row} does not fit context parallelism {size}'s split ({how})")
                return None
            rows.append(whole)
        data[name] = rows
    ranks = [[h[1]["rank"] for h in copies] for copies in by_cp]
    return chosen, data, {"size": size, "ranks": ranks, "how": how}


def _per_row(value, n: int) -> bool:
    if torch.is_tensor(value):
        return value.dim() >= 1 and value.size(0) == n
    return isinstance(value, (list, tuple)) and len(value) == n


def _equal(a: list, b: list) -> bool:
    # rows are 1-D numbers (_read_file): torch.equal is False for rows of unequal length
    return len(a) == len(b) and all(torch.equal(torch.as_tensor(u), torch.as_tensor(v)) for u, v in zip(a, b))


def _same(a: dict, b: dict) -> bool:
    for key in set(a) | set(b):
        x, y = a.get(key), b.get(key)
        if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            if not all(
                torch.equal(u, v) if torch.is_tensor(u) and torch.is_tensor(v) else u == v for u, v in zip(x, y)
            ):
                return False
        elif not (torch.equal(x, y) if torch.is_tensor(x) and torch.is_tensor(y) else x == y):
            return False
    return True
