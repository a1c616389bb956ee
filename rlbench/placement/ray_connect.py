"""Starting and reaching Ray for `--placement ray` (ray.py places the run's pieces once Ray is up).

Ray is started here (`start_local`: `ray.init(num_cpus=..., include_dashboard=False)`; ray.py's
`local_cpus` says how many) and shut down with the run, unless it is already initialised in this process or
`placement.ray_address` names a cluster (`auto`, `HOST:6379`, `ray://HOST:10001`): then rlbench
only connects, and leaves it running. rlbench must be installed on every node of such a cluster.

A Ray instance rlbench starts lives on 127.0.0.1: Ray otherwise puts a node on this machine's
network address even for a single-machine instance (and turns a loopback address given to it into
that one). `loopback()` is Ray's own switch for it (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which
the processes Ray starts inherit), held only while Ray starts or connects to a loopback address.
Connecting is bounded (`connect`): the address was checked when the config was made (config.py),
the host is resolved and its port must accept a TCP connection and answer as a gRPC server (Ray's
GCS and client server both are), then `ray.init` gets what is left of `placement.ray_timeout`
(--ray-timeout) in a thread of its own; past it, or refused by Ray, the run stops with one line.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager, nullcontext

# An HTTP/2 client's first bytes: the connection preface, then an empty SETTINGS frame (RFC 9113, 3.4).
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's nodes on 127.0.0.1 (ray_constants reads it)
# Ray's own warnings stay off stderr (its "Token authentication is enabled" notice among them): a failure is one
# line, rlbench's; the workers' output stays in Ray's session logs (log_to_driver false).
QUIET = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}


@contextmanager
def loopback():
    """Ray on 127.0.0.1 while this lasts (see the module docstring): the environment the processes Ray
    starts inherit, and the constant this process's Ray read from it when it was imported."""
    from ray._private import ray_constants

    saved_env, saved = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = saved_env


def start_local(num_cpus: int, **options) -> None:
    """A Ray instance of `num_cpus` logical CPUs on 127.0.0.1 (`options`: more of ray.init's)."""
    import ray

    with loopback():
        ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **{**QUIET, **options})


def connect(address: str, timeout: float) -> None:
    """Connect to the Ray cluster at `address` within `timeout` seconds, or BadInput in one line."""
    from rlbench.config_placement import ray_address_parts

    deadline = time.monotonic() + timeout
    _, host, port = ray_address_parts(address)
    if host is not None:
        answers_grpc(address, host, port, timeout)
    with loopback() if host in ("127.0.0.1", "localhost", "::1") else nullcontext():
        init_within(address, max(deadline - time.monotonic(), 0.1), timeout)


def answers_grpc(address: str, host: str, port: int, timeout: float) -> None:
    """`host:port` accepts a TCP connection and answers an HTTP/2 client preface with a SETTINGS frame,
    as a gRPC server does (Ray's GCS and its client server): a closed port, an unknown host or a server
    of another kind is named at once instead of leaving Ray to retry for minutes."""
    import socket

    from rlbench.errors import BadInput

    def refuse(why: str) -> BadInput:
        return BadInput(f"{address}: {why}", field="placement.ray_address")

    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(HTTP2_PREFACE)
            head = b""
            while len(head) < 9 and (chunk := sock.recv(9 - len(head))):
                head += chunk
    except socket.gaierror as exc:
        raise refuse(f"cannot resolve the host ({exc.strerror})") from None
    except ConnectionRefusedError:
        raise refuse("nothing listens there (connection refused)") from None
    except TimeoutError:
        raise refuse(f"no answer within {timeout:g} s (--ray-timeout)") from None
    except OSError as exc:
        raise refuse(f"cannot connect ({exc.strerror or exc.__class__.__name__})") from None
    if len(head) < 9 or head[3] != 0x04:  # frame type 4: SETTINGS
        raise refuse("the server there is not a Ray cluster (it does not speak gRPC)")


def init_within(address: str, seconds: float, timeout: float) -> None:
    """ray.init(address) in a thread of its own, given `seconds`; Ray's own messages while it tries
    are left out (its C++ client writes to the process's stderr), its refusal is one line."""
    import threading

    import ray

    from rlbench.errors import BadInput

    outcome: list = []

    def attempt() -> None:
        try:
            ray.init(address=address, **QUIET)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - Ray refuses in many ways; each is reported in one line
            outcome.append(exc)

    with stderr_muted():
        thread = threading.Thread(target=attempt, name="rlbench-ray-connect", daemon=True)
        thread.start()
        thread.join(seconds)
    if not outcome:
        raise BadInput(
            f"{address}: Ray did not connect within {timeout:g} s (--ray-timeout)", field="placement.ray_address"
        )
    if outcome[0] is not None:
        exc = outcome[0]
        first = (str(exc).splitlines() or [""])[0][:200]
        raise BadInput(
            f"{address}: Ray refused the connection ({exc.__class__.__name__}: {first})", field="placement.ray_address"
        )


@contextmanager
def stderr_muted():
    """The process's stderr (descriptor 2) sent to /dev/null while this lasts."""
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
