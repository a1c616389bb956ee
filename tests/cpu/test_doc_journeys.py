"""The docs' journeys as a user types them: every block between `<!-- journey:NAME -->` and
`<!-- /journey -->` in docs/*.md runs here, in order, in a fresh directory laid out like the repository after the
README's set-up (its `.vendor/` too), with the exit code its comment gives (`(exit N)`, else 0). A server is its own
process, as the user starts it; a client line `rlbench ...` runs through the CLI's own entry point in this process
(the same parsing, errors and exit codes, without an interpreter's start-up: tests/conftest.py `cli`); any other
line, one with shell syntax or a variable set before the command among them, is `bash -c LINE` in the environment a
fresh login shell has (`login_env`: where programs are and who the user is, none of this process's settings), so
what a line needs from its environment, the docs show. The in-process lines need nothing from it: `cli` undoes what
a run leaves on sys.path, and a line that needs a path set (the slime plugins' PYTHONPATH) sets it, so goes through
bash; making every line a process would cost the suite an interpreter's start-up each.

A line ending in `&` starts a server in the background, as in a shell, and the next command waits for it
the way a user does, on an event rather than a clock: `rlbench serve` until it prints where it listens
(servers started one after the other come up together), sglang-router until it lists every worker it was
given. Background processes run until the block's
test ends, then get Ctrl-C (SIGINT) and must exit by themselves. The one change from the docs: the
ports 30000-30009 that a block names become free ports the OS gives, the same one wherever a block
repeats it. Nothing else is passed, no environment variable set.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO, cli, doc_commands

BLOCK = re.compile(r"<!-- journey:([\w-]+) -->\n```bash\n(.*?)```\n<!-- /journey -->", re.S)
LISTENING = "rlbench serve: listening on "
PORT = re.compile(r"\b3000\d\b")
READY_TIMEOUT_S = 120  # a bound on a wait for an event, not the event itself
# What a fresh login shell holds after the README's set-up: where programs are, who the user is, the locale. Not
# this process's own settings (conftest's HF_HUB_OFFLINE and COLUMNS, a PYTHONPATH, pytest's variables).
LOGIN_KEYS = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "TERM", "TMPDIR", "VIRTUAL_ENV")


def login_env() -> dict[str, str]:
    return {key: os.environ[key] for key in LOGIN_KEYS if key in os.environ}


def journeys() -> dict[str, tuple[Path, list[tuple[str, int]]]]:
    """Every journey block of docs/: name -> (file, [(line as written, expected exit code)])."""
    found = {}
    for doc in sorted((REPO / "docs").glob("*.md")):
        for name, body in BLOCK.findall(doc.read_text()):
            assert name not in found, f"journey {name} appears twice"
            found[name] = (doc, doc_commands(body))
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Shell:
    """One user's terminal: a working directory, the block's ports, its background servers."""

    cwd: Path
    ports: dict[str, str] = field(default_factory=dict)
    background: list[subprocess.Popen] = field(default_factory=list)
    logs: dict[int, list[str]] = field(default_factory=dict)
    pending: list[tuple[str, subprocess.Popen, threading.Event]] = field(default_factory=list)

    def line(self, text: str) -> str:
        return PORT.sub(lambda m: self.ports.setdefault(m.group(0), str(_free_port())), text)

    def run(self, command: str, expected: int) -> str:
        serving = command.startswith("rlbench serve ")
        if not (serving and command.endswith("&")):
            self.wait_for_servers()  # a user starts the servers, then waits for them before the next command
        if command.endswith("&"):
            self._start(self.line(command[:-1].strip()))
            return ""
        argv = shlex.split(self.line(command))
        if argv[0] == "rlbench" and not set("*?$|;&<>`").intersection(command):
            res = cli(*argv[1:], cwd=self.cwd)  # a client: the CLI's own entry point in this process
        else:
            res = subprocess.run(
                ["bash", "-c", self.line(command)],
                cwd=self.cwd,
                env=login_env(),
                capture_output=True,
                text=True,
                timeout=600,
                stdin=subprocess.DEVNULL,
            )
        output = res.stdout + res.stderr
        assert res.returncode == expected, (
            f"`{command}` exited {res.returncode}, the docs say {expected}:\n{output[-3000:]}"
        )
        assert "Traceback" not in output, f"`{command}`:\n{output[-3000:]}"
        return output

    def _start(self, command: str) -> None:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=self.cwd,
            env=login_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.background.append(proc)
        seen = self.logs[proc.pid] = []
        listening = threading.Event()

        def drain():  # read everything it prints, so that a full pipe never stalls it
            for out in proc.stdout:
                seen.append(out)
                if out.startswith(LISTENING):
                    listening.set()
            listening.set()  # it exited

        threading.Thread(target=drain, daemon=True).start()
        argv = shlex.split(command)
        if argv[:2] == ["rlbench", "serve"]:
            self.pending.append((command, proc, listening))  # waited for before the next other command
            return
        if "sglang_router.launch_router" in argv:
            self._router_ready(proc, argv, command)
            return
        raise AssertionError(f"no way to tell when `{command}` is ready: teach test_doc_journeys.py")

    def wait_for_servers(self) -> None:
        for command, proc, listening in self.pending:
            listening.wait(READY_TIMEOUT_S)  # set when the server says where it listens, or exits
            seen = self.logs[proc.pid]
            assert any(out.startswith(LISTENING) for out in seen), (
                f"`{command}` did not listen (exit {proc.poll()}):\n{''.join(seen)[-3000:]}"
            )
        self.pending.clear()

    def _router_ready(self, proc: subprocess.Popen, argv: list[str], command: str) -> None:
        port = argv[argv.index("--port") + 1]
        workers = [a for a in argv[argv.index("--worker-urls") + 1 :] if not a.startswith("--")]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"`{command}` exited {proc.returncode}:\n{''.join(self.logs[proc.pid])[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=5) as answer:
                    listed = json.dumps(json.load(answer))
                if all(w in listed for w in workers):
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        raise AssertionError(f"`{command}` did not list {workers} within {READY_TIMEOUT_S} s")

    def close(self) -> list[int]:
        codes = []
        for proc in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
            try:
                codes.append(proc.wait(timeout=60))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes.append(proc.wait())
        return codes


LAYOUT = ("examples", "configs", "golden", "rlbench", "tests", "pyproject.toml", ".vendor")  # .vendor: get_miles.py's


def lay_out(cwd: Path) -> None:
    """`cwd` laid out like the repository after the README's set-up: its folders linked."""
    for name in LAYOUT:
        if (REPO / name).exists():
            (cwd / name).symlink_to(REPO / name)


