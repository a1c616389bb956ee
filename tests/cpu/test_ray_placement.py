"""`--placement ray`: the trainer's ranks and the rollout engines as Ray actors in one placement
group give the in-process run's checksums, bit for bit. A real local Ray instance (no dashboard,
`RAY_AUTH_MODE=disabled`, a private `RAY_TMPDIR`, shut down after) places `--trainer megatron --tp
2`: rank 0 in the trainer actor, rank 1 in an actor of its own, and a server actor (`rlbench
serve`) behind sglang-router; the run equals the in-process TP=2 run (rank processes), and leaves
no actor or process behind. The embedded-engine actor's path and the torch trainer's are held to
the same bits without Ray's processes (each actor taking ~10 s to import torch): their actor
classes are called in this process through the same proxies, so everything that crosses is packed
and unpacked as it is between processes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from rlbench.config import apply_overrides, load_config
from rlbench.core.loop import run
from rlbench.rundir.directory import read_run
from tests.cpu.megatron_reference import TOML, reference_runs


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    tmp = tempfile.mkdtemp(prefix="rlray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    os.environ["RAY_TMPDIR"] = tmp
    # 3 logical CPUs (Ray's scheduling tokens, not cores): a bundle of one each for two trainer ranks and a server
    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
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

    def __init__(self, config, bundles):
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


def test_bundles_one_per_trainer_rank_then_one_per_engine_and_cpus_enough_for_them(small_config):
    from rlbench.errors import BadInput
    from rlbench.backends.registry import bundles as _shape
    from rlbench.placement.ray import local_cpus

    ray = {"placement__backend": "ray"}
    assert _shape(apply_overrides(small_config, **ray)) == (1, 1)
    megatron = apply_overrides(small_config, train__backend="megatron", tp=2, dp=2, **ray)
    assert _shape(megatron) == (4, 1)
    assert _shape(apply_overrides(megatron, rollout__backend="sglang", rollout__num_engines=3)) == (4, 3)
    assert _shape(apply_overrides(megatron, mode="rollout-only")) == (0, 1)
    assert local_cpus(megatron, 5) == max(os.cpu_count(), 5)
    assert local_cpus(apply_overrides(megatron, placement__num_cpus=5), 5) == 5
    with pytest.raises(BadInput, match=r"placement.num_cpus: expected at least 5 .* got 4"):
        local_cpus(apply_overrides(megatron, placement__num_cpus=4), 5)


def _actors() -> list[dict]:
    """Ray's actor table, read from its GCS (the public state API, ray.util.state, needs the dashboard)."""
    from ray._private import state

    return list(state.actors().values())


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _instance_processes_running_rlbench() -> list[int]:
    """Processes of the test's Ray instance (its RAY_TMPDIR in their environment) whose command names rlbench."""
    tag = f"RAY_TMPDIR={os.environ['RAY_TMPDIR']}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and tag in (entry / "environ").read_bytes().split(b"\0") \
                    and b"rlbench" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.slow  # actors importing megatron-core; the reference run's rank processes (megatron_reference.py)
def test_megatron_ranks_and_servers_as_actors_give_the_in_process_tp2_run(ray_instance, tmp_path_factory,
                                                                          worker_id, tmp_path, monkeypatch):
    from rlbench.placement import ray as placement

    during = {}
    train_step = placement.RayTrainer.train_step

    def watched(self, batch, step):  # what runs while the run does
        during.setdefault("actors", [a for a in _actors() if a["State"] == "ALIVE"])
        during.setdefault("groups", list(ray_instance.util.placement_group_table().values()))
        during.setdefault("running", [_running(a["Pid"]) for a in during["actors"]])  # the check below sees them
        return train_step(self, batch, step)

    monkeypatch.setattr(placement.RayTrainer, "train_step", watched)
    (tmp_path / "s.toml").write_text(TOML)
    out = tmp_path / "ray-tp2"
    run(apply_overrides(load_config(tmp_path / "s.toml"), steps=2, tp=2, out=str(out), placement__backend="ray",
                        rollout__backend="sglang", rollout__sglang_server="rlbench"))

    # slime's shape: trainer bundles first, one per rank, then one per engine; rank 1 an actor rank 0 owns
    [group] = during["groups"]
    assert (group["strategy"], len(group["bundles"])) == ("PACK", 3)
    by_class = {a["ActorClassName"]: a for a in during["actors"]}
    assert sorted(a["ActorClassName"] for a in during["actors"]) == ["RankActor", "ServerActor", "TrainerActor"]
    assert by_class["RankActor"]["OwnerAddress"] == by_class["TrainerActor"]["Address"]
    assert during["running"] == [True] * 3

    # The in-process TP=2 run of this config (10 steps; a step's bits do not depend on the step count):
    # asked for after the run, so that another worker making it meanwhile costs no wall time here.
    reference = reference_runs(tmp_path_factory, worker_id)
    lines = (out / "checksums.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    assert lines == (reference / "tp2" / "checksums.jsonl").read_bytes().splitlines(keepends=True)[:2]
    assert lines[0] != (reference / "tp1" / "checksums.jsonl").read_bytes().splitlines(keepends=True)[0]
    strip = [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_run(out).metrics]
    assert strip == [{k: v for k, v in row.items() if not k.startswith("perf/")}
                     for row in read_run(reference / "tp2").metrics[:2]]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["placement"]["backend"] == "ray" and manifest["versions"]["ray"]
    assert (manifest["config"]["tp"], len(manifest["engines"])) == (2, 1)

    # nothing left: every actor dead and its process gone, no server process, the group removed
    assert ray_instance.is_initialized()  # rlbench left running the instance it did not start
    assert all(g["state"] == "REMOVED" for g in ray_instance.util.placement_group_table().values())
    deadline = time.monotonic() + 30
    while (any(_running(a["Pid"]) for a in during["actors"]) or _instance_processes_running_rlbench()) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [a["ActorClassName"] for a in _actors() if a["State"] != "DEAD"] == []
    assert [a["ActorClassName"] for a in during["actors"] if _running(a["Pid"])] == []
    assert _instance_processes_running_rlbench() == []
