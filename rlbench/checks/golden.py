"""Golden files: their format and reading (rlbench's and Megatron-LM's). Writing them (`golden update`) is
golden_build.py, tolerances golden_tolerance.py, the comparison (`check golden`) golden_compare.py.

A golden file (schema `rlbench.golden/1`, JSON) holds:

- a header: the platform (`cpu-x86_64`, `cuda-x86_64` + the GPU model), the versions of torch,
  transformers, tokenizers and the engines, the determinism settings, the run's configuration
  identity and its sha256, the command that made the run, the reason of the last update and the
  history of every update;
- per metric, Megatron-LM's series `{start_step, end_step, step_interval, values}` (values keyed
  by step, non-finite values as the strings "nan", "inf", "-inf") and a `tolerance`.

Tiers. `exact` (the default, what CPU CI runs): every value equal bit for bit; refused (BadInput,
exit 2) when the platform, versions or determinism settings differ, since bits are then not
expected to agree. `approx` (asked for): each metric by its tolerance: `exact`, or `approx`
(|got - expected| <= atol + rtol * |expected| per step, at most `failing_steps` steps outside,
and |mean residual| <= `mean_residual` over the steps inside: a one-sided drift that stays
within the per-step band still fails), as Megatron-LM's approximate tier and TRL's invariant
tests do. `perf/*` is never compared exactly, in either tier: the run's median over a window of
steps may be at most `max_ratio` times the golden's (Megatron-LM compares iteration time so).

Both tiers refuse a run whose configuration identity differs from the golden's: a golden file
is one configuration's curve. The identity is the resolved config without its I/O settings
(out, steps, record, checkpoint_every, rollouts) and placement (device, threads, deterministic:
the platform and determinism checks cover them; [placement]; how requests reach SGLang servers),
with file paths replaced by the sha256 of their contents, so a checkout elsewhere, a longer run or
the same run on a GPU compares. Settings added later (tp, dp, [train.megatron], [rollout.sglang])
count only when set, so older files keep their identity.

Megatron-LM golden values files (`{"lm loss": {"start_step": 1, ...}}`, no header) are read as
golden input too, as Megatron-LM's functional tests write them (NVIDIA/Megatron-LM,
tests/functional_tests/python_test_utils/common.py `read_tb_logs_as_list`): values keyed by iteration
as strings, on the grid {start_step} + every multiple of step_interval up to end_step, start_step and
end_step the first and last steps held, "nan" at a step its logs had no value for (not compared, and
said so). Approx tier only, with Megatron-LM's own tolerances for its metrics (golden_tolerance.py),
names mapped with `rename`, and Megatron's iteration k (its k-th optimizer step, counted from 1)
compared with rlbench's step k - 1 (its k-th step, counted from 0).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlbench.checks.golden_tolerance import (  # noqa: F401 - re-exported: golden files hold tolerances
    Tolerance,
    apply_override,
    default_tolerance,
    family_of,
    megatron_tolerance,
    parse_override,
    read_tolerance,
)
from rlbench.config_rollout import RolloutConfig
from rlbench.config_sections import AlgoConfig
from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir
from rlbench.rundir.jsonio import read_json

SCHEMA = "rlbench.golden/1"
# A run records the versions of the packages it used (rlbench/session.py `versions`). The exact
# tier needs them equal, except these, recorded only: rlbench's own changes are what the golden check is
# there to catch, and the others store or route values without computing them.
RECORDED_ONLY = ("python", "rlbench", "safetensors", "sglang-router", "ray")
# Left out of the configuration identity: I/O settings ([tracking]: where metrics are also logged), and placement
# (device, threads, deterministic), which the exact tier checks as platform and determinism settings.
IO_KEYS = ("out", "steps", "record", "checkpoint_every", "rollouts", "tracking", "device", "threads", "deterministic")
IO_KEYS += ("placement",)
# How requests reach the SGLang servers and how many there are: a request's result does not depend on
# them (its seed travels with it), so they are left out too.
TRANSPORT_KEYS = (
    "sglang_router_url",
    "external_engine_addrs",
    "num_engines",
    "sglang_server",
    "use_router",
    "max_inflight",
    "request_timeout",
    "request_attempts",
    "verify_engine_weights",
    "weights_dir",
    "sglang_server_concurrency",  # how many slime plugin samples generate at once: never what they compute
    "update_weight_mode",  # full checkpoints or slime's deltas: the same weights reach the servers (issue 38)
    "update_weight_delta_encoding",
    "update_weight_delta_checksum",
    "local_checkpoint_dir",
    "offload",  # the engine's memory let go of between rollouts: the same bits (issue 34)
)
# Settings added after golden files were first made: left out of the identity at their neutral
# value, so the files made before them still name the same configuration.
LATER_KEYS = {
    ("tp",): 1,
    ("dp",): 1,
    ("train", "megatron"): {},
    ("rollout", "sglang"): {},
    ("reward", "group_rm"): False,  # slime's --group-rm (issue 36)
    ("rollout", "async_mode"): "off",  # issue 38
    ("rollout", "max_staleness"): None,
    ("rollout", "update_weights_interval"): 1,
    # slime's options (issue 21), each at the value that computes what rlbench computed before it
    ("algo", "eps_clip_c"): None,
    ("algo", "normalize_advantages"): False,
    ("algo", "per_token_loss"): False,
    ("algo", "use_tis"): False,
    ("algo", "tis_clip"): 2.0,
    ("algo", "tis_clip_low"): 0.0,
    ("data", "apply_chat_template"): True,
    ("data", "chat_template_kwargs"): {},
    ("rollout", "stop_token_ids"): [],
    # memory settings (issue 34): recompute keeps the bits; the offloaded optimizer's update is the CPU's
    ("train", "recompute"): False,
    ("train", "optimizer_cpu_offload"): False,
    # the embedded engine's numerics set apart from the trainer's on purpose (issue 55); PPO's critic (issue 56)
    **{("rollout", k): RolloutConfig().__dict__[k] for k in ("dtype", "quantization", "logprobs", "batch_invariant")},
    ("rollout", "prefix_invariant"): True,
    **{("algo", key): AlgoConfig().__dict__[key] for key in ("gamma", "lambd", "value_clip", "num_critic_only_steps")},
    ("train", "critic_lr"): None,
}
PATH_KEYS = {("model", "path"): "model_config", ("model", "tokenizer"): "tokenizer", ("data", "path"): "dataset"}
TIERS = ("exact", "approx")
MEGATRON_NOTE = (
    "Megatron-LM iteration k (its k-th optimizer step, counted from 1) is compared with rlbench step "
    "k - 1 (its k-th step, counted from 0)"
)


# --------------------------------------------------------------------------- golden files


@dataclass
class Series:
    start_step: int
    end_step: int
    step_interval: int
    values: dict[int, float]
    tolerance: Tolerance
    absent: list[int] = field(default_factory=list)  # steps a Megatron-LM file marks "nan": no value, not compared

    def to_json(self) -> dict:
        return {
            "start_step": self.start_step,
            "end_step": self.end_step,
            "step_interval": self.step_interval,
            "values": {str(s): num_out(v) for s, v in sorted(self.values.items())},
            "tolerance": self.tolerance.to_json(),
        }


@dataclass
class Golden:
    path: Path
    format: str  # "rlbench" or "megatron"
    header: dict
    metrics: dict[str, Series]
    notes: list[str] = field(default_factory=list)  # what reading the file decided, said in the report
    step_offset: int = 0  # the file's own step number is the run's step + step_offset (1 for Megatron-LM)


def num_out(v: float):
    """A value as a golden file (and check golden's JSON report) writes it: a finite number as it is,
    NaN and the infinities as the strings "nan", "inf" and "-inf", which JSON has no numbers for."""
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _num_in(v, path: Path, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise BadInput(f'expected a number or "nan"/"inf"/"-inf", got {_short(v)}', path=path, field=where)
    if isinstance(v, str):
        if v.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
            raise BadInput(f'expected a number or "nan"/"inf"/"-inf", got {_short(v)}', path=path, field=where)
        return float(v)
    return _float(v, path, where)


def _float(v: int | float, path: Path, where: str) -> float:
    try:
        return float(v)
    except OverflowError:
        raise BadInput(f"{_short(v)} is beyond a float's range", path=path, field=where) from None


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _int_in(doc: dict, key: str, path: Path, where: str, minimum: int) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise BadInput(f"expected an integer >= {minimum}, got {_short(v)}", path=path, field=f"{where}.{key}")
    return v


def _shape_in(doc, path: Path, where: str, first: int) -> tuple[int, int, int]:
    """A series' start_step, end_step and step_interval, checked."""
    if not isinstance(doc, dict):
        raise BadInput(
            f"expected an object with start_step, end_step, step_interval, values, got {type(doc).__name__}",
            path=path,
            field=where,
        )
    start = _int_in(doc, "start_step", path, where, first)
    end = _int_in(doc, "end_step", path, where, start)
    return start, end, _int_in(doc, "step_interval", path, where, 1)


def _step_in(key: str, path: Path, where: str) -> int:
    if not re.fullmatch(r"0|[1-9][0-9]{0,30}", key):
        raise BadInput(f"step {_short(key)} is not an integer step", path=path, field=f"{where}.values")
    return int(key)


def _series_in(doc, path: Path, where: str) -> tuple[int, int, int, dict[int, float]]:
    """rlbench's series: values a {step: value} object or a list over the grid start_step, start_step +
    step_interval, ... up to end_step."""
    start, end, interval = _shape_in(doc, path, where, 0)
    raw = doc.get("values")
    grid = range(start, end + 1, interval)
    if isinstance(raw, list):
        size = (end - start) // interval + 1  # len(grid) overflows past sys.maxsize
        if len(raw) != size:
            raise BadInput(
                f"{len(raw)} values for the {size} steps {start}..{end} every {interval}",
                path=path,
                field=f"{where}.values",
            )
        items = list(zip(grid, raw))
    elif isinstance(raw, dict):
        items = []
        for key, v in raw.items():
            step = _step_in(key, path, where)
            if step not in grid:
                raise BadInput(
                    f"step {step} is off the series' grid {start}..{end} every {interval}",
                    path=path,
                    field=f"{where}.values",
                )
            items.append((step, v))
    else:
        raise BadInput(
            f"expected an object of step: value (or a list), got {type(raw).__name__}",
            path=path,
            field=f"{where}.values",
        )
    if not items:
        raise BadInput("no values", path=path, field=f"{where}.values")
    values = {step: _num_in(v, path, f"{where}.values.{step}") for step, v in items}
    return start, end, interval, values


def _megatron_series(doc, path: Path, where: str) -> tuple[int, int, int, dict[int, float], list[int]]:
    """A series as Megatron-LM writes it (common.py `read_tb_logs_as_list`, `GoldenValueMetric`): iterations
    from 1, values an object keyed by iteration, each step either start_step or a multiple of step_interval up
    to end_step, start_step and end_step the first and last steps held, a number or "nan" (no value in its
    logs) at each. Returns (start, end, interval, {step: value}, [steps marked "nan"]), in Megatron's numbers."""
    start, end, interval = _shape_in(doc, path, where, 1)
    raw = doc.get("values")
    if not isinstance(raw, dict) or not raw:
        got = (
            "a list (an older layout that does not say each value's step)"
            if isinstance(raw, list)
            else "an empty object"
            if raw == {}
            else type(raw).__name__
        )
        raise BadInput(
            f"expected an object of step: value, as Megatron-LM writes it, got {got}",
            path=path,
            field=f"{where}.values",
        )
    values, absent = {}, []
    for key, v in raw.items():
        step = _step_in(key, path, where)
        if not (step == start or (start < step <= end and step % interval == 0)):
            raise BadInput(
                f"step {step} is off the series' grid: {start}, then every multiple of {interval} up to {end}",
                path=path,
                field=f"{where}.values",
            )
        value = _megatron_value(v, path, f"{where}.values.{key}")
        if value is None:
            absent.append(step)
        else:
            values[step] = value
    steps = sorted([*values, *absent])
    if (steps[0], steps[-1]) != (start, end):
        raise BadInput(
            f"start_step {_short(start)} and end_step {_short(end)} are not the first and last steps the "
            f"values hold ({steps[0]} and {steps[-1]}), as Megatron-LM writes them",
            path=path,
            field=where,
        )
    return start, end, interval, values, sorted(absent)


def _megatron_value(v, path: Path, where: str) -> float | None:
    """A finite number, or None for "nan": Megatron-LM writes its values with json.dumps(allow_nan=False), and
    the string "nan" where its logs lack a step."""
    if isinstance(v, str) and v.strip().lower() == "nan":
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(_float(v, path, where)):
        raise BadInput(
            f'expected a finite number or "nan" (Megatron-LM\'s mark of a step without a value), got {_short(v)}',
            path=path,
            field=where,
        )
    return float(v)


def is_megatron(doc) -> bool:
    return (
        isinstance(doc, dict)
        and "schema" not in doc
        and bool(doc)
        and all(
            isinstance(v, dict) and {"start_step", "end_step", "step_interval", "values"} <= set(v)
            for v in doc.values()
        )
    )


def load_golden(path: str | Path, rename: dict[str, str] | None = None) -> Golden:
    """Read and validate a golden file: rlbench's, or a Megatron-LM golden values file."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(
            "no such golden file"
            if not path.exists()
            else "is a directory; give the golden file's path"
            if path.is_dir()
            else "not a file",
            path=path,
        )
    doc = read_json(path)
    rename = rename or {}
    names = doc if is_megatron(doc) else doc.get("metrics") if isinstance(doc, dict) else None
    unknown = sorted(set(rename) - set(names if isinstance(names, dict) else {}))
    if isinstance(names, dict) and unknown:
        raise BadInput(
            f"{', '.join(map(repr, unknown))} matches no metric of {path} ({', '.join(names)})", field="--rename"
        )
    if is_megatron(doc):
        return _load_megatron(doc, path, rename)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise BadInput(
            f"expected {SCHEMA!r} (or a Megatron-LM golden values file), got {got!r}", path=path, field="schema"
        )
    header, raw_metrics = doc.get("header"), doc.get("metrics")
    if not isinstance(header, dict):
        raise BadInput("expected an object", path=path, field="header")
    for key in ("platform", "versions", "history"):
        if key not in header:
            raise BadInput("missing", path=path, field=f"header.{key}")
    if not isinstance(header["versions"], dict):
        raise BadInput("expected an object", path=path, field="header.versions")
    if not isinstance(header["history"], list):
        raise BadInput("expected a list", path=path, field="header.history")
    if not isinstance(raw_metrics, dict) or not raw_metrics:
        raise BadInput("expected a non-empty object of metric: series", path=path, field="metrics")
    metrics = {}
    for name, series in raw_metrics.items():
        start, end, interval, values = _series_in(series, path, f"metrics.{name}")
        steps = sorted(values)
        tol = read_tolerance(
            name, series.get("tolerance"), steps, [values[s] for s in steps], path, f"metrics.{name}.tolerance"
        )
        metrics[rename.get(name, name)] = Series(start, end, interval, values, tol)
    return Golden(path, "rlbench", header, metrics)


def _load_megatron(doc: dict, path: Path, rename: dict[str, str]) -> Golden:
    """A Megatron-LM golden values file, its steps renumbered to the run's (iteration k is step k - 1), each
    metric with Megatron-LM's own tolerance (rlbench's family default, said so, for a metric it has none for)."""
    metrics, notes, source = {}, [], {}
    for name, raw in doc.items():
        start, end, interval, values, absent = _megatron_series(raw, path, name)
        target = rename.get(name, name)
        if target in metrics:
            raise BadInput(f"{source[target]!r} and {name!r} would both be compared as {target!r}", field="--rename")
        source[target] = name
        steps = sorted(values)
        tol = megatron_tolerance(name, steps, len(values) + len(absent))
        if tol is None and not steps:
            tol = Tolerance(family=family_of(target)[0])  # nothing to compare: check golden says so, by name
        elif tol is None:
            tol = default_tolerance(target, [s - 1 for s in steps], [values[s] for s in steps])
            notes.append(
                f"{name}: Megatron-LM's comparison has no tolerance for it; rlbench's default for {tol.family} applies"
            )
        elif tol.window is not None:
            tol = replace(tol, window=(tol.window[0] - 1, tol.window[1] - 1))
        if absent:
            notes.append(
                f'{target}: the file holds "nan" (no value in Megatron-LM\'s logs) at {len(absent)} of its '
                f"{len(absent) + len(values)} steps, {_listed(absent)}: not compared"
            )
        metrics[target] = Series(
            start - 1, end - 1, interval, {s - 1: v for s, v in values.items()}, tol, [s - 1 for s in absent]
        )
    platform = re.fullmatch(r"golden_values_(.+?)_(.+)\.json", path.name)
    header = {
        "platform": f"megatron:{platform.group(2)}" if platform else "megatron:unknown",
        "versions": {},
        "config": None,
        "config_hash": None,
        "command": None,
        "reason": "Megatron-LM golden values file",
        "history": [],
        "note": MEGATRON_NOTE,
    }
    return Golden(path, "megatron", header, metrics, notes, step_offset=1)


def _listed(steps: list[int]) -> str:
    """Megatron iterations, as a reader wants them: all of a few, else the first and last."""
    if len(steps) <= 6:
        return f"iteration{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
    return f"iterations {steps[0]}, {steps[1]}, ... {steps[-1]}"


def platform_of(manifest: dict) -> str:
    device = str(manifest.get("device") or manifest.get("config", {}).get("device") or "cpu").split(":")[0]
    return f"{device}-{manifest.get('platform', {}).get('machine') or 'unknown'}"


def config_identity(manifest: dict) -> dict:
    """The run's configuration as far as it shapes the metrics: I/O settings dropped, file paths
    replaced by the sha256 of their contents (so another checkout compares), plus the initial
    weights' checksum, prefixed by its algorithm (a manifest naming none is an older rlbench's: sha256)."""
    config = json.loads(json.dumps(manifest.get("config", {})))
    for key in IO_KEYS:
        config.pop(key, None)
    for key in TRANSPORT_KEYS:
        config.get("rollout", {}).pop(key, None)
    for path, neutral in LATER_KEYS.items():
        *parents, key = path
        table = config
        for parent in parents:
            table = table.get(parent) if isinstance(table, dict) else None
        if isinstance(table, dict) and table.get(key, neutral) == neutral:  # not a table: named as a difference
            table.pop(key, None)
    config.get("model", {}).pop("init", None)  # which weights: the initial weights' checksum below says it exactly
    hashes = manifest.get("hashes", {})
    for (section, key), hash_name in PATH_KEYS.items():
        if key in config.get(section, {}):
            config[section][key] = f"sha256:{hashes.get(hash_name)}"
    config["initial_weights"] = f"{manifest.get('checksum') or 'sha256'}:{hashes.get('initial_weights')}"
    return config


def config_hash(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def run_versions(manifest: dict) -> dict:
    """The package versions a run's manifest records (a copy; none recorded: empty)."""
    return dict(manifest.get("versions") or {})


def exact_versions(versions: dict) -> set[str]:
    """The packages whose versions the exact tier needs equal."""
    return set(versions) - set(RECORDED_ONLY)


def numerics_of(manifest: dict) -> dict:
    """What else decides a CPU run's bits (rlbench/numerics.py): compared in the exact tier."""
    from rlbench.numerics import platform_class

    device = str(manifest.get("device") or manifest.get("config", {}).get("device") or "cpu")
    return platform_class(manifest.get("numerics"), device)


def run_series(run: RunDir) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    for row in run.metrics:
        for name, value in row.items():
            if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            series.setdefault(name, {})[row["step"]] = float(value)
    return series


def same_series(a: dict[int, float], b: dict[int, float]) -> bool:
    """The same steps with the same values bit for bit (same_bits): `golden update` lists a metric whose
    series is not so as changed, and `check golden` notes when every compared series is so."""
    return a.keys() == b.keys() and all(same_bits(a[s], b[s]) for s in a)


def same_bits(a: float, b: float) -> bool:
    """Equal as logged: NaN equals NaN, and 0.0 is not -0.0."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
