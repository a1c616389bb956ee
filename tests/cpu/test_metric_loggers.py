"""slime's W&B and TensorBoard arguments (rlbench/core/trackers.py), offline: TensorBoard's event files read back with
TensorBoard's own reader, W&B's offline run read back from its .wandb log, each holding every committed step's
metrics as metrics.jsonl holds them; logging leaves the run's bytes alone; a resumed run logs only its new steps;
what slime or rlbench cannot take is refused in one line."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from rlbench.config import apply_overrides
from tests.conftest import cli, small_toml

pytest.importorskip("tensorboard")  # the dev extra installs both; a plain install skips, never fails


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, everything it writes (settings, cache, runs) under tmp_path: no network, no home directory."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path / "wandb"


def _lines(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def _events(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard's own reader loads from `directory`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _expected(metrics: list[dict], minibatches: int) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as slime logs it to TensorBoard: train/* at train/step (step * optimizer steps per step), the
    rest at rollout/step; add_scalar keeps a float32."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in metrics:
        for key, value in line.items():
            if key != "step":
                step = line["step"] * minibatches if key.startswith("train/") else line["step"]
                out.setdefault(key, []).append((step, float(np.float32(value))))
    return out


def test_tensorboard_event_files_hold_every_committed_metric(tmp_path, monkeypatch):
    """The acceptance command: `rlbench run --use-tensorboard --tb-project-name p ...` writes
    tensorboard_log/p/<start time>/ under the working directory, as slime does."""
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    (tmp_path / "small.toml").write_text(small_toml(2))
    res = cli(
        "run", "--config", "small.toml", "--out", "r", "--use-tensorboard", "--tb-project-name", "p", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    [experiment] = list((tmp_path / "tensorboard_log" / "p").iterdir())
    metrics = _lines(tmp_path / "r", "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1] and "train/loss" in metrics[0]
    assert _events(experiment) == _expected(metrics, minibatches=2)
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["config"]["tracking"]["tb_project_name"] == "p"


def _wandb_history(root: Path) -> list[dict]:
    """The history rows of the one offline run under `root`, read from its .wandb file (a LevelDB-style log of
    wandb's own protobuf Records, 32 KiB blocks after a 7-byte header; wandb 0.31 ships no Python reader of it)."""
    from wandb.proto import wandb_internal_pb2

    [log] = list(root.glob("wandb/offline-run-*/run-*.wandb"))
    data, block, pos, chunk, rows = log.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def test_wandb_offline_run_holds_the_metrics_and_the_run_its_bytes(tmp_path, small_config, offline_wandb):
    from rlbench.session import run

    config = apply_overrides(small_config, steps=2)
    run(apply_overrides(config, out=str(tmp_path / "plain")))
    logged = apply_overrides(
        config,
        out=str(tmp_path / "logged"),
        tracking__use_wandb=True,
        tracking__wandb_mode="offline",
        tracking__wandb_dir=str(offline_wandb),
        tracking__wandb_project="rlbench-test",
    )
    run(logged)
    import wandb

    wandb.teardown()  # wait for W&B's service process to have written all it was handed
    metrics = _lines(tmp_path / "logged", "metrics.jsonl")
    rows = _wandb_history(offline_wandb)
    assert len(rows) == len(metrics) == 2
    for row, line in zip(rows, metrics):
        step = line.pop("step")
        assert {k: row[k] for k in line} == line  # JSON both sides: the same float64 values
        assert (row["rollout/step"], row["train/step"]) == (step, step * config.train.minibatches)
    # with and without W&B: the same checksums and the same metrics, but for their timings (perf/*)
    plain, logged_dir = tmp_path / "plain", tmp_path / "logged"
    assert (plain / "checksums.jsonl").read_bytes() == (logged_dir / "checksums.jsonl").read_bytes()
    untimed = [
        [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in _lines(d, "metrics.jsonl")]
        for d in (plain, logged_dir)
    ]
    assert untimed[0] == untimed[1]
    recorded = json.loads((logged_dir / "manifest.json").read_text())["config"]["tracking"]
    assert (recorded["use_wandb"], recorded["wandb_mode"]) == (True, "offline")  # what --resume continues with


def test_logging_is_no_part_of_the_run_identity(small_config):
    from rlbench.checks.golden import config_hash, config_identity

    manifest = {"config": small_config.to_dict(), "hashes": {}}
    logged = apply_overrides(small_config, tracking__use_tensorboard=True, tracking__tb_project_name="p")
    assert config_hash(config_identity({**manifest, "config": logged.to_dict()})) == config_hash(
        config_identity(manifest)
    )


def test_a_resumed_run_logs_its_new_steps_once_to_the_same_directory(tmp_path, small_config, monkeypatch):
    """Killed after two committed steps, resumed from checkpoint 0: the two recomputed steps are verified, not
    logged again; the third lands in the same experiment directory (named after the run's start, not the resume's)."""
    from rlbench.replay.resume import resume
    from rlbench.session import run

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    config = apply_overrides(
        small_config,
        out=str(tmp_path / "r"),
        checkpoint_every=100,
        tracking__use_tensorboard=True,
        tracking__tb_project_name="p",
    )

    def stop(state):
        if state.step == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(config, on_step=stop)
    [experiment] = list((tmp_path / "tensorboard_log" / "p").iterdir())
    assert {step for step, _ in _events(experiment)["rollout/raw_reward"]} == {0, 1}
    resumed = resume(tmp_path / "r")
    assert (resumed.committed, resumed.checkpoint) == (2, 0)
    assert list((tmp_path / "tensorboard_log" / "p").iterdir()) == [experiment]
    assert _events(experiment) == _expected(_lines(tmp_path / "r", "metrics.jsonl"), minibatches=2)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--wandb-project", "p"], "tracking.wandb_project: expected unset without use_wandb"),
        (["--use-wandb", "--wandb-mode", "cloud"], "tracking.wandb_mode: expected online or offline or disabled"),
        (["--use-tensorboard", "--tb-experiment-name", "e"], "unset without tb_project_name"),
        (["--wandb-always-use-train-step"], "false unless use_wandb or use_tensorboard"),
        (["--use-tensorboard"], "--use-tensorboard needs --tb-project-name, or TENSORBOARD_DIR set"),
        (["--use-wandb", "--log-passrate"], "no such option: --log-passrate"),
    ],
)
def test_what_cannot_be_logged_so_is_refused_in_one_line(tmp_path, monkeypatch, extra, says):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    res = cli("run", "--steps", "1", "--out", str(tmp_path / "r"), *extra)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "name, says",
    [
        ("--wandb-key", "a secret is not written into the run's manifest"),
        ("--wandb-host", "set WANDB_BASE_URL"),
        ("--wandb-run-id", "rlbench derives the id from the run directory"),
    ],
)
def test_slimes_wandb_arguments_rlbench_does_not_read_are_refused_with_the_reason(name, says):
    from rlbench import slime_args
    from rlbench.errors import BadInput

    with pytest.raises(BadInput, match=f"{name} is not read: .*{says}"):
        slime_args.parse(["--use-wandb", name, "x"])


