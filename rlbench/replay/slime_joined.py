"""A `--dump-details` directory's train side in rlbench's recording (replay/slime.py writes it): each step's train
dump joined to its rollout dump (slime_train.join), its trainer's numbers laid out as the recording's tensors, its
DP layout and the other fields kept in each sample's metadata; a PPO run's critic (values, GAE's per-token
advantages and returns) recorded as rlbench's own PPO runs record it (core/critic_stages.py), its critic-only
steps (no train dump) named."""

from __future__ import annotations

from pathlib import Path

import torch

from rlbench.errors import BadInput

# a PPO train dump's per-token fields, by the recording's name (every response token, trained or not)
PPO_FIELDS = {"values": "values", "token_advantages": "advantages", "returns": "returns"}


def critic_only_steps(steps, train_files: dict[int, list[Path]]) -> int:
    """How many leading rollouts are a PPO run's critic-only steps: where some train dump exists, holds a critic's
    values, and the rollouts without one are exactly a leading block (0 otherwise: each missing one a finding)."""
    from rlbench.replay.slime_train import read_train_dump

    missing = [k for k, (rid, _, _) in enumerate(steps) if not train_files.get(rid)]
    if not missing or missing != list(range(len(missing))) or len(missing) == len(steps):
        return 0
    first = train_files[steps[len(missing)][0]]
    if len(first) != 1 or "_" in first[0].stem:  # format 1 (a file per rank): slime before its PPO path
        return 0
    train = read_train_dump(first[0])
    return len(missing) if any(s.get("values") is not None for s in train.samples) else 0


def _response(samples: list[dict], rows: list[dict], key: str) -> torch.Tensor:
    """A per-response-token field over the step: 0 on each prompt, the dump's values on every response token."""
    values = []
    for s, r in zip(samples, rows):
        values += [0.0] * r["prompt_length"] + [float(v) for v in s[key]]
    return torch.tensor(values, dtype=torch.float32)


def train_side(loaded, steps, train_files: dict[int, list[Path]], notes: list[str]) -> list[dict | None] | None:
    """Each step's train-side tensors and layout from its train dump, joined to its rollout dump; None where the
    train dumps do not cover every sample of every step (then the recording holds the rollout side only, said in
    a note). Every finding of every join, and each train dump without its rollout dump, is gathered first: a
    Divergence naming them (nothing written). A PPO run's (its train dumps hold a critic's values) leading rollouts
    without a train dump are its critic-only steps (slime's actor neither computes nor dumps there): None for each
    of them, said in a note."""
    from rlbench.errors import Divergence
    from rlbench.replay.slime_train import join, read_train_dump
    from rlbench.replay.slime_train_v1 import read_train_dump_v1

    joined, findings, critic_only = [], [], critic_only_steps(steps, train_files)
    if critic_only:
        notes.append(
            f"rollout id(s) {', '.join(str(rid) for rid, _, _ in steps[:critic_only])}: no train dump, PPO's "
            f"critic-only steps (--num-critic-only-steps {critic_only}: slime's actor neither computes nor dumps "
            "there); their steps hold the rollout side only"
        )
    for (dump, _), (rollout_id, _, rows) in list(zip(loaded, steps))[critic_only:]:
        paths = train_files.get(rollout_id)
        if not paths:
            findings.append(f"rollout {rollout_id}: no train dump (train_data/{rollout_id}.pt)")
            continue
        if len(paths) == 1 and "_" not in paths[0].stem:
            train, path = read_train_dump(paths[0]), paths[0]
        else:
            train, path = read_train_dump_v1(paths, dump["samples"], findings), paths[0]
        if train.rollout_id != rollout_id:
            raise BadInput(f"rollout_id {train.rollout_id}, in the file of rollout {rollout_id}", path=path)
        result = join(dump["samples"], train)
        findings += result.findings
        notes += train.notes + result.notes
        if train.unknown:
            notes.append(f"rollout {rollout_id}: train-dump fields kept, not read: {', '.join(train.unknown)}")
        joined.append((train, result, rows))
    for rid in sorted(set(train_files) - {rollout_id for rollout_id, _, _ in steps}):  # named, never dropped
        files = ", ".join(f"train_data/{p.name}" for p in train_files[rid])
        findings.append(f"rollout {rid}: no rollout dump (rollout_data/{rid}.pt) for {files}")
    if findings:
        shown = "; ".join(findings[:3]) + (f"; and {len(findings) - 3} more" if len(findings) > 3 else "")
        raise Divergence(f"the train dumps do not join their rollout dumps ({len(findings)} findings): {shown}")
    out: list[dict | None] = [None] * critic_only
    for train, result, rows in joined:
        by_position = {p: train.samples[k] for k, p in result.pairs}
        if len(by_position) != len(rows):
            notes.append("not every rollout sample was trained: the recording holds the rollout side only")
            return None
        out.append(_train_tensors(train, [by_position[r["position"]] for r in rows], rows, notes))
    return out


