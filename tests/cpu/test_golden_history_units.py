"""The history tier's file, unit by unit (rlbench/checks/golden_history.py): every refusal of a damaged file or of
a run to append, as the one line the user reads (the file, the field, what was expected); every field
`append_history` writes, read back exactly; the rule's constants and the fields a configuration differs in. Each
case edits a valid file built from run directories written by hand (tests/helpers.py); no loop runs.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

from rlbench.checks import golden_history as gh
from rlbench.checks.golden import config_hash, config_identity, numerics_of
from rlbench.errors import BadInput
from tests.cpu.test_golden_history import TRUSTED
from tests.helpers import history_file, history_run_dir

EXPECTED_INT = "expected an integer >= 1, got "
EXPECTED_NUMBER = "expected a finite number >= 0, got "
SCHEMA = "expected 'rlbench.golden-history/1', got "


def _refusal(call) -> BadInput:
    with pytest.raises(BadInput) as caught:
        call()
    return caught.value


DROP = object()  # _set's value that deletes the key
LOSS = ("runs", 0, "series", "train/loss")


def _set(*keys_value):
    """An edit of the file's JSON: set the value at the path `keys` (the last item is the value; DROP deletes)."""
    *keys, value = keys_value

    def edit(doc):
        table = doc
        for key in keys[:-1]:
            table = table[key]
        if value is DROP:
            del table[keys[-1]]
        else:
            table[keys[-1]] = value
        return doc

    return edit


@pytest.mark.parametrize(
    "edit, field, message",
    [
        (
            _set("schema", "rlbench.golden/1"),
            "schema",
            SCHEMA + "'rlbench.golden/1': a golden file of the exact and approx tiers; keep the history in a file "
            "of its own",
        ),
        (_set("schema", "x"), "schema", SCHEMA + "'x'"),
        (lambda doc: [doc], "schema", SCHEMA + "'list'"),
        (_set("history", "x"), "history", "expected an object stating the band rule and its constants"),
        (_set("history", "keep", True), "history.keep", EXPECTED_INT + "True"),
        (_set("history", "keep", 2.5), "history.keep", EXPECTED_INT + "2.5"),
        (_set("history", "keep", "x"), "history.keep", EXPECTED_INT + "'x'"),
        (_set("history", "keep", 0), "history.keep", EXPECTED_INT + "0"),
        (_set("history", "min_runs", DROP), "history.min_runs", EXPECTED_INT + "None"),
        (_set("history", "k", True), "history.k", EXPECTED_NUMBER + "True"),
        (_set("history", "k", "x"), "history.k", EXPECTED_NUMBER + "'x'"),
        (_set("history", "rel", math.nan), "history.rel", EXPECTED_NUMBER + "nan"),
        (_set("history", "atol", -1), "history.atol", EXPECTED_NUMBER + "-1"),
        (
            _set("history", "min_runs", 21),
            "history.min_runs",
            "min_runs 21 is more than the 20 runs kept: no value could be judged",
        ),
        (_set("config", "seed", 2), "config", "expected the configuration identity and its sha256"),
        (_set("runs", {}), "runs", "expected a list of 1 to 20 trusted runs, got dict"),
        (_set("runs", []), "runs", "expected a list of 1 to 20 trusted runs, got 0"),
        (
            _set("history", "keep", 1),
            "history.min_runs",
            "min_runs 2 is more than the 1 runs kept: no value could be judged",
        ),
        (
            lambda doc: _set("history", "min_runs", 1)(_set("history", "keep", 1)(doc)),
            "runs",
            "expected a list of 1 to 1 trusted runs, got 2",
        ),
        (_set("runs", 1, "x"), "runs[1]", "expected an object {reason, identity, added, series}"),
        (_set("runs", 0, "reason", 1), "runs[0].reason", "expected a string"),
        (_set("runs", 0, "identity", []), "runs[0].identity", "expected an object"),
        (_set("runs", 1, "added", DROP), "runs[1].added", "expected a string"),
        (_set("runs", 0, "series", "x"), "runs[0].series", "expected an object"),
        (_set(*LOSS, {}), "runs[0].series.train/loss", "expected a non-empty object of step: value"),
        (_set(*LOSS, [1.0]), "runs[0].series.train/loss", "expected a non-empty object of step: value"),
        (_set(*LOSS, "01", 1.0), "runs[0].series.train/loss", "step '01' is not an integer step"),
        (_set(*LOSS, "-1", 1.0), "runs[0].series.train/loss", "step '-1' is not an integer step"),
        (_set(*LOSS, "1", True), "runs[0].series.train/loss.1", "expected a finite number (a trusted value), got True"),
        (_set(*LOSS, "1", "x"), "runs[0].series.train/loss.1", "expected a finite number (a trusted value), got 'x'"),
        (_set("updates", {}), "updates", "expected a list"),
    ],
)
def test_every_refusal_of_a_damaged_file_names_the_file_the_field_and_what_was_expected(tmp_path, edit, field, message):
    golden = history_file(tmp_path, TRUSTED[:2])
    golden.write_text(json.dumps(edit(json.loads(golden.read_text()))))
    err = _refusal(lambda: gh.load_history(golden))
    assert (err.path, err.field, str(err)) == (str(golden), field, f"{golden}: {field}: {message}")


