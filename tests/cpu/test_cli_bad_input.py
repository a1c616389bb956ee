"""Bad input to `rlbench run`: one clear line on stderr, exit 2, no traceback, nothing damaged.

The rule (design.md, "Exit codes"): bad input or usage exits 2 with ONE line on stderr that
starts "rlbench: error:" and names the file / field / option and what was expected; no
traceback unless `--debug`; input is validated before anything is written, and a run
directory that already exists is never touched.

Each case runs the CLI in a subprocess, as a user would. Cases that fail at run time (the
dataset, the reward plugin, the output directory) are run twice: with `--json` and plain
(with the progress bar). Known library bugs are marked `xfail(strict=True)`, so the test
starts failing (XPASS) the moment the bug is fixed and the marker must be removed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

# --- known library bugs, as strict xfails -------------------------------------------------

# rlbench/cli.py main() catches `click.UsageError` / `click.exceptions.Exit`, but typer >= 0.2x
# vendors click as `typer._click`, whose exceptions are not click's: every usage error (unknown
# option, invalid value, no arguments) escapes as a traceback with exit code 1.
USAGE_BUG = pytest.mark.xfail(strict=True, raises=AssertionError,
                              reason="cli.main() catches click.UsageError, but typer raises typer._click "
                                     "exceptions: usage errors give a traceback and exit 1")
# rlbench/cli.py run(): the rich Progress (transient=False, on stderr) is started before run_loop()
# builds and validates, so a BadInput raised while building leaves the progress line
# ("step 0/N ... starting") on stderr before the error line: two lines, not one.
PROGRESS_BUG = pytest.mark.xfail(strict=True, raises=AssertionError,
                                 reason="cli.run() starts the progress bar before validation; its line "
                                        "stays on stderr above the error line")
# rlbench/config.py load_config(): only FileNotFoundError and TOMLDecodeError are caught around
# path.read_text(); a directory, or a file that is not UTF-8, escapes as a traceback.
CONFIG_READ_BUG = pytest.mark.xfail(strict=True, raises=AssertionError,
                                    reason="load_config() does not catch IsADirectoryError / "
                                           "UnicodeDecodeError / PermissionError from read_text()")
# rlbench/core/plugins.py load_function(): only ImportError is caught around import_module(); a
# plugin module that fails to import any other way (SyntaxError, an exception at import time)
# escapes as a traceback.
PLUGIN_IMPORT_BUG = pytest.mark.xfail(strict=True, raises=AssertionError,
                                      reason="load_function() catches only ImportError from import_module()")

# Runtime-validated cases run in both output modes; plain mode hits PROGRESS_BUG.
OUTPUT_MODES = [pytest.param(("--json",), id="json"), pytest.param((), id="plain", marks=PROGRESS_BUG)]

SMALL_TOML = """\
[data]
prompts_per_step = 2
[rollout]
n_samples_per_prompt = 2
[train]
minibatches = 1
micro_batch_size = 4
"""

GOOD_ROWS = [
    {"prompt": "Is the number 65 even or odd?", "label": "odd"},
    {"prompt": "Is the number 90 even or odd?", "label": "even"},
    {"prompt": "Is 11 even or odd?", "label": "odd"},
    {"prompt": "Is 4 even or odd?", "label": "even"},
]


# --- helpers -------------------------------------------------------------------------------

def assert_bad_input(res, *needles: str) -> str:
    """Exit 2, no traceback, and exactly one stderr line, "rlbench: error: ...", holding each needle.

    The one-line check comes last, so that a failure of the earlier checks is not hidden behind it."""
    err = res.stderr
    assert res.returncode == 2, f"exit code {res.returncode}, expected 2\nstderr:\n{err}"
    assert "Traceback" not in err, f"a traceback on bad input:\n{err}"
    lines = err.strip().splitlines()
    assert lines, "nothing on stderr"
    line = lines[-1]
    for needle in needles:
        assert needle in line, f"{needle!r} not in the error line:\n{line}"
    assert len(lines) == 1, f"expected exactly one line on stderr, got {len(lines)}:\n{err}"
    assert line.startswith("rlbench: error:"), line
    return line


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root (directories as None, files as their bytes)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def write_config(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def write_dataset(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_with_dataset(tmp_path: Path, dataset: Path, mode: tuple[str, ...]):
    """`rlbench run` over `dataset` with a small config; the out directory is tmp_path/out."""
    cfg = write_config(tmp_path, SMALL_TOML.replace("[data]\n", f"[data]\npath = {json.dumps(str(dataset))}\n"))
    return run_cli("run", "--config", str(cfg), "--steps", "1", "--out", str(tmp_path / "out"), *mode,
                   cwd=tmp_path, timeout=120)


# --- 1-3: the dataset ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", OUTPUT_MODES)
def test_missing_dataset(tmp_path, mode):
    cfg = write_config(tmp_path, '[data]\npath = "nope.jsonl"\n')  # relative: to the config's folder
    res = run_cli("run", "--config", str(cfg), "--out", str(tmp_path / "out"), *mode, cwd=tmp_path, timeout=120)
    missing = str((tmp_path / "nope.jsonl").resolve())
    line = assert_bad_input(res, missing, "not found")
    assert "dataset" in line
    assert not (tmp_path / "out").exists(), "the out directory was created before the input was validated"


@pytest.mark.parametrize("mode", OUTPUT_MODES)
def test_malformed_jsonl_line(tmp_path, mode):
    rows = [json.dumps(r) for r in GOOD_ROWS]
    rows[2] = '{"prompt": "Is 11 even or odd?", "label": "odd"'  # line 3: unterminated object
    dataset = write_dataset(tmp_path, rows)
    res = run_with_dataset(tmp_path, dataset, mode)
    line = assert_bad_input(res, str(dataset), "line 3")
    assert "JSON" in line
    assert not (tmp_path / "out").exists(), "the out directory was created before the input was validated"


@pytest.mark.parametrize("mode", OUTPUT_MODES)
@pytest.mark.parametrize("bad_row, got", [
    pytest.param({"prompt": "Is 4 even or odd?"}, "nothing", id="label-missing"),
    pytest.param({"prompt": "Is 4 even or odd?", "label": 1}, "int", id="label-not-a-string"),
    pytest.param({"prompt": "Is 4 even or odd?", "label": None}, "nothing", id="label-null"),
])
def test_bad_label_field(tmp_path, mode, bad_row, got):
    rows = [json.dumps(r) for r in GOOD_ROWS]
    rows[1] = json.dumps(bad_row)  # line 2
    dataset = write_dataset(tmp_path, rows)
    res = run_with_dataset(tmp_path, dataset, mode)
    assert_bad_input(res, str(dataset), "line 2", "'label'", "expected a string", got)
    assert not (tmp_path / "out").exists(), "the out directory was created before the input was validated"


# --- 4-5: the command line -----------------------------------------------------------------

@USAGE_BUG
def test_unknown_option(tmp_path):
    res = run_cli("run", "--bogus", "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=60)
    assert_bad_input(res, "--bogus")
    assert not (tmp_path / "out").exists()


@USAGE_BUG
@pytest.mark.parametrize("args, option", [
    pytest.param(("--steps", "0"), "--steps", id="steps-0"),
    pytest.param(("--steps", "abc"), "--steps", id="steps-abc"),
    pytest.param(("--mode", "sideways"), "--mode", id="mode-sideways"),
    pytest.param(("--seed", "-1"), "--seed", id="seed-negative"),
    pytest.param(("--threads", "0"), "--threads", id="threads-0"),
])
def test_invalid_option_value(tmp_path, args, option):
    res = run_cli("run", *args, "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=60)
    assert_bad_input(res, option)
    assert not (tmp_path / "out").exists()


def test_invalid_value_caught_after_parsing(tmp_path):
    """A value the parser accepts but the config rejects (seed >= 2**63) takes the BadInput path."""
    res = run_cli("run", "--seed", str(2**63), "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=60)
    assert_bad_input(res, "seed", "2**63")
    assert not (tmp_path / "out").exists()


# --- 6: the config file --------------------------------------------------------------------

@pytest.mark.parametrize("text, needles", [
    pytest.param("bogus_key = 1\n", ("bogus_key", "unknown key"), id="unknown-top-level-key"),
    pytest.param("[rollout]\ntemprature = 0.5\n", ("rollout.temprature", "unknown key"), id="unknown-section-key"),
    pytest.param("[bogus]\nx = 1\n", ("bogus", "unknown key"), id="unknown-section"),
    pytest.param('steps = "many"\n', ("steps", "expected an integer", "'many'"), id="wrong-type-int"),
    pytest.param('[train]\nlr = "fast"\n', ("train.lr", "expected a number"), id="wrong-type-float"),
    pytest.param("[data]\nshuffle = 1\n", ("data.shuffle", "true or false"), id="wrong-type-bool"),
    pytest.param("[rollout]\ntemperature = -1\n", ("rollout.temperature", ">= 0"), id="out-of-range-temperature"),
    pytest.param("steps = 0\n", ("steps", ">= 1"), id="out-of-range-steps"),
    pytest.param("[train]\nminibatches = 3\n", ("train.minibatches", "divisor"), id="inconsistent-minibatches"),
    pytest.param("steps = = 3\n", ("invalid TOML", "line 1"), id="invalid-toml-syntax"),
])
def test_invalid_config_file(tmp_path, text, needles):
    cfg = write_config(tmp_path, text)
    res = run_cli("run", "--config", str(cfg), "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=60)
    assert_bad_input(res, str(cfg), *needles)
    assert not (tmp_path / "out").exists(), "the out directory was created before the config was validated"


def test_missing_config_file(tmp_path):
    cfg = tmp_path / "absent.toml"
    res = run_cli("run", "--config", str(cfg), "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=60)
    assert_bad_input(res, str(cfg), "not found")
    assert not (tmp_path / "out").exists()


@CONFIG_READ_BUG
@pytest.mark.parametrize("kind", ["directory", "not-utf8"])
def test_unreadable_config_file(tmp_path, kind):
    cfg = tmp_path / "config.toml"
    if kind == "directory":
        cfg.mkdir()
    else:
        cfg.write_bytes(b"\xff\xfe[data]\n")
    res = run_cli("run", "--config", str(cfg), "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=60)
    assert_bad_input(res, str(cfg))
    assert not (tmp_path / "out").exists()


# --- 7: an --out that is not new ------------------------------------------------------------

@pytest.fixture
def existing_run(tmp_path):
    """A real one-step run in tmp_path/run, written by the CLI, and its config file."""
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    out = tmp_path / "run"
    res = run_cli("run", "--steps", "1", "--out", str(out), "--config", str(cfg), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (out / "manifest.json").is_file() and (out / "metrics.jsonl").is_file()
    return cfg, out


@pytest.mark.parametrize("mode", OUTPUT_MODES)
def test_out_holds_a_different_run(existing_run, tmp_path, mode):
    cfg, out = existing_run
    before = snapshot(out)
    res = run_cli("run", "--steps", "1", "--seed", "7", "--out", str(out), "--config", str(cfg), *mode,
                  cwd=tmp_path, timeout=120)
    assert snapshot(out) == before, "the existing run directory was modified"
    assert_bad_input(res, str(out), "a different run", "seed")


@pytest.mark.parametrize("mode", OUTPUT_MODES)
def test_out_holds_this_run_already(existing_run, tmp_path, mode):
    cfg, out = existing_run
    before = snapshot(out)
    res = run_cli("run", "--steps", "1", "--out", str(out), "--config", str(cfg), *mode, cwd=tmp_path, timeout=120)
    assert snapshot(out) == before, "the existing run directory was modified"
    line = assert_bad_input(res, str(out), "already holds", "this run")
    assert "different" not in line


@pytest.mark.parametrize("mode", OUTPUT_MODES)
def test_out_not_empty_and_not_a_run(tmp_path, mode):
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    out = tmp_path / "notes"
    (out / "sub").mkdir(parents=True)
    (out / "todo.txt").write_bytes(b"keep me\n")
    (out / "sub" / "data.bin").write_bytes(bytes(range(256)))
    before = snapshot(out)
    res = run_cli("run", "--steps", "1", "--out", str(out), "--config", str(cfg), *mode, cwd=tmp_path, timeout=120)
    assert snapshot(out) == before, "a non-run directory was modified"
    assert_bad_input(res, str(out), "not empty", "no rlbench run")


@pytest.mark.parametrize("mode", OUTPUT_MODES)
def test_out_is_a_file(tmp_path, mode):
    out = tmp_path / "out"
    out.write_bytes(b"not a directory\n")
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    res = run_cli("run", "--steps", "1", "--out", str(out), "--config", str(cfg), *mode, cwd=tmp_path, timeout=120)
    assert out.read_bytes() == b"not a directory\n"
    assert_bad_input(res, str(out), "not a directory")


# --- 8: --custom-rm-path ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", OUTPUT_MODES)
@pytest.mark.parametrize("path, needles", [
    pytest.param("no_such_module_rlbench_test.reward", ("cannot import", "no_such_module_rlbench_test"),
                 id="missing-module"),
    pytest.param("rm_plugin.no_such_function", ("no attribute", "no_such_function"), id="missing-attribute"),
    pytest.param("rm_plugin.NOT_CALLABLE", ("not callable", "rm_plugin.NOT_CALLABLE"), id="not-callable"),
    pytest.param("rm_plugin", ("dotted path",), id="not-dotted"),
])
def test_bad_custom_rm_path(tmp_path, mode, path, needles):
    (tmp_path / "rm_plugin.py").write_text("NOT_CALLABLE = 3\n\ndef reward(sample):\n    return 0.0\n")
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    # cwd=tmp_path: `python -m` puts the working directory on sys.path, so rm_plugin is importable
    res = run_cli("run", "--steps", "1", "--config", str(cfg), "--custom-rm-path", path,
                  "--out", str(tmp_path / "out"), *mode, cwd=tmp_path, timeout=120)
    assert_bad_input(res, "--custom-rm-path", *needles)
    assert not (tmp_path / "out").exists(), "the out directory was created before the input was validated"


@PLUGIN_IMPORT_BUG
@pytest.mark.parametrize("source", [
    pytest.param("def reward(:\n", id="syntax-error"),
    pytest.param("raise RuntimeError('boom at import')\n", id="raises-at-import"),
])
def test_custom_rm_module_fails_to_import(tmp_path, source):
    (tmp_path / "broken_plugin.py").write_text(source)
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    res = run_cli("run", "--steps", "1", "--config", str(cfg), "--custom-rm-path", "broken_plugin.reward",
                  "--out", str(tmp_path / "out"), "--json", cwd=tmp_path, timeout=120)
    assert_bad_input(res, "--custom-rm-path", "broken_plugin")
    assert not (tmp_path / "out").exists()


# --- 10: --debug ---------------------------------------------------------------------------------

def test_debug_shows_traceback_config_error(tmp_path):
    cfg = write_config(tmp_path, 'steps = "many"\n')
    res = run_cli("run", "--config", str(cfg), "--out", str(tmp_path / "out"), "--debug", cwd=tmp_path, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "Traceback" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("rlbench: error:") and str(cfg) in last and "steps" in last, res.stderr
    assert not (tmp_path / "out").exists()


def test_debug_shows_traceback_dataset_error(tmp_path):
    cfg = write_config(tmp_path, '[data]\npath = "nope.jsonl"\n')
    res = run_cli("run", "--config", str(cfg), "--out", str(tmp_path / "out"), "--json", "--debug",
                  cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" in res.stderr and "BadInput" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("rlbench: error:") and "not found" in last, res.stderr
    assert not (tmp_path / "out").exists()
