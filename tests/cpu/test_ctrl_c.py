"""Ctrl-C, by run kind: exit 130, one line saying what is kept (the run directory's committed steps and the
`--resume` that continues them, or that nothing was kept), and no traceback, an asyncio one included.

- the embedded run (a process stopped at a step, then SIGINT): tests/cpu/test_hardening.py, and a run whose
  slime plugin blocks its event loop: tests/cpu/test_plugin_interrupt.py;
- before anything is written, and the line for each state of the run directory: here;
- the SGLang rollout client, whose event loop Python's own SIGINT handler would interrupt inside a callback of
  aiohttp's (a transport's data_received, a request body writer: "Fatal error on transport", "Task exception
  was never retrieved ... KeyboardInterrupt"): the client alone, with the signal raised in such a callback, and a
  `--rollout sglang --sglang-server rlbench` run signalled at its second step's first request;
- a megatron TP=2 run and a Ray-placed run, whose whole process group gets SIGINT as a terminal sends it.

Each waits on what the run does (its requests, its steps), never on a clock.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import signal
import uuid

import pytest

from tests.conftest import cli, small_toml, tagged_processes
from tests.cpu.conftest import ThreadedApp

PER_STEP = 2 * 4  # /generate requests a step of small_toml sends: prompts_per_step x n_samples_per_prompt


def _no_traceback(stderr: str) -> None:
    for sign in ("Traceback", "never retrieved", "Fatal error", "KeyboardInterrupt"):
        assert sign not in stderr, stderr[-3000:]


# ---------------------------------------------------------------- what the line says


def test_the_line_says_what_of_the_run_directory_is_kept(tmp_path, reference):
    from rlbench.cli import interrupted

    assert interrupted(None) == "rlbench: interrupted"
    assert interrupted(tmp_path / "never") == "rlbench: interrupted; nothing was written"
    run = tmp_path / "run dir"
    shutil.copytree(reference, run)
    assert interrupted(run) == (
        f"rlbench: interrupted; 3 committed steps kept in {run} (rlbench run --resume '{run}' continues it)"
    )
    (run / "metrics.jsonl").write_bytes(b"")  # claimed, its first step not committed
    assert interrupted(run) == (
        f"rlbench: interrupted before the first step was committed; {run} holds no step to resume from"
    )


def test_ctrl_c_before_the_run_directory_is_made_says_nothing_was_written(tmp_path, monkeypatch):
    import rlbench.session

    def interrupted_while_loading(config, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rlbench.session, "run", interrupted_while_loading)
    (tmp_path / "s.toml").write_text(small_toml(3))
    for json_flag in ([], ["--json"]):
        res = cli("run", "-c", str(tmp_path / "s.toml"), "--out", str(tmp_path / "run"), *json_flag)
        assert res.returncode == 130 and res.stdout == "", res.stderr
        assert res.stderr == "rlbench: interrupted; nothing was written\n"


# ---------------------------------------------------------------- the SGLang client's event loop


@pytest.fixture
def answering():
    """A stand-in server answering every request at once with a small JSON object."""
    from aiohttp import web

    async def answer(request):
        await request.read()
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", answer)
    server = ThreadedApp(app)
    yield server
    server.close()


def test_ctrl_c_inside_an_aiohttp_callback_ends_every_task_and_logs_nothing(answering, monkeypatch, caplog):
    """SIGINT while aiohttp's protocol reads an answer (the callback Python's own handler once raised
    KeyboardInterrupt in, which uvloop logged as a fatal transport error and aiohttp's tasks as exceptions
    never retrieved): KeyboardInterrupt from `run`, no task left on the loop, nothing logged, the handler
    back to Python's, and the client still answers."""
    from aiohttp.client_proto import ResponseHandler

    from rlbench.backends.sglang.client import Client

    received = ResponseHandler.data_received
    signalled = []

    def data_received(self, data):
        if not signalled:
            signalled.append(True)
            signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the loop's callback
        return received(self, data)

    monkeypatch.setattr(ResponseHandler, "data_received", data_received)

    async def many(client):
        async with asyncio.TaskGroup() as group:
            for i in range(16):
                group.create_task(client.ok("POST", f"{answering.url}/generate", {"i": i}))

    client = Client()
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        with pytest.raises(KeyboardInterrupt):
            client.run(many(client))
        assert signalled and asyncio.all_tasks(client._loop) == set()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert client.run(client.ok("GET", f"{answering.url}/model_info")) == {"ok": True}
        client.close()
        gc.collect()  # a task whose exception nobody retrieved says so when it is collected
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_ctrl_c_of_an_sglang_run_stops_its_servers_and_keeps_its_committed_step(tmp_path, monkeypatch):
    """`rlbench run --rollout sglang --sglang-server rlbench`, SIGINT at step 1's first /generate (step 0
    committed, step 1's requests going out): exit 130, the line naming the one committed step and its
    `--resume`, no traceback, no server left running."""
    from rlbench.backends.sglang.client import Client

    tag = uuid.uuid4().hex
    monkeypatch.setenv("RLBENCH_TEST_TAG", tag)  # inherited by every process the run starts
    call, generated = Client.call, []

    async def counted(self, method, url, body=None, timeout_s=None):
        if url.endswith("/generate"):
            generated.append(url)
            if len(generated) == PER_STEP + 1:
                signal.raise_signal(signal.SIGINT)
        return await call(self, method, url, body, timeout_s)

    monkeypatch.setattr(Client, "call", counted)
    (tmp_path / "s.toml").write_text(small_toml(3))
    out = tmp_path / "run"
    res = cli(
        "run", "-c", str(tmp_path / "s.toml"), "--rollout", "sglang", "--sglang-server", "rlbench", "--out", str(out)
    )
    assert res.returncode == 130, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"rlbench: interrupted; 1 committed step kept in {out} (rlbench run --resume {out} continues it)"
    )
    _no_traceback(res.stderr)
    assert PER_STEP < len(generated) <= 2 * PER_STEP and tagged_processes(tag) == []  # step 1's, none after


