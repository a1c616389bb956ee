"""Which trainer and which rollout engine a run needs, and how to make them: the one place that says so.

For a `RunConfig`: whether the run trains (modes full and train-only) and rolls out (full and
rollout-only); the packages its backends need installed and record in the manifest; how many Ray
bundles it places (a trainer rank each, then an engine each); and how to make the trainer (torch,
or megatron's rank 0) and the engines (the embedded `hf` one, or SGLang's over HTTP).

rlbench/session.py makes the run's backends in this process with it; placement/ray.py makes them in
Ray actors with it. It imports neither: the backends it makes are imported when chosen, so a run
never imports megatron-core, SGLang or Ray unless its config names them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlbench.errors import BadInput
from rlbench.extras import DELTA_EXTRA, DELTA_MODULES, SERVE_EXTRA, SERVE_MODULES, require

if TYPE_CHECKING:
    import torch

    from rlbench.backends.engine_memory import OffloadedEngine
    from rlbench.backends.hf_engine import HFEngine
    from rlbench.backends.sglang.engine import SGLangEngine
    from rlbench.config import RunConfig
    from rlbench.core.protocols import Trainer

# The packages a backend adds to the versions a run records, by (config section, backend).
BACKEND_PACKAGES = {
    ("train", "megatron"): ("megatron-core",),
    ("rollout", "sglang"): ("sglang", "sglang-router"),
    ("placement", "ray"): ("ray",),
}


def trains(config: RunConfig) -> bool:
    """Whether the run has a trainer: modes full and train-only."""
    return config.mode in ("full", "train-only")


def rolls_out(config: RunConfig) -> bool:
    """Whether the run has a rollout engine: modes full and rollout-only (train-only reads a recording)."""
    return config.mode != "train-only"


def starts_servers(config: RunConfig) -> bool:
    """Whether rlbench starts the SGLang servers itself: `--rollout sglang` with neither a router nor
    servers of the user's named."""
    rollout = config.rollout
    return rollout.backend == "sglang" and not (rollout.sglang_router_url or rollout.external_engine_addrs)


def packages(config) -> list[str]:
    """The packages, beyond the ones every run uses, whose versions a run with `config` records: its
    backends'. The trainer's count unless the run is rollout-only; the engine's and Ray's always.
    `config` may be any object with a run config's sections (a missing one names no backend)."""
    found = []
    for (section, backend), extra in BACKEND_PACKAGES.items():
        used = section != "train" or getattr(config, "mode", "full") != "rollout-only"
        if used and getattr(getattr(config, section, None), "backend", None) == backend:
            found += extra
    return found


def check_installed(config: RunConfig) -> None:
    """What `config` needs is installed here: say so (BadInput naming the setting and how to install
    it) before anything is loaded or started."""
    rollout = config.rollout
    needs = []
    if rollout.backend == "sglang" and rolls_out(config):
        needs.append(("aiohttp", "rollout.backend", "pip install '.[router]'"))
        if rollout.use_router and not rollout.sglang_router_url:
            needs.append(("sglang_router", "rollout.use_router", "pip install '.[router]'"))
        if not (rollout.sglang_router_url or rollout.external_engine_addrs):
            from rlbench.backends.sglang.fleet import check_key

            check_key(config)  # before the package: a key it cannot take is refused wherever sglang is installed
            if rollout.sglang_server == "sglang":
                needs.append(
                    (
                        "sglang",
                        "rollout.sglang_server",
                        'pip install "sglang[all]"; sglang_server = '
                        '"rlbench" (--sglang-server rlbench) starts rlbench serve instead',
                    )
                )
            else:
                needs += [(m, "rollout.sglang_server", SERVE_EXTRA) for m in SERVE_MODULES]
        if rollout.update_weight_mode == "delta":
            needs += [(m, "rollout.update_weight_mode", DELTA_EXTRA) for m in DELTA_MODULES]
    if config.train.backend == "megatron" and trains(config):
        needs.append(("megatron.core", "train.backend", "pip install '.[megatron]'"))
    if config.placement.backend == "ray":
        needs.append(("ray", "placement.backend", "pip install '.[ray]'"))
        if (config.placement.ray_address or "").startswith("ray://"):
            needs.append(
                ("grpc", "placement.ray_address", "a ray:// address is Ray's client: pip install 'ray[client]'")
            )
    for module, field, how in needs:
        require(module, how, field)


def check_trainer(config: RunConfig) -> None:
    """The trainer's own settings, before anything starts (the megatron trainer's: its `[train.megatron]`
    table, precision and shape, backends/megatron/model.check); BadInput at the first problem."""
    if trains(config) and config.train.backend == "megatron":
        from rlbench.backends.megatron.model import check

        check(config.trainer_setup())


