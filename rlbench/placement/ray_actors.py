"""The Ray actors of `--placement ray` (ray.py places them and drives them): what runs inside Ray's worker
processes, and what crosses between them and the driver. Tensors cross as safetensors bytes with their names
in order, requests and results as JSON-able dicts, checkpoints as file bytes: data, never pickled objects of
ours (Ray's own transport wraps them).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rlbench.backends import registry
from rlbench.core.types import GenerateRequest

if TYPE_CHECKING:  # torch is imported where tensors are handled: a server actor never needs it
    import torch


# ---- what crosses between the driver and the actors ----------------------------------------------


def pack(tensors: dict[str, torch.Tensor | None]) -> tuple[bytes, list[str]]:
    """Named tensors as safetensors bytes and their names in order (None values are left out)."""
    from safetensors.torch import save

    kept = {k: v.detach().cpu().contiguous() for k, v in tensors.items() if v is not None}
    return save(kept), list(kept)


def unpack(data: tuple[bytes, list[str]]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    raw, names = data
    tensors = load(raw)
    return {name: tensors[name] for name in names}


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _config(config_json: str):
    from rlbench.config import config_from_dict

    return config_from_dict(json.loads(config_json), "the driver's run config")


def _actor_device(device: str) -> str:
    return "cuda" if device.startswith("cuda") else device  # Ray sets the actor's CUDA_VISIBLE_DEVICES


# ---- the actors -------------------------------------------------------------------------------


class TrainerActor:
    """Rank 0 of the trainer: the loop's Trainer calls, run here."""

    def __init__(self, config_json: str, weights: tuple[bytes, list[str]]):
        from rlbench.core.model import build_model, load_named_
        from rlbench.core.seeding import configure_determinism

        config = _config(config_json)
        config = config.replace(device=_actor_device(config.device))
        configure_determinism(config.threads, config.device, config.deterministic)
        model = build_model(config.model.path, config.seed, config.model.dtype, config.device, init=config.model.init)
        load_named_(model, unpack(weights), source="the driver's initial weights")
        self.trainer = registry.make_trainer(config, model, RankActors())
        self.checkpoints: Path | None = None  # made by the first load; the placement removes it (remove_checkpoints)

    def logprobs(self, tensors, reference: bool, per_sample: bool):
        given = unpack(tensors)
        return pack({"logprobs": self.trainer.logprobs(given["tokens"], reference, given.get("lengths"), per_sample)})

    def train_step(self, tensors, step: int):
        from rlbench.core.algo import TrainBatch

        given = unpack(tensors)
        stats = self.trainer.train_step(
            TrainBatch(
                given["tokens"],
                given["loss_mask"],
                given["advantages"],
                given["old_logprobs"],
                given.get("ref_logprobs"),
                given.get("lengths"),
                given.get("rollout_logprobs"),
                given.get("rollouts"),
            ),
            step,
        )
        return stats.metrics, pack({"losses": stats.losses}), stats.grads_digest, stats.param_grads

    def export_hf_weights(self):
        return pack(self.trainer.export_hf_weights())

    def save_checkpoint(self) -> dict[str, bytes]:
        # bytes: what Ray carries back (a memoryview does not cross processes)
        return {name: bytes(data) for name, data in self.trainer.save_checkpoint().items()}

    def load_checkpoint(self, files: dict[str, bytes]) -> None:
        """The driver's files in a directory on this node (megatron's ranks may read them only when they start): it
        stays until the placement, before killing this actor (no finalizer runs), has it removed (Placement.close)."""
        if self.checkpoints is None:
            self.checkpoints = Path(tempfile.mkdtemp(prefix="rlbench-ray-checkpoint-"))
        directory = Path(tempfile.mkdtemp(dir=self.checkpoints))
        for name, data in files.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(data)
        self.trainer.load_checkpoint(directory)

    def remove_checkpoints(self) -> None:
        import shutil

        if self.checkpoints is not None:
            shutil.rmtree(self.checkpoints, ignore_errors=True)
            self.checkpoints = None

    def close(self) -> None:
        self.trainer.close()


class RankActor:
    """A worker rank of the megatron trainer, in a bundle of its own."""

    def work(self, host: str, port: int, rank: int, world: int, device: str) -> None:
        from rlbench.backends.megatron import worker

        worker.work(host, port, rank, world, device)


