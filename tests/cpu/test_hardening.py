"""Hardening (issue 10): a run directory has one writer, nothing is written or deleted through a link,
non-finite numbers stop a step before it commits, every bad input is one line with exit 2, a plugin
cannot end a run as a success, a bug is exit 3, and the CLI keeps its contract. Locks, kills and
signals use real processes; everything else goes through the CLI's entry point in-process (`cli`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import wait_stopped
from tests.conftest import REPO, cli, rlbench_process, small_toml, RANDOM_INIT_MODEL
from tests.cpu.recordings import copy_run, edit_step


def _one_line(res, *needles: str, code: int = 2) -> str:
    assert res.returncode == code, (res.returncode, res.stdout[-800:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlbench: error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


@pytest.fixture(scope="module")
def toml(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "small.toml"
    path.write_text(small_toml(3))
    return path


@pytest.fixture(scope="module")
def done(tmp_path_factory, toml):
    """A complete small run."""
    out = tmp_path_factory.mktemp("done") / "run"
    assert cli("run", "-c", str(toml), "--out", str(out), "--json").returncode == 0
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory, toml):
    """A run SIGKILLed before its third step (steps 0 and 1 and checkpoint 2 committed): a real process
    killed once; tests resume copies of it."""
    out = tmp_path_factory.mktemp("killed") / "run"
    assert _process("run", "-c", str(toml), "--out", str(out), failpoint="step.start@3").wait(120) == -signal.SIGKILL
    return out


def _process(*args: str, failpoint: str | None = None):
    """`rlbench ARGS` as a process of its own; one that stops at its failpoint is this process's child (a fresh
    interpreter), since wait_stopped learns of the stop as its parent."""
    env = {"RLBENCH_FAILPOINT": failpoint} if failpoint else {}
    return rlbench_process(*args, env=env, fresh=bool(failpoint and failpoint.endswith(":stop")))


# --------------------------------------------------------------------------- 1. one writer


def _second_writer_refused(holder: subprocess.Popen, out: Path) -> None:
    """`holder` stops itself at a failpoint with the run's lock held: a resume from this process (a POSIX lock
    is held per process) is refused with the holder's pid and changes nothing; the holder then finishes the
    run, steps 0..2."""
    try:
        wait_stopped(holder)
        before = _snapshot(out)
        _one_line(cli("run", "--resume", str(out)), f"pid {holder.pid} is writing this run directory")
        assert _snapshot(out) == before
    finally:
        holder.send_signal(signal.SIGCONT)
        assert holder.wait(120) == 0, holder.stderr.read()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


def test_a_second_writer_is_refused_naming_the_holder(tmp_path, toml):
    """A run held at step 1 (SIGSTOP at a failpoint, its lock held): resuming it, twice at once in effect,
    is refused with the holder's pid and changes nothing; once it finishes, its steps are 0..N-1."""
    out = tmp_path / "run"
    holder = _process("run", "-c", str(toml), "--out", str(out), "--json", failpoint="step.start@2:stop")
    _second_writer_refused(holder, out)


def test_two_resumes_at_once_one_wins(tmp_path, killed):
    out = copy_run(killed, tmp_path / "run")
    _second_writer_refused(_process("run", "--resume", str(out), "--json", failpoint="step.start@1:stop"), out)


def test_a_kill_while_claiming_out_leaves_it_usable(tmp_path, toml):
    """SIGKILL after the run directory is made but before it is in place: --out is as it was (absent),
    and a new run takes it."""
    out = tmp_path / "run"
    proc = _process("run", "-c", str(toml), "--out", str(out), failpoint="claim.made@1")
    assert proc.wait(120) == -signal.SIGKILL
    assert not out.exists()
    assert cli("run", "-c", str(toml), "--out", str(out), "--json").returncode == 0
    assert (out / "manifest.json").is_file()


# --------------------------------------------------------------------------- 2. links


