"""What an rlbench process costs before and around its work: the CPU seconds (user + sys, the process and every
process it waited for) of `rlbench run --steps 1` (the default run, one step) and of `rlbench run --trainer megatron
--tp 2 --steps 1` (rank 0 and one worker rank, each importing torch, transformers and megatron-core), for this
checkout and for another commit (a git worktree made for it), alternating, each in a fresh process. The CPU suite
starts over a hundred such processes, so their start is most of its time on two cores. Most of a process's start is
imports: torch, transformers (whose Qwen3 model imports torch's dynamo and inductor through its kernels'
integrations) and, in a megatron rank, megatron-core.

Also, per tree in a fresh process: the seconds one more `rlbench` call takes in a process that already made one
(`rlbench.cli.main` with `rlbench --version`, the median of 20 after a first; tests/conftest.py's `cli` calls
the entry point so, hundreds of times a suite run): what the CLI's own set-up costs a call.

    python bench/startup.py [--against REV] [--repeats 5]

Prints each measure's median per tree and their ratio (this checkout / REV).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "default run, 1 step": ["run", "--steps", "1"],
    "megatron TP=2, 1 step": ["run", "--trainer", "megatron", "--tp", "2", "--steps", "1"],
}


def cpu_seconds(tree: Path, args: list[str], out: Path) -> float:
    """CPU seconds of `python -m rlbench ARGS --out OUT` with `tree` first on the path (its children included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "rlbench", *args, "--out", str(out)], cwd=out.parent, env=env, capture_output=True
    )
    if done.returncode != 0:
        sys.exit(f"{tree}: rlbench {' '.join(args)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


CLI_CALLS = """
import statistics, sys, time
from rlbench.cli import main
def call():
    sys.argv = ["rlbench", "--version"]
    try:
        main()
    except SystemExit:
        pass
call()
times = []
for _ in range(20):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
print(statistics.median(times), file=sys.stderr)
"""


def cli_call_seconds(tree: Path) -> float:
    """The median seconds of an in-process `rlbench --version` after the first, with `tree` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", CLI_CALLS], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{tree}: in-process rlbench calls exited {done.returncode}: {done.stderr[-500:]}")
    return float(done.stderr.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD~1", help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="rlbench-startup-"))
    other = scratch / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(other), args.against], check=True)
    try:
        trees = {"this checkout": REPO, args.against: other}
        seconds: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.repeats):
            for index, (name, command) in enumerate(COMMANDS.items()):
                for side, (label, tree) in enumerate(trees.items()):
                    out = scratch / f"run-{round_}-{index}-{side}"
                    seconds.setdefault((name, label), []).append(cpu_seconds(tree, command, out))
                    shutil.rmtree(out, ignore_errors=True)
            for label, tree in trees.items():
                seconds.setdefault(("cli", label), []).append(cli_call_seconds(tree))
        for name in COMMANDS:
            mine, theirs = (statistics.median(seconds[(name, label)]) for label in trees)
            print(
                f"{name}: this checkout {mine:.2f} s CPU, {args.against} {theirs:.2f} s (medians of {args.repeats}, "
                f"alternating): x{mine / theirs:.3f}"
            )
        mine, theirs = (statistics.median(seconds[("cli", label)]) for label in trees)
        print(
            f"an in-process `rlbench --version` after the first: this checkout {mine * 1e3:.1f} ms, {args.against} "
            f"{theirs * 1e3:.1f} ms (medians of {args.repeats} processes, alternating): x{mine / theirs:.3f}"
        )
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
