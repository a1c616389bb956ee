"""The SGLang servers a run generates with, and the sglang-router in front of them.

Three ways to get them, in the order rlbench looks (config.py's [rollout] fields):

- `sglang_router_url`: a router someone else runs; its servers are read from its `GET /workers`.
  rlbench starts and stops nothing.
- `external_engine_addrs`: servers someone else runs (slime's --rollout-external-engine-addrs).
  rlbench starts a router in front of them (unless `use_router` is false: then the client spreads
  requests over the servers itself) and stops only that.
- otherwise rlbench starts `num_engines` servers itself: `python -m sglang.launch_server` per
  engine (`sglang_server = "sglang"`, where the sglang package is installed) with every
  `--sglang-*` argument passed through, or `rlbench serve` (`"rlbench"`: the embedded engine
  behind the same API, with the run's model, seed and decode settings), and a router in front.

What rlbench starts, it stops: each process leads a process group of its own, and `close()`
sends the group SIGTERM, then SIGKILL after a grace period, on success, on error and on Ctrl-C
(the loop's `finally`). Each child also gets SIGKILL from the kernel if rlbench dies without
cleaning up (PR_SET_PDEATHSIG, Linux). Their output goes to log files in a temporary directory,
whose last lines are quoted when a process fails to start; the directory goes with `close()`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlbench.backends.sglang.wire import LISTENING
from rlbench.errors import BadInput, EngineUnavailable

STARTUP_TIMEOUT_S = 600.0  # a server loading a large model takes minutes
ROUTER_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


@dataclass
class Process:
    """A process rlbench started: a process group of its own, its output in `log`."""

    name: str
    popen: subprocess.Popen
    log: Path
    url: str | None = None  # a server's, where known before it answers

    def tail(self, lines: int = 3) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text[-lines:])

    def alive(self) -> bool:
        return self.popen.poll() is None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_process(
    name: str, command: list[str], logs: Path, env: dict | None = None, stdout: int | None = None
) -> Process:
    log = logs / f"{name.replace(' ', '-')}.log"
    with open(log, "wb") as sink:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=stdout or sink,
            stderr=sink,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    return Process(name, popen, log)


def stop_processes(processes: list[Process], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to each process group, SIGKILL to whatever is left after `grace_s`."""

    def signal_group(proc: Process, sig: int) -> None:
        try:
            os.killpg(proc.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    for proc in processes:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in processes:
        try:
            proc.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        signal_group(proc, signal.SIGKILL)  # the group's other members too (sglang's scheduler processes)
        proc.popen.wait()
        if proc.popen.stdout is not None:
            proc.popen.stdout.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def passthrough(args: dict) -> list[str]:
    """[rollout.sglang] / --sglang-KEY VALUE as the server's own --KEY VALUE (true: a bare flag)."""
    out = []
    for key, value in args.items():
        if value is False or value is None:
            continue
        out.append(f"--{key}")
        if value is not True:
            out.extend(str(v) for v in value) if isinstance(value, (list, tuple)) else out.append(str(value))
    return out


def check_key(config) -> None:
    """SGLang servers rlbench would start while the run has a key (RLBENCH_SGLANG_API_KEY): refused, never a fleet
    silently without the key. SGLang's own server takes its key only on its command line (--api-key), which every
    user of the machine can read."""
    from rlbench.backends.sglang.client import api_key
    from rlbench.keys import CLIENT_API_KEY_ENV

    if config.rollout.sglang_server == "sglang" and api_key() is not None:
        raise BadInput(
            f"{CLIENT_API_KEY_ENV} is set, and SGLang's own server takes its key only on its command line "
            "(--api-key), where every user of this machine can read it: start keyed SGLang servers "
            "yourself and name them (rollout.external_engine_addrs or rollout.sglang_router_url), or let "
            'rlbench start `rlbench serve` workers (rollout.sglang_server = "rlbench"), which take the '
            "key through their environment",
            field="rollout.sglang_server",
        )


def server_command(config, host: str, port: int, weights_dir: str | Path | None = None) -> list[str]:
    """The command that starts one server for the engine's setup `config` (config.EngineSetup) on host:port. An
    `rlbench serve` reads weight updates only below `weights_dir`, else rollout.weights_dir, else the system's temporary
    directory (where each engine makes its own: a fleet may outlive the engine that started it)."""
    rollout, model = config.rollout, config.model
    if rollout.sglang_server == "rlbench":
        allowed = weights_dir or rollout.weights_dir or tempfile.gettempdir()
        return [
            sys.executable,
            "-m",
            "rlbench.cli",
            "serve",
            "--host",
            host,
            "--port",
            str(port),
            "--weights-dir",
            str(allowed),
            "--model-path",
            model.path,
            "--tokenizer-path",
            model.tokenizer,
            "--random-seed",
            str(config.seed),
            "--load-format",
            "auto" if model.init == "checkpoint" else "dummy",
            "--dtype",
            model.dtype,
            "--device",
            config.device,
            "--threads",
            str(config.threads),
            "--decode",
            rollout.decode,
            "--decode-batch-size",
            str(rollout.decode_batch_size),
            *passthrough(rollout.sglang),
        ]
    check_key(config)
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model.path,
        "--tokenizer-path",
        model.tokenizer,
        "--host",
        host,
        "--port",
        str(port),
        "--random-seed",
        str(config.seed),
        # per-request sampling_seed takes effect only in this mode (sglang-api.md section 5)
        "--enable-deterministic-inference",
        *passthrough(rollout.sglang),
    ]


