"""What the tests' fork server (tests/forkserver.py) saves a test that needs a process of its own: `rlbench run` of
the tests' small config as the fork server's child against the same command in a fresh interpreter, alternating.

    python bench/forkserver.py [--rounds 5] [--steps 6]

Each round runs both (the order flipping every round), each to its end, timed from the request to the exit status
and the output read; the fork server is started before the first round (its own start-up, paid once per pytest
process, is printed apart). Prints each's median and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import _fork_server, run_cli, small_toml  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="the small config's steps (tests/conftest.py small_toml)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlbench-forkbench-"))
    (root / "s.toml").write_text(small_toml(args.steps))
    start = time.perf_counter()
    _fork_server()
    print(f"fork server started in {time.perf_counter() - start:.2f} s (once per pytest process)")
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for fresh in (False, True) if r % 2 == 0 else (True, False):
            out = root / f"run-{r}-{int(fresh)}"
            start = time.perf_counter()
            res = run_cli("run", "-c", str(root / "s.toml"), "--out", str(out), "--json", process=True, fresh=fresh)
            times[fresh].append(time.perf_counter() - start)
            if res.returncode != 0:
                sys.exit(f"the {'fresh' if fresh else 'forked'} run failed: {res.stderr[-2000:]}")
    forked, fresh = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"rlbench run, {args.steps} steps of the tests' small config, {args.rounds} alternating rounds: "
        f"forked {forked:.2f} s, fresh interpreter {fresh:.2f} s (medians): x{forked / fresh:.2f}"
    )


if __name__ == "__main__":
    main()