@pytest.mark.parametrize("entry", [".metrics.jsonl.tmp", "rollouts", "metrics.jsonl", "checkpoints/000002"])
def test_resume_refuses_links_and_writes_nothing_through_them(tmp_path, killed, entry):
    out = copy_run(killed, tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "users-file").write_text("precious")
    target = out / entry
    if target.exists():  # move the real entry outside and leave a link in its place
        target.rename(outside / target.name)
        target.symlink_to(outside / target.name)
    else:
        target.symlink_to(outside / "users-file")
    before, inside = _snapshot(outside), _snapshot(out)
    _one_line(cli("run", "--resume", str(out)), "(a link)", "move these away first")
    assert _snapshot(outside) == before and _snapshot(out) == inside


def test_resume_refuses_stray_entries(tmp_path, done):
    run = copy_run(done, tmp_path / "run")
    (run / "checkpoints" / "notes.txt").write_text("mine")
    (run / "rollouts" / "plot.png").write_bytes(b"png")
    _one_line(cli("run", "--resume", str(run)), "checkpoints/notes.txt", "rollouts/plot.png")
    assert (run / "checkpoints" / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- 3. non-finite numbers


def _consistent_checksums(run: Path, step: int) -> None:
    """After an edit: the step's checksums as its recording now determines them (a self-consistent run)."""
    from rlbench.core.loop import recorded_checksums
    from rlbench.rundir.recording import read_step

    rows = [json.loads(line) for line in (run / "checksums.jsonl").read_text().splitlines()]
    rows[step].update(recorded_checksums(read_step(run, step)[0]))
    (run / "checksums.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def test_a_nan_reward_in_a_recording_stops_train_only_before_the_step(tmp_path, done):
    run = copy_run(done, tmp_path / "run")
    edit_step(run, 1, lambda t, m: t["rewards"].__setitem__(2, float("nan")))
    _consistent_checksums(run, 1)
    out = tmp_path / "t"
    _one_line(
        cli("run", "--mode", "train-only", "--rollouts", str(run), "--out", str(out)),
        "step 1, stage recorded: rewards is nan at sample 2",
        "000001.safetensors",
        "not committed",
    )
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0]  # the committed step stays, readable and verified
    assert cli("diff", str(out), str(out)).returncode == 0


@pytest.mark.parametrize("plugin, value", [("returns_huge", "1e+39"), ("returns_nan", "nan")])
def test_a_reward_outside_float32_stops_the_run(tmp_path, toml, plugin, value):
    out = tmp_path / "run"
    _one_line(
        cli("run", "-c", str(toml), "--out", str(out), "--custom-rm-path", f"tests.cpu.plugins.rewards.{plugin}"),
        value,
        "finite number",
    )
    assert not out.exists()  # it failed before its first step: nothing left behind


@pytest.mark.parametrize(
    "table, key",
    [
        ("[train]\nlr = 1e308", "train.lr"),
        ("[train]\nweight_decay = inf", "train.weight_decay"),
        ("[algo]\nkl_coef = inf", "algo.kl_coef"),
        ("[algo]\nentropy_coef = inf", "algo.entropy_coef"),
        ("[rollout]\ntemperature = nan", "rollout.temperature"),
        ("out = 5", "out"),
        ("threads = 100000", "threads"),
    ],
)
def test_config_numbers_are_finite_and_in_range(tmp_path, table, key):
    path = tmp_path / "c.toml"
    path.write_text(table + "\n")
    _one_line(cli("run", "-c", str(path), "--out", str(tmp_path / "o")), str(path), key)
    assert not (tmp_path / "o").exists()


def test_a_nan_in_training_stops_before_commit_and_keeps_the_committed_steps(tmp_path, toml):
    """A reward function that goes NaN at step 2: steps 0 and 1 committed and verifiable."""
    out = tmp_path / "run"
    _one_line(
        cli("run", "-c", str(toml), "--out", str(out), "--custom-rm-path", "tests.cpu.plugins.rewards.nan_from_step_2"),
        "reward function returned nan",
    )
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    res = cli("replay", str(out), "--out", str(tmp_path / "rep"))
    assert res.returncode == 0 and "reproduced 2 steps" in res.stdout


# --------------------------------------------------------------------------- 4. bad input is exit 2, one line


def _recording_case(run: Path, name: str) -> None:
    def tokens(t, m, value):
        t["tokens"][5] = value

    edits = {
        "id 1e9": lambda t, m: tokens(t, m, 10**9),
        "id -5": lambda t, m: tokens(t, m, -5),
        "float tokens": lambda t, m: t.__setitem__("tokens", t["tokens"].float()),
        "2-D tokens": lambda t, m: t.__setitem__("tokens", t["tokens"].reshape(1, -1)),
    }
    edit_step(run, 0, edits[name])


@pytest.mark.parametrize("case", ["id 1e9", "id -5", "float tokens", "2-D tokens"])
def test_malformed_recorded_tokens_are_bad_input(tmp_path, done, case):
    run = copy_run(done, tmp_path / "run")
    _recording_case(run, case)
    for args in (
        ("replay", str(run), "--out", str(tmp_path / "r")),
        ("diff", str(done), str(run)),
        ("run", "--mode", "train-only", "--rollouts", str(run), "--out", str(tmp_path / "t")),
        ("check", "logprobs", str(run)),
        ("check", "tito", str(run)),
    ):
        _one_line(cli(*args))
    assert not (tmp_path / "r").exists() and not (tmp_path / "t").exists()


@pytest.mark.parametrize("config", [[1, 2], "a string", None])
def test_a_manifest_whose_config_is_not_an_object_is_bad_input(tmp_path, done, config):
    run = copy_run(done, tmp_path / "run")
    manifest = json.loads((run / "manifest.json").read_text())
    if config is None:
        del manifest["config"]
    else:
        manifest["config"] = config
    (run / "manifest.json").write_text(json.dumps(manifest))
    for args in (
        ("replay", str(run)),
        ("diff", str(run), str(done)),
        ("run", "--resume", str(run)),
        ("check", "golden", str(run), str(REPO / "golden" / "default.json")),
        ("check", "logprobs", str(run)),
    ):
        _one_line(cli(*args), "manifest.json", "config")


def test_deeply_nested_json_and_toml_are_bad_input(tmp_path, done):
    deep = "[" * 100_000 + "]" * 100_000
    run = copy_run(done, tmp_path / "run")
    (run / "manifest.json").write_text(deep)
    _one_line(cli("diff", str(run), str(done)), "nested too deeply")
    golden = tmp_path / "g.json"
    golden.write_text(deep)
    _one_line(cli("check", "golden", str(done), str(golden)), "nested too deeply")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": ' + deep + ', "label": "even"}\n')
    config = tmp_path / "c.toml"
    config.write_text(f"[data]\npath = '{data}'\n")
    _one_line(cli("run", "-c", str(config), "--out", str(tmp_path / "o")), "nested too deeply")
    config.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    _one_line(cli("run", "-c", str(config), "--out", str(tmp_path / "o")))


def test_broken_run_directory_entries_are_bad_input(tmp_path, done):
    run = copy_run(done, tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    _one_line(cli("diff", str(run), str(done)), "metrics.jsonl", "is a directory")


@pytest.mark.parametrize(
    "args, needle",
    [(("--device", "cuda"), "device"), (("--device", "tpu"), "device"), (("--threads", "100000"), "threads")],
)
def test_placement_options_are_checked(tmp_path, args, needle):
    if args[1] == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _one_line(cli("run", "--steps", "1", "--out", str(tmp_path / "o"), *args), needle)


def test_out_below_a_file_is_bad_input(tmp_path):
    (tmp_path / "file").write_text("x")
    _one_line(cli("run", "--steps", "1", "--out", str(tmp_path / "file" / "run")), "--out")


@pytest.mark.parametrize(
    "prompt, needle",
    [
        ("Is 4\ud800 even?", "surrogate"),
        ("7" * 2_000_000, "characters"),
        ("Is " + "1" * 300 + " even or odd?", "tokens"),
    ],
)
def test_prompts_no_model_can_take_are_bad_input(tmp_path, prompt, needle, transformers_warnings):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": prompt, "label": "even"}) + "\n")
    config = tmp_path / "c.toml"
    # one row, so one prompt a step, and its samples one minibatch: a step the config accepts, whatever the default
    # sample count and minibatches, so that the prompt is what is refused
    config.write_text(f"[data]\npath = '{data}'\nprompts_per_step = 1\n[train]\nminibatches = 1\n")
    _one_line(cli("run", "-c", str(config), "--steps", "1", "--out", str(tmp_path / "o")), str(data), needle)
    assert [r.getMessage() for r in transformers_warnings] == []  # no second line (the tokenizer's own warning)


def test_a_broken_tokenizer_or_weights_file_is_bad_input(tmp_path):
    import shutil

    from rlbench.config import ModelConfig

    tok = tmp_path / "tok"
    shutil.copytree(ModelConfig().tokenizer, tok)
    (tok / "tokenizer.json").write_text('{"model": 5}')
    config = tmp_path / "c.toml"
    config.write_text(f"[model]\ntokenizer = '{tok}'\n")
    _one_line(cli("run", "-c", str(config), "--steps", "1", "--out", str(tmp_path / "o")), "cannot load tokenizer")
    model = tmp_path / "model"
    shutil.copytree(RANDOM_INIT_MODEL, model)
    from safetensors.torch import save_file

    from rlbench.core.model import build_model, named_weights

    save_file(
        {k: v.contiguous() for k, v in named_weights(build_model(model, 0, init="random")).items()},
        str(model / "model.safetensors"),
    )
    raw = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    config.write_text(f"[model]\npath = '{model}'\n")
    _one_line(cli("run", "-c", str(config), "--steps", "1", "--out", str(tmp_path / "o")), "model.safetensors")


def test_golden_update_without_a_regular_series_writes_nothing(tmp_path, done):
    run = copy_run(done, tmp_path / "run")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{"step": r["step"], ("a" if r["step"] % 2 else "b"): 1.0} for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _one_line(cli("golden", "update", str(run), str(tmp_path / "g.json"), "--reason", "x"), "no metric")
    assert not (tmp_path / "g.json").exists()


# --------------------------------------------------------------------------- 5. plugins and signals


@pytest.mark.parametrize(
    "plugin, needle", [("calls_exit", "called sys.exit(0)"), ("raises_base_exception", "raised BaseException")]
)
def test_a_plugin_cannot_end_the_run_as_a_success(tmp_path, toml, plugin, needle):
    out = tmp_path / "run"
    _one_line(
        cli("run", "-c", str(toml), "--out", str(out), "--custom-rm-path", f"tests.cpu.plugins.rewards.{plugin}"),
        needle,
        f"tests.cpu.plugins.rewards.{plugin}",
    )
    assert not out.exists()


def test_ctrl_c_says_the_committed_steps_are_kept(tmp_path, toml):
    out = tmp_path / "run"
    proc = _process("run", "-c", str(toml), "--out", str(out), failpoint="step.start@2:stop")
    wait_stopped(proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().endswith(f"; 1 committed step kept in {out} (rlbench run --resume {out} continues it)")
    assert "Traceback" not in err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0]


def test_an_internal_error_is_exit_3_never_a_verdict(tmp_path, done, monkeypatch):
    from rlbench.replay import diff as diff_module

    monkeypatch.setattr(diff_module, "open_run", lambda *args, **kwargs: 1 // 0)
    res = cli("diff", str(done), str(done))
    _one_line(res, "internal error: ZeroDivisionError", "--debug", code=3)


# --------------------------------------------------------------------------- 6. the CLI contract


def test_errors_are_one_line_with_no_blank_line_before(tmp_path):
    res = cli("run", "--config", str(tmp_path / "missing.toml"))
    assert res.stderr.startswith("rlbench: error: ") and res.stderr.count("\n") == 1


def test_a_group_alone_prints_its_help_and_exits_2():
    res = cli("check")
    assert res.returncode == 2 and "Usage: rlbench check" in res.stdout + res.stderr
    assert "rlbench: error" not in res.stderr


def test_python_m_rlbench_works():
    res = subprocess.run(
        [sys.executable, "-m", "rlbench", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )
    assert res.returncode == 0 and "Usage: rlbench" in res.stdout


def test_help_shows_defaults_and_flags_take_no_value():
    import re

    res = cli("run", "--help")
    assert res.returncode == 0
    flat = re.sub(r"[│╭╮╰╯─\s]+", " ", res.stdout)  # the help's table, unwrapped
    for option, default in (("--seed", "0"), ("--threads", "1"), ("--device", "cpu"), ("--mode", "full")):
        segment = flat.split(f" {option} ", 1)[1].split("[default:", 1)  # its help, up to its first default
        assert segment[1].startswith(f" {default}]") and " --" not in segment[0].replace(" --rollouts", ""), option
    assert "<bool>" not in res.stdout and "<bool>" not in cli("diff", "--help").stdout


def test_the_resume_summary_covers_the_whole_run(tmp_path, toml):
    out = tmp_path / "run"
    _process("run", "-c", str(toml), "--out", str(out), failpoint="step.start@3").wait(120)
    res = cli("run", "--resume", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["summary"]["steps"] == 3


def test_train_only_names_the_recorded_settings_it_takes(tmp_path, done):
    config = tmp_path / "c.toml"
    config.write_text("[rollout]\ntemperature = 0.5\n")
    res = cli(
        "run",
        "--mode",
        "train-only",
        "--rollouts",
        str(done),
        "-c",
        str(config),
        "--out",
        str(tmp_path / "t"),
        "--json",
    )
    assert res.returncode == 0, res.stderr
    assert "train-only: rollout.temperature: the recording's 1.0, not 0.5" in json.loads(res.stdout)["notes"]


# --------------------------------------------------------------------------- 7. first-round surfaces (issue 26)


@pytest.fixture
def transformers_warnings():
    """The records transformers logs at WARNING and above while a test runs: its handler writes to the
    process's stderr, which the in-process `cli` does not capture, so a stray line shows only here."""
    import logging

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _rewrite_step_json(run: Path, step: int, edit) -> None:
    """Edit a step's JSON and recompute its samples' digest: only the reader's own checks can catch it."""
    from rlbench.rundir.recording import _samples_digest

    path = run / "rollouts" / f"{step:06d}.json"
    meta = json.loads(path.read_text())
    edit(meta)
    meta["samples_sha256"] = _samples_digest(meta.get("samples"))
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit, needle, everyone",
    [
        (
            lambda m: [s.pop("finish_reason") for s in m["samples"]],
            "samples[0].finish_reason: expected one of stop, length, abort, got nothing",
            False,
        ),
        (
            lambda m: m["samples"][3].__setitem__("finish_reason", 7),
            "samples[3].finish_reason: expected one of stop, length, abort, got 7",
            False,
        ),
        (lambda m: m.pop("samples"), "samples: missing: expected a list of per-sample objects", True),
        (lambda m: m.__setitem__("samples", {"0": {}}), "samples: expected a list of per-sample objects", True),
    ],
)
def test_a_recordings_json_without_what_readers_need_is_bad_input(tmp_path, done, edit, needle, everyone):
    """No samples: every reader refuses. No finish reason: the readers that recompute the rollout metrics
    from it (replay, train-only); diff and the checks read no finish reason."""
    run = copy_run(done, tmp_path / "run")
    _rewrite_step_json(run, 1, edit)
    for args in (
        ("replay", str(run), "--out", str(tmp_path / "r")),
        ("run", "--mode", "train-only", "--rollouts", str(run), "--out", str(tmp_path / "t")),
        ("diff", str(done), str(run)),
        ("check", "logprobs", str(run)),
    ):
        if everyone or args[0] != "diff" and args[0] != "check":
            _one_line(cli(*args), "000001.json", needle)
    assert not (tmp_path / "r").exists() and not (tmp_path / "t").exists()  # refused before anything was written


@pytest.mark.parametrize("value", ["0.5", None, True, [1.0]])
def test_a_metric_that_is_not_a_number_is_bad_input(tmp_path, done, value):
    run = copy_run(done, tmp_path / "run")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[1]["train/loss"] = value
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for args in (
        ("replay", str(run), "--out", str(tmp_path / "r")),
        ("diff", str(done), str(run)),
        ("check", "golden", str(run), str(REPO / "golden" / "default.json")),
    ):
        _one_line(cli(*args), "metrics.jsonl: line 2: 'train/loss' is", "expected a number")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "log, conflicting", [("checksums.jsonl", True), ("checksums.jsonl", False), ("metrics.jsonl", True)]
)
def test_a_second_line_for_one_step_is_bad_input(tmp_path, done, log, conflicting):
    run = copy_run(done, tmp_path / "run")
    lines = (run / log).read_text().splitlines()
    row = json.loads(lines[1])
    if conflicting:
        key = "loss" if log == "checksums.jsonl" else "train/loss"
        row[key] = "0" * 64 if log == "checksums.jsonl" else 1.5
    lines.insert(2, json.dumps(row))
    (run / log).write_text("\n".join(lines) + "\n")
    how = "differing at" if conflicting else "the same again"
    for args in (
        ("replay", str(run), "--out", str(tmp_path / "r")),
        ("diff", str(done), str(run)),
        ("run", "--resume", str(run)),
    ):
        _one_line(cli(*args), log, "line 3: a second line for step 1 (line 2 is the first)", how)


def test_a_model_config_with_a_negative_size_is_bad_input(tmp_path, transformers_warnings):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(RANDOM_INIT_MODEL, model)
    doc = json.loads((model / "config.json").read_text())
    config = tmp_path / "c.toml"
    config.write_text(f"[model]\npath = '{model}'\ninit = 'random'\n")
    for key, value in (("vocab_size", -1), ("num_hidden_layers", 0), ("hidden_size", "64"), ("head_dim", 2**40)):
        (model / "config.json").write_text(json.dumps({**doc, key: value}))
        _one_line(
            cli("run", "-c", str(config), "--steps", "1", "--out", str(tmp_path / "o")),
            f"config.json: {key}: expected an integer in [1, 2**31 - 1], got {value!r}",
        )
    assert transformers_warnings == []  # refused before transformers read it (it warns about such values)
    assert not (tmp_path / "o").exists()


def test_a_chat_template_that_cannot_render_is_bad_input(tmp_path):
    import shutil

    from rlbench.config import ModelConfig

    tok = tmp_path / "tok"
    shutil.copytree(ModelConfig().tokenizer, tok)
    doc = json.loads((tok / "tokenizer_config.json").read_text())
    config = tmp_path / "c.toml"
    config.write_text(f"[model]\ntokenizer = '{tok}'\n")
    for template, needle in (
        ("{{ messages | no_such_filter }}", "No filter named 'no_such_filter'"),
        ("{% if %}", "TemplateSyntaxError"),
        ("{{ raise_exception('no system prompt') }}", "no system prompt"),
        ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ):
        (tok / "tokenizer_config.json").write_text(json.dumps({**doc, "chat_template": template}))
        _one_line(
            cli("run", "-c", str(config), "--steps", "1", "--out", str(tmp_path / "o")),
            str(tok),
            "chat_template: the chat template cannot render prompt",
            needle,
        )
    (tok / "tokenizer_config.json").write_text(json.dumps({**doc, "chat_template": ""}))
    _one_line(cli("run", "-c", str(config), "--steps", "1", "--out", str(tmp_path / "o")), "renders to no tokens")
    assert not (tmp_path / "o").exists()
