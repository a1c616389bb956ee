"""sha256 digests of tensors, the unit of `checksums.jsonl`.

A digest covers, for each tensor in order, its name, dtype, shape and raw bytes, so two
stages agree only when every value agrees to the bit and nothing was reshaped or recast.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping

import torch


@functools.lru_cache(maxsize=8192)
def _header(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The length-prefixed JSON header of a tensor: a step hashes the same few hundred names again
    and again (every gradient of every minibatch), so each is built once."""
    header = json.dumps([name, str(dtype), list(shape)], separators=(",", ":")).encode()
    return len(header).to_bytes(4, "little") + header


def update(digest: "hashlib._Hash", name: str, tensor: torch.Tensor, *more: "hashlib._Hash") -> None:
    """Feed `name` and `tensor` to `digest` (and to each of `more`: one tensor, several running digests)."""
    tensor = tensor.detach().cpu().contiguous()  # each returns the tensor itself when it is already so
    header, data = _header(name, tensor.dtype, tuple(tensor.shape)), tensor.reshape(-1).view(torch.uint8).numpy()
    for target in (digest, *more):
        target.update(header)
        target.update(data)  # hashed in place: no bytes copy


def tensors_digest(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """Digest of named tensors, in the order given (pass a dict sorted by name for weights)."""
    digest = hashlib.sha256()
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, tensor in items:
        update(digest, name, tensor)
    return digest.hexdigest()


def tensor_digests(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's own digest, by name: what an engine reports of the weights it holds."""
    return {name: tensors_digest({name: tensor}) for name, tensor in weights.items()}


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """Digest of a state dict, by sorted name, so the order parameters were visited does not matter."""
    return tensors_digest(sorted(weights.items()))
