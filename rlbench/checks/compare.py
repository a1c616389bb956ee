"""Token-id sequence comparison: the first index where two id sequences part, with context.

Ids are compared, never decoded text: a re-encoding that keeps the text but changes the ids
(["he", "llo"] -> ["hello"]) is exactly the drift a text comparison lets through (Miles'
TokenSeqComparator splits at special tokens and compares decoded text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where `a` and `b` differ; the shorter length when one is a strict prefix of
    the other; None when they are equal."""
    if len(a) == len(b) and list(a) == list(b):  # the common case, decided at C speed without numpy
        return None
    if min(len(a), len(b)) < 512:  # short: a zip loop beats converting both to arrays
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return i
        return min(len(a), len(b))
    x = np.asarray(a, dtype=np.int64)
    y = np.asarray(b, dtype=np.int64)
    n = min(x.size, y.size)
    differ = np.flatnonzero(x[:n] != y[:n])
    if differ.size:
        return int(differ[0])
    return None if x.size == y.size else n


@dataclass(frozen=True)
class Divergence:
    index: int
    expected: tuple[int, ...]  # a window of `a` around the index
    got: tuple[int, ...]  # the same window of `b`
    window_start: int


def locate(a: Sequence[int], b: Sequence[int], context: int = 4) -> Divergence | None:
    """`first_divergence` with `context` ids on each side of it from both sequences."""
    index = first_divergence(a, b)
    if index is None:
        return None
    start = max(0, index - context)
    return Divergence(index, tuple(a[start : index + context + 1]), tuple(b[start : index + context + 1]), start)
