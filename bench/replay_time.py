"""What a replay costs next to the training it reproduces.

Runs the default loop (100 steps, recording on), then replays it, in one process. Judged:
  replay step time  = sum of the replay's perf/step_time (read + verify the recording, advantage,
                      logprob, train; no generation at all)
  original train    = sum of the original's perf/train_time (advantage, logprob, train, sync)
  ratio = replay / original train, PASS when <= 1.10.
Also printed, not judged: the replay's whole wall time (start-up, the up-front verification of
every recording file, the loop, the final drain of writes) and the original's whole wall time.

Run:  python bench/replay_time.py [--steps 100]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rlbench.config import load_config
from rlbench.session import run
from rlbench.replay.replay import replay
from rlbench.rundir.directory import read_run

BUDGET = 1.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlbench-bench-") as tmp:
        original = Path(tmp) / "original"
        start = time.perf_counter()
        run(load_config(steps=args.steps, out=str(original)))
        original_wall = time.perf_counter() - start
        start = time.perf_counter()
        res = replay(original, Path(tmp) / "replay")
        replay_wall = time.perf_counter() - start
        assert res.ok, f"replay diverged: {res.diverged}"
        train = sum(row["perf/train_time"] for row in read_run(original).metrics)
        rollout = sum(row["perf/rollout_time"] for row in read_run(original).metrics)
        replayed = sum(row["perf/step_time"] for row in read_run(Path(tmp) / "replay").metrics)
    ratio = replayed / train
    print(f"steps {args.steps}, replay reproduced {res.reproduced} bit for bit")
    print(
        f"original: wall {original_wall:.2f} s, of which generation (rollout stage) {rollout:.2f} s, "
        f"train stages {train:.3f} s"
    )
    print(f"replay:   wall {replay_wall:.2f} s (start-up and up-front verification included), steps {replayed:.3f} s")
    print(f"ratio replay steps / original train stages: {ratio:.4f} (budget {BUDGET:.2f})")
    print("PASS" if ratio <= BUDGET else "FAIL")


if __name__ == "__main__":
    main()
