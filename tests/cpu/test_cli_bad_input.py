"""Bad input to `rlbench run`: one clear line on stderr, exit 2, no traceback, nothing damaged.

The rule (design.md, "Exit codes"): bad input or usage exits 2 with ONE line on stderr that
starts "rlbench: error:" and names the file / field / option and what was expected; no
traceback unless `--debug`; input is validated before anything is written, and a run
directory that already exists is never touched.

Each case runs the CLI in a subprocess, as a user would. Cases that fail at run time (the
dataset, the reward plugin, the output directory) run with `--json`, which has no progress
bar; `test_runtime_error_plain_output` runs a few of them plain, progress bar and all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

# Cases validated at run time run with --json (no progress bar); test_runtime_error_plain_output
# runs some of them without it.
JSON = ("--json",)

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
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def write_config(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def write_dataset(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_with_dataset(tmp_path: Path, dataset: Path, *extra: str):
    """`rlbench run` over `dataset` with a small config; the out directory is tmp_path/out."""
    cfg = write_config(tmp_path, SMALL_TOML.replace("[data]\n", f"[data]\npath = {json.dumps(str(dataset))}\n"))
    return run_cli(
        "run", "--config", str(cfg), "--steps", "1", "--out", str(tmp_path / "out"), *extra, cwd=tmp_path, timeout=120
    )


# --- 1-3: the dataset ----------------------------------------------------------------------


def test_missing_dataset(tmp_path):
    cfg = write_config(tmp_path, '[data]\npath = "nope.jsonl"\n')  # relative: to the config's folder
    res = run_cli("run", "--config", str(cfg), "--out", str(tmp_path / "out"), *JSON, cwd=tmp_path, timeout=120)
    missing = str((tmp_path / "nope.jsonl").resolve())
    line = assert_bad_input(res, missing, "not found")
    assert "dataset" in line
    assert not (tmp_path / "out").exists(), "the out directory was created before the input was validated"


def test_malformed_jsonl_line(tmp_path):
    rows = [json.dumps(r) for r in GOOD_ROWS]
    rows[2] = '{"prompt": "Is 11 even or odd?", "label": "odd"'  # line 3: unterminated object
    dataset = write_dataset(tmp_path, rows)
    res = run_with_dataset(tmp_path, dataset, *JSON)
    line = assert_bad_input(res, str(dataset), "line 3")
    assert "JSON" in line
    assert not (tmp_path / "out").exists(), "the out directory was created before the input was validated"


@pytest.mark.parametrize(
    "bad_row, got",
    [
        pytest.param({"prompt": "Is 4 even or odd?"}, "nothing", id="label-missing"),
        pytest.param({"prompt": "Is 4 even or odd?", "label": 1}, "int", id="label-not-a-string"),
    ],
)
def test_bad_label_field(tmp_path, bad_row, got):
    rows = [json.dumps(r) for r in GOOD_ROWS]
    rows[1] = json.dumps(bad_row)  # line 2
    dataset = write_dataset(tmp_path, rows)
    res = run_with_dataset(tmp_path, dataset, *JSON)
    assert_bad_input(res, str(dataset), "line 2", "'label'", "expected a string", got)
    assert not (tmp_path / "out").exists(), "the out directory was created before the input was validated"


# --- 4-5: the command line -----------------------------------------------------------------


def test_unknown_option(tmp_path):
    res = run_cli("run", "--bogus", "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=60)
    assert_bad_input(res, "--bogus")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, line",
    [
        (("run", "--step", "5"), "rlbench run: no such option: --step (did you mean --steps?)"),
        (("run", "--sede=3"), "rlbench run: no such option: --sede (did you mean --seed?)"),
        (("run", "--rollout-batch-sise", "4"), "option: --rollout-batch-sise (did you mean --rollout-batch-size?)"),
        (("replay", "--stepz", "5", "x"), "No such option: --stepz (did you mean --steps?)"),
        (("--verison",), "No such option: --verison (did you mean --version?)"),
        (("run", "--eval-interval", "5"), "--eval-interval (neither rlbench's nor a slime argument rlbench models;"),
        (("run", "--wandb-key", "k"), "--wandb-key is not read: a secret is not written into the run's manifest"),
    ],
)
def test_a_mistyped_option_gets_the_closest_name(tmp_path, args, line):
    """`rlbench run` takes slime's arguments through, so click's own suggestion never saw its typos; the closest
    of its options and slime's is named, where it is a letter or two away (a slime argument rlbench does not
    model is refused as that). Elsewhere click's list of near names is one, the closest."""
    res = run_cli(*args, "--out", str(tmp_path / "out"), cwd=tmp_path) if args[0] == "run" else run_cli(*args)
    assert line in res.stderr and res.stderr.count("did you mean") == ("did you mean" in line), res.stderr
    assert_bad_input(res)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, option",
    [
        pytest.param(("--steps", "0"), "--steps", id="steps-0"),
        pytest.param(("--steps", "abc"), "--steps", id="steps-abc"),
        pytest.param(("--mode", "sideways"), "--mode", id="mode-sideways"),
        pytest.param(("--seed", "-1"), "--seed", id="seed-negative"),
        pytest.param(("--threads", "0"), "--threads", id="threads-0"),
    ],
)
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