@pytest.mark.parametrize("name, message", [("none.json", "no such history file"), (".", "not a file")])
def test_a_history_file_that_is_not_there_or_not_a_file_is_refused_by_path(tmp_path, name, message):
    path = tmp_path / name
    err = _refusal(lambda: gh.load_history(path))
    assert (err.field, str(err)) == (None, f"{path}: {message}")


@pytest.mark.parametrize(
    "edit, rule",
    [
        (lambda doc: doc, (20, 2, 3.0, 0.05, 1e-6)),
        (_set("history", "min_runs", 1), (20, 1, 3.0, 0.05, 1e-6)),  # 1 is an integer >= 1
        (_set("history", "k", 0), (20, 2, 0.0, 0.05, 1e-6)),  # k = 0: Miles' rule, no spread term
        (_set("updates", DROP), (20, 2, 3.0, 0.05, 1e-6)),  # a file written by hand without updates: none yet
    ],
)
def test_a_valid_file_loads_with_its_path_rule_configuration_and_runs(tmp_path, edit, rule):
    golden = history_file(tmp_path, TRUSTED[:2])
    doc = edit(json.loads(golden.read_text()))
    golden.write_text(json.dumps(doc))
    history = gh.load_history(str(golden))
    r = history.rule
    assert (r.keep, r.min_runs, r.k, r.rel, r.atol) == rule and isinstance(r.k, float)
    assert (history.path, history.config, history.config_hash) == (golden, doc["config"], doc["config_hash"])
    assert [run.series for run in history.runs] == TRUSTED[:2]
    assert history.updates == doc.get("updates", [])


def test_is_history_file_says_no_at_any_doubt(tmp_path):
    golden = history_file(tmp_path, TRUSTED[:1])
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "exact.json").write_text(json.dumps({"schema": "rlbench.golden/1"}))
    assert gh.is_history_file(golden) and gh.is_history_file(str(golden))
    for name in ("none.json", "bad.json", "list.json", "exact.json"):
        assert not gh.is_history_file(tmp_path / name), name


def test_the_band_of_one_value_has_no_spread_and_of_two_the_sample_spread():
    rule = gh.BandRule()
    one = rule.band([5.0])
    assert (one.n, one.mean, one.sd, one.half_width) == (1, 5.0, 0.0, 0.05 * 5.0)
    two = rule.band([1.0, 1.5])
    sd = statistics.stdev([1.0, 1.5])
    assert (two.n, two.mean, two.sd, two.half_width) == (2, 1.25, sd, 3 * sd)


def test_the_rule_states_its_constants_what_it_leaves_out_and_its_source():
    assert gh.BandRule(5, 3, 1.0, 0.1, 0.5).to_json() == {
        "rule": gh.RULE,
        "keep": 5,
        "min_runs": 3,
        "k": 1.0,
        "rel": 0.1,
        "atol": 0.5,
        "left_out": ["perf/*"],
        "source": gh.SOURCE,
    }


