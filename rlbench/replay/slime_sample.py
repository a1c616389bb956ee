"""One sample of a slime rollout dump, read field by field: every field slime writes used, kept or refused by
name (FIELDS), its ids, spans, log-probs, reward and status held to their types and the tokenizer's vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from rlbench.errors import BadInput

STATUS_TO_FINISH = {
    "completed": "stop",
    "truncated": "length",
    "aborted": "abort",
    "failed": "abort",
    "pending": "abort",
}


USED = (
    "group_index",
    "index",
    "prompt",
    "tokens",
    "response",
    "response_length",
    "label",
    "reward",
    "loss_mask",
    "rollout_log_probs",
    "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets",
    "remove_sample",
    "status",
)


KEPT = (
    "rollout_id",
    "weight_versions",
    "apply_chat_template_kwargs",
    "rollout_routed_experts",
    "teacher_log_probs",
    "metadata",
    "generate_function_path",
    "custom_rm_path",
    "train_metadata",
    "session_id",
    "non_generation_time",
    "spec_info",
    "prefix_cache_info",
)


REFUSED = ("multimodal_inputs", "multimodal_train_inputs", "multimodal_train_input_id")


FIELDS = {**{f: "used" for f in USED}, **{f: "kept" for f in KEPT}, **{f: "refused" for f in REFUSED}}


# Kept, but slime trains with them where rlbench's replay does not: named in the summary when set.
NOT_TRAINED = {
    "teacher_log_probs": "on-policy distillation (--use-opd) is not modelled",
    "train_metadata": "per-sample training metadata (custom losses) is not modelled",
    "rollout_routed_experts": "routing replay (--use-rollout-routing-replay) is not modelled",
}


MEDIA_PARTS = ("image", "image_url", "video", "video_url", "audio", "input_audio")


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


def plain_json(value, path: Path, where: str):
    """`value` as JSON keeps it: tensors as lists, tuples as lists, integer dict keys as decimal strings."""
    if torch.is_tensor(value):
        return value.tolist()
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_json(v, path, f"{where}[{k}]") for k, v in enumerate(value)]
    if isinstance(value, dict):
        bad = next((k for k in value if not isinstance(k, (str, int)) or isinstance(k, bool)), None)
        if bad is not None:
            raise BadInput(f"{where}: a key {bad!r} that JSON cannot keep (string and integer keys only)", path=path)
        return {str(k): plain_json(v, path, f"{where}.{k}") for k, v in value.items()}
    raise BadInput(f"{where}: holds a {type(value).__name__}, which the recording's JSON cannot keep", path=path)


def _messages(prompt, path: Path, where: str) -> list[dict]:
    """slime's prompt: a string (one user message) or chat messages, whose content may be null (an
    assistant turn of tool calls) or a list of content parts; a media part is a multimodal sample."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise BadInput(f"{where}: expected a string or a list of chat messages", path=path)
    for k, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadInput(f"{where}[{k}]: expected a message with a string 'role'", path=path)
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if not isinstance(kind, str):
                    raise BadInput(f"{where}[{k}].content: expected content parts {{type, ...}}", path=path)
                if kind in MEDIA_PARTS:
                    raise BadInput(
                        f"{where}[{k}].content: a '{kind}' part: multimodal samples are not supported "
                        "(rlbench's models are text only)",
                        path=path,
                    )
        elif content is not None and not isinstance(content, str):
            raise BadInput(f"{where}[{k}].content: expected a string, null or a list of content parts", path=path)
    return plain_json(prompt, path, where)


def _nucleus(raw: dict, path: Path, where: str, n: int) -> tuple[list[int], list[int]] | None:
    """The recorded top-p nucleus, (ids, offsets): response token r kept ids[offsets[r]:offsets[r + 1]]."""
    ids, offsets = raw.get("rollout_top_p_token_ids"), raw.get("rollout_top_p_token_offsets")
    if ids is None and offsets is None:
        return None
    if ids is None or offsets is None:
        missing = "rollout_top_p_token_ids" if ids is None else "rollout_top_p_token_offsets"
        raise BadInput(f"{where}.{missing}: None, while its pair is set (slime records both or neither)", path=path)
    ids = _ints(ids, path, f"{where}.rollout_top_p_token_ids")
    offsets = _ints(offsets, path, f"{where}.rollout_top_p_token_offsets")
    if (
        len(offsets) != n + 1
        or offsets[0] != 0
        or offsets[-1] != len(ids)
        or any(b < a for a, b in zip(offsets, offsets[1:]))
    ):
        raise BadInput(
            f"{where}.rollout_top_p_token_offsets: expected response_length + 1 = {n + 1} non-decreasing "
            f"offsets from 0 to {len(ids)} (the number of nucleus ids), got {len(offsets)} from "
            f"{offsets[:1]} to {offsets[-1:]}",
            path=path,
        )
    return ids, offsets


