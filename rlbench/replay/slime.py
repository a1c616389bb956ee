"""`rlbench import slime`: slime's debug rollout dumps as an rlbench recording.

slime's `--save-debug-rollout-data` writes, per rollout id, `torch.save({"rollout_id": i, "samples":
[Sample.to_dict(), ...]})` (slime/observability/rollout_data_utils.py; `to_dict` keeps the dataclass's
fields and any attribute set on the sample, the status as its string value). Evaluation rollouts go
to the same path template with the id `eval_<i>`: such a file is recognised by that name and refused,
its samples are not training data. Each file is loaded with `torch.load(weights_only=True)`, which
unpickles only plain containers, numbers, strings and tensors; a file that needs anything more is
refused, never unpickled, and named by the classes its pickle's opcodes refer to (pickled.py: images, a
multimodal dump; anything else by name). Rollout ids become steps 0..N-1 in id order.

Every field of slime's Sample (slime/utils/types.py) is used, kept or refused (FIELDS):
- used: ids, spans, reward and status. `remove_sample`: the loss mask is all 0, as slime's
  `_convert_samples_to_train_data` makes it; the sample stays in its group (its reward counts in the
  group's statistics) and the checks do not judge it. `rollout_log_probs` None: the recording's
  tensor holds 0.0 there (it needs some value) and the sample's metadata says
  `has_rollout_logprobs: false`, which every reader honours. The top-p nucleus
  (`rollout_top_p_token_ids` / `_offsets`): the recording's `top_p_ids` / `top_p_offsets` and the
  sample's `top_p: true`, for `check logprobs --recompute` (log-probs renormalised over it, as slime's
  engine reported them). `group_index`: each sample's `group`, groups of any size, as slime allows.
- kept: every other field, and any field slime's Sample does not declare, in the sample's metadata
  under "slime", as JSON (tensors as lists; integer dict keys as their decimal strings, JSON's rule).
  The ones that change what slime trains and rlbench's replay does not model are named in the summary.
- refused, one line naming the field: multimodal inputs (rlbench's models are text only).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import torch

from rlbench.config import ModelConfig, RunConfig
from rlbench.core.vocab import Vocab, model_vocab
from rlbench.errors import BadInput
from rlbench.replay.pickled import load_torch_file
from rlbench.replay.slime_dir import dump_directory, restore_trajectories
from rlbench.replay.slime_joined import train_side
from rlbench.replay.slime_sample import FIELDS, NOT_TRAINED, plain_json, read_sample


def load_dump(path: Path) -> dict:
    """One rollout dump file, loaded without unpickling anything but plain data. slime's formats before 2025-07-23
    (tests/slime_dumps/NOTES.md 3.2) are named and refused: the train-data columns (e0be9a075..1dc85516d^, no
    samples), and plain pickle (1dc85516d..ed2f3a999^: samples with no rollout id or group_index, pickled as
    Python objects)."""
    from rlbench.replay.pickled import plain_pickle

    kind = plain_pickle(path) if path.is_file() else None
    if kind is not None:
        raise BadInput(
            f"a plain pickle of a {kind}, not a torch.save file: slime's rollout dumps of 2025-06-24 to 2025-07-23 "
            "(1dc85516d..ed2f3a999^) were pickle.dump of the samples, with no rollout id or group_index; rlbench "
            "runs no pickle and reads slime's format since ed2f3a999 ({'rollout_id', 'samples'} by torch.save)",
            path=path,
        )
    dump = load_torch_file(path)
    if isinstance(dump, dict) and "samples" not in dump and {"tokens", "response_lengths"} <= set(dump):
        raise BadInput(
            "slime's first rollout dump format (2025-06, e0be9a075..1dc85516d^): the train data's columns, not "
            "samples; rlbench reads the samples slime dumps since ed2f3a999",
            path=path,
        )
    if (
        not isinstance(dump, dict)
        or not isinstance(dump.get("rollout_id"), int)
        or not isinstance(dump.get("samples"), list)
    ):
        raise BadInput("expected {'rollout_id': int, 'samples': [Sample.to_dict(), ...]}", path=path)
    extra = sorted(set(dump) - {"rollout_id", "samples", "metadata"})
    if extra:
        raise BadInput(
            f"top-level keys slime's (and Miles') rollout dump does not write: {', '.join(extra)}", path=path
        )
    if not isinstance(dump.get("metadata", {}), dict):
        raise BadInput("expected a dict (Miles' rollout-dump metadata)", path=path, field="metadata")
    if is_eval_dump(path, dump["rollout_id"]):
        raise BadInput(
            f"an evaluation dump (slime writes eval_{dump['rollout_id']} in the --save-debug-rollout-data "
            "template for its eval rollouts): not training data; import the training dumps only",
            path=path,
        )
    return dump


def is_eval_dump(path: Path, rollout_id: int) -> bool:
    """Whether the path is slime's template with `eval_<rollout_id>` where the id goes."""
    return re.search(rf"(?<![A-Za-z0-9])eval_{rollout_id}(?![0-9])", str(path)) is not None