def check_capacity(config: RunConfig) -> None:
    """The megatron trainer's tp * dp ranks against what this machine can place, before any starts: one
    CPU each (those this process may run on) or, on CUDA, one GPU each. Under `--placement ray`,
    placement/ray.py holds every bundle to the Ray instance's resources instead."""
    if not trains(config) or config.train.backend != "megatron" or config.placement.backend == "ray":
        return
    ranks = config.tp * config.dp
    if config.device.startswith("cuda"):
        import torch

        have, each = torch.cuda.device_count(), "a CUDA device"
    else:
        have, each = available_cpus(), "a CPU"
    if ranks > have:
        raise BadInput(
            f"expected at most {have} ranks ({each} each: this machine has {have}), got tp {config.tp} "
            f"x dp {config.dp} = {ranks}",
            field="tp * dp",
        )


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the system has one)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def bundles(config: RunConfig) -> tuple[int, int]:
    """How many trainer ranks and rollout engines the run places under `--placement ray`, a bundle each:
    TP*DP ranks for the megatron trainer, one for the torch trainer; an engine per server rlbench
    starts, one for the embedded engine, none for servers it only connects to."""
    ranks = engines = 0
    if trains(config):
        ranks = config.tp * config.dp if config.train.backend == "megatron" else 1
    if rolls_out(config):
        engines = config.rollout.num_engines if starts_servers(config) else int(config.rollout.backend == "hf")
    return ranks, engines


def make_trainer(config: RunConfig, model: torch.nn.Module, workers=None) -> Trainer:
    """The trainer, in this process, over `model` (the megatron trainer's other ranks are processes it
    starts, or `workers`: launch.spawn says what they may be)."""
    if config.train.backend == "megatron":
        from rlbench.backends.megatron.trainer import MegatronTrainer

        return MegatronTrainer(model, config.trainer_setup(), workers)  # checks its settings, starts its ranks
    from rlbench.backends.torch_trainer import TorchTrainer

    setup = config.trainer_setup()
    return TorchTrainer(model, setup.train, setup.algo, setup.temperature, setup.seed, setup.device)


def make_critic(config: RunConfig, model: torch.nn.Module, init_checkpoint: Path | None = None, trainer=None):
    """PPO's critic where the run trains with one: the torch trainer's (backends/critic_trainer.py: the policy's
    trunk copied from `model` as built, as slime's critic loads the policy's checkpoint, under a seeded value head)
    or the megatron trainer's (its ranks hold it beside the actor: backends/megatron/critic.py), trained with
    train.critic_lr (unset: train.lr) and the actor's other optimizer settings, restored from `init_checkpoint`'s
    critic/ where given; None otherwise."""
    if config.algo.advantage != "ppo" or not trains(config):
        return None
    if config.train.backend == "megatron":
        if trainer is None:  # made once its trainer is
            return None
        from rlbench.backends.megatron.critic import MegatronCritic

        critic = MegatronCritic(trainer)
    else:
        from rlbench.backends.critic_trainer import CriticTrainer
        from rlbench.core.critic import ValueModel

        setup = config.trainer_setup()
        critic = CriticTrainer(
            ValueModel(model, setup.seed), setup.train, setup.algo, setup.algo.value_clip, setup.seed, setup.device
        )
    if init_checkpoint is not None:
        critic.load_checkpoint(Path(init_checkpoint) / "critic")
    return critic


def make_hf_engine(
    config: RunConfig, model: torch.nn.Module, start: int, device: str, engine_id: str = "hf:0"
) -> HFEngine | OffloadedEngine:
    """The embedded engine (`--rollout hf`), in this process, over `model` on `device`, holding weight
    version `start`."""
    from rlbench.backends.engine_memory import OffloadedEngine
    from rlbench.backends.hf_engine import HFEngine

    rollout = config.rollout
    engine = HFEngine(
        model,
        device=device,
        engine_id=engine_id,
        true_on_policy=rollout.true_on_policy,
        decode=rollout.decode,
        batch_size=rollout.decode_batch_size,
        cuda_graphs=rollout.cuda_graphs,
    )
    engine.weight_version = start
    if rollout.dtype is not None or rollout.quantization != "none" or rollout.logprobs != "full":
        from rlbench.backends.engine_numerics import DTYPES, Numerics
        from rlbench.core.model import named_weights

        dtype = DTYPES[rollout.dtype] if rollout.dtype is not None else None
        engine.numerics = Numerics(dtype, rollout.quantization, rollout.logprobs)
        if dtype is not None:
            engine.model.to(dtype)
        engine.update_weights(named_weights(model), start)  # the engine's copy as it loads it: cast, quantized
    engine.batch_variant = not rollout.batch_invariant
    engine.prefix_variant = not rollout.prefix_invariant
    if rollout.offload:  # slime's --offload-rollout: the GPU memory let go of between rollouts
        from rlbench.backends.engine_memory import OffloadedEngine

        return OffloadedEngine(engine)
    return engine


def open_sglang_engine(config: RunConfig, start_servers: Callable | None = None) -> SGLangEngine:
    """The SGLang engine (`--rollout sglang`) over the servers `config.rollout` names, started by rlbench
    where it owns them (`start_servers(fleet, client)`: some other way, as sglang/engine.open_engine says)."""
    from rlbench.backends.sglang.engine import open_engine

    return open_engine(config.engine_setup(), start_servers)
