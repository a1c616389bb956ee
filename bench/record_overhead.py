"""What recording costs: the default loop with full recording vs. the same loop writing nothing.

Measures, in one process, the default run (`rlbench.config.load_config()` defaults) twice over:
  A  `out=<temp dir>`, `record=True`: rollouts, metrics, checksums and checkpoints, each fsynced;
  B  `out=None`: no run directory, nothing written (`ctx.writer is None` skips `record`).
Runs alternate A/B/A/B... for `--repeats` rounds so drift (load, page cache) hits both sides,
after one short untimed run that pays the process's first-run costs (lazy imports, allocator).

Two figures, both printed, the first judged:
- run time: wall time of `run()` from its call to its return. `run()` returns only after the
  background writer has landed every step, so this carries every byte and fsync of the recording.
- step time: the gap between consecutive `on_step` callbacks (first step dropped as warm-up),
  the cadence a user sees while the run is going.
Ratio = A / B; PASS when the run-time overhead is within the 3% budget.

Run:  python bench/record_overhead.py [--steps 100] [--repeats 3]   (about 3 minutes)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rlbench.config import load_config
from rlbench.session import run

BUDGET_PERCENT = 3.0


def measure(out: str | None, steps: int) -> tuple[float, list[float]]:
    """(wall time of the whole run, wall time of each step after the first)."""
    stamps: list[float] = []
    start = time.perf_counter()
    run(load_config(steps=steps, out=out, record=True), on_step=lambda state: stamps.append(time.perf_counter()))
    total = time.perf_counter() - start
    return total, [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per run (the default run's 100)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    totals = {"A": [], "B": []}
    steps = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="rlbench-bench-") as tmp:
        measure(str(Path(tmp) / "warmup"), 3)
        for repeat in range(args.repeats):
            for side, out in (("A", str(Path(tmp) / f"run{repeat}")), ("B", None)):
                total, times = measure(out, args.steps)
                totals[side].append(total)
                steps[side] += times
                label = "recording" if side == "A" else "no output"
                print(
                    f"repeat {repeat}  {side} {label:9s}  run {total:7.2f} s   "
                    f"median step {statistics.median(times) * 1e3:7.2f} ms"
                )

    run_ratio = statistics.median(totals["A"]) / statistics.median(totals["B"])
    step_ratio = statistics.median(steps["A"]) / statistics.median(steps["B"])
    print(f"steps per run {args.steps}, repeats {args.repeats}")
    print(
        f"run time   (median): recording {statistics.median(totals['A']):.2f} s, "
        f"no output {statistics.median(totals['B']):.2f} s, ratio {run_ratio:.4f}"
    )
    print(
        f"step time  (median): recording {statistics.median(steps['A']) * 1e3:.2f} ms, "
        f"no output {statistics.median(steps['B']) * 1e3:.2f} ms, ratio {step_ratio:.4f}"
    )
    overhead = (run_ratio - 1) * 100
    print(f"recording overhead (run time): {overhead:+.2f}% (budget {BUDGET_PERCENT:.0f}%)")
    print("PASS" if overhead <= BUDGET_PERCENT else "FAIL")


if __name__ == "__main__":
    main()
