"""`rlbench check golden` and `rlbench golden update`: tiers, tolerances, refusals, Megatron-LM
input, history, bad input and the plot. One small run is made per module; every test edits
golden files only, never the run."""

from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given, settings, strategies as st

from rlbench.checks import golden as g
from rlbench.checks.golden_build import golden_file_name
from rlbench.checks.golden_compare import compare
from rlbench.config import RunConfig, apply_overrides
from rlbench.rundir.directory import read_run
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, small_config):
    from rlbench.session import run

    out = tmp_path_factory.mktemp("golden") / "run"
    run(apply_overrides(small_config, steps=6, out=str(out)), command="rlbench run (test)")
    return out


@pytest.fixture
def golden_file(run_dir, tmp_path):
    """A fresh golden file of run_dir, written by the CLI."""
    path = tmp_path / "golden.json"
    res = run_cli("golden", "update", str(run_dir), str(path), "--reason", "initial values")
    assert res.returncode == 0, res.stderr
    return path


def _edit(path, fn, to=None):
    doc = json.loads(path.read_text())
    fn(doc)
    to = to or path
    to.write_text(json.dumps(doc, indent=1))
    return to


def _check(run_dir, golden, *args):
    return run_cli("check", "golden", str(run_dir), str(golden), "--ignore", "perf/*", *args)


def _one_line_error(res, *needles):
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlbench: error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _next_float(x: float) -> float:
    return struct.unpack("<d", struct.pack("<q", struct.unpack("<q", struct.pack("<d", x))[0] + 1))[0]


# --------------------------------------------------------------------------- file and header


def test_update_writes_header_series_and_tolerances(run_dir, golden_file):
    doc = json.loads(golden_file.read_text())
    head = doc["header"]
    assert doc["schema"] == "rlbench.golden/1"
    assert head["platform"] == g.platform_of(read_run(run_dir).manifest) and head["platform"].startswith("cpu-")
    assert head["versions"]["torch"] and head["versions"]["transformers"]
    # only the packages the run used (the default run: no megatron-core, no sglang)
    assert set(head["versions"]) == {"python", "rlbench", "torch", "transformers", "tokenizers", "safetensors"}
    assert head["numerics"] == {
        "mode": "portable",
        "aten_capability": "AVX2",
        "mkl_cbwr": "COMPATIBLE",
        "blas": head["numerics"]["blas"],
    } and head["numerics"]["blas"].startswith("MKL ")
    assert head["config_hash"] == g.config_hash(head["config"])
    assert head["command"] == "rlbench run (test)"
    assert head["reason"] == "initial values" and len(head["history"]) == 1
    run = read_run(run_dir)
    loss = doc["metrics"]["train/loss"]
    assert (loss["start_step"], loss["end_step"], loss["step_interval"]) == (0, 5, 1)
    assert loss["values"] == {str(r["step"]): r["train/loss"] for r in run.metrics}
    # families: losses rtol 0.05 (Megatron-LM), Megatron's failing-step count, a concrete mean bound
    assert loss["tolerance"]["family"] == "losses" and loss["tolerance"]["rtol"] == 0.05
    assert loss["tolerance"]["failing_steps"] == 1 and loss["tolerance"]["mean_residual"] > 0
    assert doc["metrics"]["rollout/raw_reward"]["tolerance"]["family"] == "rewards"
    assert doc["metrics"]["train/grad_norm"]["tolerance"]["family"] == "grad norms"
    assert doc["metrics"]["rollout/response_len/mean"]["tolerance"]["family"] == "lengths"
    assert doc["metrics"]["perf/step_time"]["tolerance"] == {
        "kind": "median",
        "max_ratio": 2.0,
        "window": [1, 5],
        "family": "perf",
    }