# ---------------------------------------------------------------- runs of several processes, as a terminal stops them


def _ctrl_c_at_step_1(tmp_path, monkeypatch, *args: str) -> None:
    """`rlbench run ... --steps 3` in a session of its own, as a terminal's foreground job: stopped by its own
    failpoint as step 1 starts (its second hit; step 0 committed: an event the parent waits on, waitid, no clock),
    then SIGINT to the whole process group, as Ctrl-C in a terminal sends it (the rank processes and the Ray driver's
    children with it), and the run continued: exit 130, the one line naming the committed step and its --resume, no
    traceback, nothing left running that the run started."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.helpers import wait_stopped

    tag = uuid.uuid4().hex
    (tmp_path / "s.toml").write_text(small_toml(3))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLBENCH_FAILPOINT": "step.start@2:stop", "RLBENCH_TEST_TAG": tag}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbench.cli", "run", "-c", str(tmp_path / "s.toml"), *args, "--out", str(out)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        wait_stopped(proc)
        os.killpg(proc.pid, signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert f"rlbench: interrupted; 1 committed step kept in {out} (rlbench run --resume {out} continues it)" in err
    assert err.count("rlbench:") == 1, err[-3000:]
    _no_traceback(err)
    assert tagged_processes(tag) == []


@pytest.mark.slow
def test_ctrl_c_of_a_megatron_tp2_run_stops_its_ranks_in_one_line(tmp_path, monkeypatch):
    _ctrl_c_at_step_1(tmp_path, monkeypatch, "--trainer", "megatron", "--tp", "2")


@pytest.mark.slow
def test_ctrl_c_of_a_ray_placed_run_stops_in_one_line(tmp_path, monkeypatch):
    import tempfile

    tmp = tempfile.mkdtemp(prefix="rlray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("TMPDIR", tmp)
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    try:
        _ctrl_c_at_step_1(tmp_path, monkeypatch, "--placement", "ray")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
