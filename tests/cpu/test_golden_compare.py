"""`check golden`'s comparison (rlbench/checks/golden_compare.py) on runs and golden files built in memory: each
tier's verdict, message and numbers, the perf window, the refusals and what they name. Milliseconds each; the
CLI and real runs are in test_golden_check.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rlbench.checks import golden as g
from rlbench.checks.golden_compare import StepFailure, compare
from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir

NUMERICS = {
    "mode": "portable",
    "aten_capability": "avx2",
    "mkl_cbwr": "COMPATIBLE",
    "blas": "MKL 2025",
    "cpu": {"vendor": "AMD", "isa": "avx2"},
}
MANIFEST = {
    "device": "cpu",
    "device_name": None,
    "platform": {"machine": "x86_64"},
    "numerics": NUMERICS,
    "versions": {"python": "3.11.7", "rlbench": "0.1.0", "torch": "2.13.0", "transformers": "5.23.0"},
    "determinism": {"torch_threads": 1, "deterministic_algorithms": True},
    "config": {"seed": 1, "out": "runs/a", "algo": {"eps_clip": 0.2}, "model": {"path": "m"}},
    "hashes": {"model_config": "c0", "initial_weights": "w0"},
}


def _run(series: dict[str, dict[int, float]], manifest=None, notes=()) -> RunDir:
    steps = sorted({s for values in series.values() for s in values})
    rows = [{"step": s, **{name: values[s] for name, values in series.items() if s in values}} for s in steps]
    return RunDir(Path("/runs/a"), manifest or MANIFEST, rows, [], list(notes))


def _golden(series: dict[str, dict[int, float]], manifest=None, tolerances=None, fmt="rlbench") -> g.Golden:
    manifest = manifest or MANIFEST
    header = {
        "platform": g.platform_of(manifest),
        "numerics": g.numerics_of(manifest),
        "device_name": manifest.get("device_name"),
        "versions": manifest["versions"],
        "determinism": manifest["determinism"],
        "config": g.config_identity(manifest),
    }
    if fmt == "megatron":
        header = {"note": "a Megatron-LM golden values file"}
    metrics = {}
    for name, values in series.items():
        steps = sorted(values)
        tol = (tolerances or {}).get(name) or g.default_tolerance(name, steps, [values[s] for s in steps])
        metrics[name] = g.Series(steps[0], steps[-1], 1, dict(values), tol)
    return g.Golden(Path("/golden.json"), fmt, header, metrics)


def _only(report, name=None):
    [m] = [m for m in report.metrics if name is None or m.name == name]
    return m


LOSS = {s: 0.5 - 0.01 * s for s in range(10)}


# ---------------------------------------------------------------- exact tier


def test_exact_tier_passes_the_same_bits_and_says_what_it_compared():
    report = compare(_run({"train/loss": LOSS}), _golden({"train/loss": LOSS}))
    m = _only(report)
    assert report.ok and report.failed == [] and report.tier == "exact" and report.golden_format == "rlbench"
    assert (m.kind, m.status, m.tolerance, m.steps, m.max_abs) == (
        "exact",
        "pass",
        {"kind": "exact"},
        list(range(10)),
        0.0,
    )
    assert m.expected == LOSS and m.got == LOSS and m.failures == [] and m.message == ""
    assert report.platform == {"run": "cpu-x86_64", "golden": "cpu-x86_64"} and report.notes == []
    assert (report.run, report.golden, report.ignored, report.not_in_golden) == ("/runs/a", "/golden.json", [], [])


def test_exact_tier_fails_one_ulp_naming_the_step():
    got = {**LOSS, 3: math.nextafter(LOSS[3], 1.0)}
    m = _only(compare(_run({"train/loss": got}), _golden({"train/loss": LOSS})))
    assert (m.status, m.message) == ("fail", "1 of 10 steps differ")
    assert m.failures == [StepFailure(3, LOSS[3], got[3], got[3] - LOSS[3], 0.0)]
    assert m.max_abs == got[3] - LOSS[3] > 0


@pytest.mark.parametrize(
    "expected, got, same",
    [
        (0.0, -0.0, False),
        (math.nan, math.nan, True),
        (1.0, math.nan, False),
        (math.inf, math.inf, True),
        (math.inf, -math.inf, False),
    ],
)
def test_exact_means_the_same_bits(expected, got, same):
    m = _only(compare(_run({"train/loss": {0: got, 1: 1.0}}), _golden({"train/loss": {0: expected, 1: 1.0}})))
    assert (m.status == "pass") is same
    if not same:
        [f] = m.failures
        assert f.step == 0 and (math.isnan(f.delta) or f.delta == got - expected)


# ---------------------------------------------------------------- approx tier

APPROX = g.Tolerance(kind="approx", rtol=0.1, atol=0.01, failing_steps=1, mean_residual=0.05, family="losses")


def test_approx_allows_atol_plus_rtol_times_the_golden_value_per_step():
    tol = g.Tolerance(kind="approx", rtol=0.25, atol=0.5, failing_steps=0, mean_residual=0.5, family="losses")
    expected = {s: 2.0 for s in range(10)}
    edge = {s: 3.0 if s % 2 else 1.0 for s in range(10)}  # exactly at the band's edge, 0.5 + 0.25 * 2, both sides
    m = _only(
        compare(_run({"train/loss": edge}), _golden({"train/loss": expected}, tolerances={"train/loss": tol}), "approx")
    )
    assert (m.status, m.kind, m.failures, m.allowed_failing) == ("pass", "approx", [], 0)
    assert (m.mean_residual, m.mean_bound, m.max_abs) == (0.0, 0.5, 1.0)
    assert m.tolerance == tol.to_json() == m.band
    out = {**edge, 3: math.nextafter(3.0, 4.0)}
    m = _only(
        compare(_run({"train/loss": out}), _golden({"train/loss": expected}, tolerances={"train/loss": tol}), "approx")
    )
    assert m.status == "fail" and [(f.step, f.allowed) for f in m.failures] == [(3, 1.0)]


def test_approx_allows_failing_steps_up_to_the_tolerance_and_names_them():
    expected = {s: -2.0 for s in range(10)}  # a negative golden: the band is atol + rtol * |value| = 0.21
    one = {**expected, 4: -2.5}
    m = _only(
        compare(
            _run({"train/loss": one}), _golden({"train/loss": expected}, tolerances={"train/loss": APPROX}), "approx"
        )
    )
    assert m.status == "pass" and m.failures == [StepFailure(4, -2.0, -2.5, -0.5, pytest.approx(0.21))]
    two = {**one, 7: -1.7}
    m = _only(
        compare(
            _run({"train/loss": two}), _golden({"train/loss": expected}, tolerances={"train/loss": APPROX}), "approx"
        )
    )
    assert (m.status, m.message) == ("fail", "2 of 10 steps outside the band (at most 1)")
    assert [f.step for f in m.failures] == [4, 7] and m.mean_residual == 0.0  # residuals over the steps inside


def test_approx_catches_a_one_sided_drift_inside_the_band():
    expected = {s: 1.0 for s in range(10)}
    drift = {s: 1.06 for s in range(10)}  # each step inside the band (0.11), every one on the same side
    m = _only(
        compare(
            _run({"train/loss": drift}), _golden({"train/loss": expected}, tolerances={"train/loss": APPROX}), "approx"
        )
    )
    assert m.status == "fail" and m.failures == []
    assert m.message == "mean residual +0.06 beyond +-0.05 (one-sided drift)"
    below = {s: 0.94 for s in range(10)}
    m = _only(
        compare(
            _run({"train/loss": below}), _golden({"train/loss": expected}, tolerances={"train/loss": APPROX}), "approx"
        )
    )
    assert m.message == "mean residual -0.06 beyond +-0.05 (one-sided drift)"
    both = {**drift, 0: 2.0, 1: 2.0}  # both problems at once: both named
    m = _only(
        compare(
            _run({"train/loss": both}), _golden({"train/loss": expected}, tolerances={"train/loss": APPROX}), "approx"
        )
    )
    assert (
        m.message == "2 of 10 steps outside the band (at most 1); mean residual +0.06 beyond +-0.05 (one-sided drift)"
    )


def test_approx_without_a_mean_bound_and_with_non_finite_values():
    tol = g.Tolerance(kind="approx", rtol=0.0, atol=0.5, failing_steps=0, mean_residual=None)
    expected = {0: 1.0, 1: math.nan, 2: math.inf, 3: 1.0}
    got = {0: 1.4, 1: math.nan, 2: math.inf, 3: math.inf}
    m = _only(compare(_run({"x": got}), _golden({"x": expected}, tolerances={"x": tol}), "approx"))
    # NaN = NaN and inf = inf as logged; a finite golden against an infinite value is outside any band
    assert [f.step for f in m.failures] == [3] and m.failures[0].allowed == 0.5 and math.isnan(m.failures[0].delta)
    assert m.mean_residual == pytest.approx(0.4) and m.mean_bound is None and m.max_abs == pytest.approx(0.4)
    assert m.message == "1 of 4 steps outside the band (at most 0)"
    assert (
        _only(compare(_run({"x": {0: 1.0}}), _golden({"x": {0: math.nan}}, tolerances={"x": tol}), "approx"))
        .failures[0]
        .allowed
        == 0.0
    )


def test_an_exact_tolerance_in_the_approx_tier_compares_bits():
    tol = g.Tolerance(kind="exact")
    m = _only(
        compare(
            _run({"x": {0: 1.0, 1: 2.0}}), _golden({"x": {0: 1.0, 1: 2.0 + 1e-12}}, tolerances={"x": tol}), "approx"
        )
    )
    assert (m.kind, m.status, m.message) == ("exact", "fail", "1 of 2 steps differ")


# ---------------------------------------------------------------- perf: window medians, both tiers


def _perf(values):
    return {"perf/step_time": values}


def test_perf_median_leaves_the_warm_up_steps_out():
    """The window is the steps after the first tenth. The golden's warm-up step 0 is fast here, and counting it
    would move the golden's median from 2.0 to 1.5 and fail a run at x1.75 of the golden's median."""
    steps = range(10)
    golden = _golden(_perf(dict(zip(steps, [0.0, 1, 1, 1, 1, 2, 2, 2, 2, 2]))))
    tol = golden.metrics["perf/step_time"].tolerance
    assert (tol.kind, tol.max_ratio, tol.window) == ("median", 2.0, (1, 9))
    run = _run(_perf(dict.fromkeys(steps, 3.5)))
    for tier in ("exact", "approx"):
        m = _only(compare(run, golden, tier))
        assert (m.kind, m.status, m.median_expected, m.median_got) == ("median", "pass", 2.0, 3.5)
    # and the run's own warm-up: a slow step 0 of the run does not count either
    m = _only(compare(_run(_perf({**dict.fromkeys(steps, 3.5), 0: 1000.0})), golden))
    assert (m.status, m.median_got) == ("pass", 3.5)


def test_perf_median_is_over_exactly_the_window():
    values = {s: float(s) for s in range(10)}  # the median of steps 1..9 is 5; of 0..9, 4.5; of 2..9, 5.5
    m = _only(compare(_run(_perf(values)), _golden(_perf(values))))
    assert (m.median_expected, m.median_got, m.status) == (5.0, 5.0, "pass")


def test_perf_median_over_the_limit_fails_with_the_ratio():
    golden = _golden(_perf(dict.fromkeys(range(10), 2.0)))
    m = _only(compare(_run(_perf(dict.fromkeys(range(10), 6.0))), golden))
    assert (m.status, m.message) == ("fail", "median 6 is x3.00 the golden's 2 (at most x2)")
    assert _only(compare(_run(_perf(dict.fromkeys(range(10), 4.0))), golden)).status == "pass"  # x2 is allowed
    nan = _only(compare(_run(_perf(dict.fromkeys(range(10), math.nan))), golden))
    assert nan.status == "fail"  # NaN is no speed
    zero = _golden(_perf(dict.fromkeys(range(10), 0.0)))
    assert "xinf" in _only(compare(_run(_perf(dict.fromkeys(range(10), 1.0))), zero)).message


def test_a_median_with_a_lower_bound_is_two_sided():
    """Megatron-LM's iteration-time: np.isclose(run median, golden median, rtol=0.05), i.e. x0.95 to x1.05 of a
    positive golden median: a run 6% faster fails as a run 6% slower does; the bounds themselves pass."""
    tol = g.Tolerance(kind="median", max_ratio=1.05, min_ratio=0.95, window=(1, 9), family="Megatron-LM iteration-time")
    golden = _golden(_perf(dict.fromkeys(range(10), 2.0)), tolerances={"perf/step_time": tol})
    for got, status in ((2.0 * 0.94, "fail"), (2.0 * 0.95, "pass"), (2.0, "pass"), (2.1, "pass"), (2.0 * 1.06, "fail")):
        m = _only(compare(_run(_perf(dict.fromkeys(range(10), got))), golden, "approx"))
        assert (m.status, m.compared) == (status, 9), got
    m = _only(compare(_run(_perf(dict.fromkeys(range(10), 1.0))), golden, "approx"))
    assert m.message == "median 1 is x0.50 the golden's 2 (x0.95 to x1.05)"
    assert tol.to_json() == {
        "kind": "median",
        "max_ratio": 1.05,
        "min_ratio": 0.95,
        "window": [1, 9],
        "family": "Megatron-LM iteration-time",
    }


def test_perf_window_outside_the_golden_steps_fails():
    tol = g.Tolerance(kind="median", max_ratio=2.0, window=(20, 30), family="perf")
    m = _only(
        compare(_run(_perf({0: 1.0, 1: 1.0})), _golden(_perf({0: 1.0, 1: 1.0}), tolerances={"perf/step_time": tol}))
    )
    assert (m.status, m.message) == ("fail", "no golden step in the window (20, 30)")


# ---------------------------------------------------------------- what is compared


def test_missing_metrics_and_steps_are_failures_or_refusals():
    golden = _golden({"train/loss": LOSS, "train/new": LOSS})
    report = compare(_run({"train/loss": LOSS, "train/extra": LOSS}), golden)
    new = _only(report, "train/new")
    assert (new.status, new.message, new.kind) == ("missing", "not logged by the run", "approx")
    assert new.tolerance == new.band == golden.metrics["train/new"].tolerance.to_json() and new.steps == list(range(10))
    assert new.expected == LOSS and not report.ok and report.failed == [new]
    assert report.not_in_golden == ["train/extra"]
    partial = {s: v for s, v in LOSS.items() if s != 5}
    m = _only(compare(_run({"train/loss": partial, "train/other": LOSS}), _golden({"train/loss": LOSS})))
    assert (m.status, m.message) == ("fail", "not logged at step(s) 5")
    with pytest.raises(BadInput, match=r"committed steps are 0\.\.4; the golden's train/loss needs 0\.\.9") as info:
        compare(_run({"train/loss": {s: LOSS[s] for s in range(5)}}), golden)
    assert info.value.path == "/runs/a"


def test_ignore_and_overrides():
    golden = _golden({"train/loss": LOSS, "perf/step_time": dict.fromkeys(range(10), 1.0), "train/kl": LOSS})
    run = _run(
        {"train/loss": LOSS, "perf/step_time": dict.fromkeys(range(10), 1.0), "train/kl": LOSS, "perf/train_time": LOSS}
    )
    report = compare(run, golden, ignore=["perf/*"])
    assert report.ignored == ["perf/step_time"] and report.not_in_golden == []
    assert [m.name for m in report.metrics] == ["train/kl", "train/loss"]
    moved = _run(
        {"train/loss": {**LOSS, 2: LOSS[2] + 0.02, 3: LOSS[3] + 0.02}, "train/kl": LOSS, "perf/step_time": LOSS}
    )
    report = compare(
        moved, golden, "approx", ignore=["perf/*"], overrides=[("train/lo*", {"rtol": 0.0, "atol": 0.001})]
    )
    loss = _only(report, "train/loss")
    assert (
        loss.status == "fail"
        and loss.tolerance["atol"] == 0.001
        and loss.tolerance["override"] == {"rtol": 0.0, "atol": 0.001}
    )
    assert _only(report, "train/kl").tolerance == golden.metrics["train/kl"].tolerance.to_json()
    median = _only(compare(run, golden, ignore=["perf/*", "train/kl"], overrides=[("train/loss", {"kind": "median"})]))
    assert median.kind == "median" and median.tolerance["window"] == [1, 9]  # the override's window: from the steps
    with pytest.raises(BadInput, match="^--tolerance: train/loss: max_ratio does not apply to a approx tolerance"):
        compare(run, golden, overrides=[("train/loss", {"max_ratio": 3.0})])
    with pytest.raises(BadInput, match="'nothing/\\*' matches no metric of the golden file") as info:
        compare(run, golden, overrides=[("nothing/*", {"atol": 1.0})])
    assert info.value.field == "--tolerance"


def test_another_configuration_is_refused_in_both_tiers_naming_the_fields():
    other = {**MANIFEST, "config": {**MANIFEST["config"], "seed": 2, "algo": {"eps_clip": 0.3}}}
    for tier in ("exact", "approx"):
        with pytest.raises(BadInput) as info:
            compare(_run({"train/loss": LOSS}, other), _golden({"train/loss": LOSS}), tier)
        assert str(info.value) == (
            "/golden.json: header.config: the run's configuration is not the golden's: algo.eps_clip (golden 0.2, "
            "run 0.3); seed (golden 1, run 2). A golden file holds one configuration's curve: make one for this "
            "configuration with `rlbench golden update`"
        )
    for extra, tail in (
        (4, "k3 (golden None, run 3). A golden"),
        (5, "k3 (golden None, run 3) and 1 more. A golden"),
        (6, "k3 (golden None, run 3) and 2 more. A golden"),
    ):
        many = {**MANIFEST, "config": {**MANIFEST["config"], **{f"k{i}": i for i in range(extra)}}}
        with pytest.raises(BadInput) as info:
            compare(_run({"train/loss": LOSS}, many), _golden({"train/loss": LOSS}))
        assert tail in str(info.value)
    assert compare(
        _run({"train/loss": LOSS}, {**MANIFEST, "config": {**MANIFEST["config"], "out": "elsewhere"}}),
        _golden({"train/loss": LOSS}),
    ).ok  # where the run went is not its configuration


@pytest.mark.parametrize(
    "change, named",
    [
        ({"platform": {"machine": "aarch64"}}, "platform: golden cpu-x86_64, run cpu-aarch64"),
        ({"numerics": {**NUMERICS, "blas": "OpenBLAS"}}, "CPU numerics: blas (golden 'MKL 2025', run 'OpenBLAS')"),
        ({"versions": {**MANIFEST["versions"], "torch": "2.14.0"}}, "torch: golden 2.13.0, run 2.14.0"),
        (
            {"determinism": {"torch_threads": 4, "deterministic_algorithms": True}},
            "determinism settings: torch_threads (golden 1, run 4)",
        ),
    ],
)
def test_the_exact_tier_is_refused_across_platforms_and_versions_and_approx_notes_it(change, named):
    run = _run({"train/loss": LOSS}, {**MANIFEST, **change})
    with pytest.raises(BadInput) as info:
        compare(run, _golden({"train/loss": LOSS}))
    assert named in str(info.value) and info.value.field == "header" and "--tier approx" in str(info.value)
    report = compare(run, _golden({"train/loss": LOSS}), "approx")
    assert report.ok and f"compared across {named}" in report.notes
    assert report.notes[-1].startswith("every compared value is equal bit for bit")


def test_what_the_exact_tier_does_not_refuse():
    """python and rlbench are recorded only; a GPU model differs only where there is one."""
    versions = {**MANIFEST["versions"], "python": "3.12.0", "rlbench": "0.2.0"}
    assert compare(_run({"train/loss": LOSS}, {**MANIFEST, "versions": versions}), _golden({"train/loss": LOSS})).ok
    gpu = {**MANIFEST, "device": "cuda", "device_name": "NVIDIA H200"}
    with pytest.raises(BadInput, match="device: golden NVIDIA H200, run NVIDIA H100"):
        compare(_run({"train/loss": LOSS}, {**gpu, "device_name": "NVIDIA H100"}), _golden({"train/loss": LOSS}, gpu))
    no_determinism = _golden({"train/loss": LOSS})
    del no_determinism.header["determinism"]  # an older file: nothing to compare there
    other = {**MANIFEST, "determinism": {"torch_threads": 8}}
    assert compare(_run({"train/loss": LOSS}, other), no_determinism).ok


def test_approx_notes_when_the_bits_agree_only_if_they_do():
    run = _run({"train/loss": {**LOSS, 1: LOSS[1] + 1e-9}}, {**MANIFEST, "platform": {"machine": "arm64"}})
    report = compare(run, _golden({"train/loss": LOSS}), "approx")
    assert report.ok and not any("bit for bit" in n for n in report.notes)
    same = compare(_run({"train/loss": LOSS}), _golden({"train/loss": LOSS}), "approx")
    assert same.notes == [
        "every compared value is equal bit for bit (the exact tier's preconditions are not met, but the bits agree)"
    ]
    perf_only = compare(_run(_perf(LOSS)), _golden(_perf(LOSS)), "approx")
    assert perf_only.notes == []  # medians are not bits
    gone = compare(_run({"train/loss": LOSS}), _golden({"train/loss": LOSS, "train/gone": LOSS}), "approx")
    assert not gone.ok and gone.notes == same.notes  # of the values compared; the missing metric fails on its own


def test_a_megatron_golden_file_is_approx_only_and_the_run_notes_come_along():
    golden = _golden({"lm loss": LOSS}, fmt="megatron")
    run = _run({"lm loss": LOSS}, notes=["1 step past the last committed one ignored"])
    with pytest.raises(BadInput, match="records no platform, versions or configuration"):
        compare(run, golden)
    report = compare(run, golden, "approx")
    assert report.golden_format == "megatron" and report.ok
    assert report.notes[:3] == [
        "/runs/a: 1 step past the last committed one ignored",
        "a Megatron-LM golden values file",
        "compared across a Megatron-LM golden values file records no platform, versions or configuration",
    ]


def test_an_unknown_tier_is_refused():
    with pytest.raises(BadInput, match="expected one of exact, approx, got 'fuzzy'") as info:
        compare(_run({"x": LOSS}), _golden({"x": LOSS}), "fuzzy")
    assert info.value.field == "--tier"


def test_the_report_as_json():
    golden = _golden({"train/loss": LOSS, "train/gone": LOSS})
    got = {**LOSS, 2: math.inf}
    doc = compare(_run({"train/loss": got}), golden).to_json()
    assert (doc["ok"], doc["tier"], doc["failed"], doc["run"], doc["golden"]) == (
        False,
        "exact",
        ["train/gone", "train/loss"],
        "/runs/a",
        "/golden.json",
    )
    loss = next(m for m in doc["metrics"] if m["name"] == "train/loss")
    assert loss["got"]["2"] == "inf" and loss["expected"]["2"] == LOSS[2] and loss["expected"]["0"] == 0.5
    assert loss["failures"] == [{"step": 2, "expected": LOSS[2], "got": "inf", "delta": "nan", "allowed": 0.0}]
    assert set(doc) == {
        "ok",
        "tier",
        "run",
        "golden",
        "golden_format",
        "platform",
        "notes",
        "failed",
        "ignored",
        "not_in_golden",
        "compared",
        "golden_step_offset",
        "metrics",
    }
    # train/loss's 10 steps were compared; train/gone, not logged by the run, none
    assert (doc["compared"], loss["compared"], doc["golden_step_offset"]) == (10, 10, 0)


def test_every_difference_is_named_and_only_differences_refuse():
    """Several fields at once are joined with '; '; a package only one side recorded is a difference; a GPU
    model that agrees is none."""
    two = {
        **MANIFEST,
        "numerics": {**NUMERICS, "blas": "OpenBLAS", "mkl_cbwr": "AUTO"},
        "determinism": {"torch_threads": 4, "deterministic_algorithms": False},
    }
    with pytest.raises(BadInput) as info:
        compare(_run({"train/loss": LOSS}, two), _golden({"train/loss": LOSS}))
    assert "CPU numerics: blas (golden 'MKL 2025', run 'OpenBLAS'); mkl_cbwr (golden 'COMPATIBLE', run 'AUTO')" in str(
        info.value
    )
    assert (
        "determinism settings: deterministic_algorithms (golden True, run False); torch_threads (golden 1, run 4)"
        in str(info.value)
    )
    assert "run 'AUTO'); determinism settings" in str(info.value) and info.value.path == "/golden.json"
    megatron = {**MANIFEST, "versions": {**MANIFEST["versions"], "megatron-core": "0.16.1"}}
    with pytest.raises(BadInput, match="megatron-core: golden None, run 0.16.1"):
        compare(_run({"train/loss": LOSS}, megatron), _golden({"train/loss": LOSS}))
    with pytest.raises(BadInput, match="megatron-core: golden 0.16.1, run None"):
        compare(_run({"train/loss": LOSS}), _golden({"train/loss": LOSS}, megatron))
    gpu = {**MANIFEST, "device": "cuda", "device_name": "NVIDIA H200"}
    assert compare(_run({"train/loss": LOSS}, gpu), _golden({"train/loss": LOSS}, gpu)).ok


def test_a_configuration_field_that_changed_its_kind_is_named():
    other = {**MANIFEST, "config": {**MANIFEST["config"], "algo": 0.2}}
    with pytest.raises(BadInput, match=r"algo \(golden \{'eps_clip': 0.2\}, run 0.2\)"):
        compare(_run({"train/loss": LOSS}, other), _golden({"train/loss": LOSS}))


def test_a_run_without_the_golden_steps_says_what_it_has():
    with pytest.raises(BadInput, match=r"the run's committed steps are none; the golden's train/loss needs 0\.\.9"):
        compare(_run({}), _golden({"train/loss": LOSS}))
    m = _only(compare(_run({"train/loss": {0: 0.5}, "x": LOSS}), _golden({"train/loss": LOSS})))
    assert m.message == "not logged at step(s) 1, 2, 3, 4, 5"  # the first five named


def test_the_mean_residual_bound_is_inclusive_and_needs_steps_inside():
    tol = g.Tolerance(kind="approx", rtol=0.0, atol=0.5, failing_steps=2, mean_residual=0.25)
    at_bound = _only(
        compare(_run({"x": {0: 1.25, 1: 1.25}}), _golden({"x": {0: 1.0, 1: 1.0}}, tolerances={"x": tol}), "approx")
    )
    assert (at_bound.status, at_bound.mean_residual) == ("pass", 0.25)
    outside = _only(
        compare(_run({"x": {0: 3.0, 1: 3.0}}), _golden({"x": {0: 1.0, 1: 1.0}}, tolerances={"x": tol}), "approx")
    )
    assert (outside.status, outside.mean_residual, len(outside.failures)) == ("pass", 0.0, 2)  # both allowed to fail