@pytest.mark.parametrize(
    "text, needles",
    [
        pytest.param("bogus_key = 1\n", ("bogus_key", "unknown key"), id="unknown-top-level-key"),
        pytest.param("[rollout]\ntemprature = 0.5\n", ("rollout.temprature", "unknown key"), id="unknown-section-key"),
        pytest.param("[bogus]\nx = 1\n", ("bogus", "unknown key"), id="unknown-section"),
        pytest.param('steps = "many"\n', ("steps", "expected an integer", "'many'"), id="wrong-type-int"),
        pytest.param('[train]\nlr = "fast"\n', ("train.lr", "expected a number"), id="wrong-type-float"),
        pytest.param("[data]\nshuffle = 1\n", ("data.shuffle", "true or false"), id="wrong-type-bool"),
        pytest.param(
            "[rollout]\ntemperature = -1\n", ("rollout.temperature", "in [0, 100]"), id="out-of-range-temperature"
        ),
        pytest.param("steps = 0\n", ("steps", "in [1, 10,000,000]"), id="out-of-range-steps"),
        pytest.param("[train]\nminibatches = 3\n", ("train.minibatches", "divisor"), id="inconsistent-minibatches"),
        pytest.param("steps = = 3\n", ("invalid TOML", "line 1"), id="invalid-toml-syntax"),
        pytest.param("tp = 2\n", ("tp", "unless train.backend is megatron"), id="tp-without-megatron"),
        pytest.param(
            "[train.megatron]\nhidden_dropout = 0.1\n",
            ("train.megatron", "unless train.backend is megatron"),
            id="megatron-table-for-torch",
        ),
    ],
)
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