def _nucleus_tensors(rows: list[dict]) -> dict[str, torch.Tensor]:
    """`top_p_ids` and the token-aligned `top_p_offsets` (rlbench/rundir/recording.py): empty spans on
    prompt tokens and on samples without a nucleus."""
    ids, offsets = [], [0]
    for r in rows:
        offsets += [offsets[-1]] * r["prompt_length"]
        if r["nucleus"] is None:
            offsets += [offsets[-1]] * len(r["loss_mask"])
            continue
        kept, spans = r["nucleus"]
        base = offsets[-1]
        ids += kept
        offsets += [base + o for o in spans[1:]]
    return {"top_p_ids": torch.tensor(ids, dtype=torch.long), "top_p_offsets": torch.tensor(offsets, dtype=torch.long)}


def _step_tensors(rows: list[dict]) -> dict[str, torch.Tensor]:
    from rlbench.rundir.recording import pack

    tensors = pack(
        [r["tokens"][: r["prompt_length"]] for r in rows],
        [r["tokens"][r["prompt_length"] :] for r in rows],
        [r["loss_mask"] for r in rows],
        [r["logprobs"] if r["logprobs"] is not None else [0.0] * len(r["loss_mask"]) for r in rows],
        [r["group_index"] for r in rows],
        [r["group_index"] for r in rows],
    )
    tensors["rewards"] = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
    if any(r["nucleus"] is not None for r in rows):
        tensors.update(_nucleus_tensors(rows))
    return tensors


def _read_step(dump: dict, path: Path, reward_key: str | None, vocab: int, vocabulary: str) -> list[dict]:
    """One dump's samples, ordered by (group, index), their ids held to the vocabulary."""
    rows = sorted(
        ({**read_sample(raw, path, i, reward_key), "position": i} for i, raw in enumerate(dump["samples"])),
        key=lambda r: (r["group_index"], r["index"]),
    )
    if not rows:
        raise BadInput("no samples", path=path, field="samples")
    too_big = max(max([*r["tokens"], *(r["nucleus"] or ([], []))[0]], default=0) for r in rows)
    if too_big >= vocab:
        raise BadInput(f"token id {too_big} is outside {vocabulary}, {vocab} ids: another tokenizer?", path=path)
    return rows


def _group_sizes(rows: list[dict]) -> list[int]:
    sizes: dict[int, int] = {}
    for r in rows:
        sizes[r["group_index"]] = sizes.get(r["group_index"], 0) + 1
    return list(sizes.values())


def _notes(steps: list[tuple[int, Path, list[dict]]]) -> tuple[dict, list[str]]:
    """Counts of what the summary names, and its notes: kept fields slime trains with that replay
    does not use, fields slime's Sample does not declare, compact rollouts."""
    rows = [r for _, _, step_rows in steps for r in step_rows]
    counts = {
        "removed": sum(r["meta"]["remove_sample"] for r in rows),
        "without_logprobs": sum(not r["meta"]["has_rollout_logprobs"] for r in rows),
        "top_p": sum(r["meta"]["top_p"] for r in rows),
    }
    notes = []
    for name, why in NOT_TRAINED.items():
        n = sum(r["meta"]["slime"].get(name) is not None for r in rows)
        if n:
            notes.append(f"{name} kept in {n} samples' metadata, not used by replay: {why}")
    if counts["top_p"]:
        notes.append(
            f"top-p nucleus of {counts['top_p']} samples kept: check logprobs --recompute renormalises over "
            "it; replay trains on full-vocabulary log-probs (slime renormalises there too)"
        )
    unknown = sorted({k for r in rows for k in r["meta"]["slime"] if k not in FIELDS and k != "reward"})
    if unknown:
        notes.append(f"fields slime's Sample does not declare, kept in the samples' metadata: {', '.join(unknown)}")
    for rollout_id, _, step_rows in steps:
        ids = [r["meta"]["slime"].get("rollout_id") for r in step_rows]
        shared = sum(1 for x in ids if x is not None and ids.count(x) > 1)
        if shared:
            notes.append(
                f"rollout id {rollout_id}: {shared} samples share a Sample.rollout_id with siblings (a "
                "compact rollout): slime averages their loss over the rollout's tokens together, replay per "
                "sample"
            )
    return counts, notes


