"""Portable CPU numerics (rlbench/numerics.py): pinned before torch initialises, read back from torch
and MKL into the manifest, and kept off the one MKL path that differs across CPU vendors (VML sqrt).
Cross-vendor agreement itself is measured with bench/cpu_numerics.py on two CPUs (docs/rundir-determinism.md)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.conftest import RANDOM_INIT_MODEL

PROBE = (
    "import json, rlbench, os; from rlbench import numerics; "
    "print(json.dumps({'env': [os.environ.get('MKL_CBWR'), os.environ.get('ATEN_CPU_CAPABILITY')], "
    "'identity': numerics.identity()}))"
)


def _probe(code: str = PROBE, **env: str) -> dict:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "RLBENCH_CPU_NUMERICS")
    }
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_importing_rlbench_pins_the_portable_settings_and_they_take_effect():
    doc = _probe()
    assert doc["env"] == ["COMPATIBLE", "avx2"]
    ident = doc["identity"]
    assert (ident["mode"], ident["aten_capability"], ident["mkl_cbwr"]) == ("portable", "AVX2", "COMPATIBLE")
    assert ident["blas"].startswith("MKL ") and ident["cpu"]["isa"] in ("x86-64-v3", "x86-64-v4")


def test_native_mode_pins_nothing():
    ident = _probe(RLBENCH_CPU_NUMERICS="native")
    assert ident["env"] == [None, None]
    assert ident["identity"]["mode"] == "native" and ident["identity"]["mkl_cbwr"] == "OFF"


def test_a_user_setting_is_kept_and_reported_as_custom():
    doc = _probe(MKL_CBWR="AVX2")
    assert doc["env"] == ["AVX2", "avx2"]
    assert doc["identity"]["mode"] == "custom" and doc["identity"]["mkl_cbwr"] != "COMPATIBLE"


def test_torch_imported_before_rlbench_is_reported_not_hidden():
    """Too late to pin: the manifest must say what is really in effect, so an exact golden check refuses."""
    doc = _probe("import torch; " + PROBE)
    assert doc["env"] == [None, None]
    assert doc["identity"]["mode"] == "custom" and doc["identity"]["mkl_cbwr"] == "OFF"


def test_the_manifest_records_the_numerics_in_effect(run_small):
    result = run_small("run", steps=1)
    numerics = result.manifest["numerics"]
    assert numerics["mode"] == "portable" and numerics["mkl_cbwr"] == "COMPATIBLE"
    assert numerics["cpu"]["vendor"] in ("AuthenticAMD", "GenuineIntel")


def test_the_torch_trainers_adamw_is_fused(small_config):
    """The for-loop AdamW takes torch.sqrt (MKL VML on the CPU), which rounds differently on AMD and Intel."""
    import torch

    from rlbench.backends.torch_trainer import TorchTrainer
    from rlbench.core.model import build_model

    model = build_model(RANDOM_INIT_MODEL, 0, init="random")
    trainer = TorchTrainer(model, small_config.train, small_config.algo, 1.0, 0)
    assert isinstance(trainer.optimizer, torch.optim.AdamW) and trainer.optimizer.defaults["fused"] is True


def _sqrt_calls(source: str) -> list[int]:
    """Lines calling torch.sqrt(...) or a tensor's .sqrt()/.sqrt_() (math.sqrt on Python floats is fine)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("sqrt", "sqrt_"):
            owner = node.func.value
            if not (isinstance(owner, ast.Name) and owner.id in ("math", "np", "numpy")):
                lines.append(node.lineno)
    return lines


def test_no_vml_sqrt_on_the_compute_path():
    found = {}
    for folder in ("core", "backends"):
        for path in sorted((REPO / "rlbench" / folder).rglob("*.py")):
            calls = _sqrt_calls(path.read_text())
            if calls:
                found[str(path.relative_to(REPO))] = calls
    assert found == {}, f"torch.sqrt on the CPU path (MKL VML, differs across vendors): {found}"


@pytest.mark.parametrize(
    "code, hits", [("torch.sqrt(x)", 1), ("x.sqrt()", 1), ("v.sqrt_()", 1), ("math.sqrt(2.0)", 0), ("x.rsqrt()", 0)]
)
def test_the_sqrt_scan_can_fail(code, hits):
    assert len(_sqrt_calls(code)) == hits


def test_a_run_records_the_versions_of_the_packages_it_used_only(small_config, monkeypatch):
    """With every extra installed, a torch-trainer run still names no megatron-core or sglang: a golden
    made without them is not refused for packages the run never touched."""
    from importlib import metadata

    from rlbench import session

    real = metadata.version
    monkeypatch.setattr(
        session.metadata,
        "version",
        lambda name: {"megatron-core": "0.16.1", "sglang": "0.5.4", "sglang-router": "0.3.2"}.get(name) or real(name),
    )
    assert set(session.versions(small_config)) == {
        "python",
        "rlbench",
        "torch",
        "transformers",
        "tokenizers",
        "safetensors",
    }
    from types import SimpleNamespace

    megatron = SimpleNamespace(train=SimpleNamespace(backend="megatron"), rollout=SimpleNamespace(backend="hf"))
    assert session.versions(megatron)["megatron-core"] == "0.16.1" and "sglang" not in session.versions(megatron)