def test_config_identity_ignores_io_and_checkout_location(run_dir):
    manifest = read_run(run_dir).manifest
    moved = json.loads(json.dumps(manifest))
    moved["config"].update(
        out="/elsewhere/run", steps=500, checkpoint_every=7, record=False, device="cuda:1", threads=4
    )
    moved["config"]["model"]["path"] = "/another/checkout/fixtures/models/tiny-qwen3"
    assert g.config_identity(moved) == g.config_identity(manifest)
    moved["config"]["train"]["lr"] *= 1.01
    assert g.config_identity(moved) != g.config_identity(manifest)
    moved = json.loads(json.dumps(manifest))
    moved["hashes"]["tokenizer"] = "0" * 64  # same path, other contents
    assert g.config_identity(moved) != g.config_identity(manifest)


@pytest.mark.parametrize("n, allowed", [(2, 1), (10, 1), (100, 1), (250, 2), (4999, 49), (10000, 50)])
def test_failing_steps_follow_megatron(n, allowed):
    tol = g.default_tolerance("train/loss", list(range(n)), [1.0] * n)
    assert tol.failing_steps == min(max(n // 100, 1), 50) == allowed


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=1, max_size=20))
def test_values_round_trip_bit_for_bit(tmp_path_factory, values):
    """The exact tier rests on this: a value written to a golden file reads back with the same bits
    (NaN, infinities, -0.0 and subnormals included)."""
    steps = list(range(len(values)))
    series = g.Series(0, len(values) - 1, 1, dict(zip(steps, values)), g.default_tolerance("x", steps, values))
    path = tmp_path_factory.mktemp("rt") / "golden.json"
    path.write_text(
        json.dumps(
            {
                "schema": g.SCHEMA,
                "header": {"platform": "p", "versions": {}, "history": []},
                "metrics": {"x": series.to_json()},
            }
        )
    )
    back = g.load_golden(path).metrics["x"].values
    assert all(g.same_bits(back[s], v) for s, v in zip(steps, values))


def test_same_bits_is_bitwise():
    assert g.same_bits(0.0, 0.0) and g.same_bits(math.nan, math.nan) and g.same_bits(math.inf, math.inf)
    assert not g.same_bits(0.0, -0.0) and not g.same_bits(1.0, _next_float(1.0)) and not g.same_bits(math.nan, 1.0)


# --------------------------------------------------------------------------- exact tier


def test_same_run_passes_exact_and_approx(run_dir, golden_file):
    for tier in ("exact", "approx"):
        res = _check(run_dir, golden_file, "--tier", tier)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"golden check passed ({tier} tier)" in res.stdout


def test_exact_tier_names_a_one_ulp_difference(run_dir, golden_file, tmp_path):
    got = {r["step"]: r["train/grad_norm"] for r in read_run(run_dir).metrics}
    _edit(golden_file, lambda doc: doc["metrics"]["train/grad_norm"]["values"].__setitem__("3", _next_float(got[3])))
    res = _check(run_dir, golden_file)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "failing steps" in res.stdout
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in res.stdout.splitlines()
        if line.startswith("│ train/grad_norm") and line.count("│") == 7
    ]
    assert rows == [
        [
            "train/grad_norm",
            "3",
            repr(_next_float(got[3])),
            repr(got[3]),
            f"{got[3] - _next_float(got[3]):+.3g}",
            "exact",
        ]
    ], res.stdout
    doc = json.loads(_check(run_dir, golden_file, "--json").stdout)
    assert doc["ok"] is False and doc["failed"] == ["train/grad_norm"]
    [metric] = [m for m in doc["metrics"] if m["name"] == "train/grad_norm"]
    assert [f["step"] for f in metric["failures"]] == [3] and metric["kind"] == "exact"
    # within every approx tolerance, so the approx tier passes (and does not claim equal bits)
    res = _check(run_dir, golden_file, "--tier", "approx")
    assert res.returncode == 0 and "bit for bit" not in res.stderr


