"""Regenerate the golden logs in this directory, deliberately: python golden/regenerate.py --reason TEXT

Each entry of suite.json (or of --suite FILE) is `rlbench run ARGS` (from the repository root), whose run directory
`rlbench golden update` turns into NAME.json beside the suite file, the reason appended to the file's history. A CUDA
run's file is NAME/<gpu>-torch<v>-cuda<v>-transformers<v>.json instead
(rlbench.checks.golden_build.golden_file_name): on the GPU machine this writes the file for that machine's GPU
and versions, and leaves other machines' files alone.
Only through `rlbench golden update`: the suite (tests/cpu/test_golden_suite.py) checks that the
committed files are what it writes for the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from rlbench.checks.golden_build import golden_file_name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reason", required=True, help="why the golden values change (kept in each file's history)")
    parser.add_argument(
        "--suite",
        default=str(HERE / "suite.json"),
        help="the suite file; the golden files go beside it. golden/suite.json: the CPU suite "
        "(tests/cpu); tests/gpu/golden/suite.json: the GPU suite (tests/gpu)",
    )
    parser.add_argument("names", nargs="*", help="suite entries to regenerate [default: all]")
    args = parser.parse_args()
    suite_file = Path(args.suite).resolve()
    suite = json.loads(suite_file.read_text())
    unknown = sorted(set(args.names) - set(suite))
    if unknown:
        parser.error(f"not in suite.json: {', '.join(unknown)} (entries: {', '.join(suite)})")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names or suite:
            run_dir = Path(tmp) / name
            code = rlbench("run", *suite[name], "--out", str(run_dir), "--json", quiet=True)
            if code:  # rlbench said why on stderr (one line): no golden file is written from a failed run
                print(
                    f"regenerate.py: {name}: `rlbench run {' '.join(suite[name])}` exited {code}; no golden file "
                    f"written for it or after it",
                    file=sys.stderr,
                )
                return code
            manifest = json.loads((run_dir / "manifest.json").read_text())
            golden = suite_file.parent / golden_file_name(name, manifest)  # a CUDA run's: keyed to GPU and versions
            golden.parent.mkdir(exist_ok=True)
            code = rlbench("golden", "update", str(run_dir), str(golden.relative_to(REPO)), "--reason", args.reason)
            if code:
                return code
    return 0


def rlbench(*argv: str, quiet: bool = False) -> int:
    """`rlbench ARGV` from the repository root, through the console entry point in this process (one
    interpreter start for the whole suite, not two per entry); its exit code."""
    from rlbench.cli import main

    saved_argv, saved_cwd = sys.argv, os.getcwd()
    sys.argv = ["rlbench", *argv]
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            main()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)


if __name__ == "__main__":
    sys.exit(main())
