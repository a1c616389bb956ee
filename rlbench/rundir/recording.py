"""A step's recording: its samples as flat tensors (safetensors) and per-sample JSON.

Layout, all token-aligned arrays indexed by `offsets` (sample i is tokens[offsets[i]:offsets[i+1]]):
    tokens            int64  [T]    prompt then response ids of every sample
    offsets           int64  [n+1]
    prompt_lengths    int64  [n]
    prompt_index      int64  [n]    the dataset row each sample answers
    group_index       int64  [n]    samples of one prompt share a group (GRPO normalises within it)
    loss_mask         uint8  [T]    1 on tokens the policy sampled and is trained on
    rollout_logprobs  float32[T]    the engine's log-prob of each sampled token (0 elsewhere)
    rewards           float32[n]
    advantages        float32[n]    (full mode; PPO with a critic records token_advantages instead)
    values            float32[T]    PPO: the critic's value of each response token before its update (0 on prompts)
    token_advantages  float32[T]    PPO: GAE's advantage of each response token (whitened when asked)
    returns           float32[T]    PPO: GAE's returns, advantage + value
    critic_losses     float32[m]    PPO: each of the critic's optimizer steps' value loss
    old_logprobs      float32[T]    the trainer's log-probs before the update (full mode)
    ref_logprobs      float32[T]    the reference policy's (when KL is on)
    losses            float32[m]    each optimizer step's loss (full mode)
    top_p_ids         int64  [K]    a top-p nucleus the engine sampled from (imported from slime), with
    top_p_offsets     int64  [T+1]  token j's nucleus top_p_ids[top_p_offsets[j]:top_p_offsets[j+1]]; the
                                    samples whose JSON says "top_p": true have one on every response token

Every sample's JSON names its `finish_reason` (stop, length or abort: why generation ended), which
train-only and replay read (`finish_reasons`).
Per-sample JSON keys every reader honours where present (an import from slime writes them):
    remove_sample         true: slime removed it; its loss mask is all 0 and no check judges it
    has_rollout_logprobs  false: the engine reported no log-probs; `rollout_logprobs` holds 0.0 there,
                          which no check reads as a log-prob
    top_p                 true: the sample's nucleus is in top_p_ids / top_p_offsets
    group                 the sample's group (slime's group_index); groups may differ in size

Both files verify themselves: the safetensors metadata holds the checksum of its tensors (and names its
algorithm, `checksum`: a recording by an older rlbench, sha256, is refused with the reason) and the JSON the
sha256 of its samples, so a truncated file or a flipped byte is caught as corruption
(bad input), apart from a recording that is intact but differs from the run (a divergence).
"""

from __future__ import annotations

from collections.abc import Sequence

import json
from pathlib import Path

import torch

from rlbench.errors import BadInput
from rlbench.rundir.algorithm import SCHEMA, older_checksums
from rlbench.rundir.digest import ALGORITHM, tensors_digest
from rlbench.rundir.jsonio import read_bytes, read_json

REQUIRED = (
    "tokens",
    "offsets",
    "prompt_lengths",
    "prompt_index",
    "group_index",
    "loss_mask",
    "rollout_logprobs",
    "rewards",
)