def test_another_platform_is_refused_in_exact_and_compared_in_approx(run_dir, golden_file):
    def elsewhere(doc):
        doc["header"]["platform"] = "cpu-aarch64"

    _edit(golden_file, elsewhere)
    res = _check(run_dir, golden_file)
    _one_line_error(res, "exact tier is meaningless", "platform: golden cpu-aarch64, run cpu-x86_64", "--tier approx")
    res = _check(run_dir, golden_file, "--tier", "approx")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "compared across platform: golden cpu-aarch64" in res.stderr
    assert "every compared value is equal bit for bit" in res.stderr


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("torch", "2.12.0+cpu", "torch: golden 2.12.0+cpu"),
        ("transformers", "4.57.0", "transformers: golden 4.57.0"),
        ("sglang", "0.5.4", "sglang: golden 0.5.4, run None"),
    ],
)
def test_other_versions_are_refused_in_exact(run_dir, golden_file, key, value, needle):
    _edit(golden_file, lambda doc: doc["header"]["versions"].__setitem__(key, value))
    _one_line_error(_check(run_dir, golden_file), needle)
    assert _check(run_dir, golden_file, "--tier", "approx").returncode == 0


@pytest.mark.parametrize(
    "field, value", [("aten_capability", "AVX512"), ("mkl_cbwr", "OFF"), ("blas", "OpenBLAS"), ("mode", "native")]
)
def test_other_cpu_numerics_are_refused_in_exact(run_dir, golden_file, field, value):
    """A golden made where the bits are decided otherwise (another ATen dispatch, MKL branch, BLAS,
    or the CPU's native paths) cannot hold bit for bit here: refused with the field, never a regression."""
    _edit(golden_file, lambda doc: doc["header"]["numerics"].__setitem__(field, value))
    _one_line_error(_check(run_dir, golden_file), "CPU numerics", f"{field} (golden {value!r}")
    assert _check(run_dir, golden_file, "--tier", "approx").returncode == 0