class RankActors:
    """Ranks 1.. as Ray actors (what launch.spawn starts; see launch.Processes for the other way):
    rank r in bundle r of the placement group the caller, rank 0's actor, runs in. They reach its
    store at this node's IP, and each takes the one GPU Ray gives its actor (cuda:0 there)."""

    @property
    def host(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(self, port: int, world: int, device: str) -> list[RankWorker]:
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        own = "cuda:0" if device.startswith("cuda") else device
        group, workers = get_current_placement_group(), []
        for rank in range(1, world):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank)
            handle = (
                ray.remote(RankActor)
                .options(num_cpus=1, num_gpus=int(own.startswith("cuda")), scheduling_strategy=strategy)
                .remote()
            )
            workers.append(RankWorker(handle, handle.work.remote(self.host, port, rank, world, own)))
        return workers


class RankWorker:
    """A rank actor, handled as launch.py handles a rank process (poll, wait, kill). Its loop's end
    is `wait`'s; the actor itself lives on until `kill` (then `poll` says so), unless its loop failed:
    then `poll` gives what a rank process would have exited with (SIGKILL's status for an actor that
    died, launch.PEER_LOST for a loop that failed because another rank died, 1 for any other failure),
    so that rank 0 names a dead rank actor as it names a dead rank process. launch.py's exit watcher
    calls `wait()` on a thread of its own, which returns when the actor's loop ends or the actor dies."""

    def __init__(self, handle, done):
        self.handle, self.done, self.returncode = handle, done, None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None and ray.wait([self.done], timeout=0)[0]:
            from rlbench.backends.megatron.launch import PEER_LOST, lost_peer

            try:
                ray.get(self.done)
            except ray.exceptions.RayActorError:
                self.returncode = -9
            except ray.exceptions.RayTaskError as exc:
                self.returncode = PEER_LOST if lost_peer(exc.cause) else 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        import subprocess

        import ray

        if self.returncode is None and not ray.wait([self.done], timeout=timeout)[0]:
            raise subprocess.TimeoutExpired("a megatron rank actor", timeout)
        return self.returncode

    def kill(self) -> None:
        import ray

        ray.kill(self.handle)
        self.returncode = -9


class EngineActor:
    """The embedded engine, in an actor of its own."""

    def __init__(self, config_json: str, weights: tuple[bytes, list[str]], start: int):
        from rlbench.core.model import build_model, load_named_
        from rlbench.core.seeding import configure_determinism

        config = _config(config_json)
        device = _actor_device(config.device)
        configure_determinism(config.threads, device, config.deterministic)
        model = build_model(config.model.path, config.seed, config.model.dtype, device, init=config.model.init)
        load_named_(model, unpack(weights), source="the driver's initial weights")
        self.engine = registry.make_hf_engine(config, model, start, device, engine_id="hf:ray")

    def generate(self, requests: list[dict]) -> list[dict]:
        reqs = [GenerateRequest(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()}) for r in requests]
        return [dataclasses.asdict(r) for r in self.engine.generate(reqs)]

    def update_weights(self, weights, version: int) -> None:
        self.engine.update_weights(unpack(weights), version)

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        return self.engine.weight_checksums()

    def export_weights(self, holder: str, names: list[str]):
        return pack(self.engine.export_weights(holder, names))


class ServerActor:
    """One SGLang server (or `rlbench serve`), started on the actor's node, stopped with it. `key`: the driver's
    RLBENCH_SGLANG_API_KEY, handed over as an argument (a node of a remote cluster does not have the driver's
    environment), never in a runtime environment or on a command line; the server gets it as server_env says."""

    def start(self, config_json: str, index: int, key: str | None = None) -> str:
        import ray

        from rlbench.backends.sglang.client import Client
        from rlbench.backends.sglang.fleet import launch_server, make_logs, not_ready, wait_server

        config = _config(config_json)
        host = ray.util.get_node_ip_address()
        self.logs = make_logs()
        self.proc = launch_server(config.engine_setup(), self.logs, index, host=host, key=key)
        client = Client(4, 30)
        try:
            return wait_server(self.proc, lambda url: client.run(not_ready(client, url)))
        finally:
            client.close()

    def stop(self) -> None:
        import shutil

        from rlbench.backends.sglang.fleet import stop_processes

        if getattr(self, "proc", None) is not None:
            stop_processes([self.proc])
            shutil.rmtree(self.logs, ignore_errors=True)
            self.proc = None