@pytest.mark.parametrize("module, flags", [("wandb", ["--use-wandb"]), ("tensorboard", ["--use-tensorboard"])])
def test_a_missing_library_names_its_extra_before_anything_runs(tmp_path, monkeypatch, module, flags):
    monkeypatch.setitem(sys.modules, module, None)  # `import wandb` fails here as where it is not installed
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    res = cli("run", "--steps", "1", "--out", str(tmp_path / "r"), *flags)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert f"the {module} package is not installed here (pip install 'rlbench[{module}]')" in lines[0]
    assert not (tmp_path / "r").exists() and not (tmp_path / "tb").exists()


def test_tracking_arguments_alone_keep_rlbenchs_own_settings():
    """slime's W&B and TensorBoard arguments say only where metrics go: no slime command line is asked for, and
    rlbench's defaults stay (where any other slime argument brings slime's)."""
    res = cli("run", "--use-wandb", "--wandb-group", "g", "--disable-wandb-random-suffix", "--print-config", "--json")
    assert res.returncode == 0, res.stderr
    printed = json.loads(res.stdout)
    from rlbench.config import load_config

    default = load_config().to_dict()
    tracking = printed["config"].pop("tracking")
    default.pop("tracking")
    assert printed["config"] == json.loads(json.dumps(default, default=list)) | {"out": printed["config"]["out"]}
    assert (tracking["use_wandb"], tracking["wandb_group"], tracking["wandb_random_suffix"]) == (True, "g", False)


def test_the_step_axes_are_slimes():
    """slime's compute_rollout_step and train step: rollout/step is the rollout id, or under
    --wandb-always-use-train-step the train step, rollout_id * num_steps_per_rollout (rlbench: train.minibatches)."""
    from rlbench.core.trackers import Trackers

    assert Trackers(8, False, None, None).steps(3) == (3, 24)
    assert Trackers(8, True, None, None).steps(3) == (24, 24)


def test_the_wandb_run_id_is_the_run_directorys_own():
    """What --resume continues: the same id for the same directory, its `steps` extended or not; another --out, or
    another start, another id."""
    from rlbench.core.trackers import run_key

    manifest = {"created": "2026-11-29T07:00:00+00:00", "config": {"out": "/runs/a", "steps": 3}, "platform": {}}
    assert run_key(manifest) == run_key({**manifest, "config": {"out": "/runs/a", "steps": 10}})
    assert run_key(manifest) != run_key({**manifest, "config": {"out": "/runs/b", "steps": 3}})
    assert run_key(manifest) != run_key({**manifest, "created": "2026-11-29T07:00:01+00:00"})
