"""One integrity check of a run directory, read the same way by every command that judges a run.

Replay, diff, resume, every check and the report open a run through `open_run`, so one damage gets one answer,
exit 2 naming the file, from each of them:

- the manifest and both logs are there (`metrics.jsonl` is the commit log; without it a run has no steps, which
  is not the same as a run that committed none), and every committed step has its `checksums.jsonl` line with a
  checksum for each stage the run records (RunDir.require_checksums);
- the committed steps are consecutive (0..N-1, or A..B-1 for a replay of a range);
- every committed step of a recorded run has its recording (rollouts/NNNNNN.safetensors and .json), read and held
  to the checksums checksums.jsonl gives for it (`recordings="verify"`: the recording's own digests, its token ids
  to the run's vocabulary, then the checksums its tensors determine), or only seen to be there (`"present"`,
  for a reader that never opens it: `check golden` compares metrics only, and imports no torch);
- every checkpoint the run's schedule wrote for its committed steps (the initial weights, every
  `checkpoint_every` steps, the last step) is there (`checkpoints="present"`), or also held to the checksums the
  run recorded for it (`"verify"`, checkpoints.py: for readers that load them). The one checkpoint a run stopped
  by a crash may lack, after its last committed step, is said in a note, not refused: `--resume` writes it.

Zero committed steps is refused here (`need_steps`), since no verdict may speak for nothing; `diff` asks for a
side that may be empty, since a run with steps and one without differ. A directory whose checksums.jsonl is gone
is refused by every command alike: nothing could be verified, so nothing is judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlbench.config import RunConfig, config_from_dict
from rlbench.errors import BadInput
from rlbench.replay.checkpoints import DAMAGED, verify_checkpoints
from rlbench.rundir.directory import RunDir, read_run, step_name

Depth = Literal["verify", "present"]
# A reader of metrics only (check golden, golden update): the rest of the run is seen whole, not read (no torch).
METRICS_ONLY = {"recordings": "present", "checkpoints": "present", "need_steps": True, "need_recordings": False}


@dataclass
class Integrity:
    """A run as its reader may use it, with what was verified on the way."""

    run: RunDir
    recordings: int = 0  # committed steps whose recording was read and held to checksums.jsonl
    recordings_present: int = 0  # committed steps whose recording was seen to be there, not read
    checkpoints: list[int] = field(default_factory=list)  # checkpoints (steps done) held to the run's checksums
    checkpoints_present: list[int] = field(default_factory=list)  # checkpoints seen whole (state.json), not read
    notes: list[str] = field(default_factory=list)


def open_run(
    path: str | Path, *, recordings: Depth, checkpoints: Depth, need_steps: bool, need_recordings: bool
) -> Integrity:
    """Read the run at `path` and verify it as the module docstring says; any defect is BadInput naming the file.
    Each reader says how deep it verifies (no default: a reader chooses); `need_steps`: a run that committed no
    step cannot be judged; `need_recordings`: the reader judges the recording, so a run made with --no-record
    cannot be judged."""
    run = read_run(path)
    root = run.root
    if not (root / "metrics.jsonl").is_file():
        raise BadInput(
            "missing: the run's commit log (metrics.jsonl); the run directory is damaged and cannot be judged",
            path=root / "metrics.jsonl",
        )
    run.require_checksums()  # a checksum for every stage of every committed step
    if not (root / "checksums.jsonl").is_file():  # and the log itself, where no step was committed
        raise BadInput(
            "missing: the checksums that verify the run's steps; the run directory is damaged and cannot be judged",
            path=root / "checksums.jsonl",
        )
    if need_steps and not run.steps:
        raise BadInput("no committed step: nothing to judge (undetermined)", path=root / "metrics.jsonl")
    steps = run.steps
    if steps and steps != list(range(steps[0], steps[0] + len(steps))):
        raise BadInput("committed steps are not consecutive (an edited log)", path=root / "metrics.jsonl")
    found = Integrity(run, notes=list(run.notes))
    config = config_from_dict(run.manifest["config"], root / "manifest.json")
    recorded = config.record
    if not recorded and need_recordings:
        raise BadInput("the run was made with --no-record: it holds no recording to judge", path=root / "rollouts")
    if recorded and steps:
        _recordings(found, recordings)
    if run.manifest["mode"] != "rollout-only" and steps:
        _checkpoints(found, checkpoints, config)
    return found


def _recordings(found: Integrity, depth: Depth) -> None:
    run, root = found.run, found.run.root
    if not (root / "rollouts").is_dir():
        raise BadInput(
            f"missing: the recording of {len(run.steps)} committed steps is not there", path=root / "rollouts"
        )
    if depth == "present":
        for step in run.steps:
            for suffix in ("safetensors", "json"):
                path = root / "rollouts" / f"{step_name(step)}.{suffix}"
                if not path.is_file():
                    raise BadInput(f"missing: the recording of committed step {step} is not there", path=path)
        found.recordings_present = len(run.steps)
        return
    from rlbench.core.loop import RECORDED_DIGESTS, recorded_checksums
    from rlbench.core.vocab import run_vocab
    from rlbench.rundir.recording import read_step

    rows = {row["step"]: row for row in run.checksums}
    vocab = run_vocab(run.manifest, root / "manifest.json")
    for step in run.steps:
        tensors, _ = read_step(root, step)
        if vocab is not None:  # an id the model cannot have sampled is a damaged file, whatever its checksums say
            vocab.check(tensors, root / "rollouts" / f"{step_name(step)}.safetensors")
        recorded = recorded_checksums(tensors)
        lacking = [key for key in RECORDED_DIGESTS if key in rows[step] and key not in recorded]
        if lacking:  # checksummed, so written: a recording without it is not the one the run wrote
            raise BadInput(
                f"the recording of step {step} lacks what checksums.jsonl records at {', '.join(lacking)} (an "
                "edited or mixed-up file)",
                path=root / "rollouts" / f"{step_name(step)}.safetensors",
            )
        for key, digest in recorded.items():
            if key in rows[step] and rows[step][key] != digest:
                raise BadInput(
                    f"the recording of step {step} does not match checksums.jsonl at {key} (an edited or "
                    "mixed-up file)",
                    path=root / "rollouts" / f"{step_name(step)}.safetensors",
                )
    found.recordings = len(run.steps)


def due_checkpoints(steps: list[int], every: int, total: int) -> list[int]:
    """The checkpoints (steps done) the loop wrote for committed `steps` of a run of `total` steps checkpointing
    `every` steps: the initial weights when the run began at step 0, then every `every` steps done and after the
    run's last step (core/loop.py, `record`)."""
    due = [0] if steps[0] == 0 else []
    return due + [s + 1 for s in steps if (s + 1) % every == 0 or s + 1 == total]


def _checkpoints(found: Integrity, depth: Depth, config: RunConfig) -> None:
    run, root = found.run, found.run.root
    last = run.steps[-1] + 1
    complete = last == config.steps
    for done in due_checkpoints(run.steps, config.checkpoint_every, config.steps):
        path = root / "checkpoints" / step_name(done)
        if (path / "state.json").is_file():
            found.checkpoints_present.append(done)
        elif path.is_dir():
            raise BadInput(f"not a whole checkpoint (no state.json): {DAMAGED}", path=path)
        elif done == last and not complete:  # the loop commits a step before its checkpoint: a crash between
            found.notes.append(f"{path}: not there (the run stopped before writing it; --resume writes it)")
        else:
            raise BadInput(f"missing: the checkpoint after {done} steps is not there (a damaged run)", path=path)
    if depth == "verify":
        verified = verify_checkpoints(run)
        found.checkpoints, found.checkpoints_present = verified.steps_done, []
        found.notes += verified.notes