def _reward(raw: dict, path: Path, where: str, reward_key: str | None) -> float:
    reward = raw.get("reward")
    if isinstance(reward, dict):
        if reward_key is None or reward_key not in reward:
            raise BadInput(
                f"{where}.reward is a dict ({', '.join(map(str, reward))}); name one with --reward-key", path=path
            )
        reward = reward[reward_key]
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise BadInput(f"{where}.reward: expected a finite number, got {reward!r}", path=path)
    return float(reward)


def _spans(raw: dict, path: Path, where: str) -> tuple[list[int], int, list[int], list[float] | None]:
    """(tokens, response length, loss mask, engine log-probs or None), held to slime's invariant:
    response length = loss-mask length = number of engine log-probs."""
    tokens = _ints(raw.get("tokens"), path, f"{where}.tokens")
    n = raw.get("response_length")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(tokens):
        raise BadInput(f"{where}.response_length: expected an integer in [0, {len(tokens)}], got {n!r}", path=path)
    mask = [1] * n if raw.get("loss_mask") is None else _ints(raw["loss_mask"], path, f"{where}.loss_mask", high=1)
    logprobs = (
        _floats(raw.get("rollout_log_probs"), path, f"{where}.rollout_log_probs")
        if raw.get("rollout_log_probs") is not None
        else None
    )
    for name, values in (("loss_mask", mask), ("rollout_log_probs", logprobs)):
        if values is not None and len(values) != n:  # slime's own invariant
            hint = (
                ": the engine scored another number of tokens than the sample holds, so its response ids are "
                "not the ones it sampled (re-tokenised after generation? token-in-token-out drift, mode 1)"
                if name == "rollout_log_probs"
                else ""
            )
            raise BadInput(f"{where}.{name}: {len(values)} values, response_length is {n}{hint}", path=path)
    return tokens, n, mask, logprobs


def _kept(raw: dict, path: Path, where: str) -> dict:
    """Every field that is not used, as JSON, under its own name (a dict reward too, whole)."""
    kept = {k: plain_json(v, path, f"{where}.{k}") for k, v in raw.items() if FIELDS.get(k) not in ("used", "refused")}
    if isinstance(raw.get("reward"), dict):
        kept["reward"] = plain_json(raw["reward"], path, f"{where}.reward")
    return kept


def read_sample(raw: dict, path: Path, i: int, reward_key: str | None) -> dict:
    """The dump's sample number `i` as the recording holds it (ids, spans, log-probs, reward, status, and what
    is kept under "slime"); BadInput naming the field and `path` where a field is not what slime writes."""
    where = f"samples[{i}]"
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: expected a dict (Sample.to_dict())", path=path)
    for name in REFUSED:
        if raw.get(name) is not None:
            raise BadInput(
                f"{where}.{name}: set, and multimodal samples are not supported (rlbench's models are text only)",
                path=path,
            )
    tokens, n, mask, logprobs = _spans(raw, path, where)
    nucleus = _nucleus(raw, path, where, n)
    reward = _reward(raw, path, where, reward_key)
    group, index = raw.get("group_index"), raw.get("index")
    if not isinstance(group, int) or isinstance(group, bool):
        raise BadInput(f"{where}.group_index: expected an integer, got {group!r}", path=path)
    if index is None:
        index = i
    if not isinstance(index, int) or isinstance(index, bool):
        raise BadInput(f"{where}.index: expected an integer, got {index!r}", path=path)
    status = raw.get("status", "completed")
    if not isinstance(status, str) or status not in STATUS_TO_FINISH:  # a dict or list would not even hash
        raise BadInput(
            f"{where}.status: expected one of slime's statuses ({', '.join(STATUS_TO_FINISH)}), got {status!r}",
            path=path,
        )
    removed = raw.get("remove_sample", False)
    if not isinstance(removed, bool):
        raise BadInput(f"{where}.remove_sample: expected true or false, got {removed!r}", path=path)
    if removed:
        mask = [0] * n  # slime trains nothing of a removed sample
    messages = _messages(raw.get("prompt", ""), path, f"{where}.prompt")
    if raw.get("response") is not None and not isinstance(raw["response"], str):
        raise BadInput(f"{where}.response: expected a string, got {type(raw['response']).__name__}", path=path)
    versions = raw.get("weight_versions") or []
    if not isinstance(versions, list):
        raise BadInput(f"{where}.weight_versions: expected a list, got {type(versions).__name__}", path=path)
    return {
        "tokens": tokens,
        "prompt_length": len(tokens) - n,
        "loss_mask": mask,
        "logprobs": logprobs,
        "nucleus": nucleus,
        "reward": reward,
        "group_index": group,
        "index": index,
        "meta": {
            "index": index,
            "group_index": group,
            "prompt_index": group,
            "group": group,
            "messages": messages,
            "label": plain_json(raw.get("label"), path, f"{where}.label"),
            "response": raw.get("response") or "",
            "response_length": n,
            "finish_reason": STATUS_TO_FINISH[status],
            "status": status,
            "seed": None,
            "engine_id": "slime",
            "weight_version": str(versions[-1]) if versions else None,
            "reward": reward,
            "remove_sample": removed,
            "has_rollout_logprobs": logprobs is not None,
            "top_p": nucleus is not None,
            "slime": _kept(raw, path, where),
        },
    }
