"""Worker ranks of the megatron trainer: rlbench starts them; the user never writes a launcher.

`rlbench run --trainer megatron --tp T --dp D` runs T*D ranks. Rank 0 is the process holding the
trainer (the rlbench process itself; under `--placement ray`, the trainer actor); ranks 1.. are
workers, which only train. There is one worker main (worker.py's `work`) and two ways to start it:

- `Processes` (in-process placement): `python -m rlbench.backends.megatron.worker` per rank, on
  this machine, joined through a TCP store on 127.0.0.1;
- `rlbench.placement.ray_actors.RankActors` (`--placement ray`): a Ray actor per rank, in the trainer's
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

A worker that dies (SIGKILL, the OOM killer, a lost node) closes its sockets, so the collective
the others are in fails (gloo: "Connection reset by peer"). A worker that fails that way exits
quietly (PEER_LOST: it did not cause the stop); rank 0 waits a moment for the worker that did
(`dead_rank`), stops the others, and raises `RankDied` naming it and the command the ranks were
running: exit 2, one line, the committed steps intact for `--resume`.

A worker that dies while the ranks are set up (before it signed in, inside the rendezvous of
init_process_group, or inside megatron-core's model-parallel init) is named as soon as it has
exited, not after a timeout: a thread per worker waits for that worker's exit (a pidfd, or the
handle's own `wait`), and the exit ends every wait rank 0 is in in `Watched`, its store as the
sign-in and (gloo, the CPU) the groups' rendezvous see it, which raises RankDied (exit 2, one line,
no torch timeout warning). On GPUs the NCCL groups meet in the store itself (`join` says why).
"""

from __future__ import annotations

import datetime
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlbench.errors import RlbenchError

STORE_ENV = "RLBENCH_MEGATRON_STORE"  # host:port of rank 0's TCP store (worker.py reads it)
PEER_LOST = 75  # a worker's exit code when its collective failed because another rank died (it prints nothing)
# How long rank 0 waits, after a collective failed, for the worker that died to show as exited: its sockets
# close as it exits, so the failure and the exit are moments apart.
DEATH_WAIT = 10.0
# Making a process group waits in rank 0's store for every member, and a member that died never comes. On the
# CPU its exit ends the wait (`Watched`); a member that hangs alive, or one that died on a GPU, is named after
# this timeout, which the groups are made with (then `settle` gives them the usual one), instead of after
# torch's default of 30 minutes.
SETUP_TIMEOUT = datetime.timedelta(minutes=2)
JOIN_TIMEOUT = 600.0  # seconds a worker has to start (import torch and megatron-core) and reach rank 0's store


class RankDied(RlbenchError):
    """A worker rank of the megatron trainer died: the run stops, its committed steps intact (exit 2)."""


@dataclass
class Ranks:
    """This process's place among the ranks: its rank, the world size, its device, the command
    group, and (rank 0 only) the workers."""

    rank: int
    world: int
    device: str  # this rank's own: cuda:r where a rank sees every GPU, cuda:0 where it sees its own only
    channel: object = None  # the gloo group commands travel on
    workers: list = field(default_factory=list)  # handles as subprocess.Popen's: poll, wait(timeout), kill
    store: object = None  # rank 0's TCP store: each worker notes there the command it runs (`running`)
    watched: object = None  # rank 0's `Watched` over it: the first worker that exited, named

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device == "cuda" else device


