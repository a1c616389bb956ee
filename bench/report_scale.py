"""How long `rlbench report` takes on a 10,000-step run, and how large the page is.

    python bench/report_scale.py [--steps 10000] [--work DIR]

A real default run of 3 steps is made, then a run directory of `--steps` steps is written from it:
its recordings re-encoded for every step (each with its own step number and digests, so the report
verifies every file as it reads it), its metrics with the real values moved by a slow drift, its
checksums the recordings' own. Then `rlbench report` runs on it in its own process, timed, and the
page's size is printed. The acceptance this measures (issue 25): under 10 s and under 10 MB.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(work: Path, steps: int) -> Path:
    from rlbench.core.loop import recorded_checksums
    from rlbench.rundir import recording

    seed = work / "seed"
    subprocess.run(
        [sys.executable, "-m", "rlbench", "run", "--steps", "3", "--out", str(seed), "--json"],
        check=True,
        capture_output=True,
    )
    big = work / "big"
    (big / "rollouts").mkdir(parents=True)
    manifest = json.loads((seed / "manifest.json").read_text())
    manifest["config"]["steps"] = steps
    (big / "manifest.json").write_text(json.dumps(manifest, indent=1))
    rows = [json.loads(line) for line in (seed / "metrics.jsonl").read_text().splitlines()]
    sources = [recording.read_step(seed, s) for s in range(3)]
    with open(big / "metrics.jsonl", "w") as metrics, open(big / "checksums.jsonl", "w") as sums:
        for step in range(steps):
            tensors, meta = sources[step % 3]
            data, js = recording.encode_step(
                step,
                tensors,
                meta["samples"],
                {k: v for k, v in meta.items() if k not in ("schema", "step", "samples", "samples_sha256")},
            )
            (big / "rollouts" / f"{step:06d}.safetensors").write_bytes(data)
            (big / "rollouts" / f"{step:06d}.json").write_bytes(js)
            drift = 1 + 0.2 * math.sin(step / 500)
            row = {k: (v * drift if isinstance(v, float) else v) for k, v in rows[step % 3].items()}
            metrics.write(json.dumps({**row, "step": step}) + "\n")
            sums.write(json.dumps({"step": step, **recorded_checksums(tensors)}) + "\n")
    return big


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--work", type=Path, default=None, help="where the runs are written (default: a temp dir)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="rlbench-report-scale-"))
    t0 = time.perf_counter()
    big = build(work, args.steps)
    print(f"built a {args.steps}-step run in {time.perf_counter() - t0:.1f} s: {big}")
    out = work / "report.html"
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "rlbench", "report", str(big), "--out", str(out)], capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"rlbench report failed ({res.returncode}): {res.stderr.strip()}")
    size = out.stat().st_size
    print(
        f"rlbench report: {seconds:.2f} s (its own process, imports included), page {size / 1e6:.2f} MB; "
        f"limits 10 s and 10 MB: {'met' if seconds < 10 and size < 10e6 else 'NOT met'}"
    )
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
