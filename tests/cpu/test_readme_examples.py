"""docs/usage.md as tested documentation: every command of its examples block, run as written from a
copy of the repository's layout, in order, each with the exit code docs/usage.md gives it.

Commands run in-process through the CLI's own entry point (`rlbench.cli.main`), not as subprocesses:
the same parsing, error mapping and exit codes, without paying the interpreter's start-up each time; none needs
anything from its environment (the one that does, the slime plugins' run, is a journey block of its own, run in a
fresh shell by tests/cpu/test_doc_journeys.py). The one change: the bare `rlbench run` (the full default run) runs
3 steps here. Each test also holds that the commands write nothing beside `runs/`."""

from __future__ import annotations

import glob
import re
import shlex


from tests.conftest import REPO, cli, doc_commands

USAGE = REPO / "docs" / "usage.md"
BLOCK = re.compile(r"<!-- readme:examples -->\n```bash\n(.*?)```\n<!-- /readme:examples -->", re.S)


def commands() -> list[tuple[str, int]]:
    return doc_commands(BLOCK.search(USAGE.read_text()).group(1))


def _run(command: str) -> tuple[int, str]:
    argv = shlex.split(command)
    assert argv[0] == "rlbench", command
    quoted = {arg for arg in argv if f"'{arg}'" in command or f'"{arg}"' in command}
    argv = [
        a for arg in argv for a in (sorted(glob.glob(arg)) or [arg] if "*" in arg and arg not in quoted else [arg])
    ]  # as bash expands them
    if argv[1:] == ["run"]:
        argv += ["--steps", "3"]
    res = cli(*argv[1:])
    return res.returncode, res.stdout + res.stderr


def test_the_block_names_every_command():
    names = {c.split()[1] for c, _ in commands()}
    assert {"run", "replay", "diff", "import", "check", "golden"} <= names
    assert len(commands()) >= 20


def _written(cwd) -> list[str]:
    """What the commands made in the repository's root: everything but the linked layout."""
    return sorted(p.name for p in cwd.iterdir() if not p.is_symlink())


def test_every_usage_example_runs_with_its_exit_code(tmp_path, monkeypatch):
    for name in ("examples", "configs", "golden", "rlbench"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    for command, expected in commands():
        code, output = _run(command)
        assert code == expected, f"`{command}` exited {code}, docs/usage.md says {expected}:\n{output[-3000:]}"
        assert "Traceback" not in output, f"`{command}`:\n{output[-3000:]}"
    assert (tmp_path / "runs" / "mine.json").is_file() and (tmp_path / "runs" / "d.png").is_file()
    assert _written(tmp_path) == ["runs"]


def test_the_readme_tour_runs_with_exit_0(tmp_path, monkeypatch):
    """The README's tour, line by line: `rlbench` lines in-process as above, the server line (`... &`) as its
    own process in the background, waited for by the line it prints (tests/cpu/test_doc_journeys.py's shell),
    then asked for its model over HTTP."""
    import json
    import urllib.request

    from tests.cpu.test_doc_journeys import Shell

    text = re.search(
        r"<!-- readme:tour -->\n```bash\n(.*?)```\n<!-- /readme:tour -->", (REPO / "README.md").read_text(), re.S
    ).group(1)
    lines = [line.partition("  #")[0].strip() for line in text.splitlines() if line.strip()]
    assert len(lines) >= 10 and any(line.endswith("&") for line in lines)
    for name in ("examples", "configs", "golden", "rlbench"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    shell = Shell(tmp_path)
    try:
        for command in lines:
            if command.endswith("&"):
                shell.run(command, 0)
                shell.wait_for_servers()  # until it prints where it listens
                port = next(iter(shell.ports.values()))
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/model_info", timeout=60) as answer:
                    assert json.load(answer)["model_path"]
                continue
            code, output = _run(command)
            assert code == 0 and "Traceback" not in output, f"`{command}` exited {code}:\n{output[-3000:]}"
    finally:
        assert shell.close() == [130]  # Ctrl-C
    runs = tmp_path / "runs"
    assert (runs / "tour.html").is_file() and (runs / "tour-slime" / "metrics.jsonl").is_file()
    assert _written(tmp_path) == ["runs"]


def test_the_example_dumps_are_what_examples_build_py_makes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("examples_build", REPO / "examples" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for path in module.build_dumps(tmp_path):
        rel = path.relative_to(tmp_path)
        assert path.read_bytes() == (REPO / "examples" / rel).read_bytes(), f"{rel} differs from a rebuild"