SHARD_LAYOUT = (
    "rank",
    "data_parallel_rank",
    "partition",
    "sample_indices",
    "micro_batch_indices",
    "num_microbatches",
    "global_batch_sizes",
)


def _plain(value):
    """A shard's field as JSON holds it (tensors as lists)."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _train_tensors(train, samples: list[dict], rows: list[dict], notes: list[str]) -> dict:
    """One step's train-side tensors in the recording's layout (token-aligned, 0 on prompt and untrained tokens,
    as rlbench's own old_logprobs are) and what is kept: per-sample advantages where each sample's are one value
    over its trained tokens (the GRPO family), the DP layout, and the other fields in each sample's metadata."""
    from rlbench.replay.slime_train import SAMPLE_FIELDS

    def flat(name: str) -> torch.Tensor:
        values = []
        for s, r in zip(samples, rows):
            values += [0.0] * r["prompt_length"] + [float(v) if m else 0.0 for v, m in zip(s[name], r["loss_mask"])]
        return torch.tensor(values, dtype=torch.float32)

    tensors = {"old_logprobs": flat("log_probs")} if all(s.get("log_probs") is not None for s in samples) else {}
    if all(s.get("ref_log_probs") is not None for s in samples):
        tensors["ref_logprobs"] = flat("ref_log_probs")
    ppo = all(s.get(k) is not None for s in samples for k in ("values", "advantages", "returns"))
    if ppo:  # a critic's: values, GAE's advantages and returns on every response token, as rlbench records them
        tensors |= {name: _response(samples, rows, key) for name, key in PPO_FIELDS.items()}
    elif all(s.get("advantages") is not None for s in samples):
        per_sample = []
        for s, r in zip(samples, rows):
            values = [float(v) for v in s["advantages"]]
            trained = [v for v, m in zip(values, r["loss_mask"]) if m] or values[:1]
            per_sample.append(trained[0] if len(set(trained)) == 1 else None)
        if None in per_sample:
            notes.append(
                f"rollout {train.rollout_id}: advantages vary within samples (a per-token estimator): kept per "
                "token in each sample's train fields, not recorded as the advantages stage"
            )
        else:
            tensors["advantages"] = torch.tensor(per_sample, dtype=torch.float32)
    kept = []
    for s, r in zip(samples, rows):
        fields = {
            k: (v.tolist() if torch.is_tensor(v) else v)
            for k, v in s.items()
            if not SAMPLE_FIELDS.get(k, "kept").startswith("used") and not (ppo and k in PPO_FIELDS.values())
        }
        if train.raw_reward is not None:  # the whole batch's, in the rollout dump's order (held so by the join)
            fields["raw_reward"] = _plain(train.raw_reward[r["position"]])
        if "advantages" in s and "advantages" not in tensors and not ppo:
            fields["advantages"] = [float(v) for v in s["advantages"]]
        # what the trainer computed on tokens outside the loss mask: not in the stages (0 there), kept to compare
        untrained = [i for i, m in enumerate(r["loss_mask"]) if not m]
        if untrained:
            fields["untrained_tokens"] = {"response_tokens": untrained} | {
                name: [float(s[name][i]) for i in untrained]
                for name in ("log_probs", "ref_log_probs", "advantages")
                if s.get(name) is not None and not (ppo and name == "advantages")
            }
        kept.append(fields)
    layout = [
        {k: shard.get(k) for k in SHARD_LAYOUT}
        | {k: _plain(v) for k, v in shard.items() if k not in SHARD_LAYOUT}  # any other field the shard holds
        for shard in train.shards
    ]
    return {
        "tensors": tensors,
        "kept": kept,
        "dp": [s["data_parallel_rank"] for s in samples],
        "layout": layout,
        "file": str(train.path),
        "format": train.format_version,
    }
