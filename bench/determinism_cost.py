"""What `--deterministic` costs on a GPU, by kernel: one step of bench/scale.py's run (Qwen3 shape, Qwen3's
vocabulary, bf16 over fp32 masters) with deterministic mode on and off, each in a process of its own (cuBLAS and
torch read the recipe before their first handle), stage by stage, then one more step under torch.profiler with
the CUDA kernels that took the most time. `nofill` is deterministic mode with torch's filling of fresh memory
(torch.utils.deterministic.fill_uninitialized_memory) off: what that part costs.

    python bench/determinism_cost.py [--shape 0.6B] [--modes det,free,nofill] [--profile det,free]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def one(mode: str, shape: str, profile: bool) -> None:
    """In this process: three steps after a warm-up one, medians by stage; with `profile`, a profiled step."""
    sys.path[:] = [str(BENCH)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    import scale
    from stages import STAGES, sync_device

    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    import torch

    from rlbench.core import loop
    from rlbench.session import build

    with tempfile.TemporaryDirectory() as tmp:
        ctx = build(scale.shape_config(Path(tmp), shape, "cuda", 20, 256).replace(deterministic=mode != "free"))
        if mode == "nofill":
            torch.utils.deterministic.fill_uninitialized_memory = False

        def step(i: int) -> dict:
            state, times = loop.StepState(i), {}
            for name, stage in STAGES:
                sync_device("cuda")
                start = time.perf_counter()
                stage(ctx, state)
                sync_device("cuda")
                times[name] = time.perf_counter() - start
            return times

        rows = [step(i) for i in range(4)][1:]
        stages = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
        total = statistics.median(sum(r.values()) for r in rows)
        print(f"{mode}: step {total:.3f} s {stages}", flush=True)
        if profile:
            from torch.profiler import ProfilerActivity, profile as profiler

            with profiler(activities=[ProfilerActivity.CUDA]) as prof:
                step(5)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
        ctx.writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6B")
    parser.add_argument("--modes", default="det,free,nofill")
    parser.add_argument("--profile", default="det,free", help="the modes whose step is also profiled")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: this mode only
    args = parser.parse_args()
    if args.one:
        one(args.one, args.shape, args.one in args.profile.split(","))
        return
    for mode in args.modes.split(","):
        subprocess.run(
            [sys.executable, __file__, "--one", mode, "--shape", args.shape, "--profile", args.profile], check=True
        )


if __name__ == "__main__":
    main()
