"""The golden-log regression suite: each entry of golden/suite.json is run as a user runs it and
checked against its committed golden file in the exact tier, and the committed file is shown to
be what `rlbench golden update` writes for that run (not a hand edit).

perf/* is left out of the CI comparison (`--ignore 'perf/*'`): timings are not asserted in tests
on this shared machine; the median comparison itself is tested in test_golden_check.py on
series whose ratio is fixed by construction.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, run_cli

SUITE = json.loads((REPO / "golden" / "suite.json").read_text())


def test_every_golden_file_is_in_the_suite():
    """Nothing in golden/ escapes CI: every golden file there is an entry the suite runs."""
    files = {p.stem for p in (REPO / "golden").glob("*.json") if p.name != "suite.json"}
    assert files == set(SUITE)


@pytest.mark.parametrize("name", sorted(SUITE))
def test_golden_suite(tmp_path, name):
    golden = REPO / "golden" / f"{name}.json"
    run_dir = tmp_path / "run"
    res = run_cli("run", *SUITE[name], "--out", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    check = run_cli("check", "golden", str(run_dir), str(golden), "--ignore", "perf/*")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "golden check passed (exact tier)" in check.stdout

    # The committed file is `golden update`'s output for this run: same identity, same series and
    # tolerances (perf values are timings, so for them only the grid and tolerance).
    fresh = tmp_path / "fresh.json"
    update = run_cli("golden", "update", str(run_dir), str(fresh), "--reason", "suite")
    assert update.returncode == 0, update.stderr
    committed, made = (json.loads(p.read_text()) for p in (golden, fresh))
    for key in ("platform", "device_name", "versions", "determinism", "mode", "config", "config_hash"):
        assert committed["header"][key] == made["header"][key], key
    assert committed["metrics"].keys() == made["metrics"].keys()
    for metric, series in made["metrics"].items():
        if metric.startswith("perf/"):
            series = {**series, "values": committed["metrics"][metric]["values"]}
        assert committed["metrics"][metric] == series, metric
    history = committed["header"]["history"]
    assert history and all(entry["reason"] and entry["command"].startswith("rlbench golden update")
                           for entry in history)
    assert committed["header"]["reason"] == history[-1]["reason"]
