"""Deliberate faults, for the tests that prove a check can fail (as failpoints.py does for crashes).

`RLBENCH_MEGATRON_FAULT=name[,name]` turns them on in every rank (the ranks inherit the
environment). Each is a real bug of the kind users meet in Megatron-based RL stacks:

- `swap-kv-split`: the Megatron -> Hugging Face split of fused QKV swaps k and v (same shape
  under GQA). The weight-update check must stop the run at step 0.
- `no-tp-grad-finalize`: data-parallel gradients are still reduced, but the tensor-parallel
  all-reduce of the q/k-norm gradients is skipped. TP=2 must then part from TP=1.
"""

from __future__ import annotations

import os

FAULTS = ("swap-kv-split", "no-tp-grad-finalize")
ENV = "RLBENCH_MEGATRON_FAULT"


def active(name: str) -> bool:
    assert name in FAULTS, name
    spec = os.environ.get(ENV, "")
    chosen = {s for s in spec.split(",") if s}
    unknown = chosen - set(FAULTS)
    if unknown:
        raise ValueError(f"{ENV}: unknown fault(s) {sorted(unknown)} (known: {', '.join(FAULTS)})")
    return name in chosen
