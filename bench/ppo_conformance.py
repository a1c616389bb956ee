"""How far rlbench's GAE (rlbench/core/ppo.py) is from slime's own, case by case: the largest relative difference
|rlbench - slime| / max(1, |slime|) of the advantages and returns of expected_ppo.json's GAE cases (slime 624b824a's
vanilla_gae and chunked_gae, as tests/conformance/slime/build_expected_ppo.py wrote them), by function, input dtype
and response length. tests/conformance/slime/test_ppo.py holds the same cases to their bounds; this prints the
figures docs/benchmarks.md gives.

    python bench/ppo_conformance.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlbench.core import ppo

EXPECTED = Path(__file__).resolve().parents[1] / "tests" / "conformance" / "slime" / "expected_ppo.json"


def main() -> None:
    expected = json.loads(EXPECTED.read_text())
    worst: dict[tuple[str, str, int], float] = {}
    for case in expected["gae_cases"]:
        inputs = expected["gae_inputs"][str(case["length"])]
        dtype = getattr(torch, case["dtype"])
        rewards, values = (torch.tensor(inputs[k], dtype=torch.float64).to(dtype) for k in ("rewards", "values"))
        advantages, returns = ppo.gae([rewards], [values], case["gamma"], case["lambd"])
        for got, want in ((advantages[0], case["advantages"]), (returns[0], case["returns"])):
            want = torch.tensor(want, dtype=torch.float64)
            difference = float(((got - want).abs() / want.abs().clamp(min=1)).max())
            key = (case["function"], case["dtype"], case["length"])
            worst[key] = max(worst.get(key, 0.0), difference)
    print(f"slime {expected['slime']['commit'][:12]}: the largest relative difference over (gamma, lambd) cases")
    for (function, dtype, length), difference in sorted(worst.items()):
        print(f"{function:12s} {dtype:8s} {length:4d} tokens  {difference:.2e}")


if __name__ == "__main__":
    main()
