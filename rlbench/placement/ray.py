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

Ray is started or reached by ray_connect.py (`start_local`, `connect`) and shut down with the run, unless it
is already initialised in this process or `placement.ray_address` names a cluster: then rlbench only connects,
and leaves it running. rlbench must be installed on every node of such a cluster.
Errors raised inside an actor come back as themselves (an rlbench error keeps its one line), and an
actor that died is named.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rlbench.backends import registry
from rlbench.core.types import GenerateRequest, GenerateResult
from rlbench.placement.ray_connect import connect, start_local

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
        self.checkpoints: Path | None = None  # made by the first load; the placement removes it (remove_checkpoints)

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
            handle = ray.remote(RankActor).options(num_cpus=1, num_gpus=int(own.startswith("cuda")),
                                                  scheduling_strategy=strategy).remote()
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
        self.proc = launch_server(config, self.logs, index, host=host, key=key)
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


# ---- the driver's side ------------------------------------------------------------------------


def get(ref, died):
    """ray.get(ref), with an rlbench error raised inside the actor raised here as itself (one line, its
    exit code), and `died(why)`, an rlbench error, raised where the actor died; anything else as Ray
    raises it."""
    import ray

    from rlbench.errors import RlbenchError

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, RlbenchError):
            raise exc.cause from None
        raise
    except ray.exceptions.RayActorError as exc:
        raise died((str(exc).splitlines() or [""])[0][:160]) from None


def _trainer_died(why: str):
    from rlbench.backends.megatron.launch import RankDied

    return RankDied(f"the trainer actor (the trainer's rank 0) died ({why}); the run stopped (its committed steps "
                    "are kept: rlbench run --resume RUN continues it)")


def _engine_died(why: str):
    from rlbench.errors import EngineUnavailable

    return EngineUnavailable(f"the engine actor died ({why})")


class RayTrainer:
    """The loop's Trainer: every call goes to the trainer actor."""

    is_main = True

    def __init__(self, actor, placement: Placement):
        self.actor, self.placement = actor, placement

    def _get(self, ref):
        return get(ref, _trainer_died)

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
        return get(ref, _engine_died)

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
            if config.placement.ray_address:
                connect(config.placement.ray_address, config.placement.ray_timeout)
            else:
                start_local(local_cpus(config, bundles))
                self.started_ray = True
        self.actors: list = []
        self.before_kill: list = []  # calls that make an actor remove what it wrote (each gives an ObjectRef)
        self.group = None
        self.users = 0

    def make_group(self, bundles: list[dict]) -> None:
        from ray.util.placement_group import placement_group

        from rlbench.errors import BadInput

        have = self.ray.cluster_resources()
        for resource in sorted({r for bundle in bundles for r in bundle}):
            need = sum(bundle.get(resource, 0) for bundle in bundles)
            if have.get(resource, 0) < need:
                raise BadInput(f"the Ray cluster has {have.get(resource, 0):g} {resource} in all, the run needs "
                               f"{need:g} (one for each trainer rank and engine: {len(bundles)} bundles)",
                               field="placement")
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
            self._clean_actors()
            for handle in self.actors:
                self.ray.kill(handle)
            if self.group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.group)
        finally:
            self.actors, self.group = [], None
            if self.started_ray:
                self.ray.shutdown()

    def _clean_actors(self) -> None:
        """Have the actors remove what they wrote before they are killed; one dead or slow (10 s) is not waited for."""
        cleanups, self.before_kill = self.before_kill, []
        try:
            pending = [cleanup() for cleanup in cleanups]
            if pending:
                self.ray.wait(pending, num_returns=len(pending), timeout=10)
        except Exception:  # noqa: BLE001 - the actors go anyway; a failure here must not hide the run's own
            pass


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
    """The logical CPUs of the Ray instance rlbench starts: `placement.num_cpus`, else the CPUs this
    process may run on. A bundle holds one (its piece runs config.threads = 1 thread by default), so a
    run of more bundles than that is refused before Ray starts; `placement.num_cpus` may say more, to
    share the cores on purpose."""
    from rlbench.errors import BadInput

    given = config.placement.num_cpus
    cpus = given or registry.available_cpus()
    if cpus < bundles:
        where = "placement.num_cpus" if given else f"this machine has {cpus} (placement.num_cpus may say more)"
        raise BadInput(f"expected at least {bundles} CPUs (one for each trainer rank and each engine), got {cpus}: "
                       f"{where}", field="placement.num_cpus" if given else "placement")
    return cpus


def _place(placement: Placement, config, model, start: int, init_checkpoint: Path | None, ranks: int, engines: int):
    from rlbench.core.model import named_weights

    bundle = {"CPU": 1, **({"GPU": 1} if config.device.startswith("cuda") else {})}
    placement.make_group([bundle] * (ranks + engines))
    config_json, weights = json.dumps(config.to_dict()), pack(named_weights(model))
    trainer = engine = None
    if ranks:
        trainer = RayTrainer(placement.actor(TrainerActor, 0, bundle, config_json, weights), placement)
        placement.before_kill.append(trainer.actor.remove_checkpoints.remote)
        if init_checkpoint is not None:
            trainer.load_checkpoint(init_checkpoint)
    if registry.rolls_out(config) and config.rollout.backend == "hf":
        engine = RayEngine(placement.actor(EngineActor, ranks, bundle, config_json, weights, start), placement)
    elif registry.rolls_out(config):
        def start_servers(fleet, client) -> None:
            actors = [placement.actor(ServerActor, ranks + i, bundle) for i in range(engines)]
            from rlbench.backends.sglang.client import api_key

            key = api_key()
            fleet.workers = placement.ray.get([a.start.remote(config_json, i, key) for i, a in enumerate(actors)])
            fleet.stoppers.append(lambda: placement.ray.get([a.stop.remote() for a in actors]))

        engine = registry.open_sglang_engine(config, start_servers if engines else None)
        engine.fleet.stoppers.append(placement.release)
    return trainer, engine
