"""What makes the default run learn: settings x seeds, each a whole run, and how many pass.

The default run's acceptance (tests/cpu/test_learning.py) is: mean reward of the last 10 steps
>= 0.9, and no answer word ("even", "odd") in more than 60% of those steps' responses. A run
that stops at step N is the first N steps of a longer run (nothing in the loop depends on the
step count), so one run of 1.2x the default's steps per (setting, seed) says whether the default's
step count passes and whether 1.2x it does.

Each (setting, seed) runs in its own process with 1 torch thread (`--procs` at a time), writes its
run directory to a temporary directory, and is reduced to per-step reward, answer words and step
time. Prints, per setting: how many seeds pass at the default's steps and at 1.2x them, the mean
and the worst last-10 reward at the default's steps (the worst seed named), the mean first-10
reward, the share of responses that restate another number than the prompt's ("70 odd" for 75: the
warm start's format unlearned) over those last 10 steps, and the median step time (comparable between
settings of one sweep, on one machine).

The default's settings were chosen on seeds 0-23; seeds 24-47 were held out to check the choice.

    python bench/learning_sweep.py --only base --seeds 0-23   # docs/benchmarks.md's acceptance figure
    python bench/learning_sweep.py --only base --seeds 24-47  # the held-out seeds
    python bench/learning_sweep.py                            # every setting, seeds 0-7
    python bench/learning_sweep.py --only base,"random init" --per-seed

A setting is config overrides (rlbench.config.load_config's `section__field` keys).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import tempfile
from multiprocessing import Pool
from pathlib import Path

from rlbench import numerics

numerics.pin()  # before any torch import, here and in the workers (torch reads the settings when it loads)

from rlbench.config import RunConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ANSWER = re.compile(r"even|odd", re.IGNORECASE)  # what the parity verifier reads: the first match
NUMBER = re.compile(r"\d+")  # the prompt's number (data/parity.jsonl: one per prompt)
DEFAULT_STEPS = RunConfig().steps
STEPS = (DEFAULT_STEPS, round(1.2 * DEFAULT_STEPS))
DEFAULT_SEED = RunConfig().seed  # rlbench.config loads no torch: numerics.pin above still comes first

RANDOM = {"model__path": str(REPO / "rlbench" / "fixtures" / "models" / "tiny-qwen3"), "model__init": "random"}
SETTINGS: dict[str, dict] = {
    # the default: the warm-started fixture (rlbench/fixtures/warm_start.py), 16 prompts x 4 samples, 8 minibatches,
    # lr 3e-4, GRPO with std, KL to the reference 0.1 (k3)
    "base": {},
    "lr 1e-3": {"train__lr": 1e-3},  # faster steps unlearn the restated number (the "number wrong" column)
    "lr 5e-4": {"train__lr": 5e-4},
    "no KL": {"algo__kl_coef": 0.0},
    "KL 0.05": {"algo__kl_coef": 0.05},
    "minibatches 4": {"train__minibatches": 4},
    # PPO with a critic (issue 56) as slime's PPO test runs it: whitened advantages, one critic-only step first;
    # examples/ppo.toml
    "ppo": {"algo__advantage": "ppo", "algo__normalize_advantages": True, "algo__num_critic_only_steps": 1},
    "random init": dict(RANDOM),  # the same settings from random weights: the format to learn as well
    "random init, 4x16 mb4 lr 1e-3 no KL": {  # issue 52's starting point: the old default's settings
        **RANDOM,
        "data__prompts_per_step": 4,
        "rollout__n_samples_per_prompt": 16,
        "train__minibatches": 4,
        "train__lr": 1e-3,
        "algo__kl_coef": 0.0,
    },
}


def run_one(job: tuple[str, int]) -> dict:
    name, seed = job
    import torch

    torch.set_num_threads(1)
    from rlbench.config import load_config
    from rlbench import session

    overrides = dict(SETTINGS[name])
    root = Path(tempfile.mkdtemp(prefix="rlbench-sweep-"))
    try:
        out = root / "run"
        session.run(load_config(seed=seed, out=str(out), steps=max(STEPS), **overrides))
        rows = []
        for line in (out / "metrics.jsonl").read_text().splitlines():
            metrics = json.loads(line)
            words = collections.Counter()
            wrong = 0  # responses that do not restate the prompt's number ("N even"/"N odd" for another N)
            recorded = json.loads((out / "rollouts" / f"{metrics['step']:06d}.json").read_text())
            for sample in recorded["samples"]:
                found = ANSWER.search(sample["response"])
                words[found.group(0).lower() if found else None] += 1
                number = NUMBER.search(sample["messages"][-1]["content"]).group(0)
                wrong += not re.match(rf"{number} (even|odd)$", sample["response"])
            rows.append(
                {
                    "reward": metrics["rollout/raw_reward"],
                    "time": metrics["perf/step_time"],
                    "even": words["even"],
                    "odd": words["odd"],
                    "n": sum(words.values()),
                    "wrong": wrong / len(recorded["samples"]),
                }
            )
        return {"name": name, "seed": seed, "rows": rows}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def verdict(rows: list[dict], steps: int) -> tuple[bool, float]:
    """(passes the acceptance at `steps` steps, its last-10 mean reward)."""
    last = rows[steps - 10 : steps]
    reward = statistics.fmean(r["reward"] for r in last)
    share = max(sum(r["even"] for r in last), sum(r["odd"] for r in last)) / sum(r["n"] for r in last)
    return reward >= 0.9 and share <= 0.6, reward


def _seeds(text: str) -> list[int]:
    """'0-23' or '0,5,9' (or both, comma-separated)."""
    out = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-7", help="seeds: 0-23, or 0,5,9 (default 0-7)")
    parser.add_argument("--procs", type=int, default=os.cpu_count())
    parser.add_argument("--only", default=None, help="comma-separated setting names")
    parser.add_argument(
        "--per-seed",
        action="store_true",
        help="also print each run: its last-10 reward and verdict at the default's steps and at 1.2x them",
    )
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SETTINGS)
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    seeds = _seeds(args.seeds)
    jobs = [(name, seed) for name in names for seed in seeds]
    with Pool(args.procs) as pool:
        results = pool.map(run_one, jobs, chunksize=1)
    mode = numerics.identity()
    first, second = STEPS
    print(
        f"{len(names)} settings x {len(seeds)} seeds ({args.seeds}), {second} steps each, 1 thread per run, "
        f"{args.procs} at a time; numerics {mode['mode']} (ATen {mode['aten_capability']}, MKL_CBWR {mode['mkl_cbwr']})"
    )
    print(
        f"{'setting':36s} pass@{first:<5d} pass@{second:<5d} last-10 @{first}: mean  worst (seed)  number wrong"
        f"  first-10  step"
    )
    for name in names:
        runs = [r for r in results if r["name"] == name]
        cells = [f"{sum(verdict(r['rows'], n)[0] for r in runs)}/{len(runs)}".ljust(10) for n in STEPS]
        last = {r["seed"]: verdict(r["rows"], first)[1] for r in runs}
        worst = min(last, key=last.get)
        start = statistics.fmean(row["reward"] for r in runs for row in r["rows"][:10])
        step = statistics.median(row["time"] for r in runs for row in r["rows"])
        wrong = statistics.fmean(row["wrong"] for r in runs for row in r["rows"][first - 10 : first])
        print(
            f"{name:36s} " + " ".join(cells) + f" {statistics.fmean(last.values()):.3f}  {last[worst]:.3f} ({worst})"
            f"{'':6s}{wrong:.3f}{'':9s}{start:.3f}     {step * 1e3:.0f} ms"
        )
        for run in runs if args.per_seed else ():
            texts = [
                f"@{n} {reward:.3f} {'pass' if ok else 'fail'}"
                for n in STEPS
                for ok, reward in [verdict(run["rows"], n)]
            ]
            print(f"  seed {run['seed']:<6d} " + "  ".join(texts))


if __name__ == "__main__":
    main()
