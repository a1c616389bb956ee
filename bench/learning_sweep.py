"""What makes the default run learn: settings x seeds, each a whole run, and how many pass.

The default run's acceptance (tests/cpu/test_learning.py) is: mean reward of the last 10 steps
>= 0.9, and no answer word ("even", "odd") in more than 60% of those steps' responses. A run
that stops at step N is the first N steps of a longer run (nothing in the loop depends on the
step count), so one 100-step run per (setting, seed) says whether N = 60, 80 or 100 steps pass.

Each (setting, seed) runs in its own process with 1 torch thread (`--procs` at a time), writes its
run directory to a temporary directory, and is reduced to per-step reward, answer words and step
time. Prints, per setting: how many seeds pass at 60, 80 and 100 steps, the mean last-10 reward at
100, and the median step time (comparable between settings of one sweep, on one machine).

    python bench/learning_sweep.py                       # docs/benchmarks.md's table (8 seeds each)
    python bench/learning_sweep.py --procs 16 --seeds 19,1,2,3
    python bench/learning_sweep.py --only base,lr2e-3    # some settings

A setting is config overrides (rlbench.config.load_config's `section__field` keys); `model` names a
variant of the tiny-qwen3 config (its fields changed as given), written to a temporary directory.
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
STEPS = (60, 80, 100)
DEFAULT_SEED = RunConfig().seed  # rlbench.config loads no torch: numerics.pin above still comes first

SETTINGS: dict[str, dict] = {
    "base": {},  # the default: 4 prompts x 16 samples, 4 minibatches, lr 1e-3, GRPO with std
    "lr7e-4": {"train__lr": 7e-4},
    "lr2e-3": {"train__lr": 2e-3},
    "lr3e-3": {"train__lr": 3e-3},
    "minibatches 2": {"train__minibatches": 2},
    "minibatches 2, lr2e-3": {"train__minibatches": 2, "train__lr": 2e-3},
    "minibatches 1, lr3e-3": {"train__minibatches": 1, "train__lr": 3e-3},
    "8 prompts x 8": {"data__prompts_per_step": 8, "rollout__n_samples_per_prompt": 8},
    "2 new tokens": {"rollout__max_new_tokens": 2},
    "no std (Dr. GRPO)": {"algo__normalize_std": False},
    "no std, lr2e-3": {"algo__normalize_std": False, "train__lr": 2e-3},
    "temperature 1.5": {"rollout__temperature": 1.5},
    "entropy 0.001": {"algo__entropy_coef": 0.001},
    "clip-higher 0.28": {"algo__eps_clip_high": 0.28},
    "betas 0.9, 0.99": {"train__betas": (0.9, 0.99)},
    "grad clip 10": {"train__grad_clip": 10.0},
    "init std 0.05": {"model": {"initializer_range": 0.05}},
    "1 layer": {"model": {"num_hidden_layers": 1}},
    "hidden 128": {
        "model": {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 8, "num_key_value_heads": 4}
    },
}


def _model_dir(changes: dict, root: Path) -> str:
    source = REPO / "rlbench" / "fixtures" / "models" / "tiny-qwen3"
    target = root / "model"
    shutil.copytree(source, target)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}, indent=1))
    return str(target)


def run_one(job: tuple[str, int]) -> dict:
    name, seed = job
    import torch

    torch.set_num_threads(1)
    from rlbench.config import load_config
    from rlbench import session

    overrides = dict(SETTINGS[name])
    root = Path(tempfile.mkdtemp(prefix="rlbench-sweep-"))
    try:
        if "model" in overrides:
            overrides["model__path"] = _model_dir(overrides.pop("model"), root)
        out = root / "run"
        session.run(load_config(seed=seed, out=str(out), steps=max(STEPS), **overrides))
        rows = []
        for line in (out / "metrics.jsonl").read_text().splitlines():
            metrics = json.loads(line)
            words = collections.Counter()
            recorded = json.loads((out / "rollouts" / f"{metrics['step']:06d}.json").read_text())
            for sample in recorded["samples"]:
                found = ANSWER.search(sample["response"])
                words[found.group(0).lower() if found else None] += 1
            rows.append(
                {
                    "reward": metrics["rollout/raw_reward"],
                    "time": metrics["perf/step_time"],
                    "even": words["even"],
                    "odd": words["odd"],
                    "n": sum(words.values()),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=",".join(map(str, [DEFAULT_SEED, *range(1, 8)])))
    parser.add_argument("--procs", type=int, default=os.cpu_count())
    parser.add_argument("--only", default=None, help="comma-separated setting names")
    parser.add_argument(
        "--per-seed",
        action="store_true",
        help="also print each run: its last-10 reward and verdict at the default's 85 steps and at 100",
    )
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SETTINGS)
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(name, seed) for name in names for seed in seeds]
    with Pool(args.procs) as pool:
        results = pool.map(run_one, jobs, chunksize=1)
    mode = numerics.identity()
    print(
        f"{len(names)} settings x {len(seeds)} seeds ({', '.join(map(str, seeds))}), {max(STEPS)} steps each, "
        f"1 thread per run, {args.procs} at a time; numerics {mode['mode']} (ATen {mode['aten_capability']}, "
        f"MKL_CBWR {mode['mkl_cbwr']})"
    )
    print(
        f"{'setting':24s} "
        + " ".join(f"pass@{n:<4d}" for n in STEPS)
        + f"  last-10 @100  seed {DEFAULT_SEED} @100  step"
    )
    for name in names:
        runs = [r for r in results if r["name"] == name]
        cells = [f"{sum(verdict(r['rows'], n)[0] for r in runs)}/{len(runs):<5d}" for n in STEPS]
        mean = statistics.fmean(verdict(r["rows"], max(STEPS))[1] for r in runs)
        own = [verdict(r["rows"], max(STEPS)) for r in runs if r["seed"] == DEFAULT_SEED]
        own_text = (f"{own[0][1]:.2f} {'pass' if own[0][0] else 'fail'}" if own else "-").ljust(14)
        step = statistics.median(row["time"] for r in runs for row in r["rows"])
        print(f"{name:24s} " + "  ".join(cells) + f"   {mean:.2f}          {own_text}  {step * 1e3:.0f} ms")
        for run in runs if args.per_seed else ():
            texts = [
                f"@{n} {reward:.3f} {'pass' if ok else 'fail'}"
                for n in (85, max(STEPS))
                for ok, reward in [verdict(run["rows"], n)]
            ]
            print(f"  seed {run['seed']:<6d} " + "  ".join(texts))


if __name__ == "__main__":
    main()
