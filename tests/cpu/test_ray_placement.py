"""`--placement ray`: the trainer and the rollout engine as Ray actors in one placement group give the
in-process run's checksums, bit for bit, with the embedded engine in an actor and with an `rlbench
serve` server started by an actor behind sglang-router. One local Ray instance for the module
(`num_cpus=2`, no dashboard, `RAY_AUTH_MODE=disabled`, a private `RAY_TMPDIR`), shut down after it."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import pytest

from rlbench.config import apply_overrides
from rlbench.core.loop import run
from rlbench.rundir.directory import read_run

pytestmark = pytest.mark.xdist_group("ray")  # one Ray instance: every test of the module on one worker


@pytest.fixture(scope="module")
def ray_instance():
    import os

    ray = pytest.importorskip("ray")
    tmp = tempfile.mkdtemp(prefix="rlray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             _temp_dir=tmp)
    try:
        yield ray
    finally:
        ray.shutdown()
        os.environ.pop("RAY_TMPDIR", None)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(small_config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    run(apply_overrides(small_config, out=str(out)))
    return out


def _same_run(got: Path, want: Path) -> None:
    assert (got / "checksums.jsonl").read_bytes() == (want / "checksums.jsonl").read_bytes()
    strip = [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_run(got).metrics]
    assert strip == [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_run(want).metrics]


def test_trainer_and_engine_as_actors_give_the_in_process_run(ray_instance, small_config, reference, tmp_path):
    out = tmp_path / "ray"
    run(apply_overrides(small_config, out=str(out), placement__backend="ray"))
    _same_run(out, reference)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["placement"]["backend"] == "ray" and manifest["versions"]["ray"]
    assert ray_instance.is_initialized()  # rlbench left the instance it did not start running
    assert not ray_instance.util.placement_group_table() or all(
        group["state"] == "REMOVED" for group in ray_instance.util.placement_group_table().values())


def test_servers_started_by_actors_behind_the_router_give_the_in_process_run(ray_instance, small_config,
                                                                             reference, tmp_path):
    out = tmp_path / "ray-sglang"
    run(apply_overrides(small_config, out=str(out), placement__backend="ray", rollout__backend="sglang",
                        rollout__sglang_server="rlbench"))
    _same_run(out, reference)
    assert len(json.loads((out / "manifest.json").read_text())["engines"]) == 1
