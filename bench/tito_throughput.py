"""How fast `check tito` reads a recording, against plain tokenizer encoding of the same text.

Records a default-task run (`--steps`, 64 samples a step), then, in one process:
  check   `rlbench.checks.tito.check_run(RUN)`: read and verify every rollout file, render each
          sample's conversation with the chat template, encode it, compare ids, classify findings;
  encode  `tokenizer.encode` of the same rendered texts, one call per sample, nothing else.
Each is timed `--repeats` times, best kept (the least disturbed by other load); prints samples per
second of both and the ratio check / encode, PASS when <= 2.

Run:  python bench/tito_throughput.py [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rlbench.checks.tito import render
from rlbench.checks.tito_run import check_run
from rlbench.config import load_config
from rlbench.session import run
from rlbench.core.model import load_tokenizer
from rlbench.rundir.recording import read_step
from rlbench.rundir.directory import read_run

BUDGET = 2.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlbench-bench-") as tmp:
        root = Path(tmp) / "run"
        config = load_config(steps=args.steps, out=str(root))
        run(config)
        tok = load_tokenizer(config.model.tokenizer)
        texts = []
        for step in read_run(root).steps:
            for sample in read_step(root, step)[1]["samples"]:
                reply = {"role": "assistant", "content": sample["response"]}
                texts.append(render(tok, list(sample["messages"]) + [reply], None, False))
        check_times, encode_times = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            report = check_run(root)
            check_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            for text in texts:
                tok.encode(text, add_special_tokens=False)
            encode_times.append(time.perf_counter() - start)
    check, encode = min(check_times), min(encode_times)
    n = report.samples
    print(f"{n} samples over {args.steps} steps; {len(report.findings)} findings")
    print(f"check tito: {check:.3f} s, {n / check:,.0f} samples/s")
    print(f"plain encode of the same texts: {encode:.3f} s, {n / encode:,.0f} samples/s")
    print(f"ratio check / encode: {check / encode:.2f} (budget {BUDGET:.0f}x)")
    print("PASS" if check / encode <= BUDGET else "FAIL")


if __name__ == "__main__":
    main()