def init_rank(rank: int, world: int, device: str, store, group_store=None) -> Ranks:
    """Join the process group as `rank`, on `device` (this rank's own); the groups meet in `group_store`
    (rank 0: its `Watched` store), else in `store`."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, store=group_store or store, rank=rank, world_size=world, timeout=SETUP_TIMEOUT)
    channel = dist.new_group(backend="gloo", timeout=SETUP_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    settle([dist.group.WORLD, channel])
    return Ranks(rank, world, device, channel, store=store)


def settle(groups: list, timeout: datetime.timedelta | None = None) -> None:
    """Give process groups made with SETUP_TIMEOUT the timeout their collectives have otherwise (`timeout`,
    else torch's default for the group's backend): a short one would stop the workers while rank 0 rolls out
    between two commands. torch sets a group's timeout only through a private function."""
    from torch.distributed import constants
    from torch.distributed.distributed_c10d import _rank_not_in_group, _set_pg_timeout

    for group in groups:
        if isinstance(group, dist.ProcessGroup) and not _rank_not_in_group(group):
            nccl = dist.get_backend(group) == "nccl" and constants.default_pg_nccl_timeout is not None
            _set_pg_timeout(
                timeout or (constants.default_pg_nccl_timeout if nccl else constants.default_pg_timeout), group
            )


class Watched(dist.Store):
    """Rank 0's store as the sign-in and its (gloo) process groups see it (a group's rendezvous is a
    wait in it for every member's key), which a worker's exit ends: every wait in it then raises the
    RankDied naming that worker, at once.

    `stop(error)` is called from another thread (a worker's exit, a deadline); `error` is kept (the
    first one: `died` names it). Where rank 0 waits, it first stops the other workers (woken, they
    would read the key values below), then wakes the waits by setting the keys they wait for, with
    values never read, through `side`, a connection of its own for such threads (a wait holds
    `inner`'s). A wait that starts after it raises at once. Every other call passes through."""

    def __init__(self, inner, workers: list):
        super().__init__()
        self.inner, self.side, self.workers = inner, inner.clone(), workers
        self._lock = threading.Lock()
        self._waiting: list[list[str]] = []
        self.error: RankDied | None = None
        self.closed = False  # rank 0 ends the workers itself: their exits are no news
        self._stopped = threading.Event()  # `stop` has woken every wait: rank 0 may go on (and exit)

    def close(self) -> None:
        """Rank 0 is about to stop the workers itself: a watcher that wakes at their exits touches nothing
        (the process may be exiting, its stores going)."""
        with self._lock:
            self.closed = True

    @property
    def quiet(self) -> bool:
        """Nothing more to report: closed, or a worker's exit already reported."""
        return self.closed or self.error is not None

    def stop(self, error: RankDied) -> None:
        with self._lock:
            if self.quiet:
                return
            self.error = error
            keys = [key for keys in self._waiting for key in keys]
        try:
            if keys:
                kill(self.workers)
                for key in keys:
                    self.side.set(key, b"")
        finally:
            self._stopped.set()

    def _raise_error(self) -> None:
        if self.error is not None:
            self._stopped.wait()  # the watcher's store calls are done before rank 0 goes on to exit
            raise self.error

    def wait(self, keys, timeout=None) -> None:
        with self._lock:
            self._raise_error()
            self._waiting.append(keys)
        try:
            self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)
        finally:
            with self._lock:
                self._waiting.remove(keys)
        self._raise_error()

    def get(self, key):
        self.wait([key])
        return self.inner.get(key)

    def set(self, key, value):
        return self.inner.set(key, value)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def _watch_exit(watched: Watched, rank: int, world: int, proc) -> None:
    """Stop `watched` when worker `rank` exits, naming it and what it was doing (an exit PEER_LOST only
    follows another's). A daemon thread waits for the exit: of a process through a pidfd (readable at
    its exit, opened here, before anyone could reap it; the process is left for its Popen to reap), of
    any other handle through its own `wait()`. The thread ends with the worker, which the run always ends."""
    if isinstance(proc, subprocess.Popen):
        fd = os.pidfd_open(proc.pid)

        def exit_() -> None:
            try:
                select.select([fd], [], [])
            finally:
                os.close(fd)
    else:
        exit_ = proc.wait

    def watch() -> None:
        exit_()
        code = proc.wait()  # it has exited: at once (poll() says None while another thread reaps it)
        code = proc.poll() if code is None else code  # a rank actor's code comes from poll()
        if code == PEER_LOST or watched.quiet:  # another's exit, or rank 0's own doing: nothing to report
            return
        try:
            doing = _doing(watched.side, rank)
        except Exception:  # noqa: BLE001 - the store went with rank 0's trainer: nothing waits in it any more
            return
        watched.stop(RankDied(f"megatron rank {rank} of {world} {_how(code)} {doing}"))

    threading.Thread(target=watch, name=f"megatron-rank-{rank}-exit", daemon=True).start()


