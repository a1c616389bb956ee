"""`--placement ray`: the trainer and the rollout engines as Ray actors in one placement group give
the in-process run's checksums, bit for bit: a real local Ray instance (`num_cpus=2`, no dashboard,
`RAY_AUTH_MODE=disabled`, a private `RAY_TMPDIR`, shut down after) places a trainer actor and a
server actor (`rlbench serve`) behind sglang-router. The embedded-engine actor's path is held to
the same bits without Ray's processes (each actor taking ~10 s to import torch): its actor classes
are called in this process through the same proxies, so everything that crosses is packed and
unpacked as it is between processes."""

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


class _InProcess:
    """Placement without Ray: an "actor" is its class, instantiated here; a method's `.remote()` calls it."""

    def __init__(self, config):
        self.users, self.bundles = 0, None

    def make_group(self, bundles):
        self.bundles = bundles

    def actor(self, cls, bundle, resources, *args):
        from types import SimpleNamespace

        instance = cls(*args)
        return SimpleNamespace(**{name: SimpleNamespace(remote=getattr(instance, name)) for name in dir(cls)
                                  if not name.startswith("_")})

    def release(self):
        self.users -= 1

    def close(self):
        pass


def test_trainer_and_engine_actor_classes_give_the_in_process_run(small_config, reference, tmp_path, monkeypatch):
    from rlbench.placement import ray as placement

    monkeypatch.setattr(placement, "Placement", _InProcess)
    for proxy in (placement.RayTrainer, placement.RayEngine):
        monkeypatch.setattr(proxy, "_get", lambda self, ref: ref)
    out = tmp_path / "actors"
    run(apply_overrides(small_config, out=str(out), placement__backend="ray"))
    _same_run(out, reference)


def test_servers_started_by_actors_behind_the_router_give_the_in_process_run(ray_instance, small_config,
                                                                             reference, tmp_path):
    out = tmp_path / "ray-sglang"
    run(apply_overrides(small_config, out=str(out), placement__backend="ray", rollout__backend="sglang",
                        rollout__sglang_server="rlbench"))
    _same_run(out, reference)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["placement"]["backend"] == "ray" and manifest["versions"]["ray"]
    assert len(manifest["engines"]) == 1
    assert ray_instance.is_initialized()  # rlbench left running the instance it did not start
    assert all(group["state"] == "REMOVED" for group in ray_instance.util.placement_group_table().values())