def server_env(config, key: str | None = None) -> dict | None:
    """The environment of an `rlbench serve` worker: the client's key (RLBENCH_SGLANG_API_KEY) handed over
    as the server's (RLBENCH_SERVE_API_KEY), never on the command line, which every user of the machine can
    read; without a client key, none (a key left in this environment would lock the run out). `key`: the
    client's key where it was handed over (a Ray actor on another node), else this process's variable. None
    (this process's environment) for SGLang's own server."""
    from rlbench.backends.sglang.client import api_key
    from rlbench.keys import SERVE_API_KEY_ENV

    if config.rollout.sglang_server != "rlbench":
        return None
    env = {k: v for k, v in os.environ.items() if k != SERVE_API_KEY_ENV}
    key = key or api_key()
    if key is not None:
        env[SERVE_API_KEY_ENV] = key
    return env


def launch_server(
    config,
    logs: Path,
    index: int,
    host: str = "127.0.0.1",
    weights_dir: str | Path | None = None,
    key: str | None = None,
) -> Process:
    """Start one server (`weights_dir`: server_command's; `key`: server_env's); `wait_server` says where it
    listens once it answers."""
    port = 0 if config.rollout.sglang_server == "rlbench" else free_port()
    proc = start_process(
        f"server-{index}",
        server_command(config, host, port, weights_dir),
        logs,
        stdout=subprocess.PIPE,
        env=server_env(config, key),
    )
    if port:
        proc.url = f"http://{host}:{port}"
    return proc


def wait_server(proc: Process, not_ready: Callable[[str], str | None], timeout_s: float = STARTUP_TIMEOUT_S) -> str:
    """The server's URL once `not_ready(url)` says None (its /health_generate answers 200); until then it
    says what the server answered, which the timeout's line quotes."""
    import select

    deadline = time.monotonic() + timeout_s
    url, why = proc.url, None
    while time.monotonic() < deadline:
        if not proc.alive():
            raise EngineUnavailable(
                f"SGLang {proc.name} exited with code {proc.popen.returncode} before it answered "
                f"(its last lines: {proc.tail() or 'none'})"
            )
        if url is None:  # rlbench serve says where it listens on its first line
            ready, _, _ = select.select([proc.popen.stdout], [], [], 0.5)
            line = proc.popen.stdout.readline().decode(errors="replace") if ready else ""
            if line.startswith(LISTENING):
                url = line[len(LISTENING) :].split()[0]
            continue
        why = not_ready(url)
        if why is None:
            return url
        time.sleep(0.2)
    said = f"; the last answer: {why}" if why else ""
    raise EngineUnavailable(
        f"SGLang {proc.name} did not answer within {timeout_s:.0f} s{said} (its last lines: {proc.tail() or 'none'})"
    )


