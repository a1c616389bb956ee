"""A worker rank of the megatron trainer (ranks 1..): it joins rank 0, then runs rank 0's commands.

launch.py starts ranks 1.. in one of two ways, and both end in `work`:

- as processes of this machine (launch.Processes): `python -m rlbench.backends.megatron.worker`,
  whose `rank_main` reads the rank's place from the environment rank 0 gave it;
- as Ray actors (rlbench.placement.ray_actors.RankActors, `--placement ray`), which call `work` directly.

This module imports launch (the group, the commands) and trainer (each rank's shard), and neither
imports it: launch names it only by its module path on the command line it starts, so the imports
go one way.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from rlbench.backends.megatron import faults, launch
from rlbench.backends.megatron.trainer import RankTrainer, dispatch
from rlbench.config import TrainerSetup, setup_from_dict
from rlbench.core.seeding import configure_determinism


def run_commands(ranks: launch.Ranks) -> None:
    """A worker rank's life: the init command (config and initial weights), then commands until stop."""
    op, meta, tensors = launch.receive(ranks)
    launch.running(ranks, op, {})
    faults.kill_point(ranks.rank, op)
    assert op == "init", op
    config = setup_from_dict(TrainerSetup, meta["setup"], "the init command")
    configure_determinism(config.threads, config.device, config.deterministic)  # as rank 0 has them
    trainer = RankTrainer(ranks, config, tensors)
    if config.algo.advantage == "ppo":  # PPO's critic beside it, as rank 0 makes its own (critic.MegatronCritic)
        from rlbench.backends.megatron.critic import attach

        attach(trainer, config, tensors)
    try:
        while True:
            op, meta, tensors = launch.receive(ranks)
            launch.running(ranks, op, meta)
            faults.kill_point(ranks.rank, op)
            if op == "stop":
                return
            dispatch(trainer, op, meta, tensors)
    finally:
        trainer.close()


def work(host: str, port: int, rank: int, world: int, device: str) -> None:
    """A worker rank, however it was started: join rank 0's store at host:port as `rank`, on
    `device` (its own), then run rank 0's commands until it says stop."""
    store = dist.TCPStore(host, port, world, is_master=False)
    launch.signed_in(store, rank)
    faults.kill_point(rank, "join")  # RLBENCH_MEGATRON_KILL=RANK:join@1: dies while rank 0 makes the group
    ranks = launch.init_rank(rank, world, device, store)
    run_commands(ranks)
    dist.destroy_process_group()


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this worker when rank 0 dies, even by SIGKILL (no cleanup runs there)."""
    import signal

    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def rank_main() -> None:
    """A worker rank as a process (launch.Processes): its place from the environment rank 0 gave it. Ctrl-C in a
    terminal signals every process of the run: it is rank 0's to answer (its one line; the ranks stop with it), so a
    rank ignores SIGINT rather than print a KeyboardInterrupt of its own."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(int(os.environ["RLBENCH_MEGATRON_PARENT"]))
    host, port = os.environ[launch.STORE_ENV].rsplit(":", 1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        work(host, int(port), rank, world, launch.rank_device(os.environ["RLBENCH_MEGATRON_DEVICE"], rank))
    except Exception as exc:  # noqa: BLE001 - sorted: another rank's death, or this rank's own failure
        if launch.lost_peer(exc):
            os._exit(launch.PEER_LOST)  # quiet: rank 0 names the rank that died
        raise


if __name__ == "__main__":
    rank_main()
