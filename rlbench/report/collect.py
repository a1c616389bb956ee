"""What the report shows, gathered from run directories into plain data (no HTML here).

Everything comes from the run directory's own files, read one step at a time: metrics.jsonl and
checksums.jsonl, the manifest, and the recordings (each verified against its digest as it is read),
so a long run's recordings are never all in memory. The verdicts are rlbench's own: `diff` for where
two runs part, `check logprobs` for the train-inference mismatch, `check tito` for token drift,
`check golden` for the curves; each says how many items it compared, and one that could not judge
says so ("undetermined"), never "passed".
"""

from __future__ import annotations

import math
from pathlib import Path

from rlbench.errors import BadInput
from rlbench.rundir import recording
from rlbench.rundir.directory import RunDir

# |delta| bins of the mismatch histogram (besides exactly 0 and above the last): one per decade up to 10.
EDGES = [10.0**k for k in range(-9, 2)]
STEP_BUDGET = 2_000  # the mismatch section reads at most about this many steps' recordings (evenly spread)
TITO_SAMPLE_BUDGET = 20_000  # check tito on the page only up to this many samples (the command checks any number)
WORST = 12
MANIFEST_KEYS = (
    "created",
    "command",
    "mode",
    "seed",
    "device",
    "device_name",
    "stages",
    "reward_fn",
    "weights",
    "vocab",
    "versions",
    "determinism",
    "numerics",
    "platform",
)


def collect(
    run_a: str | Path,
    run_b: str | Path | None = None,
    golden: str | Path | None = None,
    rename: dict[str, str] | None = None,
    tier: str = "approx",
    ignore: list[str] = (),
) -> dict:
    """The page's data for run A (and B, and a golden file): plain, JSON-safe values."""
    from rlbench.replay.integrity import open_run

    # each run verified as every command verifies it (integrity.py): the page shows no verdict over a damaged run;
    # its recordings are read (the mismatch, TITO), its checkpoints not
    READ = {"recordings": "verify", "checkpoints": "present", "need_steps": True, "need_recordings": False}
    a = open_run(run_a, **READ).run
    b = open_run(run_b, **READ).run if run_b is not None else None
    data = {
        "runs": [_run_summary(a)] + ([_run_summary(b)] if b else []),
        "verdicts": [],
        "metrics": _series(a, b),
        "timings": _timings(a, b),
    }
    data["mismatch"] = _mismatch(a, data["verdicts"])
    data["tito"] = _tito(a, data["verdicts"])
    data["divergence"] = _divergence(a, b, data["verdicts"]) if b is not None else None
    data["golden"] = _golden(a, golden, rename, tier, ignore, data["verdicts"]) if golden is not None else None
    return data


def _run_summary(run: RunDir) -> dict:
    manifest = run.manifest
    return {
        "path": str(run.root),
        "steps": len(run.steps),
        "last_step": run.steps[-1],
        "manifest": {key: manifest.get(key) for key in MANIFEST_KEYS},
        "notes": list(run.notes),
    }


def _metric_rows(run: RunDir) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for row in run.metrics:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((row["step"], float(value)))
    return series


def _series(a: RunDir, b: RunDir | None) -> dict:
    """Each metric's values by step, A's and B's (perf/* apart: see `_timings`)."""
    rows_a, rows_b = _metric_rows(a), _metric_rows(b) if b else {}
    names = sorted(k for k in set(rows_a) | set(rows_b) if not k.startswith("perf/"))
    return {name: {"a": rows_a.get(name, []), "b": rows_b.get(name, [])} for name in names}


def _timings(a: RunDir, b: RunDir | None) -> dict:
    rows_a, rows_b = _metric_rows(a), _metric_rows(b) if b else {}
    names = sorted(k for k in set(rows_a) | set(rows_b) if k.startswith("perf/") and k.endswith("_time"))
    return {name: {"a": rows_a.get(name, []), "b": rows_b.get(name, [])} for name in names}


