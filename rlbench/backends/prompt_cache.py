"""Prompt prefills the embedded engine keeps between generations (`rlbench serve`'s prefix cache).

A prefill is a function of the prompt and the shape it is computed at (hf_engine.py): on the batched path
the prompt left-padded to its width bucket, one row of a fixed PREFILL_ROWS-row forward whose other rows
never touch it; on the per-sample path the prompt alone at its own length. So the keys, values and last
logits of a prompt computed once are the very bytes a second computation would give, and a request whose
whole prompt was prefilled before reuses them: its tokens and log-probs are bit-identical to a fresh
engine's. A prompt that only shares a prefix with a kept one is computed anew: its prefix would sit at
other columns, with other padding, in forwards of other shapes (other roundings), so reusing part of a
prefill would change a request's bits with what happened to be cached.

The cache holds at most `max_bytes` of tensors, dropping the prompts used longest ago; the engine empties it
whenever its weights change (a stale prefill would be the old model's).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


class PromptCache:
    """Prefills by key (the decode path, its width, the prompt's ids), least recently used dropped first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def get(self, key: tuple) -> Any:
        """The kept prefill for `key` (now the most recently used), or None."""
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found[0]

    def put(self, key: tuple, prefill: Any, tensors: list[torch.Tensor]) -> None:
        """Keep `prefill` (whose memory is `tensors`), dropping the oldest prompts past `max_bytes`; one
        larger than the whole cache is not kept."""
        size = sum(t.numel() * t.element_size() for t in tensors)
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = (prefill, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
