"""What `check golden --tier history` reports, field by field (golden_history_compare.py): the whole JSON document a
CI script reads, for a run that holds a failure of each kind, a metric the history lacks, values at steps no trusted
run holds, an ignored metric and another platform; where undetermined ends (exactly min_runs trusted values are
judged); and the refusal of another configuration, naming the file and the field. Hand-made run directories, as in
test_golden_history.py; milliseconds each."""

from __future__ import annotations

import json
import math

import pytest

from rlbench.checks import golden_history as gh
from rlbench.checks.golden_history_compare import check_history
from rlbench.errors import BadInput
from tests.cpu.test_golden_history import SD, TRUSTED
from tests.helpers import history_file, history_run_dir


def test_the_report_holds_every_value_judged_and_everything_left_out(tmp_path):
    golden = history_file(tmp_path, TRUSTED)
    series = {m: dict(v) for m, v in TRUSTED[0].items()}
    series["train/loss"][1] = 1.0 + 4 * SD  # outside
    series["train/loss"].pop(2)  # missing
    series["rollout/raw_reward"][0] = math.inf  # non-finite
    series["rollout/raw_reward"][3] = 0.4  # a step no trusted run holds
    series["train/grad_norm"] = {0: 1.0}  # a metric the history lacks
    series["perf/step_time"] = {0: 0.5}  # left out by the rule
    run = history_run_dir(tmp_path / "new", series)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["platform"] = {"machine": "aarch64"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    rule = gh.load_history(golden).rule

    doc = check_history(run, golden).to_json()
    assert {k: doc[k] for k in ("ok", "verdict", "tier", "run", "golden", "rule", "runs", "compared", "metrics")} == {
        "ok": False,
        "verdict": "failed",
        "tier": "history",
        "run": str(run),
        "golden": str(golden),
        "rule": rule.to_json(),
        "runs": 4,
        "compared": 6,
        "metrics": 2,
    }
    assert doc["failures"] == [
        {
            "metric": "rollout/raw_reward",
            "step": 0,
            "status": "nonfinite",
            "got": "inf",
            "band": [0.1 - 0.05 * 0.1, 0.1 + 0.05 * 0.1],
            "mean": 0.1,
            "sd": 0.0,
            "n": 4,
            "message": f"inf outside [{0.1 - 0.005!r}, {0.1 + 0.005!r}] (a non-finite value fails): mean 0.1 +- 0.005 "
            "(sd 0 over 4 runs)",
        },
        {
            "metric": "train/loss",
            "step": 1,
            "status": "fail",
            "got": 1.0 + 4 * SD,
            "band": [1.0 - 3 * SD, 1.0 + 3 * SD],
            "mean": 1.0,
            "sd": SD,
            "n": 4,
            "message": f"{1.0 + 4 * SD!r} outside [{1.0 - 3 * SD!r}, {1.0 + 3 * SD!r}]: mean 1.0 +- {3 * SD:.4g} "
            f"(sd {SD:.4g} over 4 runs)",
        },
        {
            "metric": "train/loss",
            "step": 2,
            "status": "missing",
            "got": None,
            "band": [0.5 - 0.025, 0.5 + 0.025],
            "mean": 0.5,
            "sd": 0.0,
            "n": 4,
            "message": "not logged by the run",
        },
    ]
    assert doc["undetermined"] == [] and doc["ignored"] == [] and doc["not_in_golden"] == ["train/grad_norm"]
    assert doc["notes"] == [
        "the run's platform cpu-aarch64; the trusted runs': cpu-x86_64",
        "1 of the run's values are at steps no trusted run holds: not compared",
    ]
    ignoring = check_history(run, golden, ignore=["rollout/*", "train/grad_*"]).to_json()
    assert ignoring["ignored"] == ["rollout/raw_reward"] and ignoring["not_in_golden"] == []
    assert [f["metric"] for f in ignoring["failures"]] == ["train/loss", "train/loss"] and ignoring["compared"] == 3
    assert ignoring["notes"] == ["the run's platform cpu-aarch64; the trusted runs': cpu-x86_64"]


@pytest.mark.parametrize("runs, verdict", [(1, "undetermined"), (2, "passed")])
def test_min_runs_trusted_values_are_judged_and_fewer_are_not(tmp_path, runs, verdict):
    """min_runs (2) trusted values at a metric and step are enough to judge; one is not: undetermined, every value
    listed with its count, none compared."""
    golden = history_file(tmp_path, TRUSTED[:runs])
    report = check_history(history_run_dir(tmp_path / "new", TRUSTED[0]), golden)
    doc = report.to_json()
    assert (doc["verdict"], doc["ok"], doc["compared"]) == (verdict, verdict == "passed", 6 if runs == 2 else 0)
    if runs == 1:
        assert len(doc["undetermined"]) == 6
        assert doc["undetermined"][0] == {
            "metric": "rollout/raw_reward",
            "step": 0,
            "status": "undetermined",
            "got": 0.1,
            "band": None,
            "mean": None,
            "sd": None,
            "n": 1,
            "message": "1 trusted value(s), fewer than min_runs: not judged",
        }


def test_a_run_of_another_configuration_is_refused_naming_the_file_and_the_field(tmp_path):
    golden = history_file(tmp_path, TRUSTED)
    other = history_run_dir(tmp_path / "other", TRUSTED[0], seed=2)
    with pytest.raises(BadInput) as refused:
        check_history(other, golden)
    assert (refused.value.path, refused.value.field) == (str(golden), "config")
    assert str(refused.value) == (
        f"{golden}: config: the run's configuration is not the history's: seed (golden 1, run 2). A history file "
        "holds one configuration's runs: keep this configuration's in another file"
    )


def test_each_value_the_report_holds_says_how_it_was_judged(tmp_path):
    """HistoryReport.values, the library's view: every (metric, step) the file holds with its status, a passing one
    too (inside its band); and the trusted runs' platforms named, each, where the run's is none of them."""
    path = tmp_path / "history.json"
    for i, machine in enumerate(("x86_64", "aarch64")):
        run = history_run_dir(tmp_path / f"trusted{i}", TRUSTED[i])
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["platform"] = {"machine": machine}
        (run / "manifest.json").write_text(json.dumps(manifest))
        gh.append_history(run, path, f"trusted {i}")
    series = {m: dict(v) for m, v in TRUSTED[0].items()}
    series["train/loss"][2] = 9.0
    run = history_run_dir(tmp_path / "new", series)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["platform"] = {"machine": "riscv64"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    report = check_history(run, path)
    assert [(v.metric, v.step, v.status) for v in report.values] == [
        ("rollout/raw_reward", 0, "pass"),
        ("rollout/raw_reward", 1, "pass"),
        ("rollout/raw_reward", 2, "pass"),
        ("train/loss", 0, "pass"),
        ("train/loss", 1, "pass"),
        ("train/loss", 2, "fail"),
    ]
    assert report.values[0].message.startswith("0.1 inside [")
    assert report.notes == ["the run's platform cpu-riscv64; the trusted runs': cpu-aarch64, cpu-x86_64"]