@pytest.mark.parametrize("kind", ["directory", "not-utf8"])
def test_unreadable_config_file(tmp_path, kind):
    """A config path that is a directory, or a file that is not UTF-8: read errors other than
    "not found" are bad input too."""
    cfg = tmp_path / "config.toml"
    if kind == "directory":
        cfg.mkdir()
    else:
        cfg.write_bytes(b"\xff\xfe[data]\n")
    res = run_cli("run", "--config", str(cfg), "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=60)
    assert_bad_input(res, str(cfg))
    assert not (tmp_path / "out").exists()


# --- 7: an --out that is not new ------------------------------------------------------------


def test_out_holds_a_run(tmp_path):
    """A real one-step run, then the CLI twice more into its directory: another seed, then the
    same config. Both are refused, and the directory stays byte for byte as it was."""
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    out = tmp_path / "run"
    res = run_cli("run", "--steps", "1", "--out", str(out), "--config", str(cfg), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (out / "manifest.json").is_file() and (out / "metrics.jsonl").is_file()
    before = snapshot(out)
    assert any(v is not None for v in before.values())

    res = run_cli(
        "run", "--steps", "1", "--seed", "7", "--out", str(out), "--config", str(cfg), *JSON, cwd=tmp_path, timeout=120
    )
    assert snapshot(out) == before, "a run into a directory holding a different run modified it"
    assert_bad_input(res, str(out), "a different run", "seed")

    res = run_cli("run", "--steps", "1", "--out", str(out), "--config", str(cfg), *JSON, cwd=tmp_path, timeout=120)
    assert snapshot(out) == before, "a repeated run into the same directory modified it"
    line = assert_bad_input(res, str(out), "already holds", "this run")
    assert "different" not in line


def test_out_not_empty_and_not_a_run(tmp_path):
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    out = tmp_path / "notes"
    (out / "sub").mkdir(parents=True)
    (out / "todo.txt").write_bytes(b"keep me\n")
    (out / "sub" / "data.bin").write_bytes(bytes(range(256)))
    before = snapshot(out)
    res = run_cli("run", "--steps", "1", "--out", str(out), "--config", str(cfg), *JSON, cwd=tmp_path, timeout=120)
    assert snapshot(out) == before, "a non-run directory was modified"
    assert_bad_input(res, str(out), "not empty", "no rlbench run")


def test_out_is_a_file(tmp_path):
    out = tmp_path / "out"
    out.write_bytes(b"not a directory\n")
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    res = run_cli("run", "--steps", "1", "--out", str(out), "--config", str(cfg), *JSON, cwd=tmp_path, timeout=120)
    assert out.read_bytes() == b"not a directory\n"
    assert_bad_input(res, str(out), "not a directory")


# --- 8: --custom-rm-path ----------------------------------------------------------------------

PLUGIN = "NOT_CALLABLE = 3\n\n\ndef reward(sample):\n    return 0.0\n"


@pytest.mark.parametrize(
    "path, needles",
    [
        pytest.param(
            "no_such_module_rlbench_test.reward", ("cannot import", "no_such_module_rlbench_test"), id="missing-module"
        ),
        pytest.param("rm_plugin.no_such_function", ("no attribute", "no_such_function"), id="missing-attribute"),
        pytest.param("rm_plugin.NOT_CALLABLE", ("not callable", "rm_plugin.NOT_CALLABLE"), id="not-callable"),
    ],
)
def test_bad_custom_rm_path(tmp_path, path, needles):
    (tmp_path / "rm_plugin.py").write_text(PLUGIN)
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    # cwd=tmp_path: `python -m` puts the working directory on sys.path, so rm_plugin is importable
    res = run_cli(
        "run",
        "--steps",
        "1",
        "--config",
        str(cfg),
        "--custom-rm-path",
        path,
        "--out",
        str(tmp_path / "out"),
        *JSON,
        cwd=tmp_path,
        timeout=120,
    )
    assert_bad_input(res, "--custom-rm-path", *needles)
    assert not (tmp_path / "out").exists(), "the out directory was created before the input was validated"


def test_custom_rm_module_fails_to_import(tmp_path):
    """A plugin module that fails to import with something other than ImportError."""
    (tmp_path / "broken_plugin.py").write_text("def reward(:\n")  # a SyntaxError, not an ImportError
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    res = run_cli(
        "run",
        "--steps",
        "1",
        "--config",
        str(cfg),
        "--custom-rm-path",
        "broken_plugin.reward",
        "--out",
        str(tmp_path / "out"),
        *JSON,
        cwd=tmp_path,
        timeout=120,
    )
    assert_bad_input(res, "--custom-rm-path", "broken_plugin")
    assert not (tmp_path / "out").exists()


# --- 9: the same rule without --json, progress bar and all ---------------------------------------


@pytest.mark.parametrize("case", ["dataset", "custom-rm-path", "out-not-a-run"])
def test_runtime_error_plain_output(tmp_path, case):
    """Without --json the progress bar is on stderr; a bad input found while the run is built
    must still leave exactly one line there (the bar starts only at the first step)."""
    cfg = write_config(tmp_path, SMALL_TOML, "small.toml")
    out = tmp_path / "out"
    if case == "dataset":
        cfg = write_config(tmp_path, '[data]\npath = "nope.jsonl"\n')
        args, needles = ("--config", str(cfg)), (str((tmp_path / "nope.jsonl").resolve()), "not found")
    elif case == "custom-rm-path":
        args, needles = (
            ("--config", str(cfg), "--custom-rm-path", "no_such_module_rlbench_test.reward"),
            ("--custom-rm-path",),
        )
    else:
        out.mkdir()
        (out / "todo.txt").write_bytes(b"keep me\n")
        args, needles = ("--config", str(cfg)), (str(out), "no rlbench run")
    before = snapshot(tmp_path)
    res = run_cli("run", "--steps", "1", *args, "--out", str(out), cwd=tmp_path, timeout=120)
    assert snapshot(tmp_path) == before, "bad input changed the files"
    assert_bad_input(res, *needles)


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
    res = run_cli(
        "run", "--config", str(cfg), "--out", str(tmp_path / "out"), "--json", "--debug", cwd=tmp_path, timeout=120
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" in res.stderr and "BadInput" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("rlbench: error:") and "not found" in last, res.stderr
    assert not (tmp_path / "out").exists()


HIDER = """import os, sys
HIDDEN = set(os.environ["RLBENCH_TEST_HIDE"].split(","))


class Hide:  # as if the package were not installed: importing it (or a module under it) fails
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hide())
"""


@pytest.mark.parametrize(
    "hidden, args, needle",
    [
        (
            "uvicorn",
            ["serve", "--port", "0"],
            "rlbench serve: the uvicorn package is not installed here (pip install '.[serve]')",
        ),
        ("starlette", ["serve", "--port", "0"], "the starlette package is not installed here (pip install '.[serve]')"),
        (
            "megatron",
            ["run", "--trainer", "megatron", "--steps", "1"],
            "train.backend: the megatron.core package is not installed here (pip install '.[megatron]')",
        ),
        (
            "ray",
            ["run", "--placement", "ray", "--steps", "1"],
            "the ray package is not installed here (pip install '.[ray]')",
        ),
        (
            "aiohttp",
            ["run", "--rollout", "sglang", "--sglang-server", "rlbench", "--steps", "1"],
            "the aiohttp package is not installed here (pip install '.[router]')",
        ),
        ("matplotlib", ["check", "golden", "RUN", "golden/default.json", "--plot", "p.png"], "--plot needs matplotlib"),
    ],
)
def test_a_missing_extra_is_one_line_with_its_pip_line_before_anything_starts(tmp_path, hidden, args, needle):
    """Each extra missing (its import fails, as where it was never installed): exit 2, one line naming the
    package and the pip line, nothing printed on stdout (rlbench serve never says it listens), no run written."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDER)
    args = [str(REPO / "golden" / "default.json") if a == "golden/default.json" else a for a in args]
    if "RUN" in args:
        assert run_cli("run", "--steps", "1", "--out", str(tmp_path / "run")).returncode == 0
        args[args.index("RUN")] = str(tmp_path / "run")
    else:
        args += ["--out", str(tmp_path / "out")] if args[0] == "run" else []
    # the hider first, then the caller's path: the child runs the rlbench under test (a PYTHONPATH checkout, not
    # only an installed one)
    path = os.pathsep.join([str(tmp_path / "hide"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "RLBENCH_TEST_HIDE": hidden}
    res = subprocess.run(
        [sys.executable, "-m", "rlbench.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stdout + res.stderr
    assert "listening" not in res.stdout and not (tmp_path / "out" / "metrics.jsonl").exists()
