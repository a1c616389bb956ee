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
import warnings
from pathlib import Path

import torch

from rlbench.config import ModelConfig, RunConfig
from rlbench.core.vocab import Vocab, model_vocab
from rlbench.errors import BadInput
from rlbench.replay.slime_sample import FIELDS, NOT_TRAINED, read_sample


def load_dump(path: Path) -> dict:
    """One dump file, loaded without unpickling anything but plain data."""
    if not path.is_file():
        raise BadInput("dump not found", path=path)
    if path.stat().st_size == 0:
        raise BadInput("empty file (0 bytes): not a torch.save file", path=path)
    try:
        with warnings.catch_warnings():  # torch's note on a protocol-4 pickle: rlbench loads it or names what it holds
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            dump = torch.load(path, map_location="cpu", weights_only=True)
    except (Exception, RecursionError) as exc:  # pickle.UnpicklingError for what weights_only refuses
        lines = str(exc).splitlines() or [""]
        if type(exc).__name__ == "UnpicklingError" and "weights_only" in str(exc):
            raise BadInput(_refusal(path, lines), path=path) from None
        raise BadInput(f"not a torch.save file ({exc.__class__.__name__}: {lines[0][:120]})", path=path) from None
    if (
        not isinstance(dump, dict)
        or not isinstance(dump.get("rollout_id"), int)
        or not isinstance(dump.get("samples"), list)
    ):
        raise BadInput("expected {'rollout_id': int, 'samples': [Sample.to_dict(), ...]}", path=path)
    if is_eval_dump(path, dump["rollout_id"]):
        raise BadInput(
            f"an evaluation dump (slime writes eval_{dump['rollout_id']} in the --save-debug-rollout-data "
            "template for its eval rollouts): not training data; import the training dumps only",
            path=path,
        )
    return dump


def _refusal(path: Path, lines: list[str]) -> str:
    """Why a dump that torch.load(weights_only=True) refused is refused: what it holds, read from its pickle's
    opcodes, none run (pickled.py). torch's own text invites the user to allowlist the class, which would run it:
    where the opcodes cannot be read, only its first sentence is kept."""
    from rlbench.replay.pickled import refused_globals, what_it_holds

    names = refused_globals(path)
    if names:
        return f"refused: the dump {what_it_holds(names)}"
    reason = next((line.strip() for line in lines if "GLOBAL" in line or "global" in line), lines[0])
    reason = reason.split(" Please use", 1)[0].removeprefix("WeightsUnpickler error: ")[:160]
    return (
        f"refused: loading needs more than torch.load(weights_only=True), and rlbench unpickles nothing else ({reason})"
    )


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
        (read_sample(raw, path, i, reward_key) for i, raw in enumerate(dump["samples"])),
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
    vocabulary when a model was given (`model_given`), else to the tokenizer's."""
    from rlbench.core.model import load_tokenizer

    if not dumps:
        raise BadInput("no dump files given", field="DUMP")
    loaded = sorted(((load_dump(Path(p)), Path(p)) for p in dumps), key=lambda item: item[0]["rollout_id"])
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
    sizes = [_group_sizes(rows) for _, _, rows in steps]
    _write(steps, sizes, out, model, dumps, Vocab(vocab, min(len(tokenizer), vocab)))
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
) -> None:
    """The recording: a rollout-only manifest (its vocabulary: the one the ids were held to, core/vocab.py)
    and one committed step per dump. The dumps do not say slime's batch settings: prompts per step and
    samples per prompt are the largest of the dumps' (groups may differ in size), and one optimizer step
    per rollout id (train.minibatches 1)."""
    import json

    from rlbench.session import versions
    from rlbench.core.loop import StepState, checksum_inputs
    from rlbench.core.model import file_digest
    from rlbench.rundir.algorithm import CHECKSUM
    from rlbench.rundir.directory import SCHEMA, RunWriter

    config = RunConfig(steps=len(steps), mode="rollout-only", out=str(out), model=model)
    config = config.replace(
        data=config.data.__class__(path=str(dumps[0]), prompts_per_step=max(map(len, sizes))),
        rollout=config.rollout.__class__(n_samples_per_prompt=max(map(max, sizes))),
        train=config.train.__class__(minibatches=1),
    )
    manifest = json.loads(
        json.dumps(
            {
                "schema": SCHEMA,
                "checksum": CHECKSUM,
                "config": config.to_dict(),
                "seed": config.seed,
                "mode": "rollout-only",
                "stages": ["data", "rollout", "reward"],
                "reward_fn": "imported",
                "versions": versions(),
                "device": "cpu",
                "imported": {
                    "from": "slime",
                    "files": [str(p) for _, p, _ in steps],
                    "rollout_ids": [rid for rid, _, _ in steps],
                    "group_sizes": sizes,
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
            checksum_inputs(state)
            writer.commit_step(step, state.tensors, state.sample_meta, state.checksums, state.metrics)
    finally:
        writer.close()