@dataclass
class Pending:
    """Rank 0's half of starting the ranks: the store is open and the workers are importing."""

    world: int
    device: str
    store: object
    workers: list
    watched: Watched | None = None  # the store the groups meet in; None for one rank


# Workers print to the process's standard error (descriptor 2), never to rank 0's standard output,
# which carries the run's report; descriptor 2, not sys.stderr, which a caller may have replaced
# with an object that has no descriptor (an in-process CLI runner).
_STDERR_FD = 2


class Processes:
    """Ranks 1.. as processes of this machine (in-process placement): the store on 127.0.0.1."""

    host = "127.0.0.1"

    def start(self, port: int, world: int, device: str) -> list[subprocess.Popen]:
        env = {
            **os.environ,
            STORE_ENV: f"{self.host}:{port}",
            "WORLD_SIZE": str(world),
            "RLBENCH_MEGATRON_DEVICE": device,
            "RLBENCH_MEGATRON_PARENT": str(os.getpid()),
        }
        return [
            subprocess.Popen(
                [sys.executable, "-m", "rlbench.backends.megatron.worker"],
                env={**env, "RANK": str(rank)},
                stdin=subprocess.DEVNULL,
                stdout=_STDERR_FD,
            )
            for rank in range(1, world)
        ]


def spawn(world: int, device: str, workers=None) -> Pending:
    """Rank 0: open the store and start ranks 1..world-1 (`workers`: Processes, or anything with a
    `host` they reach this one at and `start(port, world, device)`), which join when `join` is called."""
    if world == 1:
        return Pending(1, device, dist.HashStore(), [])
    workers = workers or Processes()
    store = dist.TCPStore(workers.host, 0, world, is_master=True, wait_for_workers=False)
    pending = Pending(world, device, store, workers.start(store.port, world, device))
    pending.watched = Watched(store, pending.workers)
    for rank, proc in enumerate(pending.workers, start=1):
        _watch_exit(pending.watched, rank, world, proc)
    return pending


def _doing(store, rank: int) -> str:
    """What worker `rank` was doing, as far as rank 0's store says (it signs in, then notes each command)."""
    if not store.check([f"rlbench/joined/{rank}"]):
        return "before it joined the others; nothing was trained"
    key = f"rlbench/running/{rank}"
    if store.check([key]):
        return (
            f"while running {store.get(key).decode()}; the run stopped (its committed steps are kept: "
            "rlbench run --resume RUN continues it)"
        )
    return "while the ranks set up their process groups; nothing was trained"


def kill(workers: list, watched: Watched | None = None) -> None:
    """Stop workers that were never joined or cannot be told to stop (`watched`, rank 0's store over them: told
    first, so that their watchers report nothing)."""
    if watched is not None:
        watched.close()
    for proc in workers:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def signed_in(store, rank: int) -> None:
    """A worker: tell rank 0 it reached the store (before the group's rendezvous), so that rank 0 can say
    whether a worker that exits died before or while the ranks set up their groups."""
    store.set(f"rlbench/joined/{rank}", "1")


def _wait_signed_in(pending: Pending) -> None:
    """Rank 0: until every worker signed in. A worker that exits first ends the wait (RankDied, naming it);
    so does JOIN_TIMEOUT, by the same way (a timer), naming the late ones."""
    keys = [f"rlbench/joined/{rank}" for rank in range(1, pending.world)]

    def late() -> None:
        missing = [str(r) for r, key in enumerate(keys, start=1) if not pending.watched.side.check([key])]
        pending.watched.stop(
            RankDied(
                f"megatron rank(s) {', '.join(missing)} of {pending.world} did not start "
                f"within {JOIN_TIMEOUT:g} s; nothing was trained"
            )
        )

    timer = threading.Timer(JOIN_TIMEOUT, late)
    timer.daemon = True
    timer.start()
    try:
        pending.watched.wait(keys, datetime.timedelta(seconds=JOIN_TIMEOUT * 2))
    finally:
        timer.cancel()


