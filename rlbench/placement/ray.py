"""`--placement ray`: the trainer's ranks and the rollout engines as Ray actors in one placement
group, in slime's shape (slime/ray/placement_group.py: one group, trainer bundles first, one per
rank, then a bundle per rollout engine; PACK strategy).

- The trainer actor (bundle 0) builds the run's trainer from the run's config and the driver's
  initial weights, so it starts from the very bytes the manifest hashed. It is rank 0: the torch
  trainer's only rank, or the megatron trainer's first, which starts ranks 1..T*D-1 as actors of
  their own (`RankActors`: rank r in bundle r), each running the same worker loop as a rank process
  does (megatron/worker.py's `work`). They join the TCP store rank 0 opens on its node's IP. Rank 0
  created them, so Ray takes them down with it (an actor dies with its owner), and the group's
  removal takes down what is left.
- The rollout engine is an actor holding the embedded engine (`--rollout hf`), or, for `--rollout
  sglang` with servers rlbench starts, one actor per server: the actor starts the server on its
  node and stops it with itself; sglang-router runs next to the driver, in front of them.
- What each piece is and how it is made (which trainer, which engine, how many bundles) is
  backends/registry.py's to say, as it is for a run in one process; this module only places them.
- The driver keeps the loop, the run directory and the checks; the proxies below are the
  Trainer and RolloutEngine the loop calls. Tensors cross as safetensors bytes with their names in
  order, requests and results as JSON-able dicts, checkpoints as file bytes: what travels is data,
  never pickled objects of ours (Ray's own transport wraps them).

Ray is started here (`ray.init(num_cpus=..., include_dashboard=False)`, `local_cpus` says how many)
and shut down with the run, unless it is already initialised in this process or
`placement.ray_address` names a cluster (`auto`, `HOST:6379`, `ray://HOST:10001`): then rlbench
only connects, and leaves it running. rlbench must be installed on every node of such a cluster.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rlbench.backends import registry
from rlbench.core.types import GenerateRequest, GenerateResult

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


def _files(directory: Path) -> dict[str, bytes]:
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
        model = build_model(config.model.path, config.seed, config.model.dtype, config.device,
                            init=config.model.init)
        load_named_(model, unpack(weights), source="the driver's initial weights")
        self.trainer = registry.make_trainer(config, model, RankActors())
        self.checkpoints = tempfile.TemporaryDirectory(prefix="rlbench-ray-checkpoint-")

    def logprobs(self, tensors, reference: bool, per_sample: bool):
        given = unpack(tensors)
        return pack({"logprobs": self.trainer.logprobs(given["tokens"], reference, given.get("lengths"), per_sample)})

    def train_step(self, tensors, step: int):
        from rlbench.core.algo import TrainBatch

        given = unpack(tensors)
        stats = self.trainer.train_step(TrainBatch(given["tokens"], given["loss_mask"], given["advantages"],
                                                   given["old_logprobs"], given.get("ref_logprobs"),
                                                   given.get("lengths"), given.get("rollout_logprobs")), step)
        return stats.metrics, pack({"losses": stats.losses}), stats.grads_digest, stats.param_grads

    def export_hf_weights(self):
        return pack(self.trainer.export_hf_weights())

    def save_checkpoint(self) -> dict[str, bytes]:
        return self.trainer.save_checkpoint()

    def load_checkpoint(self, files: dict[str, bytes]) -> None:
        directory = Path(tempfile.mkdtemp(dir=self.checkpoints.name))
        for name, data in files.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(data)
        self.trainer.load_checkpoint(directory)

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
            handle = ray.remote(RankActor).options(num_cpus=1, num_gpus=int(own.startswith("cuda")),
                                                  scheduling_strategy=strategy).remote()
            workers.append(RankWorker(handle, handle.work.remote(self.host, port, rank, world, own)))
        return workers


class RankWorker:
    """A rank actor, handled as launch.py handles a rank process (poll, wait, kill). Its loop's end
    is `wait`'s; the actor itself lives on until `kill` (then `poll` says so)."""

    def __init__(self, handle, done):
        self.handle, self.done, self.returncode = handle, done, None

    def poll(self) -> int | None:
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
    """One SGLang server (or `rlbench serve`), started on the actor's node, stopped with it."""

    def start(self, config_json: str, index: int) -> str:
        import ray

        from rlbench.backends.sglang.client import Client
        from rlbench.backends.sglang.fleet import answers, launch_server, make_logs, wait_server

        config = _config(config_json)
        host = ray.util.get_node_ip_address()
        self.logs = make_logs()
        self.proc = launch_server(config, self.logs, index, host=host)
        client = Client(4, 30)
        try:
            return wait_server(self.proc, lambda url: client.run(answers(client, url)))
        finally:
            client.close()

    def stop(self) -> None:
        import shutil

        from rlbench.backends.sglang.fleet import stop_processes

        if getattr(self, "proc", None) is not None:
            stop_processes([self.proc])
            shutil.rmtree(self.logs, ignore_errors=True)
            self.proc = None


# ---- the driver's side ------------------------------------------------------------------------


