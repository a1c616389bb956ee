"""The embedded engine's speed: per-sample against batched decoding, a default step by stage, a run.

1. Generation: the default step 0's 64 requests decoded by the per-sample path and by the batched
   path, alternating, `--repeats` times each, in one process; then the same with 4 new tokens
   (the shape the issue measured). Prints both medians and their ratio, and checks that both
   paths chose the same token ids.
2. A default step split into stages (data, rollout, reward, advantage, logprob, train, sync,
   record), median over `--steps` steps after one untimed step, with a run directory written.
3. The default run's wall time as a user sees it: `rlbench run` in a subprocess, start-up included.

Run:  python bench/engine.py [--device cuda] [--threads 1] [--repeats 7] [--steps 20] [--no-run]
On CUDA the run uses deterministic mode (configure_determinism), as `rlbench run --device cuda` does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stages import STAGES, sync_device, timed_step  # noqa: E402

from rlbench.backends.hf_engine import HFEngine  # noqa: E402
from rlbench.config import load_config  # noqa: E402
from rlbench.core import loop  # noqa: E402
from rlbench.session import build  # noqa: E402


def generation(config, repeats: int) -> None:
    ctx = build(config)
    state = loop.StepState(0)
    loop.data(ctx, state)
    requests = loop.step_requests(ctx, state)
    engines = {
        "per-sample": HFEngine(ctx.trainer.model, config.device, decode="per-sample"),
        "batched": HFEngine(ctx.trainer.model, config.device, batch_size=config.rollout.decode_batch_size),
    }
    results, times = {}, {name: [] for name in engines}
    for name, engine in engines.items():  # untimed warm-up
        results[name] = engine.generate(requests)
    for _ in range(repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.generate(requests)
            sync_device(config.device)
            times[name].append(time.perf_counter() - start)
    same = sum(a.output_ids == b.output_ids for a, b in zip(results["per-sample"], results["batched"]))
    print(
        f"generation of {len(requests)} samples ({config.rollout.max_new_tokens} new tokens), {repeats} alternating "
        f"repeats; same token ids on both paths: {same} of {len(requests)}"
    )
    for name in engines:
        print(
            f"  {name:10s} median {statistics.median(times[name]) * 1e3:8.2f} ms   "
            f"[{', '.join(f'{t * 1e3:.1f}' for t in times[name])}]"
        )
    ratio = statistics.median(times["per-sample"]) / statistics.median(times["batched"])
    print(f"  ratio per-sample / batched: {ratio:.1f}x")


def step_stages(config, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = build(config.replace(out=str(Path(tmp) / "run"), steps=steps + 1))
        try:
            timed_step(ctx, 0)  # warm-up
            rows = [timed_step(ctx, step) for step in range(1, steps + 1)]
        finally:
            ctx.writer.close()
    print(f"default step by stage, median of {steps} steps after one warm-up:")
    totals = [sum(row.values()) for row in rows]
    for name, _ in STAGES:
        median = statistics.median(row[name] for row in rows)
        print(f"  {name:10s} {median * 1e3:8.2f} ms")
    print(f"  {'step':10s} {statistics.median(totals) * 1e3:8.2f} ms")


def whole_run(device: str, threads: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlbench.cli",
                "run",
                "--device",
                device,
                "--threads",
                str(threads),
                "--out",
                str(Path(tmp) / "run"),
                "--json",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"rlbench run failed: {proc.stderr.strip().splitlines()[-1:]}")
    print(f"`rlbench run --device {device}` (the default run, start-up included): {wall:.1f} s wall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-run", action="store_true", help="skip the whole-run timing")
    args = parser.parse_args()
    config = load_config(device=args.device, threads=args.threads)
    from rlbench import numerics

    mode = numerics.identity()
    print(
        f"numerics {mode['mode']} (ATen {mode['aten_capability']}, MKL_CBWR {mode['mkl_cbwr']}), "
        f"{args.threads} thread(s), {(mode['cpu'] or {}).get('model')}"
    )
    for new in dict.fromkeys((config.rollout.max_new_tokens, 4)):
        generation(config.replace(rollout=replace(config.rollout, max_new_tokens=new)), args.repeats)
    step_stages(config, args.steps)
    if not args.no_run:
        whole_run(args.device, args.threads)


if __name__ == "__main__":
    main()
