"""GPU golden logs (tests/gpu/golden/suite.json): a CUDA run checked in the exact tier against the golden file
made on this GPU model with these torch, CUDA and transformers builds (deterministic mode repeats bit for bit).

Golden files are keyed to that environment (rlbench.checks.golden_build.golden_file_name), so the test runs on the
GPU machine's own versions and never skips for a file made elsewhere. Where this environment has no file yet,
it fails and says how to make one: deliberately, with a reason, by `golden/regenerate.py`."""

from __future__ import annotations

import json

import pytest

from rlbench.checks.golden_build import golden_file_name
from tests.conftest import REPO, run_cli

HERE = REPO / "tests" / "gpu" / "golden"
SUITE = json.loads((HERE / "suite.json").read_text())


@pytest.mark.parametrize("name", sorted(SUITE))
def test_cuda_golden(tmp_path, name):
    if "megatron" in SUITE[name]:
        pytest.importorskip(
            "megatron.core", reason="--trainer megatron needs megatron-core (pip install '.[megatron]')"
        )
    res = run_cli("run", *SUITE[name], "--out", str(tmp_path / "run"), "--json")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    golden = HERE / golden_file_name(name, manifest)
    assert golden.is_file(), (
        f"no golden file for this GPU and these versions ({golden.relative_to(REPO)}): make it on this machine with "
        f"`python golden/regenerate.py --suite tests/gpu/golden/suite.json --reason '<why>' {name}`, then commit it"
    )
    check = run_cli("check", "golden", str(tmp_path / "run"), str(golden), "--ignore", "perf/*")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "golden check passed (exact tier)" in check.stdout
