"""How sharp the golden suite is: each mutation of tests/cpu/test_golden_mutations.py applied to
golden/default.json's run, and what `check golden` finds in each tier (perf/* left out).

The test asserts the exact tier catches every mutation; this prints the detail: how many metrics
move, from which step, and which of them the approx tier (the cross-platform tolerances) still
catches.

Run:  python bench/golden_mutations.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlbench.checks.golden import load_golden  # noqa: E402
from rlbench.checks.golden_compare import compare  # noqa: E402
from tests.cpu import test_golden_mutations as mutations  # noqa: E402


def main() -> int:
    golden = load_golden(mutations.GOLDEN)
    missed = 0
    for name, apply in mutations.MUTATIONS.items():
        patch = pytest.MonkeyPatch()
        try:
            if apply is not None:
                apply(patch)
            with tempfile.TemporaryDirectory() as tmp:
                run = mutations._golden_run(Path(tmp))
        finally:
            patch.undo()
        exact = compare(run, golden, "exact", ignore=["perf/*"])
        approx = compare(run, golden, "approx", ignore=["perf/*"])
        first = min((f.step for m in exact.failed for f in m.failures), default=None)
        caught = not exact.ok
        if apply is not None and not caught:
            missed += 1
        print(
            f"{name:25s} exact: {len(exact.failed):2d} of {len(exact.metrics)} metrics differ"
            f"{f', from step {first}' if first is not None else ''}; approx: "
            f"{', '.join(m.name for m in approx.failed) or 'passes'}"
        )
    print("every mutation caught in the exact tier" if not missed else f"{missed} mutation(s) MISSED")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
