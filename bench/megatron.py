"""What the megatron trainer costs: its step against the torch trainer's (CPU), and deterministic
against default mode (GPU).

CPU: both trainers (megatron at TP=1, in-process) are built side by side and take the same
batches of the default task, alternating step by step (the order flips every step), after an
untimed warm-up step each. A trainer's step is its share of the loop: the logprob stage (old
log-probs) and the train stage (the optimizer steps, the weight export and digests).

GPU: determinism settings are process-wide (cuBLAS reads its workspace config once), so each
mode is a `rlbench run` of its own, the modes alternating, `--repeats` times; a step's trainer
share is `perf/train_time`, the first two steps left out as warm-up.

Prints each side's median and the ratio of medians.

Run:  python bench/megatron.py                  # CPU: megatron (TP=1) vs torch trainer
      python bench/megatron.py --gpu            # one GPU: megatron --deterministic vs default mode
      python bench/megatron.py --gpu --tp 2     # the same over two GPUs
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = 2
# Run as a script, this file's folder leads sys.path, and this file's name would hide the megatron package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def train_times(args: list[str], out: Path) -> list[float]:
    subprocess.run(
        [sys.executable, "-m", "rlbench.cli", "run", *args, "--out", str(out), "--json"],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["perf/train_time"] for row in rows[WARMUP:]]


def report(times: dict[str, list[float]]) -> None:
    (name_a, a), (name_b, b) = times.items()
    ma, mb = statistics.median(a), statistics.median(b)
    print(
        f"{name_a} {ma * 1e3:.1f} ms, {name_b} {mb * 1e3:.1f} ms (medians of {len(a)} and {len(b)} steps); "
        f"ratio {name_b}/{name_a} = {mb / ma:.3f}"
    )


def gpu(args: list[str], repeats: int) -> None:
    variants = {"default": args, "deterministic": [*args, "--deterministic"]}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            this = {name: train_times(variant, Path(tmp) / f"{name}-{r}") for name, variant in variants.items()}
            print(f"repeat {r}: ", end="")
            report(this)
            for name, got in this.items():
                times[name] += got
    print("all repeats: ", end="")
    report(times)


def cpu(steps: int) -> None:
    from rlbench.config import apply_overrides, load_config
    from rlbench.core import loop
    from rlbench.session import build

    config = load_config(steps=steps)
    contexts = {"torch": build(config), "megatron": build(apply_overrides(config, train__backend="megatron"))}
    batches = []
    for step in range(steps + 1):  # the same rollouts for both: the torch context's engine makes them
        state = loop.StepState(step)
        for stage in (loop.data, loop.rollout, loop.reward, loop.advantage):
            stage(contexts["torch"], state)
        batches.append(state)
    times: dict[str, list[float]] = {name: [] for name in contexts}
    try:
        for i, batch in enumerate(batches):
            for name in list(contexts) if i % 2 == 0 else list(contexts)[::-1]:
                state = copy.deepcopy(batch)
                start = time.perf_counter()
                loop.logprob(contexts[name], state)
                loop.train(contexts[name], state)
                if i > 0:  # step 0 is the warm-up (the megatron trainer starts its rank there)
                    times[name].append(time.perf_counter() - start)
    finally:
        for ctx in contexts.values():
            ctx.trainer.close()
            ctx.engine.close()
    report(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="deterministic vs default mode on CUDA")
    parser.add_argument("--tp", type=int, default=1, help="--gpu: tensor-parallel GPUs")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="--gpu: runs per mode")
    args = parser.parse_args()
    if args.gpu:
        gpu(
            ["--steps", str(args.steps), "--trainer", "megatron", "--device", "cuda", "--tp", str(args.tp)],
            args.repeats,
        )
    else:
        cpu(args.steps)


if __name__ == "__main__":
    main()
