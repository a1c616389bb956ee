"""`rlbench import slime`: slime's debug rollout dumps as an rlbench recording.

slime's `--save-debug-rollout-data` writes, per rollout id, `torch.save({"rollout_id": i,
"samples": [Sample.to_dict(), ...]})` (slime/utils/types.py: `to_dict` keeps plain types, the
status as its string value). Each file is loaded with `torch.load(weights_only=True)`, which
unpickles only plain containers, numbers, strings and tensors; a file that needs anything more
is refused, never unpickled. Rollout ids become steps 0..N-1 in id order; samples are grouped
by `group_index` (groups must be equal-sized, as GRPO needs). The recording holds the
data, rollout and reward stages, with their checksums; `replay` and `run --mode train-only`
train on it given a model (`--model`) and tokenizer (`--tokenizer`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from rlbench.config import ModelConfig, RunConfig
from rlbench.errors import BadInput

STATUS_TO_FINISH = {"completed": "stop", "truncated": "length", "aborted": "abort", "failed": "abort",
                    "pending": "abort"}


def load_dump(path: Path) -> dict:
    """One dump file, loaded without unpickling anything but plain data."""
    if not path.is_file():
        raise BadInput("dump not found", path=path)
    try:
        dump = torch.load(path, map_location="cpu", weights_only=True)
    except (Exception, RecursionError) as exc:  # pickle.UnpicklingError for what weights_only refuses
        if type(exc).__name__ == "UnpicklingError" and "weights_only" in str(exc):
            reason = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "global" in line),
                          str(exc).splitlines()[0])[:160]
            raise BadInput(f"refused: loading needs more than torch.load(weights_only=True), and rlbench unpickles "
                           f"nothing else ({reason})", path=path) from None
        raise BadInput(f"not a torch.save file ({exc.__class__.__name__}: {str(exc).splitlines()[0][:120]})",
                       path=path) from None
    if not isinstance(dump, dict) or not isinstance(dump.get("rollout_id"), int) or \
            not isinstance(dump.get("samples"), list):
        raise BadInput("expected {'rollout_id': int, 'samples': [Sample.to_dict(), ...]}", path=path)
    return dump


def _ints(value, path: Path, where: str, high: int | None = None) -> list[int]:
    """A list of integers >= 0 (and <= `high`): ids, or a loss mask of 0 and 1."""
    if torch.is_tensor(value):
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadInput(f"{where}: expected a list of integers", path=path)
    bad = next((v for v in value if v < 0 or (high is not None and v > high)), None)
    if bad is not None:
        span = f"0..{high}" if high is not None else "integers >= 0"
        raise BadInput(f"{where}: holds {bad}, expected {span}", path=path)
    return value


def _floats(value, path: Path, where: str) -> list[float]:
    if torch.is_tensor(value):
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in value):
        raise BadInput(f"{where}: expected a list of finite numbers", path=path)
    return [float(v) for v in value]


def _sample(raw: dict, path: Path, i: int, reward_key: str | None) -> dict:
    where = f"samples[{i}]"
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: expected a dict (Sample.to_dict())", path=path)
    tokens = _ints(raw.get("tokens"), path, f"{where}.tokens")
    n = raw.get("response_length")
    if not isinstance(n, int) or not 0 <= n <= len(tokens):
        raise BadInput(f"{where}.response_length: expected an integer in [0, {len(tokens)}], got {n!r}", path=path)
    mask = [1] * n if raw.get("loss_mask") is None else _ints(raw["loss_mask"], path, f"{where}.loss_mask", high=1)
    logprobs = _floats(raw.get("rollout_log_probs"), path, f"{where}.rollout_log_probs") \
        if raw.get("rollout_log_probs") is not None else None
    for name, values in (("loss_mask", mask), ("rollout_log_probs", logprobs)):
        if values is not None and len(values) != n:  # slime's own invariant
            hint = (": the engine scored another number of tokens than the sample holds, so its response ids are "
                    "not the ones it sampled (re-tokenised after generation? token-in-token-out drift, mode 1)"
                    if name == "rollout_log_probs" else "")
            raise BadInput(f"{where}.{name}: {len(values)} values, response_length is {n}{hint}", path=path)
    reward = raw.get("reward")
    if isinstance(reward, dict):
        if reward_key is None or reward_key not in reward:
            raise BadInput(f"{where}.reward is a dict ({', '.join(map(str, reward))}); name one with --reward-key",
                           path=path)
        reward = reward[reward_key]
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise BadInput(f"{where}.reward: expected a finite number, got {reward!r}", path=path)
    group = raw.get("group_index")
    if not isinstance(group, int):
        raise BadInput(f"{where}.group_index: expected an integer, got {group!r}", path=path)
    index = raw.get("index", i)
    if not isinstance(index, int) or isinstance(index, bool):
        raise BadInput(f"{where}.index: expected an integer, got {index!r}", path=path)
    status = raw.get("status", "completed")
    if not isinstance(status, str):
        raise BadInput(f"{where}.status: expected a string, got {status!r}", path=path)
    prompt = raw.get("prompt", "")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in messages):
        raise BadInput(f"{where}.prompt: expected a string or a list of {{role, content}} messages", path=path)
    for key in ("label", "response"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise BadInput(f"{where}.{key}: expected a string, got {type(raw[key]).__name__}", path=path)
    versions = raw.get("weight_versions") or []
    if not isinstance(versions, list):
        raise BadInput(f"{where}.weight_versions: expected a list, got {type(versions).__name__}", path=path)
    return {"tokens": tokens, "prompt_length": len(tokens) - n, "loss_mask": mask, "logprobs": logprobs,
            "reward": float(reward), "group_index": group, "index": index,
            "meta": {"index": index, "group_index": group, "prompt_index": group,
                     "messages": messages, "label": raw.get("label"), "response": raw.get("response", ""),
                     "response_length": n, "finish_reason": STATUS_TO_FINISH.get(status, "abort"),
                     "status": status, "seed": None, "engine_id": "slime",
                     "weight_version": str(versions[-1]) if versions else None, "reward": float(reward)}}


def _step_tensors(rows: list[dict]) -> dict[str, torch.Tensor]:
    from rlbench.rundir.recording import pack

    tensors = pack([r["tokens"][: r["prompt_length"]] for r in rows], [r["tokens"][r["prompt_length"]:] for r in rows],
                   [r["loss_mask"] for r in rows], [r["logprobs"] or [0.0] * len(r["loss_mask"]) for r in rows],
                   [r["group_index"] for r in rows], [r["group_index"] for r in rows])
    tensors["rewards"] = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
    return tensors


def import_slime(dumps: list[Path], out: Path, model: ModelConfig, reward_key: str | None = None,
                 model_given: bool = True) -> dict:
    """Write the dumps as a recording at `out`; return a summary. Token ids are held to the model's
    vocabulary when a model was given (`model_given`), else to the tokenizer's."""
    import json

    from rlbench.core.context import versions
    from rlbench.core.loop import StepState, checksum_inputs
    from rlbench.core.model import file_digest, load_model_config, load_tokenizer
    from rlbench.rundir.directory import SCHEMA, RunWriter

    if not dumps:
        raise BadInput("no dump files given", field="DUMP")
    loaded = sorted(((load_dump(Path(p)), Path(p)) for p in dumps), key=lambda item: item[0]["rollout_id"])
    ids = [d["rollout_id"] for d, _ in loaded]
    if len(set(ids)) != len(ids):
        raise BadInput(f"rollout ids repeat across the dumps: {ids}", field="DUMP")
    tokenizer = load_tokenizer(model.tokenizer)  # refuse a missing or broken tokenizer before anything is written
    if model_given:
        vocab, vocabulary = load_model_config(model.path).vocab_size, f"the model's vocabulary ({model.path})"
    else:
        vocab, vocabulary = len(tokenizer), f"the tokenizer's vocabulary ({model.tokenizer})"
    steps, group_size, groups = [], None, None
    for dump, path in loaded:
        rows = sorted((_sample(raw, path, i, reward_key) for i, raw in enumerate(dump["samples"])),
                      key=lambda r: (r["group_index"], r["index"]))
        if not rows:
            raise BadInput("no samples", path=path, field="samples")
        too_big = max(max(r["tokens"], default=0) for r in rows)
        if too_big >= vocab:
            raise BadInput(f"token id {too_big} is outside {vocabulary}, {vocab} ids: another tokenizer?", path=path)
        sizes = {}
        for r in rows:
            sizes[r["group_index"]] = sizes.get(r["group_index"], 0) + 1
        if len(set(sizes.values())) != 1 or (group_size is not None and
                                             (set(sizes.values()) != {group_size} or len(sizes) != groups)):
            raise BadInput(f"groups must have one size across all dumps (GRPO), got sizes {sorted(set(sizes.values()))}",
                           path=path, field="group_index")
        group_size, groups = next(iter(sizes.values())), len(sizes)
        steps.append((dump["rollout_id"], path, rows))
    config = RunConfig(steps=len(steps), mode="rollout-only", out=str(out), model=model)
    config = config.replace(data=config.data.__class__(path=str(dumps[0]), prompts_per_step=groups),
                            rollout=config.rollout.__class__(n_samples_per_prompt=group_size))
    manifest = json.loads(json.dumps({
        "schema": SCHEMA, "config": config.to_dict(), "seed": config.seed, "mode": "rollout-only",
        "stages": ["data", "rollout", "reward"], "reward_fn": "imported", "versions": versions(),
        "device": "cpu", "imported": {"from": "slime", "files": [str(p) for _, p, _ in steps],
                                      "rollout_ids": [rid for rid, _, _ in steps]},
        "hashes": {"model_config": file_digest(Path(model.path) / "config.json"),
                   "tokenizer": file_digest(Path(model.tokenizer)), "initial_weights": None, "dataset": None}}))
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
    return {"out": str(out), "steps": len(steps), "rollout_ids": [rid for rid, _, _ in steps],
            "samples_per_step": groups * group_size, "group_size": group_size}
