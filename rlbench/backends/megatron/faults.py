"""Deliberate faults, for the tests that prove a check can fail (as failpoints.py does for crashes).

`RLBENCH_MEGATRON_FAULT=name[,name]` turns them on in every rank (the ranks inherit the
environment). Each is a real bug of the kind users meet in Megatron-based RL stacks:

- `swap-kv-split`: the Megatron -> Hugging Face split of fused QKV swaps k and v (same shape
  under GQA). The weight-update check must stop the run at step 0.
- `no-tp-grad-finalize`: data-parallel gradients are still reduced, but the tensor-parallel
  all-reduce of the q/k-norm gradients is skipped. TP=2 must then part from TP=1.

`RLBENCH_MEGATRON_KILL=RANK:OP@N` kills a worker rank: rank RANK sends itself SIGKILL when it
receives rank 0's N-th OP command (`init`, `logprobs`, `train_step`, `export`, `checkpoint`,
`load`), or with OP `join`, after it signed in and before it enters init_process_group, as the OOM
killer or a lost node would end it, at a place a test names instead of a time it guesses. Rank 0
must then stop the run cleanly, naming the rank and the command (or the set-up).
"""

from __future__ import annotations

import os

FAULTS = ("swap-kv-split", "no-tp-grad-finalize")
ENV = "RLBENCH_MEGATRON_FAULT"
KILL_ENV = "RLBENCH_MEGATRON_KILL"
_received: dict[str, int] = {}  # this worker's commands so far, by op


def active(name: str) -> bool:
    assert name in FAULTS, name
    spec = os.environ.get(ENV, "")
    chosen = {s for s in spec.split(",") if s}
    unknown = chosen - set(FAULTS)
    if unknown:
        raise ValueError(f"{ENV}: unknown fault(s) {sorted(unknown)} (known: {', '.join(FAULTS)})")
    return name in chosen


def kill_point(rank: int, op: str) -> None:
    """A worker rank received an `op` command: SIGKILL itself if RLBENCH_MEGATRON_KILL names this one."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    where, _, count = spec.partition("@")
    target, _, target_op = where.partition(":")
    if not (target.isdigit() and target_op and count.isdigit()):
        raise ValueError(f"{KILL_ENV}: expected RANK:OP@N, got {spec!r}")
    _received[op] = _received.get(op, 0) + 1
    if int(target) == rank and target_op == op and _received[op] == int(count):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
