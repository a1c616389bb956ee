"""Issue 56's cost figure: PPO with a critic against GRPO on the same task, in one process, alternating.

Each round runs the default task with GRPO (the default settings) and then with examples/ppo.toml's settings (ppo,
whitened advantages, one critic-only step), each for --steps steps from the same seed, 1 torch thread, no recording
beside the run directory's own files; printed per round and as medians: each run's median step time (its metrics'
perf/step_time), the train part of it (perf/train_time: for PPO the critic's values and step too) and the ratio
PPO / GRPO. The first step of each run (its warm-up) is left out of the medians.

    python bench/ppo_cost.py [--rounds 3] [--steps 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from rlbench.config import load_config
from rlbench.session import run

PPO = {"algo__advantage": "ppo", "algo__normalize_advantages": True, "algo__num_critic_only_steps": 1}


def one(root: Path, name: str, steps: int, seed: int, overrides: dict) -> dict[str, float]:
    result = run(load_config(seed=seed, steps=steps, out=str(root / name), **overrides))
    rows = result.history[1:]
    return {key: statistics.median(row[key] for row in rows) for key in ("perf/step_time", "perf/train_time")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.steps} steps a run")
    ratios = {"perf/step_time": [], "perf/train_time": []}
    with tempfile.TemporaryDirectory(prefix="rlbench-ppo-cost-") as tmp:
        for k in range(args.rounds):
            grpo = one(Path(tmp), f"grpo{k}", args.steps, args.seed, {})
            ppo = one(Path(tmp), f"ppo{k}", args.steps, args.seed, PPO)
            for key in ratios:
                ratios[key].append(ppo[key] / grpo[key])
            print(
                f"round {k}: step GRPO {grpo['perf/step_time'] * 1e3:.1f} ms, PPO {ppo['perf/step_time'] * 1e3:.1f} ms"
                f" (x{ratios['perf/step_time'][-1]:.2f}); train part GRPO {grpo['perf/train_time'] * 1e3:.1f} ms, "
                f"PPO {ppo['perf/train_time'] * 1e3:.1f} ms (x{ratios['perf/train_time'][-1]:.2f})",
                flush=True,
            )
    print(
        f"PPO / GRPO, median over {args.rounds} rounds: step x{statistics.median(ratios['perf/step_time']):.2f}, "
        f"train part x{statistics.median(ratios['perf/train_time']):.2f}"
    )


if __name__ == "__main__":
    main()
