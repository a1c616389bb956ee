"""The golden files' history tier (rlbench/checks/golden_history.py, golden_history_compare.py): `golden update
--tier history` appends trusted runs (N kept, the oldest dropped, written atomically, NaN and another
configuration refused), and `check golden --tier history` holds a run, value by value, to the band around the
trusted runs' mean, both ways: inside passes; one value pushed out fails naming the metric, the step and the band;
a NaN or a missing value fails; too few trusted runs is undetermined, never a pass. The runs are run directories
written here (a manifest, metrics.jsonl and what every reader verifies of a run), with known spread; no loop
runs. Milliseconds each."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import pytest

from rlbench.checks import golden_history as gh
from rlbench.checks.golden_history_compare import check_history, compare_history
from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir
from tests.conftest import run_cli
from tests.helpers import history_file, history_run_dir

# Five trusted runs of two metrics over steps 0..2: at step 1, train/loss is 1.0 +- a spread of sd 0.0816...
TRUSTED = [
    {"train/loss": {0: 2.0, 1: 1.0, 2: 0.5}, "rollout/raw_reward": {0: 0.1, 1: 0.2, 2: 0.3}},
    {"train/loss": {0: 2.0, 1: 1.1, 2: 0.5}, "rollout/raw_reward": {0: 0.1, 1: 0.2, 2: 0.3}},
    {"train/loss": {0: 2.0, 1: 0.9, 2: 0.5}, "rollout/raw_reward": {0: 0.1, 1: 0.2, 2: 0.3}},
    {"train/loss": {0: 2.0, 1: 1.0, 2: 0.5}, "rollout/raw_reward": {0: 0.1, 1: 0.2, 2: 0.3}},
]
SD = statistics.stdev([1.0, 1.1, 0.9, 1.0])
HI = 1.0 + 3 * SD  # the band at train/loss step 1: mean 1.0 +- 3 sd (3 sd is above 5 % of 1.0)


def _history(tmp_path: Path, runs=TRUSTED, keep: int | None = None) -> Path:
    return history_file(tmp_path, runs, keep)


def _new_run(tmp_path: Path, **moves) -> Path:
    """The mean of the trusted runs, with `{metric: {step: value}}` moves applied (None: not logged)."""
    series = {m: dict(v) for m, v in TRUSTED[0].items()}
    series["train/loss"][1] = 1.0
    for metric, by_step in moves.items():
        for step, value in by_step.items():
            if value is None:
                series[metric].pop(step)
            else:
                series[metric][step] = value
    return history_run_dir(tmp_path / "new", series)


def _check(run: Path, golden: Path, *args: str):
    return run_cli("check", "golden", str(run), str(golden), "--tier", "history", "--json", *args)


def test_the_band_is_the_mean_plus_or_minus_the_widest_of_spread_relative_and_absolute():
    rule = gh.BandRule()
    assert (rule.keep, rule.min_runs, rule.k, rule.rel, rule.atol) == (20, 2, 3.0, 0.05, 1e-6)
    band = rule.band([1.0, 1.1, 0.9, 1.0])
    assert (band.n, band.mean, band.sd, band.half_width) == (4, 1.0, SD, 3 * SD)
    assert band.holds(band.hi) and band.holds(band.lo) and not band.holds(math.nextafter(band.hi, 2.0))
    assert rule.band([2.0, 2.0]).half_width == 0.05 * 2.0  # no spread: the relative floor
    assert rule.band([0.0, 0.0]).half_width == 1e-6  # nothing to be relative to: the absolute floor
    assert not band.holds(math.nan)


def test_a_run_inside_the_band_passes_and_says_how_many_values_it_compared(tmp_path):
    golden = _history(tmp_path)
    res = _check(_new_run(tmp_path, **{"train/loss": {1: 1.0 + 2.9 * SD}}), golden)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert (doc["verdict"], doc["ok"], doc["compared"], doc["runs"], doc["metrics"]) == ("passed", True, 6, 4, 2)
    assert doc["failures"] == [] and doc["undetermined"] == []
    text = run_cli("check", "golden", str(tmp_path / "new"), str(golden), "--tier", "history")
    assert text.returncode == 0 and "6 values of 2 metrics held to the band of 4 trusted runs" in text.stdout


def test_one_value_pushed_out_fails_naming_the_metric_the_step_and_the_band(tmp_path):
    golden = _history(tmp_path)
    res = _check(_new_run(tmp_path, **{"train/loss": {1: 1.0 + 3.1 * SD}}), golden)
    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["verdict"] == "failed" and doc["compared"] == 6
    [failure] = doc["failures"]
    assert (failure["metric"], failure["step"], failure["status"]) == ("train/loss", 1, "fail")
    assert failure["band"] == [1.0 - 3 * SD, HI] and (failure["mean"], failure["sd"], failure["n"]) == (1.0, SD, 4)
    assert "outside" in failure["message"] and repr(HI) in failure["message"]
    text = run_cli("check", "golden", str(tmp_path / "new"), str(golden), "--tier", "history")
    assert text.returncode == 1
    assert "train/loss" in text.stdout and repr(HI) in text.stdout and "outside the band" in text.stdout
    low = _check(_new_run(tmp_path / "low", **{"train/loss": {1: 1.0 - 3.1 * SD}}), golden)  # two-sided
    assert low.returncode == 1 and json.loads(low.stdout)["failures"][0]["step"] == 1


@pytest.mark.parametrize(
    "moves, status",
    [
        ({"rollout/raw_reward": {2: math.nan}}, "nonfinite"),
        ({"rollout/raw_reward": {2: math.inf}}, "nonfinite"),
        ({"rollout/raw_reward": {2: None}}, "missing"),
    ],
)
def test_a_nan_or_a_missing_value_fails_by_name_never_skipped(tmp_path, moves, status):
    golden = _history(tmp_path)
    res = _check(_new_run(tmp_path, **moves), golden)
    assert res.returncode == 1, res.stdout + res.stderr
    [failure] = json.loads(res.stdout)["failures"]
    assert (failure["metric"], failure["step"], failure["status"]) == ("rollout/raw_reward", 2, status)


def test_a_metric_the_run_does_not_log_fails_at_every_step(tmp_path):
    golden = _history(tmp_path)
    run = history_run_dir(tmp_path / "new", {"train/loss": {0: 2.0, 1: 1.0, 2: 0.5}})
    report = check_history(run, golden)
    assert report.verdict == "failed"
    assert [(v.metric, v.step, v.status) for v in report.failures] == [
        ("rollout/raw_reward", s, "missing") for s in range(3)
    ]


def test_too_few_trusted_runs_is_undetermined_never_a_pass(tmp_path):
    golden = _history(tmp_path, TRUSTED[:1])
    run = _new_run(tmp_path)
    report = check_history(run, golden)
    assert (report.verdict, report.ok, report.compared, len(report.undetermined)) == ("undetermined", False, 0, 6)
    res = run_cli("check", "golden", str(run), str(golden), "--tier", "history")
    assert res.returncode == 2
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("rlbench: error: ") and "undetermined" in line and "min_runs 2" in line
    doc = json.loads(_check(run, golden).stdout)
    assert doc["verdict"] == "undetermined" and doc["undetermined"][0]["band"] is None
    assert doc["undetermined"][0]["n"] == 1
    # a NaN still fails where the band cannot be drawn yet
    assert _check(_new_run(tmp_path / "nan", **{"train/loss": {0: math.nan}}), golden).returncode == 1
    # every metric left out: nothing judged, undetermined
    everything = check_history(run, _history(tmp_path / "more"), ignore=["*"])
    assert everything.verdict == "undetermined" and everything.ignored == ["rollout/raw_reward", "train/loss"]


def test_n_runs_are_kept_the_oldest_dropped_in_order(tmp_path):
    golden = tmp_path / "history.json"
    for i in range(5):
        run = history_run_dir(tmp_path / f"r{i}", {"train/loss": {0: 1.0 + i / 100, 1: 1.0, 2: 1.0}})
        res = run_cli(
            "golden", "update", str(run), str(golden), "--tier", "history", "--reason", f"run {i}", "--keep", "3"
        )
        assert res.returncode == 0, res.stderr
    assert "dropped the oldest: run 1" in res.stdout
    doc = json.loads(golden.read_text())
    assert doc["schema"] == "rlbench.golden-history/1" and doc["history"]["keep"] == 3
    assert [r["reason"] for r in doc["runs"]] == ["run 2", "run 3", "run 4"]
    assert [r["series"]["train/loss"]["0"] for r in doc["runs"]] == [1.02, 1.03, 1.04]
    assert [d["reason"] for u in doc["updates"] for d in u["dropped"]] == ["run 0", "run 1"]
    # the file keeps its N; a later --keep is deliberate, and drops down to it
    done = gh.append_history(history_run_dir(tmp_path / "r5", {"train/loss": {0: 1.0, 1: 1.0, 2: 1.0}}), golden, "r5")
    assert (done.runs, done.keep, done.dropped) == (3, 3, ["run 2"])
    done = gh.append_history(
        history_run_dir(tmp_path / "r6", {"train/loss": {0: 1.0, 1: 1.0, 2: 1.0}}), golden, "r6", keep=2
    )
    assert (done.runs, done.keep, done.dropped) == (2, 2, ["run 3", "run 4"])
    with pytest.raises(BadInput, match="fewer than the 2 runs the band is judged from"):
        gh.append_history(
            history_run_dir(tmp_path / "r7", {"train/loss": {0: 1.0, 1: 1.0, 2: 1.0}}), golden, "r7", keep=1
        )


def test_the_file_states_the_rule_and_each_run_its_reason_and_identity(tmp_path):
    doc = json.loads(_history(tmp_path).read_text())
    rule = doc["history"]
    assert {k: rule[k] for k in ("keep", "min_runs", "k", "rel", "atol")} == {
        "keep": 20,
        "min_runs": 2,
        "k": 3.0,
        "rel": 0.05,
        "atol": 1e-6,
    }
    assert "max(k * sd, rel * |mean|, atol)" in rule["rule"] and "miles" in rule["source"]
    run = doc["runs"][0]
    assert set(run) == {"reason", "identity", "added", "series"} and run["reason"] == "trusted 0"
    assert run["identity"]["config_hash"] == doc["config_hash"] and run["identity"]["platform"] == "cpu-x86_64"
    assert run["identity"]["versions"] == {"torch": "2.13.0"} and run["added"].endswith("+00:00")


def test_the_write_is_atomic(tmp_path, monkeypatch):
    golden = _history(tmp_path)
    before = golden.read_bytes()
    run = history_run_dir(tmp_path / "next", TRUSTED[0])

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError):
        gh.append_history(run, golden, "the disk filled")
    assert golden.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["history.json"]  # no temporary left


def test_a_trusted_run_with_a_nan_is_refused_by_name(tmp_path):
    golden = _history(tmp_path)
    before = golden.read_bytes()
    run = history_run_dir(tmp_path / "nan", {"train/loss": {0: 2.0, 1: math.nan, 2: 0.5}})
    res = run_cli("golden", "update", str(run), str(golden), "--tier", "history", "--reason", "nan")
    assert res.returncode == 2 and "train/loss at step 1" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert golden.read_bytes() == before


def test_another_configuration_is_refused_on_update_and_on_check(tmp_path):
    golden = _history(tmp_path)
    before = golden.read_bytes()
    other = history_run_dir(tmp_path / "other", TRUSTED[0], seed=2)
    res = run_cli("golden", "update", str(other), str(golden), "--tier", "history", "--reason", "seed 2")
    assert res.returncode == 2 and "seed (golden 1, run 2)" in res.stderr, res.stderr
    assert golden.read_bytes() == before
    res = _check(other, golden)
    assert res.returncode == 2 and "configuration is not the history's" in res.stderr


def test_the_tiers_keep_their_own_files(tmp_path):
    """A rlbench.golden/1 file still loads and compares in the exact tier; each kind of file, given to the other's
    tier, is refused in one line saying which tier reads it."""
    run = _new_run(tmp_path)
    exact = tmp_path / "exact.json"
    assert run_cli("golden", "update", str(run), str(exact), "--reason", "initial").returncode == 0
    assert run_cli("check", "golden", str(run), str(exact)).returncode == 0
    assert run_cli("check", "golden", str(run), str(exact), "--tier", "approx").returncode == 0
    res = _check(run, exact)
    assert res.returncode == 2 and "keep the history in a file of its own" in res.stderr
    res = run_cli("golden", "update", str(run), str(exact), "--tier", "history", "--reason", "x")
    assert res.returncode == 2 and "rlbench.golden/1" in res.stderr
    golden = _history(tmp_path / "h")
    for args in (
        ("check", "golden", str(run), str(golden)),
        ("golden", "update", str(run), str(golden), "--reason", "x"),
    ):
        res = run_cli(*args)
        assert res.returncode == 2 and "--tier history" in res.stderr, res.stderr
    for extra in (("--tolerance", "train/loss:rtol=0.1"), ("--rename", "a=b")):
        assert _check(run, golden, *extra).returncode == 2
    res = run_cli("golden", "update", str(run), str(exact), "--reason", "x", "--keep", "3")
    assert res.returncode == 2 and "--keep" in res.stderr


def test_the_library_calls_print_nothing_and_take_run_dirs_in_memory(tmp_path, capsys):
    golden = _history(tmp_path)
    manifest = json.loads((tmp_path / "trusted0" / "manifest.json").read_text())
    rows = [{"step": s, "train/loss": TRUSTED[0]["train/loss"][s], "rollout/raw_reward": 9.0} for s in range(3)]
    report = compare_history(RunDir(Path("/runs/x"), manifest, rows, [], []), gh.load_history(golden))
    assert [(v.metric, v.step) for v in report.failures] == [("rollout/raw_reward", s) for s in range(3)]
    assert report.to_json()["failures"][0]["band"] == [0.1 - 0.05 * 0.1, 0.1 + 0.05 * 0.1]
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda d: d.update(runs=[]), "runs: expected a list of 1 to 20 trusted runs, got 0"),
        (lambda d: d["runs"][0]["series"]["train/loss"].update({"1": "nan"}), "runs[0].series.train/loss.1"),
        (lambda d: d["runs"][0]["series"]["train/loss"].update({"x": 1.0}), "step 'x' is not an integer step"),
        (lambda d: d["history"].update(min_runs=30), "history.min_runs"),
        (lambda d: d["history"].update(k=-1), "history.k: expected a finite number >= 0"),
        (lambda d: d["config"].update(seed=2), "config: expected the configuration identity and its sha256"),
        (lambda d: d.update(schema="rlbench.golden-history/2"), "schema"),
    ],
)
def test_a_damaged_history_file_is_bad_input_in_one_line_and_left_as_it_is(tmp_path, edit, named):
    golden = _history(tmp_path, TRUSTED[:2])
    doc = json.loads(golden.read_text())
    edit(doc)
    golden.write_text(json.dumps(doc))
    before = golden.read_bytes()
    for args in (
        ("check", "golden", str(tmp_path / "trusted0"), str(golden)),
        ("golden", "update", str(tmp_path / "trusted0"), str(golden), "--reason", "x"),
    ):
        res = run_cli(*args, "--tier", "history")
        assert res.returncode == 2 and named in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert golden.read_bytes() == before