def router_command(workers: list[str], port: int, metrics_port: int) -> list[str]:
    # A distinct --prometheus-port per router: two routers on one port panic (research.md section 5).
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "error",
        "--worker-urls",
        *workers,
    ]


@dataclass
class Fleet:
    """Where a run's requests go (`route`: the router, or the servers), the servers themselves
    (`workers`: weight updates and checksums go to each), and what rlbench started."""

    route: list[str]
    workers: list[str]
    router: str | None = None
    processes: list[Process] = field(default_factory=list)
    logs: Path | None = None
    stoppers: list[Callable[[], None]] = field(default_factory=list)  # e.g. Ray actors that run servers

    def close(self) -> None:
        try:
            stop_processes(self.processes)
            for stop in self.stoppers:
                stop()
        finally:
            self.processes, self.stoppers = [], []
            if self.logs is not None:
                shutil.rmtree(self.logs, ignore_errors=True)


def make_logs() -> Path:
    return Path(tempfile.mkdtemp(prefix="rlbench-sglang-"))


PORT_TAKEN = "Address already in use"  # the router's error when another process bound its port first
PORT_TRIES = 5  # the router started on fresh ports this many times at most while its ports are taken


def start_router(fleet: Fleet, listed: Callable[[str], set[str]]) -> None:
    """Start sglang-router in front of `fleet.workers` and wait until it has registered all of them
    (`listed(router_url)`: the worker URLs it lists as healthy). Its ports are free when chosen, but another process
    may bind one before the router does: a router that exits saying so is started again on fresh ports (PORT_TRIES
    times at most)."""
    for attempt in range(PORT_TRIES):
        port, metrics = free_port(), free_port()
        proc = start_process("router", router_command(fleet.workers, port, metrics), fleet.logs)
        fleet.processes.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ROUTER_TIMEOUT_S
        while time.monotonic() < deadline:
            if not proc.alive():
                break
            if set(fleet.workers) <= listed(url):
                fleet.router, fleet.route = url, [url]
                return
            time.sleep(0.2)
        else:
            raise EngineUnavailable(
                f"sglang-router did not register {fleet.workers} within {ROUTER_TIMEOUT_S:.0f} s "
                f"(its last lines: {proc.tail() or 'none'})"
            )
        fleet.processes.remove(proc)
        stop_processes([proc])
        if PORT_TAKEN not in proc.tail() or attempt == PORT_TRIES - 1:
            raise EngineUnavailable(
                f"sglang-router exited with code {proc.popen.returncode} (its last lines: {proc.tail() or 'none'})"
            )


async def not_ready(client, url: str) -> str | None:
    """None once the server at `url` generates (GET /health_generate answers 200, whatever its body: SGLang's
    is empty); else what it answered (SGLang answers 503 while it loads), or that it did not."""
    from rlbench.backends.sglang.client import Retryable

    probe = f"{url}/health_generate"
    try:
        status, data = await client.call("GET", probe, timeout_s=30)
    except Retryable as exc:
        return str(exc)
    return None if status == 200 else f"GET {probe}: {status} {str(data)[:200]}"


async def registered(client, router: str) -> set[str]:
    """The servers `router` lists as healthy (GET /workers); none while it does not answer, or not as a router."""
    from rlbench.backends.sglang import wire
    from rlbench.backends.sglang.client import Retryable

    source = f"{router}/workers"
    try:
        status, data = await client.call("GET", source, timeout_s=10)
        return wire.healthy(wire.parse_workers(data, f"GET {source}")) if status == 200 else set()
    except (Retryable, ValueError):
        return set()