def _mismatch(run: RunDir, verdicts: list) -> dict:
    """The train-inference log-prob mismatch as `check logprobs` measures it, in one pass over the
    recordings: its statistics, its worst tokens, and a histogram of |trainer - rollout| over every
    judged token (removed samples and samples without engine log-probs left out, and counted)."""
    from rlbench.checks.logprobs import check_logprobs

    labels = ["0"] + [f"<=1e{k}" for k in range(-9, 2)] + [">10 or not finite"]
    if run.manifest.get("mode") == "rollout-only" or (
        run.steps and "old_logprobs" not in recording.read_step(run.root, run.steps[0])[0]
    ):
        verdicts.append(
            {
                "check": "check logprobs",
                "verdict": "undetermined",
                "detail": "the recording holds no trainer log-probs (a rollout-only or imported run); "
                "`rlbench check logprobs --recompute` recomputes them",
            }
        )
        return {"tokens": 0, "counts": [0] * len(labels), "labels": labels, "stats": {}, "worst": []}
    steps = run.steps
    stride = math.ceil(len(steps) / STEP_BUDGET)
    if stride > 1:  # a long run: every stride-th step (and the last), said on the page
        steps = sorted(set(steps[::stride]) | {steps[-1]})
    report = check_logprobs(run.root, top=WORST, edges=EDGES, steps=steps, per_step=False)
    stats = {k: v for k, v in report.stats.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    left = [
        f"{n} {what}"
        for n, what in ((report.removed, "removed"), (report.without_logprobs, "without engine log-probs"))
        if n
    ]
    over = (
        f"{len(report.steps)} steps"
        if stride == 1
        else f"{len(report.steps)} of {len(run.steps)} steps (every {stride}th and the last: "
        "`rlbench check logprobs` reads all)"
    )
    verdicts.append(
        {
            "check": "check logprobs",
            "verdict": "measured",
            "detail": f"{report.tokens} tokens of {report.samples} samples over {over} compared"
            + (f" ({', '.join(left)} samples left out)" if left else "")
            + "; no gate set: `rlbench check logprobs --max-mean ...` gates",
        }
    )
    worst = [
        {
            "step": w.step,
            "sample": w.sample,
            "token": w.response_token,
            "id": w.token_id,
            "text": w.text,
            "context": w.context,
            "trainer": w.trainer,
            "rollout": w.rollout,
            "delta": w.delta,
        }
        for w in report.worst
    ]
    return {
        "tokens": report.tokens,
        "counts": report.histogram,
        "labels": labels,
        "stats": stats,
        "worst": worst,
        "notes": list(report.notes),
        "steps": len(report.steps),
        "of": len(run.steps),
        "per_lag": report.per_lag,  # an async run's mismatch by policy lag
    }


def _tito(run: RunDir, verdicts: list) -> dict:
    """`check tito` over the run's samples (up to TITO_SAMPLE_BUDGET; the command itself checks any number)."""
    config = run.manifest.get("config") or {}
    per_step = (config.get("data") or {}).get("prompts_per_step", 0) * (config.get("rollout") or {}).get(
        "n_samples_per_prompt", 0
    )
    samples = len(run.steps) * per_step
    if samples > TITO_SAMPLE_BUDGET:
        verdicts.append(
            {
                "check": "check tito",
                "verdict": "undetermined",
                "detail": f"not run for the page: {samples} samples, more than {TITO_SAMPLE_BUDGET}; "
                f"`rlbench check tito {run.root}` checks them all",
            }
        )
        return {"ran": False, "findings": []}
    from rlbench.checks.tito_run import check_run

    report = check_run(run.root)
    findings = [
        {
            "step": f.step,
            "sample": f.sample,
            "where": f.where,
            "mode": f.finding.mode,
            "index": f.finding.index,
            "context": f.finding.context_text,
            "expected": f.finding.expected[:12],
            "got": f.finding.got[:12],
            "expected_text": f.finding.expected_text,
            "got_text": f.finding.got_text,
        }
        for f in report.findings[:20]
    ]
    verdict = (
        "drift"
        if report.findings
        else ("no drift" if report.compared == report.samples and report.samples else "undetermined")
    )
    verdicts.append(
        {
            "check": "check tito",
            "verdict": verdict,
            "detail": f"{report.compared} of {report.samples} samples held to the engine's ids "
            f"({report.lens} lens), {len(report.findings)} findings",
        }
    )
    return {
        "ran": True,
        "samples": report.samples,
        "compared": report.compared,
        "lens": report.lens,
        "findings": findings,
        "notes": list(report.notes),
    }


def _divergence(a: RunDir, b: RunDir, verdicts: list) -> dict | None:
    """Where `rlbench diff` says the runs part, and the first differing sample's two id sequences."""
    from rlbench.replay.diff import diff

    result = diff(a.root, b.root)
    if result.first is None:
        verdicts.append(
            {
                "check": "diff",
                "verdict": "no difference",
                "detail": f"{result.comparisons} (step, stage) checksums compared over "
                f"{len(result.steps_compared)} steps",
            }
        )
        return None
    first = result.first
    verdicts.append(
        {
            "check": "diff",
            "verdict": "differ",
            "detail": f"first at step {first.step}, stage {first.stage}: {first.where} "
            f"(after {result.comparisons} comparisons)",
        }
    )
    out = {
        "step": first.step,
        "stage": first.stage,
        "where": first.where,
        "max_abs": first.max_abs,
        "count": first.count,
        "sample": None,
    }
    sample = _sample_of(first.where)
    if sample is not None and first.step in a.steps and first.step in b.steps:
        out["sample"] = _two_samples(a, b, first.step, sample)
    return out


def _sample_of(where: str) -> int | None:
    words = where.replace(",", " ").split()
    if "sample" in words and words.index("sample") + 1 < len(words) and words[words.index("sample") + 1].isdigit():
        return int(words[words.index("sample") + 1])
    return None


def _two_samples(a: RunDir, b: RunDir, step: int, sample: int) -> dict:
    """Sample `sample` of `step` in both runs: ids, each id's text, and its log-probs, aligned by position."""
    sides = []
    for run in (a, b):
        tensors, _ = recording.read_step(run.root, step)
        lo, hi = int(tensors["offsets"][sample]), int(tensors["offsets"][sample + 1])
        prompt = int(tensors["prompt_lengths"][sample]) if "prompt_lengths" in tensors else 0
        sides.append(
            {
                "ids": tensors["tokens"][lo:hi].tolist(),
                "prompt": prompt,
                "logprobs": tensors["rollout_logprobs"][lo:hi].tolist(),
            }
        )
    texts = _token_texts(a, sides[0]["ids"] + sides[1]["ids"])
    for side in sides:
        side["text"] = [texts.get(t, "") for t in side["ids"]]
    width = max(len(sides[0]["ids"]), len(sides[1]["ids"]))
    differ = [
        i
        for i in range(width)
        if i >= len(sides[0]["ids"])
        or i >= len(sides[1]["ids"])
        or sides[0]["ids"][i] != sides[1]["ids"][i]
        or sides[0]["logprobs"][i] != sides[1]["logprobs"][i]
    ]
    return {"index": sample, "a": sides[0], "b": sides[1], "differ": differ}


def _token_texts(run: RunDir, ids: list[int]) -> dict[int, str]:
    """Each id's own text with the run's tokenizer ({} when it cannot be loaded: the ids still show); a padded
    id (core/vocab.py: no text) as `<padded id N>`."""
    tokenizer_dir = ((run.manifest.get("config") or {}).get("model") or {}).get("tokenizer")
    try:
        from rlbench.core.model import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
    except (BadInput, TypeError):
        return {}
    from rlbench.core.vocab import run_vocab

    vocab = run_vocab(run.manifest, run.root / "manifest.json", tokenizer)
    return {t: vocab.text(tokenizer, [t]) for t in set(ids)}


def _golden(
    run: RunDir, path: str | Path, rename: dict[str, str] | None, tier: str, ignore: list[str], verdicts: list
) -> dict:
    """`check golden`: each metric's expected values, its band, and the steps outside it."""
    from rlbench.checks.golden import load_golden
    from rlbench.checks.golden_compare import compare

    report = compare(run, load_golden(path, rename), tier=tier, ignore=list(ignore))
    failed = [m.name for m in report.failed]
    verdicts.append(
        {
            "check": f"check golden ({tier})",
            "verdict": "failed" if failed else "passed",
            "detail": f"{len(report.metrics) - len(failed)} of {len(report.metrics)} metrics within "
            f"tolerance"
            + (f"; failing: {', '.join(failed)}" if failed else "")
            + (f"; not compared: {', '.join(report.ignored)}" if report.ignored else ""),
        }
    )
    return {
        "path": str(path),
        "tier": tier,
        "metrics": {
            m.name: {
                "status": m.status,
                "expected": sorted(m.expected.items()),
                "failing": [f.step for f in m.failures],
                "band": _band(m.band, m.expected),
            }
            for m in report.metrics
        },
    }


def _band(tolerance: dict, expected: dict[int, float]) -> list[tuple[int, float, float]]:
    """The golden's approx tolerance around each expected value, as (step, low, high); [] for other kinds."""
    if tolerance.get("kind") != "approx":
        return []
    return [
        (s, e - tolerance["atol"] - tolerance["rtol"] * abs(e), e + tolerance["atol"] + tolerance["rtol"] * abs(e))
        for s, e in sorted(expected.items())
        if math.isfinite(e)
    ]
