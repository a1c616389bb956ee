"""What recording costs: the step time of the default loop with full recording vs. writing nothing.

Measures, in one process, the default run (`rlbench.config.load_config()` defaults) twice over:
  A  `out=<temp dir>`, `record=True`: rollouts, metrics, checksums and checkpoints, each fsynced;
  B  `out=None`: no run directory, nothing written (`ctx.writer is None` skips `record`).
Runs alternate A/B/A/B... for `--repeats` rounds so drift (thermal, page cache) hits both sides.
A step's wall time is the gap between consecutive `on_step` callbacks, so it covers every stage
plus recording and checkpointing; the first step of each run is warm-up and is dropped. Reports
the median step time of each side, their ratio, the overhead in percent, and PASS/FAIL against
the 3% budget.

Run:  python bench/record_overhead.py [--steps 30] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rlbench.config import load_config
from rlbench.core.loop import run

BUDGET_PERCENT = 3.0


def step_times(out: str | None, steps: int) -> list[float]:
    """Wall time of each step after the first, from the gaps between `on_step` calls."""
    stamps: list[float] = []
    run(load_config(steps=steps, out=out, record=True), on_step=lambda step, metrics: stamps.append(time.perf_counter()))
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    recorded: list[float] = []
    bare: list[float] = []
    with tempfile.TemporaryDirectory(prefix="rlbench-bench-") as tmp:
        for repeat in range(args.repeats):
            times = step_times(str(Path(tmp) / f"run{repeat}"), args.steps)
            recorded += times
            print(f"repeat {repeat}  A recording  median {statistics.median(times) * 1e3:8.2f} ms/step")
            times = step_times(None, args.steps)
            bare += times
            print(f"repeat {repeat}  B no output  median {statistics.median(times) * 1e3:8.2f} ms/step")

    with_rec, without = statistics.median(recorded), statistics.median(bare)
    ratio = with_rec / without
    overhead = (ratio - 1) * 100
    print(f"steps per run {args.steps} (first dropped), repeats {args.repeats}, "
          f"{len(recorded)} + {len(bare)} step times")
    print(f"median step time, recording:  {with_rec * 1e3:8.2f} ms")
    print(f"median step time, no output:  {without * 1e3:8.2f} ms")
    print(f"ratio (recording / no output): {ratio:.4f}")
    print(f"overhead: {overhead:+.2f}% (budget {BUDGET_PERCENT:.0f}%)")
    print("PASS" if overhead <= BUDGET_PERCENT else "FAIL")


if __name__ == "__main__":
    main()
