"""Shared by the benches: one step of the loop, stage by stage, each stage timed.

`session.run` times a step as a whole (perf/step_time); a bench that wants to know where a step's
time goes calls the loop's stage functions itself, in `session.run`'s order, with a clock around
each. The numbers are the same work as a run's: same stages, same context, same writer.
"""

from __future__ import annotations

import time

from rlbench import numerics

numerics.pin()  # before torch loads, which reads the settings then (importing rlbench pins them too)

import torch  # noqa: E402

from rlbench.core import loop  # noqa: E402

STAGES = (
    ("data", loop.data),
    ("rollout", loop.rollout),
    ("reward", loop.reward),
    ("advantage", loop.advantage),
    ("logprob", loop.logprob),
    ("train", loop.train),
    ("sync", loop.sync),
    ("record", loop.record),
)


def sync_device(device: str) -> None:
    """Wait for queued kernels, so a clock read after it measures the work and not its launch."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_step(ctx, step: int) -> dict[str, float]:
    """Run step `step` of a full-mode context; seconds per stage, in loop order."""
    state = loop.StepState(step)
    times = {}
    for name, stage in STAGES:
        start = time.perf_counter()
        stage(ctx, state)
        sync_device(ctx.config.device)
        times[name] = time.perf_counter() - start
    return times
