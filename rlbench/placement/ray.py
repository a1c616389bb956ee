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
from pathlib import Path

from rlbench.backends import registry
from rlbench.core.types import GenerateResult
from rlbench.placement.ray_actors import EngineActor, ServerActor, TrainerActor, checkpoint_files, pack, unpack
from rlbench.placement.ray_connect import connect, start_local

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

    return RankDied(
        f"the trainer actor (the trainer's rank 0) died ({why}); the run stopped (its committed steps "
        "are kept: rlbench run --resume RUN continues it)"
    )


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
        return unpack(
            self._get(self.actor.logprobs.remote(pack({"tokens": tokens, "lengths": lengths}), reference, per_sample))
        )["logprobs"]

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
        self._get(self.actor.load_checkpoint.remote(checkpoint_files(Path(directory))))

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
                raise BadInput(
                    f"the Ray cluster has {have.get(resource, 0):g} {resource} in all, the run needs "
                    f"{need:g} (one for each trainer rank and engine: {len(bundles)} bundles)",
                    field="placement",
                )
        self.group = placement_group(bundles, strategy="PACK")
        ready, _ = self.ray.wait([self.group.ready()], timeout=300)
        if not ready:
            raise BadInput(
                f"Ray cannot place {len(bundles)} bundles {bundles[0]} within 300 s (available: "
                f"{self.ray.available_resources()})",
                field="placement",
            )

    def actor(self, cls, bundle: int, resources: dict, *args):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=bundle)
        handle = (
            self.ray.remote(cls)
            .options(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0), scheduling_strategy=strategy)
            .remote(*args)
        )
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
        raise BadInput(
            f"expected at least {bundles} CPUs (one for each trainer rank and each engine), got {cpus}: {where}",
            field="placement.num_cpus" if given else "placement",
        )
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
