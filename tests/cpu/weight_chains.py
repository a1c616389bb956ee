"""A small chain of weight versions for the delta-sync tests (test_weight_delta.py, test_confined_weights.py):
three tensors of three dtypes, published as slime's trainer publishes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rlbench.core import weight_delta
from tests.conftest import REPO

CONFIG = REPO / "rlbench/fixtures/models/tiny-qwen3/config.json"


def trained(step: int) -> dict:
    """A trainer's weights after `step` steps: three small tensors of three dtypes, two moved each step, one never."""
    import torch

    return {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4) * (1 + step / 8),
        "b": torch.arange(6, dtype=torch.bfloat16) + step,
        "c": torch.ones(5, dtype=torch.int64),
    }


def raw(weights: dict) -> dict:
    return {name: weight_delta.raw_bytes(t) for name, t in weights.items()}


def chain(root: Path, last: int, encoding: str = "xor") -> weight_delta.Publisher:
    """Version 1 full, then a delta per step up to `last`."""
    publisher = weight_delta.Publisher(root, encoding)
    publisher.publish_full(1, trained(1), CONFIG)
    for version in range(2, last + 1):
        publisher.publish(version, trained(version))
    return publisher


def pulled(local: Path) -> dict:
    return {name: data for name, (_, data) in weight_delta.read_checkpoint(local).items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