def test_portable_numerics_compare_across_cpu_vendors(run_dir, golden_file, tmp_path):
    """In portable mode the CPU's vendor and ISA level are not part of the identity (bench/cpu_numerics.py
    shows them agreeing): a run made on another vendor's CPU is compared bit for bit. In native mode
    they are, and the same run is refused."""
    import shutil

    other = tmp_path / "other-cpu"
    shutil.copytree(run_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["numerics"]["cpu"] = {
        "machine": "x86_64",
        "vendor": "GenuineIntel",
        "model": "Intel(R) Xeon(R)",
        "isa": "x86-64-v4",
    }
    (other / "manifest.json").write_text(json.dumps(manifest))
    doc = json.loads(_check(other, golden_file, "--json").stdout)
    assert doc["failed"] == [] and doc["ok"] is True
    manifest["numerics"]["mode"] = "native"
    (other / "manifest.json").write_text(json.dumps(manifest))
    _edit(golden_file, lambda d: d["header"]["numerics"].update(mode="native", vendor="AuthenticAMD", isa="x86-64-v3"))
    _one_line_error(
        _check(other, golden_file),
        "CPU numerics",
        "vendor (golden 'AuthenticAMD', run 'GenuineIntel')",
        "isa (golden 'x86-64-v3', run 'x86-64-v4')",
    )


def test_other_determinism_settings_are_refused_in_exact(run_dir, golden_file):
    _edit(golden_file, lambda doc: doc["header"]["determinism"].__setitem__("torch_threads", 4))
    _one_line_error(_check(run_dir, golden_file), "determinism settings: torch_threads")
    assert _check(run_dir, golden_file, "--tier", "approx").returncode == 0


def test_another_config_is_refused_in_both_tiers(run_dir, golden_file):
    _edit(golden_file, lambda doc: doc["header"]["config"]["train"].__setitem__("lr", 0.1))
    for tier in ("exact", "approx"):
        _one_line_error(
            _check(run_dir, golden_file, "--tier", tier),
            "header.config",
            f"train.lr (golden 0.1, run {RunConfig().train.lr})",
            "golden update",
        )


# --------------------------------------------------------------------------- approx tier


def _scale_steps(doc, metric, steps, factor):
    values = doc["metrics"][metric]["values"]
    for s in steps:
        values[str(s)] = values[str(s)] * factor


def test_approx_allows_the_failing_step_count_and_no_more(run_dir, golden_file, tmp_path):
    one = _edit(golden_file, lambda d: _scale_steps(d, "train/entropy_loss", [2], 1.5), tmp_path / "one.json")
    res = _check(run_dir, one, "--tier", "approx")
    assert res.returncode == 0, res.stdout  # 1 failing step allowed out of 6
    two = _edit(golden_file, lambda d: _scale_steps(d, "train/entropy_loss", [2, 4], 1.5), tmp_path / "two.json")
    res = _check(run_dir, two, "--tier", "approx")
    assert res.returncode == 1
    doc = json.loads(_check(run_dir, two, "--tier", "approx", "--json").stdout)
    [m] = [m for m in doc["metrics"] if m["status"] != "pass"]
    assert m["name"] == "train/entropy_loss" and [f["step"] for f in m["failures"]] == [2, 4]
    assert "2 of 6 steps outside the band (at most 1)" in m["message"]
    # an override can widen it, per metric
    res = _check(run_dir, two, "--tier", "approx", "--tolerance", "train/entropy_loss:failing_steps=2")
    assert res.returncode == 0, res.stdout


def test_mean_residual_catches_one_sided_drift_inside_the_band(run_dir, golden_file, tmp_path):
    """Every step inside its band, all on one side: the per-step test passes, the mean fails."""

    def drift(doc, fraction):
        series = doc["metrics"]["train/entropy_loss"]
        tol = series["tolerance"]
        for s, v in series["values"].items():
            series["values"][s] = v - fraction * (tol["atol"] + tol["rtol"] * abs(v))

    biased = _edit(golden_file, lambda d: drift(d, 0.9), tmp_path / "biased.json")
    doc = json.loads(_check(run_dir, biased, "--tier", "approx", "--json").stdout)
    [m] = [m for m in doc["metrics"] if m["name"] == "train/entropy_loss"]
    assert m["status"] == "fail" and m["failures"] == [] and "one-sided drift" in m["message"]
    assert m["mean_residual"] > m["mean_bound"] > 0

    # the same size of difference with alternating signs averages out and passes
    def alternate(doc):
        series = doc["metrics"]["train/entropy_loss"]
        tol = series["tolerance"]
        for s, v in series["values"].items():
            series["values"][s] = v + (-1) ** int(s) * 0.9 * (tol["atol"] + tol["rtol"] * abs(v))

    noisy = _edit(golden_file, alternate, tmp_path / "noisy.json")
    assert _check(run_dir, noisy, "--tier", "approx").returncode == 0


def test_perf_compares_window_medians_never_exactly(run_dir, golden_file, tmp_path):
    run = read_run(run_dir)
    got = {r["step"]: r["perf/step_time"] for r in run.metrics}

    def scaled(factor):
        def fn(doc):
            doc["metrics"]["perf/step_time"]["values"] = {str(s): v * factor for s, v in got.items()}

        return fn

    # golden twice as slow: the run is faster, which passes (even in the exact tier: never exact)
    slow = _edit(golden_file, scaled(2.0), tmp_path / "slow.json")
    res = run_cli("check", "golden", str(run_dir), str(slow), "--json")
    assert json.loads(res.stdout)["ok"] is True
    # golden a third of the run's: the run's median is x3 > x2 allowed
    fast = _edit(golden_file, scaled(1 / 3), tmp_path / "fast.json")
    doc = json.loads(run_cli("check", "golden", str(run_dir), str(fast), "--json").stdout)
    assert doc["failed"] == ["perf/step_time"]
    [m] = [m for m in doc["metrics"] if m["name"] == "perf/step_time"]
    assert m["kind"] == "median" and "x3.00" in m["message"]

    # the window leaves the first (warm-up) step out: a huge step 0 does not move the median
    def warmup(doc):
        doc["metrics"]["perf/step_time"]["values"]["0"] = 1e-9

    assert json.loads(run_cli("check", "golden", str(run_dir), str(_edit(slow, warmup)), "--json").stdout)["ok"]


# --------------------------------------------------------------------------- missing data


def test_a_metric_the_run_no_longer_logs_is_a_regression(run_dir, golden_file):
    def add(doc):
        doc["metrics"]["train/new_metric"] = {**doc["metrics"]["train/loss"]}

    _edit(golden_file, add)
    res = _check(run_dir, golden_file)
    assert res.returncode == 1 and "train/new_metric" in res.stdout and "not logged by the run" in res.stdout


def test_a_run_short_of_the_golden_steps_is_bad_input(run_dir, golden_file, tmp_path):
    def longer(doc):
        for series in doc["metrics"].values():
            series["end_step"] = 9
            series["values"].update({str(s): 0.0 for s in range(6, 10)})

    _edit(golden_file, longer)
    _one_line_error(_check(run_dir, golden_file), "committed steps are 0..5", "needs 0..9")


def test_metrics_not_in_the_golden_are_listed_not_failed(run_dir, golden_file):
    _edit(golden_file, lambda doc: doc["metrics"].pop("train/ppo_kl"))
    res = _check(run_dir, golden_file)
    assert res.returncode == 0 and "not in the golden file (not compared): train/ppo_kl" in res.stdout


# --------------------------------------------------------------------------- update and history


def test_update_keeps_history_and_overrides(run_dir, tmp_path):
    path = tmp_path / "g.json"
    res = run_cli(
        "golden", "update", str(run_dir), str(path), "--reason", "first", "--tolerance", "train/loss:rtol=0.2,atol=0.01"
    )
    assert res.returncode == 0, res.stderr
    res = run_cli("golden", "update", str(run_dir), str(path), "--reason", "torch upgrade", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["history"] == 2 and summary["changed"] == [] and summary["added"] == []
    assert summary["config_changed"] is False and summary["platform_changed"] is False
    doc = json.loads(path.read_text())
    assert [h["reason"] for h in doc["header"]["history"]] == ["first", "torch upgrade"]
    assert doc["header"]["reason"] == "torch upgrade"
    tol = doc["metrics"]["train/loss"]["tolerance"]
    assert (tol["rtol"], tol["atol"], tol["override"]) == (0.2, 0.01, {"rtol": 0.2, "atol": 0.01})
    assert "override" not in doc["metrics"]["train/pg_loss"]["tolerance"]


def test_update_reports_changed_values(run_dir, golden_file):
    # The entropy is never 0 (a grad norm is, on a step whose groups all score alike): x2 changes it.
    _edit(golden_file, lambda d: _scale_steps(d, "train/entropy_loss", [1], 2.0))
    res = run_cli("golden", "update", str(run_dir), str(golden_file), "--reason", "refresh", "--json")
    assert json.loads(res.stdout)["changed"] == ["train/entropy_loss"]
    assert json.loads(golden_file.read_text())["header"]["history"][-1]["changed"] == ["train/entropy_loss"]


def test_step_interval(run_dir, tmp_path):
    path = tmp_path / "g.json"
    assert run_cli("golden", "update", str(run_dir), str(path), "--reason", "r", "--step-interval", "2").returncode == 0
    loss = json.loads(path.read_text())["metrics"]["train/loss"]
    assert (loss["start_step"], loss["end_step"], loss["step_interval"]) == (0, 4, 2)
    assert list(loss["values"]) == ["0", "2", "4"]
    assert _check(run_dir, path).returncode == 0


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--reason", "  "], ["--reason", "reason for this update"]),
        (["--reason", "r", "--tolerance", "train/loss"], ["--tolerance", "METRIC:key=value"]),
        (["--reason", "r", "--tolerance", "train/loss:rtol=-1"], ["--tolerance", "a number >= 0"]),
        (["--reason", "r", "--tolerance", "train/loss:speed=1"], ["--tolerance", "key one of"]),
        (["--reason", "r", "--tolerance", "nothing/*:rtol=1"], ["--tolerance", "matches no metric"]),
        (["--reason", "r", "--tolerance", "perf/*:rtol=1"], ["does not apply to a median tolerance"]),
    ],
)
def test_update_bad_input(run_dir, tmp_path, args, needles):
    path = tmp_path / "g.json"
    _one_line_error(run_cli("golden", "update", str(run_dir), str(path), *args), *needles)
    assert not path.exists()


