"""GPU golden logs (tests/gpu/golden/suite.json): a CUDA run checked against the golden file made on
the same GPU model and versions, in the exact tier (deterministic mode repeats bit for bit).
Where the GPU model or versions differ, the exact tier does not apply and the test says so."""

from __future__ import annotations

import json

import pytest
import torch

from rlbench.checks.golden import exact_versions, load_golden
from tests.conftest import REPO, run_cli

HERE = REPO / "tests" / "gpu" / "golden"
SUITE = json.loads((HERE / "suite.json").read_text())


def _installed(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@pytest.mark.parametrize("name", sorted(SUITE))
def test_cuda_golden(tmp_path, name):
    golden = HERE / f"{name}.json"
    header = load_golden(golden).header
    names = sorted(exact_versions(header["versions"]))  # what the golden's run used and the exact tier compares
    here = {"device": torch.cuda.get_device_name(), **{k: _installed(k) for k in names}}
    made = {"device": header["device_name"], **{k: header["versions"].get(k) for k in names}}
    if here != made:
        pytest.skip(f"{golden.name} was made with {made}, this machine has {here}: the exact tier does not apply")
    res = run_cli("run", *SUITE[name], "--out", str(tmp_path / "run"), "--json")
    assert res.returncode == 0, res.stderr
    check = run_cli("check", "golden", str(tmp_path / "run"), str(golden), "--ignore", "perf/*")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "golden check passed (exact tier)" in check.stdout
