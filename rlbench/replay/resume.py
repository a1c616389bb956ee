"""Resume: continue a killed run from its last checkpoint and its last committed step.

The run directory is first cut back to what was committed: torn or uncommitted log lines,
rollouts of uncommitted steps, and half-written temporaries are removed (and listed). The loop
then restarts from the newest checkpoint at or before the last committed step; the committed
steps after that checkpoint are recomputed and verified against their recorded checksums (a
free determinism check) but not rewritten, and the run goes on from there. The result is the
same bytes as a run that was never interrupted (`perf/*` aside).

Extending (`steps`, the CLI's `--resume RUN --steps N`): a run of M recorded steps goes on to N > M, and ends the
same bytes as a run of N steps from the start (checksums.jsonl byte for byte; the manifest's config says N). That
holds because nothing a step computes reads the total: the learning rate is constant (no warmup or decay over
`steps`), the data cursor is a pure function of (seed, step), every seed is derived from (seed, purpose, step,
sample), and the async schedule (core/pipeline.py) plans each step's groups alike, stopping only at the total. The
one file the total changes is the checkpoint after the last step, which the shorter run wrote and the longer one
keeps (the extension restarts from it). The manifest's `steps` is rewritten first, so an extension that is killed
resumes to N with a plain `--resume`; one refused before any new step commits puts the old manifest back. A run is
never shortened: N below the recorded steps is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlbench.config import RunConfig
from rlbench.core.loop import StepState
from rlbench.session import RunResult, run
from rlbench.errors import BadInput
from rlbench.rundir.failpoints import hit
from rlbench.replay.integrity import open_run
from rlbench.replay.replay import source_config
from rlbench.rundir.directory import RunDir, foreign_entries, read_run, step_name
from rlbench.rundir.writes import atomic_write
from rlbench.rundir.lock import RunLock


@dataclass
class ResumeResult:
    run_dir: str
    committed: int  # steps committed when resume began
    checkpoint: int  # steps done by the checkpoint it restarted from
    discarded: list[str] = field(default_factory=list)
    result: RunResult | None = None  # None: the run was already complete
    extended_from: int | None = None  # the steps the run was started with, where `steps` extended it


def _committed_prefix(path: Path, steps: set[int]) -> bytes:
    """The bytes of the log's complete lines whose step is committed, unchanged."""
    keep = []
    for line in path.read_bytes().split(b"\n")[:-1]:
        if json.loads(line)["step"] in steps:
            keep.append(line + b"\n")
    return b"".join(keep)


def cut_back(root: Path, committed: int) -> list[str]:
    """Remove everything past the committed steps; return what was removed."""
    import shutil

    removed = []
    steps = set(range(committed))
    for log in ("metrics.jsonl", "checksums.jsonl"):
        path = root / log
        kept = _committed_prefix(path, steps) if path.exists() else b""
        if not path.exists() or kept != path.read_bytes():
            removed.append(f"{log}: lines past step {committed - 1}")
            atomic_write(path, kept)
    for path in sorted((root / "rollouts").iterdir()) if (root / "rollouts").is_dir() else []:
        stem = path.name.split(".")[0]
        if path.name.startswith(".") or not stem.isdigit() or int(stem) >= committed:
            removed.append(f"rollouts/{path.name}")
            path.unlink()
    for path in sorted((root / "checkpoints").iterdir()) if (root / "checkpoints").is_dir() else []:
        if path.name.startswith(".") or not (path / "state.json").is_file() or int(path.name) > committed:
            removed.append(f"checkpoints/{path.name}")
            shutil.rmtree(path)
    for path in root.glob(".*.tmp"):
        removed.append(path.name)
        path.unlink()
    return removed


def resume(
    run_dir: str | Path, on_step: Callable[[StepState], None] | None = None, steps: int | None = None
) -> ResumeResult:
    """Continue the run at `run_dir`, holding its lock from the first look to the last write; with `steps`, to
    that many steps (module docstring: extending)."""
    with RunLock(run_dir):
        return _resume(Path(run_dir), on_step, steps)


def _extend(root: Path, config: RunConfig, steps: int) -> RunConfig:
    """The run's config with `steps` steps, written into its manifest: a run is extended, never shortened."""
    if steps < config.steps:
        raise BadInput(
            f"{steps} is fewer than the run's {config.steps} steps; --resume --steps extends a run, never shortens it",
            field="--steps",
        )
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["config"]["steps"] = steps
    atomic_write(root / "manifest.json", (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return config.replace(steps=steps)


def _resume(run_dir: Path, on_step: Callable[[StepState], None] | None, steps: int | None) -> ResumeResult:
    if not (run_dir / "manifest.json").is_file():
        read_run(run_dir)  # the reader's own error
    foreign = foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise BadInput(
            f"holds what rlbench did not write: {shown}. Resume writes and deletes only inside a run "
            "directory of its own making; move these away first",
            path=run_dir,
        )
    # the whole directory verified first: a damaged run is refused, never "already complete"; the committed steps
    # it recomputes are then verified by their checksums
    source = open_run(run_dir, recordings="verify", checkpoints="present", need_steps=False, need_recordings=False).run
    root = source.root
    committed = len(source.steps)
    if source.steps != list(range(committed)):
        raise BadInput("committed steps are not 0..N-1 in order; cannot resume", path=root / "metrics.jsonl")
    config = source_config(source)
    if config.out is None or Path(config.out).resolve() != root.resolve():
        config = config.replace(out=str(root))
    before, recorded = (root / "manifest.json").read_bytes(), config.steps
    if steps is not None and steps != recorded:
        config = _extend(root, config, steps)
    if committed >= config.steps:
        return ResumeResult(str(root), committed, committed)
    try:  # from the manifest's rewrite on: an extension refused before it adds a step puts the old one back
        start, discarded, result = _go_on(source, config, committed, on_step)
    except BaseException:
        if config.steps != recorded and len(read_run(root).steps) == committed:
            atomic_write(root / "manifest.json", before)
        raise
    extended = recorded if config.steps != recorded else None
    return ResumeResult(str(root), committed, start, discarded, result, extended)


def _go_on(source: RunDir, config: RunConfig, committed: int, on_step) -> tuple[int, list[str], RunResult]:
    """Cut the run back to its committed steps and run on from the newest checkpoint at or before them:
    (the step it restarted from, what was cut, the run's result)."""
    root = source.root
    discarded = cut_back(root, committed)
    hit("resume.cut_back")
    checkpoints = [int(p.name) for p in (root / "checkpoints").iterdir() if p.name.isdigit()]
    start = committed if config.mode == "rollout-only" else max([c for c in checkpoints if c <= committed], default=0)
    if config.rollout.async_mode != "off":  # the groups in flight at a checkpoint were generated by older weights
        start = 0  # than it holds: an async run is recomputed from its start (verified), then goes on
    init = root / "checkpoints" / step_name(start) if start > 0 and config.mode != "rollout-only" else None
    expect = {row["step"]: row for row in source.checksums}
    result = run(config, on_step, start=start, init_checkpoint=init, expect=expect, write_from=committed, resume=True)
    return start, discarded, result