def test_update_without_reason_is_a_usage_error(run_dir, tmp_path):
    res = run_cli("golden", "update", str(run_dir), str(tmp_path / "g.json"))
    _one_line_error(res, "--reason")


def test_update_refuses_to_overwrite_an_invalid_file(run_dir, tmp_path):
    path = tmp_path / "g.json"
    path.write_text('{"not": "a golden file"}')
    before = path.read_bytes()
    _one_line_error(run_cli("golden", "update", str(run_dir), str(path), "--reason", "r"), str(path), "schema")
    assert path.read_bytes() == before
    _one_line_error(run_cli("golden", "update", str(run_dir), str(tmp_path), "--reason", "r"), "is a directory")
    _one_line_error(
        run_cli("golden", "update", str(tmp_path / "nope"), str(path), "--reason", "r"), "not a run directory"
    )


# --------------------------------------------------------------------------- bad golden files


@pytest.mark.parametrize(
    "edit, needles",
    [
        (lambda d: d.__setitem__("schema", "rlbench.golden/9"), ["schema", "rlbench.golden/1"]),
        (lambda d: d["metrics"]["train/loss"].pop("step_interval"), ["metrics.train/loss.step_interval"]),
        (lambda d: d["metrics"]["train/loss"]["values"].__setitem__("1", "fast"), ["metrics.train/loss.values.1"]),
        (lambda d: d["metrics"]["train/loss"]["values"].__setitem__("99", 1.0), ["off the series' grid"]),
        (
            lambda d: d["metrics"]["train/loss"].update(end_step=10**30, values=[0.0] * 6),  # a hostile end_step
            ["6 values for the 1000000000000000000000000000001 steps 0..1000000000000000000000000000000 every 1"],
        ),
        (lambda d: d["metrics"]["train/loss"]["values"].__setitem__("01", 1.0), ["step '01' is not an integer step"]),
        (lambda d: d["metrics"]["train/loss"]["tolerance"].__setitem__("kind", "fuzzy"), ["tolerance", "kind one of"]),
        (lambda d: d["metrics"]["train/loss"]["tolerance"].__setitem__("rtol", -0.1), ["rtol", "a number >= 0"]),
        (lambda d: d["metrics"]["train/loss"]["tolerance"].__setitem__("speed", 1), ["unknown key(s) speed"]),
        (lambda d: d["header"].pop("versions"), ["header.versions", "missing"]),
        (lambda d: d.__setitem__("metrics", {}), ["metrics", "non-empty"]),
    ],
)
def test_bad_golden_file(run_dir, golden_file, edit, needles):
    _edit(golden_file, edit)
    _one_line_error(_check(run_dir, golden_file), str(golden_file), *needles)


