"""A fork server for the tests' `rlbench` processes (issue 57: most of the suite's time was interpreter start-up).

`rlbench run` in a fresh interpreter spends about 4 s of CPU importing torch and transformers' Qwen3 (which pulls
in torch._dynamo and DTensor) before it does anything. A test that needs a process of its own for what processes
have (a SIGKILL at a failpoint, a lock held by another process) does not need that start-up: this server imports
what `rlbench run` imports, once, without running any torch operation (no thread pool is started, so a fork is
safe), then forks a child per request. The child is a real process: its own pid, signals, exit status, open files
and locks; it takes the request's working directory, environment, arguments and standard streams, and runs
`python -m rlbench.cli` as a fresh interpreter would.

What a fork does not give a child, the client (tests/conftest.py `run_cli`) keeps a fresh interpreter for: an
environment that differs from the server's in anything `forkable` does not allow (what torch and MKL read at import, a
numerics mode, is the server's), a process another test finds by its environment in /proc (a fork's /proc environ
is the server's), and bits across interpreters (the same hash seed in every child).

Protocol, one request per connection on the server's Unix socket: the client sends a JSON line {args, cwd, env}
with its stdin, stdout and stderr descriptors (SCM_RIGHTS); the server answers the child's pid as a line, and its
exit status (the subprocess convention: -N for signal N) as a second line when it ends. One thread: exits are
watched through pidfds in the same select loop that accepts requests.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys

# the environment a child may differ from the server in: read by rlbench at run time, never at import (and pytest's
# own PYTEST_* variables, which nothing of rlbench's reads)
FORKABLE_ENV = frozenset({"RLBENCH_FAILPOINT", "COLUMNS", "LINES"})


def forkable(key: str) -> bool:
    """Whether a child may take this environment variable's value from its request (it is read at run time)."""
    return key in FORKABLE_ENV or key.startswith("PYTEST_")


def _child(request: dict, fds: list[int], added: dict[str, str]) -> None:
    """In the forked child: become the requested `python -m rlbench.cli ARGS` and exit with its status."""
    import runpy
    import signal

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for key, value in added.items():  # as the child's own imports would set them (setdefault)
            os.environ.setdefault(key, value)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the descriptors are the child's own from here
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        sys.argv = ["rlbench", *request["args"]]
        import importlib

        from rlbench.rundir import failpoints

        importlib.reload(failpoints)  # the one module that reads the environment (RLBENCH_FAILPOINT) at import
        try:
            runpy.run_module("rlbench.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, (int, type(None))):
                print(exit_.code, file=sys.stderr)
        except KeyboardInterrupt:
            code = 130
    except BaseException:  # noqa: BLE001 - what a fresh interpreter prints for an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def serve(path: str) -> None:
    started = dict(os.environ)
    import rlbench.cli  # noqa: F401 - what every child runs, imported once here
    import rlbench.session  # noqa: F401 - torch, transformers, the trainer and the engine
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401 - torch._dynamo and DTensor come with it

    # what those imports set in the environment (TRANSFORMERS_NO_ADVISORY_WARNINGS, TORCHINDUCTOR_CACHE_DIR, ...): a
    # child's imports would have set them over its request's environment, so each child sets them the same way
    added = {k: v for k, v in os.environ.items() if started.get(k) != v}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    print(json.dumps({"ready": True, "added": added}), flush=True)  # the client waits for this line
    watched: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, the connection to answer)
    while True:
        readable, _, _ = select.select([listener, sys.stdin, *watched], [], [])
        for ready in readable:
            if ready is sys.stdin:  # the client's end closed: the test session is over
                if not sys.stdin.buffer.read1(1):
                    return
            elif ready is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message.decode())
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    for other, (_, answer) in watched.items():  # the other children's exit watches and clients
                        os.close(other)
                        answer.close()
                    _child(request, fds, added)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                watched[os.pidfd_open(pid)] = (pid, conn)
            else:
                pid, conn = watched.pop(ready)
                os.close(ready)
                _, raw = os.waitpid(pid, 0)
                try:
                    conn.sendall(f"{_status(raw)}\n".encode())
                except OSError:  # the client went away
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])


class ForkedProcess:
    """The client's handle on a child of the fork server, as much of subprocess.Popen's as the tests use: its pid,
    its exit status (from the server: the test process is not its parent), its output pipes, and signals."""

    def __init__(self, path: str, args: list[str], cwd: str, env: dict, stdout, stderr):
        import subprocess

        self.args, self.returncode = ["rlbench", *args], None
        fds, mine, self.stdout, self.stderr = [os.open(os.devnull, os.O_RDONLY)], [], None, None
        for stream, name in ((stdout, "stdout"), (stderr, "stderr")):
            if stream == subprocess.STDOUT:
                fds.append(fds[1])
            elif stream == subprocess.PIPE:
                read, write = os.pipe()
                fds.append(write)
                mine.append(write)
                setattr(self, name, open(read, encoding="utf-8", errors="replace"))  # noqa: SIM115
            else:
                fds.append(os.open(os.devnull, os.O_WRONLY))
                mine.append(fds[-1])
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._conn.connect(path)
            request = json.dumps({"args": args, "cwd": cwd, "env": env}).encode()
            socket.send_fds(self._conn, [request], fds)
        finally:
            for fd in {fds[0], *mine}:
                os.close(fd)
        self.pid = int(self._conn.recv(64))

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            import subprocess

            self._conn.settimeout(timeout)
            try:
                self.returncode = int(self._conn.recv(64))
            except (TimeoutError, BlockingIOError):
                if timeout is None or timeout > 0:
                    raise subprocess.TimeoutExpired(self.args, timeout) from None
                return None
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        return self._status(timeout)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Both pipes read to their end, then the exit status (timeout: over both, as Popen's)."""
        import selectors
        import subprocess
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {s.fileno(): (s, []) for s in (self.stdout, self.stderr) if s is not None}
        with selectors.DefaultSelector() as selector:
            for fd in streams:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        streams[key.fd][1].append(data)
                    else:
                        selector.unregister(key.fd)
        out = [b"".join(parts).decode("utf-8", "replace") for _, parts in streams.values()]
        for stream, _ in streams.values():
            stream.close()
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.001))
        texts = iter(out)
        return (next(texts) if self.stdout else None), (next(texts) if self.stderr else None)
