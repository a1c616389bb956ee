"""The weights of `rlbench serve`: loading new ones all or nothing, and SGLang's weight checker.

- `read_candidate`: the weights /update_weights_from_disk names, in a copy of the served model: a
  Hugging Face-format directory of safetensors (every tensor, each file, each shard of the index
  checked by rlbench.core.model before anything is kept), or, for a server started with dummy weights,
  the seeded initial weights of a directory without any (--random-seed's, as at start-up). Any
  failure leaves the served model as it was: the copy is swapped in only once complete
  (`ServerState.load_weights`).
- `checker`: SGLang's /weights_checker actions on the served model (srt/utils/weight_checker.py):
  "checksum" (each tensor's SGLang hash on the CPU: the first 64 bits of the sha256 of its bytes, as
  16 hex digits; `overall_checksum` over them), "snapshot", "compare", "reset_tensors"; non-persistent
  buffers (inv_freq, ...) are skipped as SGLang skips them. The answer is SGLang 0.5.23's:
  {success, message, ranks: [{checksums, per_gpu_checksum, parallelism_info: [{role, ...}]}],
  per_engine_checksum}, one rank (rlbench serve is one process).
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import torch

from rlbench.backends.sglang.wire import tensor_hash
from rlbench.errors import BadInput

NON_PERSISTENT = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
FORMATS = ("auto", "safetensors", "dummy")


class LoadFailed(Exception):
    """A weight load that changed nothing: SGLang's message for it."""


def read_candidate(
    model: torch.nn.Module, path: str, load_format: str, seed: int, root: Path | None = None
) -> torch.nn.Module:
    """A copy of `model` holding the weights `path` names (LoadFailed, with SGLang's message, when they
    cannot be read whole). `load_format` dummy (a server started from random weights, asked without a
    format) reads the directory's safetensors where it has some, else gives the seeded initial weights
    of a model directory without any (the one the server started from): SGLang's own server refuses any
    disk update once started with --load-format dummy. `root` (--weights-dir) confines every file read, links
    followed (rlbench/core/confine.py)."""
    from rlbench.core.confine import inside
    from rlbench.core.model import init_weights_, load_checkpoint_, weight_files

    if load_format not in FORMATS:
        raise LoadFailed(
            f"Failed to get model loader: load_format {load_format!r} (rlbench serve reads {', '.join(FORMATS)})."
        )
    try:
        directory = Path(path)
        files = [inside(f, root) for f in weight_files(directory)]  # none where it is no directory
        bare = directory.is_dir() and (directory / "config.json").is_file() and not files
    except (OSError, BadInput) as exc:
        raise LoadFailed(f"Failed to get weights iterator: {_reason(exc)}.") from None
    candidate = copy.deepcopy(model)
    if load_format == "dummy" and bare:
        init_weights_(candidate, seed, model.config.initializer_range)  # every served model's config has one
        return candidate
    if not files:
        raise LoadFailed(f"Failed to get weights iterator: Cannot find any model weights with `{path}`.")
    try:
        load_checkpoint_(candidate, files)
    except (OSError, BadInput, RuntimeError, ValueError) as exc:
        raise LoadFailed(f"Failed to update weights: {_reason(exc)}.\nRolling back to original weights.") from None
    return candidate


def _reason(exc: Exception) -> str:
    text = str(exc) if not isinstance(exc, OSError) else f"{exc.__class__.__name__}: {exc.strerror or exc}"
    return text[:400]


def state(model: torch.nn.Module):
    """(name, tensor) of the parameters, then the buffers, that SGLang's checker reads (not the
    non-persistent buffers)."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not any(p in name for p in NON_PERSISTENT):
            yield name, tensor.detach()


def overall_checksum(checksums: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


PARALLELISM = {
    "role": "target",
    "tp_rank": 0,
    "tp_size": 1,
    "dp_rank": 0,
    "dp_size": 1,
    "pp_rank": 0,
    "pp_size": 1,
    "rank": 0,
    "size": 1,
}


def checksum_answer(model: torch.nn.Module) -> dict:
    checksums = {name: tensor_hash(tensor) for name, tensor in state(model)}
    rank = {
        "checksums": checksums,
        "per_gpu_checksum": overall_checksum(checksums),
        "parallelism_info": [dict(PARALLELISM)],
    }
    engine = hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    return {"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": engine}


class Checker:
    """The snapshot the checker's "snapshot" takes and "compare" compares with."""

    def __init__(self):
        self.snapshot: dict[str, torch.Tensor] | None = None

    def handle(self, model: torch.nn.Module, action: str, skip: list[str] | None) -> dict:
        """The answer to one action (success false, with SGLang's message, when it fails)."""
        try:
            if action == "checksum":
                return checksum_answer(model)
            if action == "snapshot":
                self.snapshot = {name: t.clone() for name, t in state(model)}
            elif action == "compare":
                self._compare(model, skip)
            elif action == "reset_tensors":
                _reset(model, skip)
            else:
                raise ValueError(f"Unsupported action={action!r}")
        except (ValueError, AssertionError) as exc:
            return {"success": False, "message": str(exc)}
        return {"success": True, "message": "Success."}

    def _compare(self, model: torch.nn.Module, skip: list[str] | None) -> None:
        if self.snapshot is None:  # SGLang asserts it: success false, an empty message (raised, not `assert`: the
            raise AssertionError()  # same under python -O and under pytest's rewriting of rlbench, a pytest plugin)
        errors = []
        for name, actual in state(model):
            if any(p in name for p in (skip or ())):
                continue
            expected = self.snapshot[name]
            if not torch.equal(expected, actual):
                diff = (expected.float() - actual.float()).abs()
                errors.append(
                    f"name={name} max_abs_err={float(diff.max())} mean_abs_err={float(diff.mean())} "
                    f"num_exceed={int((diff > 0).sum())} "
                )
        if errors:
            raise AssertionError("check tensor equality failed:\n" + "\n".join(errors))
        self.snapshot = None


def _reset(model: torch.nn.Module, skip: list[str] | None) -> None:
    """Random values in every checked float tensor (SGLang's reset_tensors), from a generator of its own:
    the process's global RNG is left alone."""
    noise = torch.Generator()
    with torch.no_grad():
        for name, tensor in state(model):
            if any(p in name for p in (skip or ())):
                continue
            if tensor.is_floating_point():
                tensor.copy_(torch.rand(tensor.shape, dtype=torch.float32, generator=noise))  # copy_ casts