def test_not_json_and_missing_files(run_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ nope")
    _one_line_error(_check(run_dir, bad), "invalid JSON")
    _one_line_error(_check(run_dir, tmp_path / "absent.json"), "no such golden file")
    _one_line_error(_check(run_dir, bad, "--rename", "x"), "--rename", "GOLDEN_NAME=RUN_NAME")
    _one_line_error(_check(run_dir, bad, "--tier", "fuzzy"), "--tier")


def test_debug_shows_the_traceback(run_dir, tmp_path):
    res = _check(run_dir, tmp_path / "absent.json", "--debug")
    assert res.returncode == 2 and "Traceback" in res.stderr


# --------------------------------------------------------------------------- Megatron-LM input


def _megatron_file(run_dir, path, scale=1.0, nan_at=None):
    """A Megatron-LM golden values file of the run's metrics, as Megatron writes them: iterations
    from 1, values rounded to 5 decimals, "nan" for a missing value."""
    run = read_run(run_dir)

    def series(metric):
        values = {r["step"] + 1: round(r[metric] * scale, 5) for r in run.metrics}
        if nan_at is not None:
            values[nan_at] = "nan"
        return {
            "start_step": 1,
            "end_step": len(values),
            "step_interval": 1,
            "values": {str(k): v for k, v in values.items()},
        }

    path.write_text(json.dumps({"lm loss": series("train/entropy_loss"), "iteration-time": series("perf/step_time")}))
    return path


def test_megatron_golden_values_compare_in_the_approx_tier(run_dir, tmp_path):
    path = _megatron_file(run_dir, tmp_path / "golden_values_dev_dgx_h100.json")
    renames = ["--rename", "lm loss=train/entropy_loss", "--rename", "iteration-time=perf/step_time"]
    res = run_cli("check", "golden", str(run_dir), str(path), *renames, "--tier", "approx", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["golden_format"] == "megatron" and doc["platform"]["golden"] == "megatron:dgx_h100"
    kinds = {m["name"]: m["kind"] for m in doc["metrics"]}
    assert kinds == {"train/entropy_loss": "approx", "perf/step_time": "median"}
    [loss] = [m for m in doc["metrics"] if m["name"] == "train/entropy_loss"]
    assert loss["steps"] == [0, 1, 2, 3, 4, 5]  # Megatron iteration k is rlbench step k - 1
    assert doc["golden_step_offset"] == 1 and loss["compared"] == 6
    # Megatron-LM's own tolerance for its "lm loss", whatever it is renamed to
    assert loss["tolerance"] == {
        "kind": "approx",
        "rtol": 0.05,
        "atol": 0.0,
        "failing_steps": 1,
        "mean_residual": None,
        "family": "Megatron-LM lm loss",
    }
    # no header: the exact tier has nothing to stand on
    _one_line_error(
        run_cli("check", "golden", str(run_dir), str(path), *renames),
        "Megatron-LM golden values file records no platform",
    )
    # a list of values says no step: Megatron-LM's own reader (a pydantic Dict[int, ...]) refuses it too
    _edit(path, lambda d: d["lm loss"].__setitem__("values", list(d["lm loss"]["values"].values())))
    _one_line_error(
        run_cli("check", "golden", str(run_dir), str(path), *renames, "--tier", "approx"),
        "lm loss.values",
        "expected an object of step: value",
    )


def test_megatron_regression_and_nan(run_dir, tmp_path):
    path = _megatron_file(run_dir, tmp_path / "golden_values_lts_dgx_a100.json", scale=1.2, nan_at=3)
    res = run_cli(
        "check",
        "golden",
        str(run_dir),
        str(path),
        "--rename",
        "lm loss=train/entropy_loss",
        "--ignore",
        "iteration-time",
        "--tier",
        "approx",
        "--json",
    )
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    [m] = doc["metrics"]
    # "nan" is Megatron-LM's mark of a step its logs lack: that step (iteration 3, step 2) is named, not compared
    assert [f["step"] for f in m["failures"]] == [0, 1, 3, 4, 5] and m["compared"] == 5
    assert (
        'train/entropy_loss: the file holds "nan" (no value in Megatron-LM\'s logs) at 1 of its 6 steps, '
        "iteration 3: not compared"
    ) in doc["notes"]


# --------------------------------------------------------------------------- plot


def test_plot_marks_failing_steps(run_dir, golden_file, tmp_path):
    from matplotlib.collections import PathCollection, PolyCollection

    from rlbench.checks import plot

    failing = _edit(golden_file, lambda d: _scale_steps(d, "train/entropy_loss", [1, 4], 1.5), tmp_path / "f.json")
    report = compare(read_run(run_dir), g.load_golden(failing), "approx", ignore=["perf/*"])
    fig = plot.figure(report)
    panels = {ax.get_title().split()[0]: ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {m.name for m in report.metrics}
    ax = panels["train/entropy_loss"]
    assert "FAIL" in ax.get_title()
    assert {line.get_label() for line in ax.get_lines()} >= {"golden", "run"}
    assert any(isinstance(c, PolyCollection) for c in ax.collections)  # the tolerance band
    [marks] = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert sorted(x for x, _ in marks.get_offsets()) == [1, 4]
    assert not any(isinstance(c, PathCollection) for c in panels["train/loss"].collections)
    png = tmp_path / "out.png"
    res = run_cli("check", "golden", str(run_dir), str(failing), "--tier", "approx", "--plot", str(png))
    assert res.returncode == 1 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _one_line_error(
        run_cli("check", "golden", str(run_dir), str(failing), "--plot", str(tmp_path / "x.jpg")), "--plot", ".png"
    )


def test_checks_write_nothing_into_the_run(run_dir, golden_file):
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    res = _check(run_dir, golden_file)
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli("golden", "update", str(run_dir), str(golden_file), "--reason", "again")
    assert res.returncode == 0, res.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_plot_without_matplotlib_is_one_clear_line(run_dir, golden_file, tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.argv = ['rlbench'] + sys.argv[1:]; "
        "from rlbench.cli import main; main()"
    )
    png = tmp_path / "p.png"
    res = subprocess.run(
        [sys.executable, "-c", code, "check", "golden", str(run_dir), str(golden_file), "--plot", str(png)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    _one_line_error(res, "--plot needs matplotlib", "rlbench[plot]")
    assert not png.exists()


def test_update_from_another_configuration_says_so(golden_file, small_config, tmp_path):
    from rlbench.session import run

    other = tmp_path / "other"
    run(apply_overrides(small_config, steps=2, out=str(other), train__lr=0.01))
    res = run_cli("golden", "update", str(other), str(golden_file), "--reason", "new lr", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["config_changed"] is True
    doc = json.loads(golden_file.read_text())
    assert doc["header"]["config"]["train"]["lr"] == 0.01 and doc["header"]["history"][-1]["config_changed"] is True
    assert run_cli("check", "golden", str(other), str(golden_file), "--ignore", "perf/*").returncode == 0


def test_rename_must_name_a_golden_metric(run_dir, golden_file):
    _one_line_error(
        _check(run_dir, golden_file, "--rename", "lm loss=train/loss"), "--rename", "'lm loss' matches no metric"
    )


def test_a_cuda_golden_file_is_keyed_to_its_gpu_and_versions():
    """The GPU suite's files: one per GPU model and torch, CUDA and transformers build; a CPU run's is NAME.json."""
    cuda = {
        "device": "cuda",
        "device_name": "NVIDIA H200",
        "versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "transformers": "5.17.0", "python": "3.12.3"},
    }
    assert golden_file_name("default", {"device": "cpu", "versions": cuda["versions"]}) == "default.json"
    assert (
        golden_file_name("default-cuda", cuda)
        == "default-cuda/nvidia_h200-torch2.11.0_cu130-cuda13.0-transformers5.17.0.json"
    )
    names = {golden_file_name("d", cuda)}
    for key, value in (("torch", "2.12.0"), ("cuda", "12.8"), ("transformers", "5.18.0")):
        names.add(golden_file_name("d", {**cuda, "versions": {**cuda["versions"], key: value}}))
    names.add(golden_file_name("d", {**cuda, "device": "cuda:1", "device_name": "NVIDIA H100 80GB HBM3"}))
    names.add(golden_file_name("d", {**cuda, "versions": {**cuda["versions"], "python": "3.13.0"}}))
    assert len(names) == 5  # each of GPU, torch, CUDA, transformers makes its own file; python does not