def import_slime(
    dumps: list[Path], out: Path, model: ModelConfig, reward_key: str | None = None, model_given: bool = True
) -> dict:
    """Write the dumps as a recording at `out`; return a summary. Token ids are held to the model's
    vocabulary when a model was given (`model_given`), else to the tokenizer's. A single `--dump-details`
    directory brings its train dumps too, each joined to its rollout dump (slime_train.py) before anything is
    written: a broken join is a Divergence (exit 1) naming the samples, and nothing is written."""
    from rlbench.core.model import load_tokenizer

    if not dumps:
        raise BadInput("no dump files given", field="DUMP")
    train_files: dict[int, list[Path]] = {}
    dir_notes: list[str] = []
    directory = None
    if len(dumps) == 1 and Path(dumps[0]).is_dir():
        directory = Path(dumps[0])
        dumps, train_files, dir_notes = dump_directory(directory)
        if not dumps:
            raise BadInput("no training rollout dumps in rollout_data/", path=Path(dumps[0]) if dumps else None)
    loaded = sorted(((load_dump(Path(p)), Path(p)) for p in dumps), key=lambda item: item[0]["rollout_id"])
    if directory is not None:
        dir_notes += restore_trajectories(directory, loaded)
    ids = [d["rollout_id"] for d, _ in loaded]
    if len(set(ids)) != len(ids):
        raise BadInput(f"rollout ids repeat across the dumps: {ids}", field="DUMP")
    tokenizer = load_tokenizer(model.tokenizer)  # refuse a missing or broken tokenizer before anything is written
    if model_given:
        vocab, vocabulary = model_vocab(model.path), f"the model's vocabulary ({model.path})"
    else:
        vocab, vocabulary = len(tokenizer), f"the tokenizer's vocabulary ({model.tokenizer})"
    steps = [(dump["rollout_id"], path, _read_step(dump, path, reward_key, vocab, vocabulary)) for dump, path in loaded]
    counts, notes = _notes(steps)
    notes = dir_notes + notes
    metadata = {
        rid: plain_json(d["metadata"], p, "metadata") for (d, p), (rid, _, _) in zip(loaded, steps) if d.get("metadata")
    }
    if metadata:
        keys = sorted({k for m in metadata.values() for k in m})
        notes.append(
            f"Miles' rollout-dump metadata ({', '.join(keys)}) of {len(metadata)} rollout ids kept in their steps' "
            "JSON, not used"
        )
    trained = train_side(loaded, steps, train_files, notes) if train_files else None
    sizes = [_group_sizes(rows) for _, _, rows in steps]
    _write(steps, sizes, out, model, dumps, Vocab(vocab, min(len(tokenizer), vocab)), trained, metadata)
    flat = sorted({s for step_sizes in sizes for s in step_sizes})
    return {
        "out": str(out),
        "steps": len(steps),
        "rollout_ids": [rid for rid, _, _ in steps],
        "samples": sum(len(rows) for _, _, rows in steps),
        "samples_per_step": [len(rows) for _, _, rows in steps],
        "group_size": flat[0] if len(flat) == 1 else None,
        "group_sizes": sizes,
        **counts,
        "notes": notes,
    }