@pytest.fixture
def shell(tmp_path):
    lay_out(tmp_path)
    shell = Shell(tmp_path)
    yield shell
    shell.close()


def _walk(shell: Shell, name: str) -> list[str]:
    doc, lines = journeys()[name]
    return [shell.run(command, expected) for command, expected in lines]


def test_the_docs_journeys_are_all_tested():
    assert set(journeys()) == {
        "served",
        "routed",
        "started",
        "conformance",
        "regenerate",
        "slime-plugins",
        "trackers",
        "engine-check",
        "attribute",
        "ppo",
    }


@pytest.mark.slow
def test_a_run_against_servers_the_user_started_is_the_embedded_run(shell):
    """`rlbench serve` started by hand, then a run against it; then sglang-router in front of two: both
    runs write the embedded run's checksums.jsonl byte for byte."""
    outputs = _walk(shell, "served")
    assert "no difference (bit for bit)" in outputs[-1], outputs[-1]
    outputs = _walk(shell, "routed")
    assert "no difference (bit for bit)" in outputs[-1], outputs[-1]
    runs = shell.cwd / "runs"
    embedded = (runs / "embedded" / "checksums.jsonl").read_bytes()
    assert embedded.count(b"\n") == 4
    assert (runs / "served" / "checksums.jsonl").read_bytes() == embedded
    assert (runs / "routed" / "checksums.jsonl").read_bytes() == embedded
    assert shell.close()[:3] == [130, 130, 130]  # Ctrl-C stops each rlbench serve, with Ctrl-C's code


def test_check_engine_passes_rlbench_serve_and_names_where_a_batch_variant_one_differs(shell):
    """docs/usage.md's `check engine` block: two servers the user started, the second `--batch-variant`; the check
    passes the first with its counts and fails the second (exit 1) naming the first prompt, batch size and position."""
    outputs = _walk(shell, "engine-check")
    assert re.search(r": deterministic: \d+ answers held to their prompt's reference", outputs[2]), outputs[2]
    assert re.search(
        r"not deterministic: .* the first at mode \w+, prompt \d+, batch size \d+, position \d+", outputs[3]
    )
    assert sorted(p.name for p in shell.cwd.iterdir() if not p.is_symlink()) == []  # nothing written


def test_the_attribution_asks_a_server_the_user_started_for_the_engines_side(shell):
    """docs/usage.md's attribution block: a run against `rlbench serve` the user started, then `check logprobs
    --attribute` asking that server for the engine's state of every sample (its versions loaded first): every link
    measured on every token, the server's forward equal to the trainer's (kernels 0), the mismatch in `cache`."""
    outputs = _walk(shell, "attribute")
    text = " ".join(outputs[2].split())
    assert "engine: http://127.0.0.1:" in text and "largest: cache" in text, outputs[2]  # the port as the harness gave
    assert "checked equal, tensor by tensor" in text, outputs[2]
    assert "not split:" not in text and "not measured:" not in text, outputs[2]


