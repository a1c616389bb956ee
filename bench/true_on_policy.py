"""What true on-policy costs, and what it buys: the default run with and without it.

Runs the default loop (100 steps) both ways, alternating, in one process (after a short untimed
warm-up run). With `rollout.true_on_policy`, the engine rescores every finished sequence with the
trainer's batch-size-1 forward and the trainer's logprob stage uses that same forward, so
train/train_rollout_logprob_abs_diff is exactly 0; without it, the mismatch is what it is.
Prints the mean |delta| of both, their median step times, and the ratio.

Run:  python bench/true_on_policy.py [--steps 100] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics

from rlbench.config import load_config
from rlbench.session import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    run(load_config(steps=3))
    times = {False: [], True: []}
    mismatch = {False: [], True: []}
    for _ in range(args.repeats):
        for on in (False, True):
            result = run(load_config(steps=args.steps, rollout__true_on_policy=on))
            times[on] += [h["perf/step_time"] for h in result.history[1:]]
            mismatch[on] += [h["train/train_rollout_logprob_abs_diff"] for h in result.history]
    for on in (False, True):
        label = "true on-policy" if on else "default       "
        print(
            f"{label}: median step {statistics.median(times[on]) * 1e3:7.2f} ms, "
            f"mean |delta logp| {statistics.fmean(mismatch[on]):.3e}, max over steps {max(mismatch[on]):.3e}"
        )
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"cost of true on-policy: step time ratio {ratio:.4f} ({(ratio - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
