"""Megatron-LM's own golden values files as `check golden` input. tests/cpu/data/megatron_golden/ holds real
files, byte for byte as NVIDIA/Megatron-LM has them at the commit SOURCES.json names: step intervals 1, 2 and 5,
series starting at iteration 1, 2 and 5, "nan" steps, one-step files, mtp and total losses. Each loads as
Megatron-LM writes it; `check golden --tier approx --rename "lm loss=train/loss"` compares a run at the file's
steps (its iteration k against the run's step k - 1) with Megatron-LM's own tolerances, both ways; a hostile or
off-grid file is bad input in one line (exit 2). The runs are run directories written here (a manifest and
metrics.jsonl, and what every reader verifies of a run), plus one short real run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rlbench.checks import golden as g
from rlbench.checks.golden_compare import compare
from rlbench.rundir.directory import read_run
from tests.conftest import REPO, run_cli

DATA = REPO / "tests" / "cpu" / "data" / "megatron_golden"
SOURCES = json.loads((DATA / "SOURCES.json").read_text())
FILES = sorted(SOURCES["files"])
# Megatron-LM's metrics an rlbench run does not log: left out where only "lm loss" is compared
OTHERS = ["num-zeros", "mem-*", "iteration-time", "mtp_*", "total loss"]
NOT_LOGGED = [arg for glob in OTHERS for arg in ("--ignore", glob)]
FILL = 1.0e6  # the run's value at steps the file holds none for: compared, it would fail


def _raw(rel: str) -> dict:
    return json.loads((DATA / rel).read_text())


def _finite(series: dict) -> dict[int, float]:
    return {int(k): v for k, v in series["values"].items() if not isinstance(v, str)}


def _run_dir(root: Path, series: dict[str, dict[int, float]], steps: int) -> Path:
    """A run directory whose committed steps 0..steps-1 log these metrics (FILL where a series has no value): a
    rollout-only run made without recording and with no stage checksummed, so what every reader verifies of a run
    (replay/integrity.py) is there and the metrics are all the check reads."""
    root.mkdir(parents=True)
    manifest = {
        "schema": "rlbench.run/1",
        "checksum": "wordsum/1",
        "config": {"record": False},
        "stages": [],
        "mode": "rollout-only",
        "device": "cpu",
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    rows = [{"step": s, **{name: values.get(s, FILL) for name, values in series.items()}} for s in range(steps)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "checksums.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(steps)))
    return root


def _loss_run(root: Path, rel: str, scale: dict[int, float] | None = None) -> Path:
    """A run whose train/loss at step k - 1 is the file's lm loss at iteration k, times scale[k - 1] where given
    (a loss of 0, as Megatron-LM's GRPO files log, moves to scale - 1 where scale is above 1.05)."""
    raw = _raw(rel)["lm loss"]
    scale = scale or {}

    def moved(step, v):
        factor = scale.get(step, 1.0)
        return v * factor if v or factor <= 1.05 else factor - 1.0

    loss = {k - 1: moved(k - 1, v) for k, v in _finite(raw).items()}
    return _run_dir(root, {"train/loss": loss}, raw["end_step"])


def _check(run: Path, golden: Path, *args: str):
    return run_cli("check", "golden", str(run), str(golden), "--tier", "approx", *args)


def _compare(run: Path, golden: Path, rename=None, ignore=OTHERS):
    """What `check golden RUN GOLDEN --tier approx` compares, as a library call: the verdicts many at a time."""
    return compare(
        read_run(run), g.load_golden(golden, {"lm loss": "train/loss"} if rename is None else rename), "approx", ignore
    )


def _one_line_error(res, *needles):
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlbench: error: ") and "Traceback" not in res.stderr, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# --------------------------------------------------------------------------- the files


def test_the_files_are_megatrons_own_bytes():
    """Every file is listed with its Megatron-LM path, and its git object id proves the bytes unchanged."""
    assert SOURCES["repo"] == "NVIDIA/Megatron-LM" and len(SOURCES["commit"]) == 40
    on_disk = sorted(str(p.relative_to(DATA)) for p in DATA.rglob("*.json") if p.name != "SOURCES.json")
    assert on_disk == FILES and len(FILES) >= 10
    for rel, source in SOURCES["files"].items():
        data = (DATA / rel).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == source["git_blob"], rel
        assert source["path"] == f"tests/functional_tests/test_cases/{rel}"
        assert len(data) < 8_000  # a few KB each


def test_the_files_cover_megatrons_grids():
    shapes = [(s["start_step"], s["step_interval"]) for rel in FILES for s in _raw(rel).values()]
    assert {interval for _, interval in shapes} >= {1, 2, 5}
    assert {start for start, _ in shapes} >= {1, 2, 5}
    assert any(isinstance(v, str) for rel in FILES for s in _raw(rel).values() for v in s["values"].values())
    names = {name for rel in FILES for name in _raw(rel)}
    assert names >= {
        "lm loss",
        "num-zeros",
        "mem-allocated-bytes",
        "mem-max-allocated-bytes",
        "iteration-time",
        "mtp_1 loss",
        "mtp_2 loss",
        "total loss",
    }


@pytest.mark.parametrize("rel", FILES)
def test_each_file_loads_as_megatron_writes_it(rel):
    golden = g.load_golden(DATA / rel)
    raw = _raw(rel)
    assert golden.format == "megatron" and golden.step_offset == 1 and set(golden.metrics) == set(raw)
    for name, series in raw.items():
        got = golden.metrics[name]
        finite = _finite(series)
        nan = sorted(int(k) for k, v in series["values"].items() if v == "nan")
        # iteration k is the run's step k - 1; "nan" steps are kept aside, named, never a number
        assert got.values == {k - 1: float(v) for k, v in finite.items()} and got.absent == [k - 1 for k in nan]
        assert (got.start_step, got.end_step, got.step_interval) == (
            series["start_step"] - 1,
            series["end_step"] - 1,
            series["step_interval"],
        )
        assert got.tolerance.family == f"Megatron-LM {name}"
        assert any(note.startswith(f'{name}: the file holds "nan"') for note in golden.notes) == bool(nan)


def test_megatrons_tolerances_per_metric():
    """As test_pretraining_regular_pipeline.py's CHECK_THRESHOLDS and common.py's pipeline apply them."""
    golden = g.load_golden(DATA / "t5/t5_11b_mcore_tp4_pp1/golden_values_dev_dgx_a100.json", {"lm loss": "train/loss"})
    tol = {name: s.tolerance for name, s in golden.metrics.items()}
    for name, rtol in (
        ("train/loss", 0.05),
        ("num-zeros", 0.20),
        ("mem-allocated-bytes", 0.05),
        ("mem-max-allocated-bytes", 0.05),
    ):
        assert (tol[name].kind, tol[name].rtol, tol[name].atol, tol[name].mean_residual) == ("approx", rtol, 0.0, None)
        assert tol[name].failing_steps == 1  # min(max(6 // 100, 1), 50)
    # iteration-time: medians over iterations 5..20 (the last is 25), i.e. the run's steps 4..19, within 5%
    it = tol["iteration-time"]
    assert (it.kind, it.max_ratio, it.min_ratio, it.window) == ("median", 1.05, 0.95, (4, 19))
    one = g.load_golden(DATA / "gpt/gpt3_mcore_reruns_resume_check_grads/golden_values_dev_dgx_h100.json")
    assert one.metrics["lm loss"].tolerance.failing_steps == 0  # a single step must pass
    # past iteration 25 the window is 30..45; with no value inside it, the first 4 values from 30 on
    late = g.load_golden(DATA / "mixtral/mixtral_8x22b_tp2pp8ep8vpp1_release/golden_values_dev_dgx_h100.json")
    assert late.metrics["iteration-time"].tolerance.window == (29, 44)
    grpo = g.load_golden(DATA / "moe/gpt_grpo_tp8tp4_pp1_ep8ep2_dp8_throughputtest/golden_values_dev_dgx_h100.json")
    assert grpo.metrics["iteration-time"].tolerance.window == (4, 4)


# --------------------------------------------------------------------------- check golden at the files' steps


@pytest.mark.parametrize("rel", FILES)
def test_check_golden_compares_a_run_at_the_files_steps(rel, tmp_path):
    path = DATA / rel
    lm = _finite(_raw(rel)["lm loss"])
    steps = [k - 1 for k in sorted(lm)]
    res = _check(_loss_run(tmp_path / "same", rel), path, "--rename", "lm loss=train/loss", *NOT_LOGGED, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    [loss] = doc["metrics"]
    # every value the file holds was compared, at the run's step k - 1, and only there (FILL elsewhere)
    assert (loss["name"], loss["steps"], loss["compared"], doc["compared"]) == ("train/loss", steps, len(lm), len(lm))
    assert doc["golden_step_offset"] == 1 and g.MEGATRON_NOTE in doc["notes"]
    # within Megatron-LM's rtol 0.05 everywhere: passes
    assert _compare(_loss_run(tmp_path / "near", rel, {s: 1.04 for s in steps}), path).ok
    # 10% off at two steps: more than the one failing step Megatron-LM allows (none for a single step)
    report = _compare(_loss_run(tmp_path / "off", rel, {s: 1.10 for s in steps[:2]}), path)
    [loss] = report.metrics
    assert not report.ok and [f.step for f in loss.failures] == steps[:2] and loss.compared == len(lm)
    if len(steps) > 1:  # one step off is within Megatron-LM's allowance of min(max(N // 100, 1), 50)
        assert _compare(_loss_run(tmp_path / "one", rel, {steps[0]: 1.10}), path).ok


def test_the_report_says_what_it_compared_in_both_numberings(tmp_path):
    rel = "gpt/gpt3_mcore_te_tp2_pp2_cp2_nondeterministic/golden_values_dev_dgx_a100.json"  # 1, 5, 10, ..., 50
    run = _loss_run(tmp_path / "run", rel)
    res = _check(run, DATA / rel, "--rename", "lm loss=train/loss", *NOT_LOGGED)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (
        "golden check passed (approx tier): 1 metrics (11 values compared, steps 0..49, the golden's 1..50)"
        in " ".join(res.stdout.split())
    )
    assert (
        "Megatron-LM iteration k (its k-th optimizer step, counted from 1) is compared with rlbench step k - 1"
        in res.stderr
    )
    res = _check(
        _loss_run(tmp_path / "off", rel, {4: 1.5, 9: 1.5}), DATA / rel, "--rename", "lm loss=train/loss", *NOT_LOGGED
    )
    assert res.returncode == 1 and "(golden's)" in res.stdout  # the step column's heading
    assert "4 (5)" in res.stdout and "9 (10)" in res.stdout  # run step 4 is Megatron-LM's iteration 5


def test_every_megatron_metric_with_its_own_tolerance(tmp_path):
    """num-zeros within 20%, memory within 5% per step; iteration-time's steady-window median within 5% either
    way, its warm-up (iteration 1: 12 s against about 1 s after) left out."""
    rel = "t5/t5_11b_mcore_tp4_pp1/golden_values_dev_dgx_a100.json"
    raw = _raw(rel)

    def run(name, **scale):
        series = {
            "train/loss" if m == "lm loss" else m: {
                k - 1: v * scale.get(m.replace("-", "_").replace(" ", "_"), 1.0) for k, v in _finite(s).items()
            }
            for m, s in raw.items()
        }
        series["iteration-time"][0] = 1000.0  # the run's own warm-up: outside the window
        return _run_dir(tmp_path / name, series, 25)

    res = _check(run("same"), DATA / rel, "--rename", "lm loss=train/loss", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["compared"] == 4 * 6 + 4  # four metrics at 6 steps, iteration-time's window of 4
    for metric, inside, outside in (
        ("num_zeros", 1.19, 1.21),
        ("mem_allocated_bytes", 1.04, 1.06),
        ("mem_max_allocated_bytes", 0.96, 0.94),
        ("iteration_time", 1.04, 0.94),
    ):
        assert _compare(run(f"{metric}-in", **{metric: inside}), DATA / rel, ignore=()).ok, metric
        report = _compare(run(f"{metric}-out", **{metric: outside}), DATA / rel, ignore=())
        assert [m.name for m in report.failed] == [metric.replace("_", "-")], metric
    [it] = _compare(run("faster", iteration_time=0.9), DATA / rel, ignore=()).failed
    assert it.compared == 4 and it.message.endswith("(x0.95 to x1.05)")  # iterations 5, 10, 15, 20


def test_a_metric_the_run_does_not_log_is_named_with_the_way_out(tmp_path):
    rel = "t5/t5_11b_mcore_tp4_pp1/golden_values_dev_dgx_a100.json"
    res = _check(_loss_run(tmp_path / "run", rel), DATA / rel, "--rename", "lm loss=train/loss", "--json")
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert sorted(doc["failed"]) == ["iteration-time", "mem-allocated-bytes", "mem-max-allocated-bytes", "num-zeros"]
    assert all(
        m["message"] == "not logged by the run; --rename it to a metric the run logs, or --ignore it"
        and m["compared"] == 0
        for m in doc["metrics"]
        if m["name"] in doc["failed"]
    )


def test_a_real_short_run_at_a_files_steps(tmp_path, small_config):
    """A real rlbench run of one step against a one-iteration Megatron-LM file: compared there, and far apart
    (rlbench's policy loss against an LM loss of 29.3); a longer file needs a longer run, said in both numberings."""
    from rlbench.config import apply_overrides
    from rlbench.session import run

    out = tmp_path / "run"
    run(apply_overrides(small_config, steps=1, out=str(out)), command="rlbench run (test)")
    rel = "gpt/gpt3_mcore_reruns_resume_check_grads/golden_values_dev_dgx_h100.json"
    res = _check(out, DATA / rel, "--rename", "lm loss=train/loss", *NOT_LOGGED, "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    [loss] = json.loads(res.stdout)["metrics"]
    assert loss["compared"] == 1 and [(f["step"], f["expected"]) for f in loss["failures"]] == [(0, 29.29548)]
    grpo = "moe/gpt_grpo_tp8tp4_pp1_ep8ep2_dp8_throughputtest/golden_values_dev_dgx_h100.json"
    _one_line_error(
        _check(out, DATA / grpo, "--rename", "lm loss=train/loss", *NOT_LOGGED),
        "committed steps are 0..0",
        "needs 0..4 (Megatron-LM iterations 1..5)",
    )


# --------------------------------------------------------------------------- Megatron-LM's other grids


@pytest.mark.parametrize(
    "start, interval, steps",
    [
        (10, 10, [10, 20, 30, 4760]),  # nemotron3_super_release_gb200_sm's iteration-time (195 KB, not kept)
        (1, 100, [1, 100, 200, 300]),  # t5_release's lts file (865 KB, not kept)
        (2, 2, [2, 4, 6]),
    ],
)
def test_other_grids_megatron_writes(tmp_path, start, interval, steps):
    path = tmp_path / "golden_values_dev_dgx_h100.json"
    values = {str(k): 1.0 + k for k in steps}
    path.write_text(
        json.dumps(
            {"lm loss": {"start_step": start, "end_step": steps[-1], "step_interval": interval, "values": values}}
        )
    )
    assert sorted(g.load_golden(path).metrics["lm loss"].values) == [k - 1 for k in steps]


# --------------------------------------------------------------------------- bad input


BASE = "gpt/gpt3_mcore_te_tp2_pp2_cp2_nondeterministic/golden_values_dev_dgx_a100.json"  # 1, 5, ..., 50


def _set(key, value, metric="lm loss"):
    return lambda d: d[metric].__setitem__(key, value)


def _value(step, value, metric="lm loss"):
    return lambda d: d[metric]["values"].__setitem__(step, value)


@pytest.mark.parametrize(
    "edit, needles",
    [
        (_value("7", 10.0), ["lm loss.values", "step 7 is off the series' grid: 1, then every multiple of 5 up to 50"]),
        (_value("55", 10.0), ["step 55 is off the series' grid"]),
        (_set("end_step", 10**30), ["start_step 1 and end_step 1000000000000000000000000000000 are not the first"]),
        (_set("end_step", 10**400), ["end_step 1000000000000000000000000000000000000... are not the first"]),
        (_set("start_step", 0), ["lm loss.start_step", "expected an integer >= 1"]),
        (_set("step_interval", 0), ["lm loss.step_interval", "expected an integer >= 1"]),
        (_set("values", {}), ["lm loss.values", "got an empty object"]),
        (_value("05", 10.0), ["step '05' is not an integer step"]),
        (_value("1e30", 10.0), ["step '1e30' is not an integer step"]),
        (_value("10", "fast"), ["lm loss.values.10", 'expected a finite number or "nan"']),
        (_value("10", True), ["lm loss.values.10", "expected a finite number"]),
        (_value("10", 10**400), ["lm loss.values.10", "beyond a float's range"]),
        (_value("10", float("inf")), ["lm loss.values.10", "expected a finite number"]),
    ],
)
def test_a_hostile_or_off_grid_file_is_one_line_of_bad_input(tmp_path, edit, needles):
    doc = _raw(BASE)
    edit(doc)
    path = tmp_path / "golden_values_dev_dgx_a100.json"
    path.write_text(json.dumps(doc))
    run = _loss_run(tmp_path / "run", BASE)
    _one_line_error(_check(run, path, "--rename", "lm loss=train/loss", *NOT_LOGGED), str(path), *needles)


def test_a_series_of_nan_only_is_bad_input_unless_left_out(tmp_path):
    doc = _raw(BASE)
    doc["num-zeros"]["values"] = dict.fromkeys(doc["num-zeros"]["values"], "nan")
    path = tmp_path / "golden_values_dev_dgx_a100.json"
    path.write_text(json.dumps(doc))
    run = _loss_run(tmp_path / "run", BASE)
    others = ["--ignore", "mem-*", "--ignore", "iteration-time"]
    _one_line_error(_check(run, path, "--rename", "lm loss=train/loss", *others), "num-zeros holds no value")
    assert _check(run, path, "--rename", "lm loss=train/loss", *NOT_LOGGED).returncode == 0


def test_two_metrics_renamed_to_one_are_refused(tmp_path):
    run = _loss_run(tmp_path / "run", BASE)
    _one_line_error(
        _check(run, DATA / BASE, "--rename", "lm loss=train/loss", "--rename", "num-zeros=train/loss"),
        "--rename",
        "would both be compared as 'train/loss'",
    )