def test_the_ppo_block_replays_and_diffs_the_critics_stages(shell):
    """docs/usage.md's PPO block: a PPO run, its replay reproduced with the critic's stages counted (step 0 the
    critic's alone), a run with the critic's learning rate x1.01 parting first at a critic stage, the report."""
    outputs = _walk(shell, "ppo")
    replayed = " ".join(outputs[1].split())
    assert "reproduced 3 steps (0..2)" in replayed and "35 checksums compared" in replayed, outputs[1]
    assert "critic_loss, critic_grads, critic_weights" in replayed, outputs[1]
    assert "first difference: step 0, stage critic_loss" in outputs[3] and "minibatch 1" in outputs[3], outputs[3]
    assert (shell.cwd / "runs" / "ppo.html").is_file()


def test_servers_rlbench_starts_need_sglang_here(shell):
    outputs = _walk(shell, "started")
    assert "the sglang package is not installed here" in outputs[0] and len(outputs[0].strip().splitlines()) == 1


def test_the_slime_plugins_block_runs_as_typed_in_a_fresh_shell(shell):
    """docs/usage.md's slime-plugin block after the README's set-up: the run line, which puts Miles' package on
    PYTHONPATH itself, in a login shell's environment (no `miles` fixture, nothing on this process's path), exit 0;
    then `check tito runs/sp`, exit 0 and no drift. The check runs in-process (see the docstring above): it reads the
    run directory alone, neither the plugin nor Miles."""
    assert (REPO / ".vendor" / "miles-rl-0.0.2" / "miles").is_dir(), "run `python tests/get_miles.py` (README set-up)"
    doc, lines = journeys()["slime-plugins"]
    assert lines[0][0].startswith("PYTHONPATH=") and lines[1][0] == "rlbench check tito runs/sp", lines
    outputs = _walk(shell, "slime-plugins")
    assert "slime's contract, " in outputs[0] and ".utils.types.Sample" in outputs[0], outputs[0][-2000:]
    assert "no drift" in outputs[1], outputs[1][-2000:]
    assert sorted(p.name for p in shell.cwd.iterdir() if not p.is_symlink()) == ["runs"]  # nothing else written


def test_metrics_reach_tensorboard_and_wandb_as_the_docs_show(shell):
    """docs/usage.md's tracker block: TensorBoard's event files under TENSORBOARD_DIR, W&B's offline run directory
    under --wandb-dir, each run's metrics (TensorBoard's own reader: tests/cpu/test_metric_loggers.py), all in runs/."""
    _walk(shell, "trackers")
    assert list((shell.cwd / "runs" / "tb-log").rglob("events.out.tfevents.*"))
    assert list((shell.cwd / "runs" / "wandb").rglob("*.wandb"))
    assert sorted(p.name for p in shell.cwd.iterdir() if not p.is_symlink()) == ["runs"]  # nothing else written


@pytest.mark.slow
def test_the_conformance_suite_against_a_server_the_user_started(shell):
    outputs = _walk(shell, "conformance")
    assert re.search(r"\d+ passed", outputs[-1]) and " failed" not in outputs[-1], outputs[-1][-2000:]


@pytest.mark.slow
def test_regenerating_the_golden_files_writes_what_is_committed(shell):
    """The golden page's block, on a copy of golden/: each CPU entry of golden/suite.json is run as a user runs
    it and its file remade by `golden update`, which must give the committed file's identity and series (timings
    aside) with the new reason kept: so the committed files are what the suite's runs give today, and not hand
    edits. (`check golden` on a fresh run against them is a usage example: test_readme_examples.py.) The GPU
    suite's line, without CUDA, stops in rlbench's one line and writes nothing."""
    (shell.cwd / "golden").unlink()
    copy = shutil.copytree(REPO / "golden", shell.cwd / "golden")
    outputs = _walk(shell, "regenerate")
    assert "device: no CUDA device" in outputs[1] and "Traceback" not in outputs[1], outputs[1]
    suite = json.loads((REPO / "golden" / "suite.json").read_text())
    assert {p.stem for p in (REPO / "golden").glob("*.json") if p.name != "suite.json"} == set(suite)
    for name in suite:  # the committed file is what `golden update` writes for this entry's run today
        committed, remade = (json.loads((d / f"{name}.json").read_text()) for d in (REPO / "golden", copy))
        for key in ("platform", "device_name", "versions", "determinism", "mode", "config", "config_hash"):
            assert committed["header"][key] == remade["header"][key], (name, key)
        timed = {k for k in committed["metrics"] if k.startswith("perf/")}  # timings: the grid and tolerance only
        assert set(remade["metrics"]) == set(committed["metrics"]) and timed, name
        for metric, series in remade["metrics"].items():
            if metric in timed:
                series = {**series, "values": committed["metrics"][metric]["values"]}
            assert committed["metrics"][metric] == series, (name, metric)
        history = committed["header"]["history"]
        assert history and all(
            entry["reason"] and entry["command"].startswith("rlbench golden update") for entry in history
        )
        assert committed["header"]["reason"] == history[-1]["reason"]
        assert remade["header"]["reason"] == "GRPO: population std, as in the paper", name