RECORDED = {
    "device_name": "NVIDIA H200",
    "determinism": {"deterministic_algorithms": True},
    "command": ["rlbench", "run", "configs/tiny.toml"],
    "created": "2026-11-28T10:00:00+00:00",
}


def test_every_field_append_history_writes_reads_back_exactly(tmp_path):
    golden = tmp_path / "history.json"
    first = history_run_dir(tmp_path / "first", {"train/loss": {0: 2.0, 1: 1.0}, "perf/step_s": {0: 9.0}}, **RECORDED)
    done = gh.append_history(first, golden, "  first  ", command="rlbench golden update first")
    doc = json.loads(golden.read_text())
    manifest = json.loads((first / "manifest.json").read_text())
    identity = config_identity(manifest)
    [run] = doc["runs"]
    added = run["added"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", added)
    assert doc == {
        "schema": gh.SCHEMA,
        "history": gh.BandRule().to_json(),
        "config": identity,
        "config_hash": config_hash(identity),
        "runs": [
            {
                "reason": "first",
                "identity": {
                    "config_hash": config_hash(identity),
                    "platform": "cpu-x86_64",
                    "numerics": numerics_of(manifest),
                    "versions": {"torch": "2.13.0"},
                    **RECORDED,
                },
                "added": added,
                "series": {"train/loss": {"0": 2.0, "1": 1.0}},  # perf/* left out
            }
        ],
        "updates": [
            {"date": added, "reason": "first", "command": "rlbench golden update first", "keep": 20, "dropped": []}
        ],
    }
    assert done.to_json() == {
        "golden": str(golden),
        "run": str(first),
        "created": True,
        "runs": 1,
        "keep": 20,
        "dropped": [],
        "metrics": 1,
        "values": 2,
        "added_metrics": [],  # a new file: nothing was added to what it held
        "rule": gh.BandRule().to_json(),
    }
    second = history_run_dir(tmp_path / "second", {"train/loss": {0: 2.0, 1: 1.0}, "new/metric": {1: 3.0}})
    done = gh.append_history(second, golden, "second")
    assert (done.created, done.runs, done.metrics, done.values, done.added_metrics) == (False, 2, 2, 3, ["new/metric"])
    third = history_run_dir(tmp_path / "third", {"train/loss": {0: 2.0, 1: 1.0}})
    done = gh.append_history(third, golden, "third", keep=2)
    doc = json.loads(golden.read_text())
    assert (done.dropped, done.added_metrics, [r["reason"] for r in doc["runs"]]) == (
        ["first"],
        [],
        ["second", "third"],
    )
    assert doc["updates"][-1]["dropped"] == [{"reason": "first", "added": added}]
    assert doc["runs"][0]["identity"]["device_name"] is None  # not recorded: null, the key still there


def test_a_new_keep_keeps_the_files_other_constants(tmp_path):
    golden = history_file(tmp_path, TRUSTED[:2])
    doc = json.loads(golden.read_text())
    doc["history"].update(k=2.0, rel=0.1, atol=0.01, min_runs=3)
    golden.write_text(json.dumps(doc))
    done = gh.append_history(history_run_dir(tmp_path / "next", TRUSTED[2]), golden, "next", keep=5)
    rule = json.loads(golden.read_text())["history"]
    assert (rule["keep"], rule["min_runs"], rule["k"], rule["rel"], rule["atol"]) == (5, 3, 2.0, 0.1, 0.01)
    assert done.rule == rule


def _nan_run(tmp_path: Path, bad: int) -> Path:
    return history_run_dir(tmp_path / f"nan{bad}", {"a": {s: math.nan if s < bad else 1.0 for s in range(6)}})


@pytest.mark.parametrize(
    "call, path, field, message",
    [
        (
            lambda t, g: gh.append_history(history_run_dir(t / "r", TRUSTED[0]), g, " "),
            None,
            "--reason",
            "give the reason this run is trusted (it is kept with the run)",
        ),
        (
            lambda t, g: gh.append_history(history_run_dir(t / "r", TRUSTED[0]), g, "x", keep=0),
            None,
            "--keep",
            "expected an integer >= 1, got 0",
        ),
        (
            lambda t, g: gh.append_history(history_run_dir(t / "r", TRUSTED[0]), g, "x", keep=1),
            None,
            "--keep",
            "1 is fewer than the 2 runs the band is judged from (min_runs)",
        ),
        (
            lambda t, g: gh.append_history(history_run_dir(t / "r", TRUSTED[0], seed=2), g, "x"),
            "{golden}",
            "config",
            "the run's configuration is not the history's: seed (golden 1, run 2). A history file holds one "
            "configuration's runs: keep this configuration's in another file",
        ),
        (
            lambda t, g: gh.append_history(history_run_dir(t / "r", {"perf/step_s": {0: 1.0}}), g, "x"),
            "{run}/metrics.jsonl",
            None,
            "the run logs no metric to keep (perf/* is left out)",
        ),
        (
            lambda t, g: gh.append_history(_nan_run(t / "r", 3), g, "x"),
            "{run}/nan3",
            None,
            "a trusted run holds finite values only; this run has NaN or inf: a at step 0, a at step 1, a at step 2",
        ),
        (
            lambda t, g: gh.append_history(_nan_run(t / "r", 4), g, "x"),
            "{run}/nan4",
            None,
            "a trusted run holds finite values only; this run has NaN or inf: a at step 0, a at step 1, a at step 2 "
            "and 1 more",
        ),
        (
            lambda t, g: gh.append_history(_nan_run(t / "r", 6), g, "x"),
            "{run}/nan6",
            None,
            "a trusted run holds finite values only; this run has NaN or inf: a at step 0, a at step 1, a at step 2 "
            "and 3 more",
        ),
    ],
)
def test_every_refusal_to_append_names_the_option_or_the_file(tmp_path, call, path, field, message):
    golden = history_file(tmp_path, TRUSTED[:2])
    before = golden.read_bytes()
    err = _refusal(lambda: call(tmp_path, golden))
    path = path and path.format(golden=golden, run=tmp_path / "r")
    where = ": ".join(x for x in (path, field) if x)
    assert (err.path, err.field, str(err)) == (path, field, f"{where}: {message}")
    assert golden.read_bytes() == before


def _diffs(n: int) -> tuple[dict, dict]:
    return {f"k{i}": i for i in range(n)}, {f"k{i}": -i - 1 for i in range(n)}


@pytest.mark.parametrize(
    "held, run, named",
    [
        ({"a": 1, "b": 2}, {"a": 1, "b": 3}, "b (golden 2, run 3)"),  # an equal field is not named
        ({"a": 1}, {}, "a (golden 1, run None)"),
        ({}, {"a": 1}, "a (golden None, run 1)"),
        ({"r": {"x": {"y": 1}}}, {"r": {"x": 2}}, "r.x (golden {'y': 1}, run 2)"),
        ({"r": 2}, {"r": {"x": 1}}, "r (golden 2, run {'x': 1})"),
        (*_diffs(4), "k0 (golden 0, run -1); k1 (golden 1, run -2); k2 (golden 2, run -3); k3 (golden 3, run -4)"),
        (
            *_diffs(5),
            "k0 (golden 0, run -1); k1 (golden 1, run -2); k2 (golden 2, run -3); k3 (golden 3, run -4) and 1 more",
        ),
        (
            *_diffs(7),
            "k0 (golden 0, run -1); k1 (golden 1, run -2); k2 (golden 2, run -3); k3 (golden 3, run -4) and 3 more",
        ),
    ],
)
def test_another_configuration_is_named_by_the_fields_it_differs_in(held, run, named):
    assert gh.not_the_config(held, run) == (
        f"the run's configuration is not the history's: {named}. A history file holds one configuration's runs: "
        "keep this configuration's in another file"
    )
