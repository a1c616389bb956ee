"""Shared test set-up: hermetic environment, a small fast config, and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["RAY_AUTH_MODE"] = "disabled"
# Wide output, as `run_cli` gives a process: rich reads COLUMNS once, when rlbench.cli makes its consoles.
os.environ["COLUMNS"] = "200"

import pytest  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

from rlbench.config import RunConfig, load_config  # noqa: E402

# bench/mutation.py runs the tests once per mutant with --hypothesis-profile=mutation: a failing example is all
# it needs, not the minimal one hypothesis otherwise searches for (shrinking), which can take minutes.
settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate])

REPO = Path(__file__).resolve().parents[1]
# the tiny fixture model without weights (model.init = "random"); the default run starts from its fine-tuned
# copy, models/tiny-qwen3-sft, whose weights are committed
RANDOM_INIT_MODEL = REPO / "rlbench" / "fixtures" / "models" / "tiny-qwen3"
# Miles' miles/ package (a real slime Sample and http_utils), unpacked by tests/get_miles.py (the README's test
# command runs it): never installed, since its wheel also ships sglang/ and megatron/core trees.
MILES = REPO / ".vendor" / "miles-rl-0.0.2"


@pytest.fixture
def miles(monkeypatch):
    """Miles' package on this process's path (and its children's, through PYTHONPATH); a missing one fails with the
    command that fetches it."""
    if not (MILES / "miles" / "utils" / "types.py").is_file():
        pytest.fail(f"Miles' miles/ package is not in {MILES}: run `python tests/get_miles.py` (the README's set-up)")
    monkeypatch.syspath_prepend(str(MILES))
    paths = [str(MILES), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    return MILES


def word_level_tokenizer():
    """A 4-id tokenizer with no decoder ("decoder": null: its ids are words joined by spaces) and no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "odd": 1, "even": 2, "<eot>": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eot>")


def small_toml(steps: int) -> str:
    """The TOML of `small_config`, for tests that go through the CLI."""
    return (
        f"steps = {steps}\ncheckpoint_every = 2\n[data]\nprompts_per_step = 2\n[rollout]\n"
        "n_samples_per_prompt = 4\n[train]\nminibatches = 2\nmicro_batch_size = 3\n"
    )


@pytest.fixture(scope="session")
def small_config() -> RunConfig:
    """A few steps of the default task at a size that runs in about a second."""
    return load_config(
        steps=3,
        checkpoint_every=2,
        data__prompts_per_step=2,
        rollout__n_samples_per_prompt=4,
        train__minibatches=2,
        train__micro_batch_size=3,
    )


@pytest.fixture
def run_small(tmp_path, small_config):
    """run_small(name, **overrides) -> RunResult, written to tmp_path/name."""
    from rlbench.session import run

    def _run(name: str = "run", **overrides):
        from rlbench.config import apply_overrides

        config = apply_overrides(small_config, out=str(tmp_path / name), **overrides)
        return run(config)

    return _run


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`rlbench ARGS` in this process, through the console entry point itself (`rlbench.cli.main`): the
    same parsing, error boundary and exit codes as a subprocess, without paying the interpreter's
    start-up (importing torch and transformers: seconds per call, most of the suite's time when every
    call was a process). What a run leaves in the process is undone: the working directory, sys.path, and modules
    imported from outside the installed packages (plugins: a module-level
    counter or a same-named module in another test's directory must not carry over). For what needs a
    process of its own (signals, locks, crashes, bits across processes), `run_cli(..., process=True)`."""
    from rlbench.testing import rlbench

    saved_cwd, saved_modules = os.getcwd(), set(sys.modules)
    try:
        if cwd is not None:
            os.chdir(cwd)
        outcome = rlbench(*args)  # argv, sys.path and the working directory it ran in are restored
    finally:
        os.chdir(saved_cwd)
        for name in set(sys.modules) - saved_modules:
            if _user_module(sys.modules[name]):
                del sys.modules[name]
    return subprocess.CompletedProcess(["rlbench", *args], outcome.code, outcome.stdout, outcome.stderr)


# Where installed packages live: the interpreter's prefixes and every sys.path entry outside this checkout (a
# PYTHONPATH of carried wheels on the GPU host among them), and rlbench itself; plugins come from anywhere else.
_INSTALLED = tuple(
    {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    | {str(Path(p).resolve()) for p in sys.path if p and REPO not in (Path(p).resolve(), *Path(p).resolve().parents)}
) + (str(REPO / "rlbench"),)


def _user_module(module) -> bool:
    """A module imported from outside the interpreter's prefixes and rlbench itself: a plugin."""
    path = getattr(module, "__file__", None)
    return bool(path) and not str(Path(path).resolve()).startswith(_INSTALLED)


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 300, process: bool = False, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`rlbench ARGS` as a user runs it: in this process (`cli`) unless `process`, where it gets a process of its
    own (`python -m rlbench.cli`, COLUMNS=200): forked from the session's fork server (tests/forkserver.py: the
    interpreter's start-up paid once) where its environment allows, else, or with `fresh`, a new interpreter (for
    bits across interpreters); `timeout` applies to a process."""
    if not process:
        return cli(*args, cwd=cwd or REPO)
    proc = rlbench_process(*args, cwd=cwd, fresh=fresh)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(["rlbench", *args], proc.returncode, out, err)


_SERVER: dict = {}  # this test process's fork server: its socket path, environment and process
_SESSION_ENV = dict(os.environ)  # as the session set it up, before any test (pytest_configure): the fork server's


def _server_env() -> dict[str, str]:
    """The fork server's environment: this process's as the session set it up (before any test changed it), with
    PYTHONPATH at the checkout, less what a child may set itself (forkserver.forkable)."""
    from tests.forkserver import forkable

    return {**{k: v for k, v in _SESSION_ENV.items() if not forkable(k)}, "PYTHONPATH": str(REPO)}


def _forkable(env: dict[str, str]) -> bool:
    """Whether a child of the fork server can be this environment's process: it differs from the server's only
    where forkserver.forkable allows (the rest is read at import, or marks a process others look for)."""
    from tests.forkserver import forkable

    _fork_server()  # what its imports set is known once it has started
    wanted, added = _SERVER["env"], _SERVER["added"]
    return all(
        forkable(k) or (k in added and env.get(k) in (None, added[k]))  # a child's imports set it so
        for k in env.keys() | wanted.keys()
        if env.get(k) != wanted.get(k)
    )


def _fork_server() -> str:
    """The socket of this process's fork server, started on first use; it exits when this process does."""
    if "path" not in _SERVER:
        env = _server_env()
        path = str(Path(tempfile.mkdtemp(prefix="rlbench-fork-")) / "socket")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", path],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = proc.stdout.readline()
        assert ready.startswith('{"ready": true'), f"the fork server did not start: {ready!r}"
        _SERVER.update(path=path, env=env, proc=proc, added=json.loads(ready)["added"])
    return _SERVER["path"]


def rlbench_process(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    fresh: bool = False,
):
    """`python -m rlbench.cli ARGS` started, not waited for (PYTHONPATH at the checkout, `env` over this process's
    environment, no input): a subprocess.Popen, or where the environment allows and not `fresh`, the fork server's
    child (forkserver.ForkedProcess: the same pid, signals, pipes, wait and communicate; text output). A test that
    waits for the process's stop itself (waitid: only a parent may) takes `fresh`."""
    full = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    if not fresh and _forkable(full):
        from tests.forkserver import ForkedProcess

        return ForkedProcess(_fork_server(), list(args), str(cwd or REPO), full, stdout, stderr)
    return subprocess.Popen(
        [sys.executable, "-m", "rlbench.cli", *args],
        cwd=cwd or REPO,
        env=full,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def tagged_processes(tag: str) -> list[int]:
    """Processes (other than this one) that inherited RLBENCH_TEST_TAG=tag: what the run started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RLBENCH_TEST_TAG={tag}".encode() in environ:
            found.append(int(entry.name))
    return found


# The hostile-input sweep (tests/cpu/test_sweep.py) counts what it tried; each xdist worker adds its counts to a
# file under the session's base temporary directory, and the controller prints their sum at the end.
def record_sweep(**counts: int) -> None:
    base = Path(os.environ.get("RLBENCH_SWEEP_DIR", tempfile.gettempdir()))
    with open(base / f"sweep-{os.getpid()}.jsonl", "a") as fh:
        fh.write(json.dumps(counts) + "\n")


def pytest_configure(config):
    import signal

    # A suite started in the background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and so would
    # every process the tests start: the tests that press Ctrl-C on a run or a server would see nothing happen. A
    # handler here is reset to the default in each child at exec, as in a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) owns the directory
        os.environ["RLBENCH_SWEEP_DIR"] = tempfile.mkdtemp(prefix="rlbench-sweep-")
    _SESSION_ENV.clear()
    _SESSION_ENV.update(os.environ)  # the session's environment, set up: what the fork server starts with


def pytest_terminal_summary(terminalreporter):
    from rlbench import numerics

    # The machine the suite's bit-exact verdicts held on (or failed on), in CI's log too.
    ident = numerics.identity()
    cpu = ident.get("cpu") or {}
    terminalreporter.write_line(
        f"platform: {cpu.get('model')} ({cpu.get('vendor')}, {cpu.get('isa')}), numerics "
        f"{ident['mode']} (ATen {ident['aten_capability']}, MKL_CBWR {ident['mkl_cbwr']})"
    )

    base = os.environ.get("RLBENCH_SWEEP_DIR")
    totals: dict[str, int] = {}
    for path in sorted(Path(base).glob("sweep-*.jsonl")) if base else []:
        for line in path.read_text().splitlines():
            for key, value in json.loads(line).items():
                totals[key] = totals.get(key, 0) + value
    if totals:
        terminalreporter.write_line(
            f"hostile-input sweep: {totals.get('inputs', 0)} inputs, {totals.get('commands', 0)} "
            f"commands run, 0 tracebacks, {totals.get('outside_writes', 0)} writes outside "
            "the directories the commands own (any traceback or write fails its test)"
        )


def doc_commands(block: str) -> list[tuple[str, int]]:
    """A docs command block's lines as (command, the exit code its comment gives as `(exit N)`, else 0)."""
    import re

    out = []
    for line in block.splitlines():
        command, _, comment = line.partition("  #")
        if command.strip():
            code = re.search(r"\(exit (\d)\)", comment)
            out.append((command.strip(), int(code.group(1)) if code else 0))
    return out