def join(pending: Pending) -> Ranks:
    """Rank 0: join the process group with the workers (one rank: a group of one, in-process). A worker
    that exits meanwhile is named (RankDied) as soon as it has exited; the others are stopped."""
    try:
        if pending.world > 1:
            _wait_signed_in(pending)
        # Gloo groups (the CPU) meet in the watched store. NCCL groups meet in the store itself: NCCL's monitor
        # threads call their store from C++ all run long, which a Python store would serve under the GIL, and
        # that path is not tested here; on a GPU a rank dead inside a rendezvous is named at SETUP_TIMEOUT.
        cpu = not pending.device.startswith("cuda")
        ranks = init_rank(
            0, pending.world, rank_device(pending.device, 0), pending.store, pending.watched if cpu else None
        )
    except BaseException:
        kill(pending.workers)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    ranks.workers, ranks.watched = pending.workers, pending.watched
    return ranks


def lost_peer(exc: BaseException) -> bool:
    """Whether a torch.distributed call failed because another rank's connection went away."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        sign in text
        for sign in ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
    )


def dead_rank(workers: list, wait: float = DEATH_WAIT) -> tuple[int, int] | None:
    """Rank 0, after a command failed: (rank, exit status) of the worker that died and caused it, waiting
    up to `wait` seconds for it to show as exited; None when none did (the failure was rank 0's own).
    A worker that exited PEER_LOST only followed another's death."""
    deadline = time.monotonic() + wait
    while True:
        codes = [(rank, proc.poll()) for rank, proc in enumerate(workers, start=1)]
        causes = [(rank, code) for rank, code in codes if code is not None and code != PEER_LOST]
        if causes:
            return min(causes, key=lambda rc: (rc[1] >= 0, rc[0]))  # a signal first: it came from outside
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def running(ranks: Ranks, op: str, meta: dict) -> None:
    """A worker, on receiving a command: note it in rank 0's store, for rank 0 to name if this rank dies."""
    step = f" of step {meta['step']}" if isinstance(meta.get("step"), int) else ""
    ranks.store.set(f"rlbench/running/{ranks.rank}", f"the {op} command{step}")


def died(ranks: Ranks, wait: float = DEATH_WAIT) -> RankDied | None:
    """Rank 0, after a command failed: the RankDied to raise if a worker died, naming it and the command
    it was running (the others are stopped first, so no rank outlives the run); else None. The worker
    whose exit was seen first, where it was (`Watched`, which may have stopped the others already)."""
    if ranks.watched is not None and ranks.watched.error is not None:
        kill(ranks.workers)
        return ranks.watched.error
    found = dead_rank(ranks.workers, wait)
    if found is None:
        return None
    kill(ranks.workers)
    rank, code = found
    key = f"rlbench/running/{rank}"
    when = f"while running {ranks.store.get(key).decode()}" if ranks.store.check([key]) else "before its first command"
    return RankDied(
        f"megatron rank {rank} of {ranks.world} {_how(code)} {when}; the run stopped (its committed "
        "steps are kept: rlbench run --resume RUN continues it)"
    )


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed (signal {-code})"
    return f"exited with code {code}"


def stop(ranks: Ranks, timeout: float = 60) -> None:
    """Rank 0, after the workers were told to stop: wait for them, then leave the group."""
    if ranks.watched is not None:
        ranks.watched.close()
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
    header = json.dumps(
        {
            "op": op,
            "meta": meta,
            "tensors": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors.items()],
        }
    )
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
