"""What the megatron trainer costs: its step against the torch trainer's (CPU), and deterministic
against default mode (GPU).

Each variant is a `rlbench run` of the default task in its own process (determinism settings are
process-wide: cuBLAS reads its workspace config once), the variants alternating, `--repeats`
times. A step's trainer share is `perf/train_time` (advantages, log-probs, the optimizer steps,
the weight export and the sync); the first two steps of each run are warm-up and left out.
Prints each variant's median and the ratio of medians, per repeat and over all repeats.

Run:  python bench/megatron.py                  # CPU: megatron (TP=1) vs torch trainer
      python bench/megatron.py --gpu            # one GPU: megatron --deterministic vs default mode
      python bench/megatron.py --gpu --tp 2     # the same over two GPUs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = 2


def train_times(args: list[str], out: Path) -> list[float]:
    subprocess.run([sys.executable, "-m", "rlbench.cli", "run", *args, "--out", str(out), "--json"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["perf/train_time"] for row in rows[WARMUP:]]


def compare(variants: dict[str, list[str]], repeats: int) -> None:
    """Alternate the variants `repeats` times; the ratio is the second's median over the first's."""
    (name_a, _), (name_b, _) = variants.items()
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            medians = {}
            for name, args in variants.items():
                got = train_times(args, Path(tmp) / f"{name}-{r}")
                times[name] += got
                medians[name] = statistics.median(got)
            print(f"repeat {r}: " + ", ".join(f"{n} {m * 1e3:.1f} ms" for n, m in medians.items())
                  + f", ratio {medians[name_b] / medians[name_a]:.3f}", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"over {repeats} repeats: {name_a} {median[name_a] * 1e3:.1f} ms, {name_b} {median[name_b] * 1e3:.1f} ms "
          f"per step's train stage; ratio {name_b}/{name_a} = {median[name_b] / median[name_a]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="deterministic vs default mode on CUDA")
    parser.add_argument("--tp", type=int, default=1, help="--gpu: tensor-parallel GPUs")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    common = ["--steps", str(args.steps)]
    if args.gpu:
        mega = [*common, "--trainer", "megatron", "--device", "cuda", "--tp", str(args.tp)]
        compare({"default": mega, "deterministic": [*mega, "--deterministic"]}, args.repeats)
    else:
        compare({"torch": common, "megatron": [*common, "--trainer", "megatron"]}, args.repeats)


if __name__ == "__main__":
    main()
