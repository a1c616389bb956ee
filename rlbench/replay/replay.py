"""Replay: retrain on a run's recording, with no rollout engine, and verify every stage.

RUN is first verified whole (integrity.py): every recording held to RUN's checksums.jsonl, every checkpoint to the
checksums RUN recorded for it; a missing, edited or damaged file is bad input, before anything is replayed. So the
recorded data..rewards are RUN's own, and their checksums, recomputed from the recording, agree. `replay(RUN)` then
recomputes advantage, logprob and train from the recorded initial weights (or from a checkpoint, for a step range)
and compares each step's checksums with RUN's as it goes. The first stage that differs ends the replay: it is
reported as (step, stage), and the replay's own run directory keeps that step for `rlbench diff`.
`engine_weights` is not compared: a replay starts no engine.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlbench.config import RunConfig, config_from_dict
from rlbench.config_tracking import TrackingConfig
from rlbench.core.loop import Diverged, StepState
from rlbench.session import RunResult, run
from rlbench.errors import BadInput
from rlbench.replay.integrity import open_run
from rlbench.rundir.directory import CHECKSUM_KEYS, RunDir, step_name


@dataclass
class ReplayResult:
    source: str
    out: str
    steps: tuple[int, int]  # [first, last) replayed
    reproduced: int  # steps whose every compared stage matched
    diverged: Diverged | None
    compared_stages: list[str]  # the stages compared at every replayed step
    result: RunResult | None
    comparisons: int = 0  # (step, stage) checksums compared
    checkpoints_verified: list[int] = field(default_factory=list)  # the source's checkpoints (steps done) verified
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.diverged is None


def source_config(source: RunDir) -> RunConfig:
    return config_from_dict(source.manifest["config"], source.root / "manifest.json")


def parse_range(text: str | None, committed: int) -> tuple[int, int]:
    """'A:B' (either side may be empty) -> [A, B) within the committed steps."""
    if text is None:
        return 0, committed
    head, sep, tail = text.partition(":")
    try:
        first = int(head) if head else 0
        last = int(tail) if tail else committed
    except ValueError:
        raise BadInput(f"expected A:B (step numbers), got {text!r}", field="--steps") from None
    if not sep or not 0 <= first < last <= committed:
        raise BadInput(
            f"expected A:B with 0 <= A < B <= {committed} (the committed steps), got {text!r}", field="--steps"
        )
    return first, last


def default_out(source: Path) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return source.parent / f"{source.name}.replay-{stamp}"


def replay(
    run_dir: str | Path,
    out: str | Path | None = None,
    steps: str | None = None,
    on_step: Callable[[StepState], None] | None = None,
) -> ReplayResult:
    opened = open_run(run_dir, recordings="verify", checkpoints="verify", need_steps=True, need_recordings=True)
    source = opened.run
    first, last = parse_range(steps, len(source.steps))
    if source.steps[:last] != list(range(last)):
        raise BadInput(f"committed steps are not 0..{last - 1} in order", path=source.root / "metrics.jsonl")
    init = None
    if first > 0:
        init = source.root / "checkpoints" / step_name(first)
        if not (init / "state.json").is_file():
            have = sorted(p.name for p in (source.root / "checkpoints").iterdir() if p.name.isdigit())
            raise BadInput(
                f"no checkpoint after {first} steps to start from (have: {', '.join(have) or 'none'})", field="--steps"
            )
    out = Path(out) if out is not None else default_out(source.root)
    recorded = source_config(source)
    config = recorded.replace(
        mode="train-only",
        rollouts=str(source.root),
        out=str(out),
        steps=last,
        record=True,
        rollout=without_async(recorded.rollout),
        tracking=TrackingConfig(),  # a replay logs nowhere but its own directory: not into the run's W&B or TensorBoard
    )
    expect = {row["step"]: row for row in source.checksums}
    done, compared = [], []

    def step_done(state: StepState) -> None:
        """Count what `run` compared at this step: the stages both the source and the replay have."""
        stages = [k for k in CHECKSUM_KEYS if k in expect[state.step] and k in state.checksums]
        if not stages:
            raise BadInput(
                f"step {state.step}: the replay and the recording share no checksummed stage",
                path=source.root / "checksums.jsonl",
            )
        done.append(state.step)
        compared.append(stages)
        if on_step is not None:
            on_step(state)

    def common() -> list[str]:
        return [k for k in CHECKSUM_KEYS if all(k in stages for stages in compared)]

    try:
        result = run(config, step_done, start=first, init_checkpoint=init, expect=expect)
    except Diverged as diverged:
        return ReplayResult(
            str(source.root),
            str(out),
            (first, last),
            len(done),
            diverged,
            common(),
            None,
            sum(map(len, compared)),
            opened.checkpoints,
            opened.notes,
        )
    if done != list(range(first, last)):  # every step of the range compared, or no verdict
        raise AssertionError(f"replay compared steps {done}, expected {first}..{last - 1}")
    return ReplayResult(
        str(source.root),
        str(out),
        (first, last),
        len(done),
        None,
        common(),
        result,
        sum(map(len, compared)),
        opened.checkpoints,
        opened.notes,
    )


def recorded_overrides(config: RunConfig, recorded: RunConfig) -> list[str]:
    """The settings of `config` a train-only run takes from the recording instead, where they differ."""
    out = []
    for section in ("model", "data", "rollout", "reward"):
        mine, theirs = getattr(config, section).__dict__, getattr(recorded, section).__dict__
        out += [
            f"{section}.{key}: the recording's {theirs[key]!r}, not {mine[key]!r}"
            for key in mine
            if mine[key] != theirs.get(key)
        ]
    return out


def train_only_config(config: RunConfig, rollouts: str | Path, steps: int | None) -> RunConfig:
    """`run --mode train-only --rollouts RUN`: the trainer and algorithm are this config's; what was
    recorded (model, tokenizer, data, sampling) is the recording's, and so is the step count unless
    `steps` asks for fewer (`recorded_overrides` names what that changes)."""
    source = open_run(rollouts, recordings="verify", checkpoints="present", need_steps=False, need_recordings=True).run
    recorded = source_config(source)
    committed = len(source.steps)
    if steps is not None and steps > committed:
        raise BadInput(f"the recording has {committed} committed steps, --steps asks for {steps}", field="--steps")
    if committed == 0:
        raise BadInput("the recording has no committed step", path=source.root / "metrics.jsonl")
    return config.replace(
        mode="train-only",
        rollouts=str(source.root),
        steps=steps or committed,
        model=recorded.model,
        data=recorded.data,
        rollout=without_async(recorded.rollout),
        reward=recorded.reward,
    )


def without_async(rollout):
    """A recording's rollout settings for a train-only run over it: its samples are recorded, so how far ahead
    they were generated (--async) is history, kept in its samples' metadata, not a setting of the replay."""
    from dataclasses import replace

    return replace(rollout, async_mode="off", max_staleness=None, update_weights_interval=1)
