"""A plain install works: the wheel holds the fixtures the defaults name, and `rlbench run` from
that wheel, in a fresh virtual environment and a directory outside the checkout, runs its default.

Offline: the wheel is built without build isolation (the set-up's setuptools), installed without
dependencies, and the fresh environment reads the dependencies from this one's site-packages through
a .pth line (which adds that folder to sys.path but runs none of its .pth files: an editable install of
rlbench there stays invisible)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def _run(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = out / "src"  # a copy of the tracked tree: the build writes build/ and *.egg-info beside its input
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        if (REPO / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            (source / rel).write_bytes((REPO / rel).read_bytes())
    res = _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        str(source),
        cwd=out,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (built,) = out.glob("rlbench-*.whl")
    return built


def test_the_wheel_holds_the_fixtures_the_defaults_name(wheel):
    from rlbench.config import RunConfig

    names = set(zipfile.ZipFile(wheel).namelist())
    default = RunConfig()
    for path in (
        Path(default.model.path) / "config.json",
        Path(default.model.tokenizer) / "tokenizer.json",
        Path(default.model.tokenizer) / "tokenizer_config.json",
        Path(default.data.path),
    ):
        rel = path.relative_to(REPO).as_posix()
        assert rel in names, f"{rel} is not in {wheel.name}"
    assert not any(name.endswith("build.py") for name in names if "fixtures" in name)


def fresh_venv(wheel: Path, tmp_path: Path) -> tuple[Path, Path, dict]:
    """A new virtual environment in tmp_path/venv with the wheel installed (not editable) and the dependencies read
    from this environment's site-packages: (its bin folder, its site-packages, the environment to run it with)."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # this pip installs into it (--python): no ensurepip, 2.4 s
    python = env_dir / "bin" / "python"
    site = Path(
        _run(
            str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path
        ).stdout.strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    res = _run(*install, str(wheel), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", PATH=f"{env_dir / 'bin'}:{env.get('PATH', '')}")
    where = _run(str(python), "-c", "import rlbench; print(rlbench.__file__)", cwd=tmp_path, env=env)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # the wheel's, not the checkout's
    return env_dir / "bin", site, env


def test_a_plain_install_runs_the_default_outside_the_checkout(wheel, tmp_path):
    bin_dir, site, env = fresh_venv(wheel, tmp_path)
    env_dir = bin_dir.parent
    res = _run(str(env_dir / "bin" / "rlbench"), "run", "--steps", "5", "--out", "r", "--json", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout)["steps"] == 5
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["config"]["model"]["path"].startswith(str(site))
    assert len((tmp_path / "r" / "checksums.jsonl").read_text().splitlines()) == 5
