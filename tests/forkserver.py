"""A fork server for the tests' `rlbench` processes (issue 57: most of the suite's time was interpreter start-up).

`rlbench run` in a fresh interpreter spends about 4 s of CPU importing torch and transformers' Qwen3 (which pulls
in torch._dynamo and DTensor) before it does anything. A test that needs a process of its own for what processes
have (a SIGKILL at a failpoint, a lock held by another process) does not need that start-up: this server imports
what `rlbench run` imports, once, without running any torch operation (no thread pool is started, so a fork is
safe), then forks a child per request. The child is a real process: its own pid, signals, exit status, open files
and locks; it takes the request's working directory, environment, arguments and standard streams, and runs
`python -m rlbench.cli` as a fresh interpreter would.

What a fork does not give a child, the client (tests/conftest.py `run_cli`) keeps a fresh interpreter for: an
environment that differs from the server's in anything but FORKABLE_ENV (what torch and MKL read at import, a
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

# the environment a child may differ from the server in: read by rlbench at run time, never at import
FORKABLE_ENV = frozenset({"RLBENCH_FAILPOINT", "COLUMNS", "LINES", "PYTEST_CURRENT_TEST"})


def _child(request: dict, fds: list[int]) -> None:
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
    import rlbench.cli  # noqa: F401 - what every child runs, imported once here
    import rlbench.session  # noqa: F401 - torch, transformers, the trainer and the engine
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401 - torch._dynamo and DTensor come with it

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)  # the client waits for this line
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
                    for other in watched:  # the other children's exit watches
                        os.close(other)
                    _child(request, fds)
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