class RayTrainer:
    """The loop's Trainer: every call goes to the trainer actor."""

    is_main = True

    def __init__(self, actor, placement: Placement):
        self.actor, self.placement = actor, placement

    def _get(self, ref):
        import ray

        return ray.get(ref)

    def logprobs(self, tokens, reference=False, lengths=None, per_sample=False):
        return unpack(self._get(self.actor.logprobs.remote(pack({"tokens": tokens, "lengths": lengths}), reference,
                                                           per_sample)))["logprobs"]

    def train_step(self, batch, step):
        from rlbench.core.algo import TrainStats

        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        metrics, losses, digest, param_grads = self._get(self.actor.train_step.remote(pack(fields), step))
        return TrainStats(metrics, unpack(losses)["losses"], digest, param_grads)

    def export_hf_weights(self):
        return unpack(self._get(self.actor.export_hf_weights.remote()))

    def save_checkpoint(self):
        return self._get(self.actor.save_checkpoint.remote())

    def load_checkpoint(self, directory):
        self._get(self.actor.load_checkpoint.remote(_files(Path(directory))))

    def close(self):
        try:
            self._get(self.actor.close.remote())
        finally:
            self.placement.release()


class RayEngine:
    """The loop's RolloutEngine: every call goes to the engine actor."""

    engine_id = "hf:ray"

    def __init__(self, actor, placement: Placement):
        self.actor, self.placement = actor, placement

    def _get(self, ref):
        import ray

        return ray.get(ref)

    def generate(self, requests):
        answers = self._get(self.actor.generate.remote([dataclasses.asdict(r) for r in requests]))
        return [GenerateResult(**{k: tuple(v) if isinstance(v, list) else v for k, v in a.items()}) for a in answers]

    def update_weights(self, weights, version):
        self._get(self.actor.update_weights.remote(pack(dict(weights)), version))

    def weight_checksums(self):
        return self._get(self.actor.weight_checksums.remote())

    def export_weights(self, holder, names):
        return unpack(self._get(self.actor.export_weights.remote(holder, list(names))))

    def close(self):
        self.placement.release()


class Placement:
    """The placement group, the actors in it, and whether rlbench started Ray (then it stops it).
    Each backend placed here releases it when the loop closes that backend; the last release
    removes the group and its actors."""

    def __init__(self, config, bundles: int):
        import ray

        self.ray = ray
        self.started_ray = False
        if not ray.is_initialized():
            options = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": False}
            if config.placement.ray_address:
                ray.init(address=config.placement.ray_address, **options)
            else:
                ray.init(num_cpus=local_cpus(config, bundles), **options)
                self.started_ray = True
        self.actors: list = []
        self.group = None
        self.users = 0

    def make_group(self, bundles: list[dict]) -> None:
        from ray.util.placement_group import placement_group

        from rlbench.errors import BadInput

        self.group = placement_group(bundles, strategy="PACK")
        ready, _ = self.ray.wait([self.group.ready()], timeout=300)
        if not ready:
            raise BadInput(f"Ray cannot place {len(bundles)} bundles {bundles[0]} within 300 s (available: "
                           f"{self.ray.available_resources()})", field="placement")

    def actor(self, cls, bundle: int, resources: dict, *args):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=bundle)
        handle = self.ray.remote(cls).options(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                                             scheduling_strategy=strategy).remote(*args)
        self.actors.append(handle)
        return handle

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.close()

    def close(self) -> None:
        try:
            for handle in self.actors:
                self.ray.kill(handle)
            if self.group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.group)
        finally:
            self.actors, self.group = [], None
            if self.started_ray:
                self.ray.shutdown()


def place(config, model, start: int, init_checkpoint: Path | None):
    """(trainer, engine) of the run as Ray actors in one placement group; None where the mode has none."""
    ranks, engines = registry.bundles(config)
    placement = Placement(config, ranks + engines)
    try:
        trainer, engine = _place(placement, config, model, start, init_checkpoint, ranks, engines)
    except BaseException:
        placement.close()
        raise
    placement.users = int(trainer is not None) + int(engine is not None)
    return trainer, engine


def local_cpus(config, bundles: int) -> int:
    """The logical CPUs of the Ray instance rlbench starts. A bundle holds one (its piece runs
    config.threads = 1 thread by default): as many as the machine has cores, or one per bundle
    where the run has more (they share the cores, as rank processes do under in-process placement)."""
    from rlbench.errors import BadInput

    cpus = config.placement.num_cpus or max(os.cpu_count() or 1, bundles)
    if cpus < bundles:
        raise BadInput(f"expected at least {bundles} (a CPU for each trainer rank and each engine), got {cpus}",
                       field="placement.num_cpus")
    return cpus


def _place(placement: Placement, config, model, start: int, init_checkpoint: Path | None, ranks: int, engines: int):
    from rlbench.core.model import named_weights

    bundle = {"CPU": 1, **({"GPU": 1} if config.device.startswith("cuda") else {})}
    placement.make_group([bundle] * (ranks + engines))
    config_json, weights = json.dumps(config.to_dict()), pack(named_weights(model))
    trainer = engine = None
    if ranks:
        trainer = RayTrainer(placement.actor(TrainerActor, 0, bundle, config_json, weights), placement)
        if init_checkpoint is not None:
            trainer.load_checkpoint(init_checkpoint)
    if registry.rolls_out(config) and config.rollout.backend == "hf":
        engine = RayEngine(placement.actor(EngineActor, ranks, bundle, config_json, weights, start), placement)
    elif registry.rolls_out(config):
        def start_servers(fleet, client) -> None:
            actors = [placement.actor(ServerActor, ranks + i, bundle) for i in range(engines)]
            fleet.workers = placement.ray.get([a.start.remote(config_json, i) for i, a in enumerate(actors)])
            fleet.stoppers.append(lambda: placement.ray.get([a.stop.remote() for a in actors]))

        engine = registry.open_sglang_engine(config, start_servers if engines else None)
        engine.fleet.stoppers.append(placement.release)
    return trainer, engine