def _write(
    steps: list[tuple[int, Path, list[dict]]],
    sizes: list[list[int]],
    out: Path,
    model: ModelConfig,
    dumps: list[Path],
    vocab: Vocab,
    trained: list[dict | None] | None = None,
    metadata: dict | None = None,
) -> None:
    """The recording: a rollout-only manifest (its vocabulary: the one the ids were held to, core/vocab.py)
    and one committed step per dump. The dumps do not say slime's batch settings: prompts per step and
    samples per prompt are the largest of the dumps' (groups may differ in size), and one optimizer step
    per rollout id (train.minibatches 1)."""
    import json

    from rlbench.session import versions
    from rlbench.core.loop import StepState, checksum_inputs, recorded_checksums
    from rlbench.core.model import file_digest
    from rlbench.rundir.algorithm import CHECKSUM
    from rlbench.rundir.directory import SCHEMA, RunWriter

    config = RunConfig(steps=len(steps), mode="rollout-only", out=str(out), model=model)
    config = config.replace(
        data=config.data.__class__(path=str(dumps[0]), prompts_per_step=max(map(len, sizes))),
        rollout=config.rollout.__class__(n_samples_per_prompt=max(map(max, sizes))),
        train=config.train.__class__(minibatches=1),
    )
    sides = [side for side in trained or [] if side is not None]
    first = sides[0]["tensors"] if sides else {}
    if "values" in first:  # a PPO run's: its critic-only steps are the leading ones without a train dump
        critic_only = next(k for k, side in enumerate(trained) if side is not None)
        config = config.replace(algo=config.algo.__class__(advantage="ppo", num_critic_only_steps=critic_only))
    manifest = json.loads(
        json.dumps(
            {
                "schema": SCHEMA,
                "checksum": CHECKSUM,
                "config": config.to_dict(),
                "seed": config.seed,
                "mode": "rollout-only",
                "stages": ["data", "rollout", "reward"]
                + (
                    [
                        stage
                        for key, stage in (
                            ("values", "values"),
                            ("advantages", "advantage"),
                            ("token_advantages", "advantage"),
                            ("old_logprobs", "logprob"),
                        )
                        if key in first
                    ]
                    if sides
                    else []
                ),
                "reward_fn": "imported",
                "versions": versions(),
                "device": "cpu",
                "imported": {
                    "from": "slime",
                    "files": [str(p) for _, p, _ in steps],
                    "rollout_ids": [rid for rid, _, _ in steps],
                    "group_sizes": sizes,
                    **(
                        {"train_files": [t["file"] for t in sides], "train_format": sides[0]["format"]} if sides else {}
                    ),
                },
                "hashes": {
                    "model_config": file_digest(Path(model.path) / "config.json"),
                    "tokenizer": file_digest(Path(model.tokenizer)),
                    "initial_weights": None,
                    "dataset": None,
                },
                "vocab": vocab.as_manifest(),
            }
        )
    )
    writer = RunWriter(out, manifest)
    try:
        for step, (rollout_id, _, rows) in enumerate(steps):
            state = StepState(step)
            state.tensors = _step_tensors(rows)
            state.sample_meta = [{**r["meta"], "rollout_id": rollout_id} for r in rows]
            side = trained[step] if trained else None
            if side is not None:
                state.tensors.update(side["tensors"])
                for meta, kept, dp in zip(state.sample_meta, side["kept"], side["dp"]):
                    meta["slime_train"] = kept
                    meta["data_parallel_rank"] = dp
                state.extra["dp_shards"] = side["layout"]
            if (metadata or {}).get(rollout_id):
                state.extra["miles_metadata"] = metadata[rollout_id]
            checksum_inputs(state)
            state.checksums.update(
                {
                    k: v
                    for k, v in recorded_checksums(state.tensors).items()
                    if k in ("values", "advantages", "old_logprobs")
                }
            )
            writer.commit_step(step, state.tensors, state.sample_meta, state.checksums, state.metrics, state.extra)
    finally:
        writer.close()


def is_dump_directory(path: Path) -> bool:
    """A slime `--dump-details` directory (rollout_data/ beside, no run directory's manifest)."""
    return (Path(path) / "rollout_data").is_dir() and not (Path(path) / "manifest.json").exists()


@contextmanager
def as_runs(*paths: Path):
    """Each path as a run directory: itself, or a slime `--dump-details` directory imported (with the tokenizer
    slime saved beside its dumps, DIR/tokenizer/) into a temporary run directory, removed afterwards. What diff,
    report and check logprobs read a slime run through."""
    import shutil
    import tempfile

    made: list[Path] = []
    try:
        runs = []
        for path in paths:
            if path is None or not is_dump_directory(Path(path)):
                runs.append(path)
                continue
            path = Path(path)
            tokenizer = path / "tokenizer"
            if not tokenizer.is_dir():
                raise BadInput(
                    "a slime --dump-details directory without tokenizer/ (slime saves it there with a global "
                    "dataset): import it with `rlbench import slime DIR --tokenizer TOKENIZER --out RUN` and give RUN",
                    path=path,
                )
            made.append(Path(tempfile.mkdtemp(prefix="rlbench-slime-dump-")))
            run = made[-1] / path.name
            model = ModelConfig(tokenizer=str(tokenizer.resolve()))  # the default model and its weights
            import_slime([path.resolve()], run, model, model_given=False)
            runs.append(run)
        yield runs
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)
