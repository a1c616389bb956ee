"""Build expected_packing.json: how slime packs a step's samples into micro-batches under
`--use-dynamic-batch-size --max-tokens-per-gpu` (slime/utils/seqlen_balancing.py `first_fit_pack`, called by
slime/utils/dp_schedule.py `_pack_step_into_mbs` with the samples' total lengths), for the cases below.

    python tests/conformance/slime/build_expected_packing.py --slime /tmp/slime

`--slime` is a checkout of THUDM/slime (`git archive` of its repository); the commit is recorded in the output.
seqlen_balancing.py imports only the standard library, so it is loaded from its file alone. Run once; the JSON is
committed and tests/conformance/slime/test_packing.py reads only it.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

from build_expected import commit_of, slime_parser  # a sibling script (these run as scripts)

OUT = Path(__file__).resolve().parent / "expected_packing.json"


def cases() -> list[tuple[list[int], int]]:
    """(lengths, max tokens per micro-batch): hand-made edge cases, then seeded random steps."""
    made = [
        ([4, 7, 3, 5, 12, 1, 6], 10),
        ([5, 5, 5], 10),
        ([10, 10], 10),
        ([11], 10),
        ([1] * 9, 4),
        ([], 8),
        ([3, 9, 2, 8, 1, 7], 9),
    ]
    rng = random.Random(24)
    for _ in range(12):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
        made.append((lengths, rng.choice([64, 256, 300, 512, 1024])))
    return made


def main() -> None:
    given = slime_parser(__doc__.splitlines()[0]).parse_args()
    commit = commit_of(given.slime, given.commit)
    spec = importlib.util.spec_from_file_location(
        "seqlen_balancing", given.slime / "slime" / "utils" / "seqlen_balancing.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = [
        {"lengths": lengths, "max_tokens": cap, "bins": module.first_fit_pack(lengths, cap)} for lengths, cap in cases()
    ]
    OUT.write_text(json.dumps({"slime_commit": commit, "cases": out}, indent=1) + "\n")
    print(f"wrote {OUT} ({len(out)} cases, slime {commit[:12]})")


if __name__ == "__main__":
    main()
