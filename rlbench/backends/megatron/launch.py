"""Worker ranks of the megatron trainer: rlbench starts them; the user never writes a launcher.

`rlbench run --trainer megatron --tp T --dp D` runs T*D ranks. Rank 0 is the process holding the
trainer (the rlbench process itself; under `--placement ray`, the trainer actor); ranks 1.. are
workers, which only train. There is one worker main (worker.py's `work`) and two ways to start it:

- `Processes` (in-process placement): `python -m rlbench.backends.megatron.worker` per rank, on
  this machine, joined through a TCP store on 127.0.0.1;
- `rlbench.placement.ray.RankActors` (`--placement ray`): a Ray actor per rank, in the trainer's
  placement group, joined through a store on the trainer actor's node IP.

This module names worker.py only by its module path on that command line, and imports neither it
nor trainer.py: they import this one.

torch.distributed joins them (gloo on the CPU, NCCL on GPUs) through the TCP store rank 0 opens
on a free port. The workers are started (`spawn`) when the trainer is made, so they import torch
and megatron-core while rank 0 checks the settings, and join the process group (`join`) at the
trainer's first call.

Rank 0 drives: every trainer call is sent to all ranks as a command (a JSON header and tensors,
broadcast over a gloo group: no pickle), and every rank then runs the same call, so the
collectives inside Megatron line up. Only rank 0 records, exports and checkpoints. Workers
die with rank 0: the broadcast they wait in fails when its socket closes, and, whatever killed
rank 0, a worker process gets SIGKILL from the kernel when its parent dies (PR_SET_PDEATHSIG,
Linux), a worker actor from Ray when the actor that created it dies (Ray's owner fate-sharing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

STORE_ENV = "RLBENCH_MEGATRON_STORE"  # host:port of rank 0's TCP store (worker.py reads it)


@dataclass
class Ranks:
    """This process's place among the ranks: its rank, the world size, its device, the command
    group, and (rank 0 only) the workers."""

    rank: int
    world: int
    device: str  # this rank's own: cuda:r where a rank sees every GPU, cuda:0 where it sees its own only
    channel: object = None  # the gloo group commands travel on
    workers: list = field(default_factory=list)  # handles as subprocess.Popen's: poll, wait(timeout), kill

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else device


def init_rank(rank: int, world: int, device: str, store) -> Ranks:
    """Join the process group as `rank`, on `device` (this rank's own)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    channel = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return Ranks(rank, world, device, channel)


@dataclass
class Pending:
    """Rank 0's half of starting the ranks: the store is open and the workers are importing."""

    world: int
    device: str
    store: object
    workers: list


# Workers print to the process's standard error (descriptor 2), never to rank 0's standard output,
# which carries the run's report; descriptor 2, not sys.stderr, which a caller may have replaced
# with an object that has no descriptor (an in-process CLI runner).
_STDERR_FD = 2


class Processes:
    """Ranks 1.. as processes of this machine (in-process placement): the store on 127.0.0.1."""

    host = "127.0.0.1"

    def start(self, port: int, world: int, device: str) -> list[subprocess.Popen]:
        env = {**os.environ, STORE_ENV: f"{self.host}:{port}", "WORLD_SIZE": str(world),
               "RLBENCH_MEGATRON_DEVICE": device, "RLBENCH_MEGATRON_PARENT": str(os.getpid())}
        return [subprocess.Popen([sys.executable, "-m", "rlbench.backends.megatron.worker"],
                                 env={**env, "RANK": str(rank)}, stdin=subprocess.DEVNULL, stdout=_STDERR_FD)
                for rank in range(1, world)]


def spawn(world: int, device: str, workers=None) -> Pending:
    """Rank 0: open the store and start ranks 1..world-1 (`workers`: Processes, or anything with a
    `host` they reach this one at and `start(port, world, device)`), which join when `join` is called."""
    if world == 1:
        return Pending(1, device, dist.HashStore(), [])
    workers = workers or Processes()
    store = dist.TCPStore(workers.host, 0, world, is_master=True, wait_for_workers=False)
    return Pending(world, device, store, workers.start(store.port, world, device))


def kill(workers: list) -> None:
    """Stop workers that were never joined or cannot be told to stop."""
    for proc in workers:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def join(pending: Pending) -> Ranks:
    """Rank 0: join the process group with the workers (one rank: a group of one, in-process)."""
    try:
        ranks = init_rank(0, pending.world, rank_device(pending.device, 0), pending.store)
    except BaseException:
        kill(pending.workers)
        raise
    ranks.workers = pending.workers
    return ranks


def stop(ranks: Ranks, timeout: float = 60) -> None:
    """Rank 0, after the workers were told to stop: wait for them, then leave the group."""
    for proc in ranks.workers:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    kill(ranks.workers)
    ranks.workers = []
    if dist.is_initialized():
        dist.destroy_process_group()


def send(ranks: Ranks, op: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Rank 0: broadcast one command (op, JSON-able meta, named CPU tensors) to every rank."""
    if ranks.world == 1:
        return
    header = json.dumps({"op": op, "meta": meta,
                         "tensors": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors.items()]})
    data = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=0, group=ranks.channel)
    dist.broadcast(data, src=0, group=ranks.channel)
    for t in tensors.values():
        dist.broadcast(t.detach().cpu().contiguous(), src=0, group=ranks.channel)


def receive(ranks: Ranks) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """A worker: the next command from rank 0."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=ranks.channel)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=ranks.channel)
    header = json.loads(bytes(data.numpy()).decode())
    tensors = {}
    for name, dtype, shape in header["tensors"]:
        tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(tensors[name], src=0, group=ranks.channel)
    return header["op"], header["meta"], tensors