def pack(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    prompt_index: Sequence[int],
    group_index: Sequence[int],
) -> dict[str, torch.Tensor]:
    """The layout above from plain per-sample lists (prompt and response spans split); the loss mask
    and log-probs are response-aligned (a generate function's mask is 0 on tool tokens)."""
    lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)], dtype=torch.long)
    offsets = torch.zeros(len(prompts) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    tokens, mask, lps = [], [], []
    for p, r, m, lp in zip(prompts, responses, loss_masks, logprobs):
        tokens += [*p, *r]
        mask += [0] * len(p) + list(m)
        lps += [0.0] * len(p) + list(lp)
    return {
        "tokens": torch.tensor(tokens, dtype=torch.long),
        "offsets": offsets,
        "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.long),
        "prompt_index": torch.tensor(list(prompt_index), dtype=torch.long),
        "group_index": torch.tensor(list(group_index), dtype=torch.long),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "rollout_logprobs": torch.tensor(lps, dtype=torch.float32),
    }


def padded(flat: torch.Tensor, offsets: torch.Tensor, width: int, fill: float = 0) -> torch.Tensor:
    """[n, width] right-padded rows from a flat token-aligned array."""
    n = offsets.numel() - 1
    out = torch.full((n, width), fill, dtype=flat.dtype)
    for i in range(n):
        a, b = int(offsets[i]), int(offsets[i + 1])
        out[i, : b - a] = flat[a:b]
    return out


def unpad(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The inverse of `padded`: a flat token-aligned array from [n, width] rows."""
    if offsets.numel() <= 1:
        return rows.new_empty(0)
    return torch.cat([rows[i, : int(offsets[i + 1] - offsets[i])] for i in range(offsets.numel() - 1)])


def _samples_digest(samples: list) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(samples, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def encode_step(
    step: int, tensors: dict[str, torch.Tensor], samples: list[dict], extra: dict | None = None
) -> tuple[bytes, bytes]:
    """The two files of a step's recording, as bytes: (safetensors, json)."""
    from safetensors.torch import save

    tensors = {k: v.contiguous() for k, v in sorted(tensors.items())}
    # One metadata key holding sorted JSON: safetensors writes `__metadata__` from a Rust
    # HashMap, so two or more keys come out in a per-process order and the bytes differ.
    header = {
        "rlbench": json.dumps(
            {"schema": SCHEMA, "step": step, "checksum": ALGORITHM, "tensors_checksum": tensors_digest(tensors)},
            sort_keys=True,
        )
    }
    meta = {
        "schema": SCHEMA,
        "step": step,
        **(extra or {}),
        "samples": samples,
        "samples_sha256": _samples_digest(samples),
    }
    return save(tensors, metadata=header), _step_json(meta)


_SAMPLES = "\0samples\0"


def _step_json(meta: dict) -> bytes:
    """The step's JSON, indented, with one sample per line. The samples are most of the file, and
    json.dumps with an indent runs the pure-Python encoder over all of them (several ms a step); one
    compact dumps per sample runs the C encoder and reads as well."""
    lines = ",\n  ".join(json.dumps(sample, separators=(", ", ": ")) for sample in meta["samples"])
    text = json.dumps({**meta, "samples": _SAMPLES}, indent=1)
    return (text.replace(json.dumps(_SAMPLES), f"[\n  {lines}\n ]" if lines else "[]", 1) + "\n").encode()


def read_step(root: Path, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Load and verify one step's recording; any defect raises BadInput naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    name = f"{step:06d}"
    st_path, js_path = root / "rollouts" / f"{name}.safetensors", root / "rollouts" / f"{name}.json"
    for path in (st_path, js_path):
        if not path.is_file():
            raise BadInput(f"missing: the recording of committed step {step} is not there", path=path)
    raw = read_bytes(st_path)
    try:
        tensors = dict(sorted(load(raw).items()))  # `load` gives a per-process hash order
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(json.loads(raw[8 : 8 + header_len])["__metadata__"]["rlbench"])
        if not isinstance(header, dict):
            raise TypeError("the rlbench metadata is not an object")
    except (SafetensorError, ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise BadInput(
            f"corrupt or truncated safetensors ({exc.__class__.__name__}: {str(exc)[:80]})", path=st_path
        ) from None
    if header.get("schema") != SCHEMA or header.get("step") != step:
        raise BadInput(
            f"expected schema {SCHEMA!r} and step {step}, got {header.get('schema')!r} and {header.get('step')!r}",
            path=st_path,
            field="__metadata__",
        )
    if header.get("checksum") != ALGORITHM:
        raise BadInput(older_checksums(header.get("checksum")), path=st_path, field="__metadata__")
    if tensors_digest(dict(sorted(tensors.items()))) != header.get("tensors_checksum"):
        raise BadInput("corrupt: tensors do not match the digest in the file's header", path=st_path)
    meta = read_json(js_path)
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        got = meta.get("schema") if isinstance(meta, dict) else type(meta).__name__
        raise BadInput(f"expected {SCHEMA!r}, got {got!r}", path=js_path, field="schema")
    if "samples" not in meta:
        raise BadInput("missing: expected a list of per-sample objects", path=js_path, field="samples")
    if _samples_digest(meta["samples"]) != meta.get("samples_sha256"):
        raise BadInput("corrupt: samples do not match samples_sha256", path=js_path)
    if not isinstance(meta["samples"], list) or not all(isinstance(x, dict) for x in meta["samples"]):
        raise BadInput("expected a list of per-sample objects", path=js_path, field="samples")
    _check_shapes(tensors, len(meta["samples"]), st_path)
    return tensors, meta


FINISH_REASONS = ("stop", "length", "abort")


def finish_reasons(root: Path, step: int, samples: list[dict]) -> list[str]:
    """Each sample's finish reason, from a step's JSON as read_step returns it: what a reader that
    recomputes the rollout metrics needs (train-only, replay), held to stop, length or abort."""
    path = root / "rollouts" / f"{step:06d}.json"
    for i, sample in enumerate(samples):
        reason = sample.get("finish_reason")
        if reason not in FINISH_REASONS:
            got = "nothing" if "finish_reason" not in sample else repr(reason)
            raise BadInput(
                f"expected one of {', '.join(FINISH_REASONS)}, got {got}",
                path=path,
                field=f"samples[{i}].finish_reason",
            )
    return [sample["finish_reason"] for sample in samples]


DTYPES = {
    "tokens": torch.int64,
    "offsets": torch.int64,
    "prompt_lengths": torch.int64,
    "prompt_index": torch.int64,
    "group_index": torch.int64,
    "loss_mask": torch.uint8,
    "rollout_logprobs": torch.float32,
    "rewards": torch.float32,
    "advantages": torch.float32,
    "values": torch.float32,
    "token_advantages": torch.float32,
    "returns": torch.float32,
    "critic_losses": torch.float32,
    "old_logprobs": torch.float32,
    "ref_logprobs": torch.float32,
    "losses": torch.float32,
    "top_p_ids": torch.int64,
    "top_p_offsets": torch.int64,
}


def _check_shapes(t: dict[str, torch.Tensor], n: int, path: Path) -> None:
    """The layout above, held to: every tensor flat and of its dtype, lengths agreeing, ids and
    indices not negative, the loss mask 0 or 1, each prompt inside its sample."""
    for key in REQUIRED:
        if key not in t:
            raise BadInput(f"tensor '{key}' missing", path=path)
    for key, tensor in t.items():
        if key in DTYPES and (tensor.dtype != DTYPES[key] or tensor.dim() != 1):
            raise BadInput(
                f"tensor '{key}' is {tensor.dtype} of shape {tuple(tensor.shape)}, expected a flat "
                f"{DTYPES[key]} tensor",
                path=path,
            )
    for key in ("tokens", "prompt_index", "group_index"):
        if t[key].numel() and int(t[key].min()) < 0:
            raise BadInput(f"tensor '{key}' holds {int(t[key].min())}; ids and indices are >= 0", path=path)
    if t["loss_mask"].numel() and int(t["loss_mask"].max()) > 1:
        raise BadInput(f"tensor 'loss_mask' holds {int(t['loss_mask'].max())}; expected 0 or 1", path=path)
    total = t["tokens"].numel()
    expect = {
        "offsets": n + 1,
        "prompt_lengths": n,
        "prompt_index": n,
        "group_index": n,
        "rewards": n,
        "loss_mask": total,
        "rollout_logprobs": total,
        "advantages": n,
        "values": total,
        "token_advantages": total,
        "returns": total,
        "old_logprobs": total,
        "ref_logprobs": total,
    }
    for key, size in expect.items():
        if key in t and t[key].numel() != size:
            raise BadInput(f"tensor '{key}' has {t[key].numel()} values, expected {size}", path=path)
    offsets = t["offsets"]
    if int(offsets[0]) != 0 or int(offsets[-1]) != total or bool((offsets[1:] < offsets[:-1]).any()):
        raise BadInput("tensor 'offsets' is not a monotone split of 'tokens'", path=path)
    lengths = offsets[1:] - offsets[:-1]
    if bool(((t["prompt_lengths"] < 0) | (t["prompt_lengths"] > lengths)).any()):
        raise BadInput("tensor 'prompt_lengths' does not fit the samples' lengths", path=path)
    _check_nucleus(t, total, path)


def _check_nucleus(t: dict[str, torch.Tensor], total: int, path: Path) -> None:
    """top_p_ids and top_p_offsets: both or neither, ids >= 0, one monotone span per token."""
    if ("top_p_ids" in t) != ("top_p_offsets" in t):
        raise BadInput("tensors 'top_p_ids' and 'top_p_offsets' come together; one is missing", path=path)
    if "top_p_ids" not in t:
        return
    ids, offsets = t["top_p_ids"], t["top_p_offsets"]
    if ids.numel() and int(ids.min()) < 0:
        raise BadInput(f"tensor 'top_p_ids' holds {int(ids.min())}; ids are >= 0", path=path)
    if (
        offsets.numel() != total + 1
        or int(offsets[0]) != 0
        or int(offsets[-1]) != ids.numel()
        or bool((offsets[1:] < offsets[:-1]).any())
    ):
        raise BadInput(
            f"tensor 'top_p_offsets' is not a monotone split of 'top_p_ids' with one span per token ({total} tokens)",
            path=path,
        )
