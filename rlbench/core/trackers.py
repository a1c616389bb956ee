"""Each committed step's metrics mirrored to Weights & Biases and TensorBoard, as slime logs them
(THUDM/slime 624b824a: slime/observability/logging_utils.py, wandb_utils.py, tensorboard_utils.py).

What is logged is the step's metrics.jsonl line, the same values under the same names (slime's: `train/loss`,
`rollout/raw_reward`, `perf/step_time`, ...), handed over by the run writer after the line is on disk: a crash never
logs a step that was not committed, and a resumed run logs only the steps it commits (the ones it recomputes and
verifies were logged the first time). Logging reads the metrics and nothing else, so a run computes and writes the
same bytes with or without it.

slime's step axes: `train/*` at `train/step`, everything else at `rollout/step` (W&B's `define_metric`, slime's
`_init_wandb_common`; TensorBoard's `add_scalar(key, value, step)`). slime logs train metrics per optimizer step, at
rollout_id * num_steps_per_rollout + step_id; rlbench's train metrics are the step's means over its optimizer steps,
logged at its first, `step * train.minibatches`. `rollout/step` is the step (the rollout id), or that same train step
under --wandb-always-use-train-step (slime's `compute_rollout_step`).

Where, as slime: W&B in `--wandb-dir` (default ./wandb, or WANDB_DIR), mode `--wandb-mode` (else WANDB_MODE), the
group `--wandb-group` (default: the run directory's name) with a suffix and the name `GROUP-RANK_0`; TensorBoard in
TENSORBOARD_DIR, else tensorboard_log/PROJECT/EXPERIMENT under the working directory. slime's random parts are drawn
from the run directory instead, so that `--resume` continues the same W&B run (its id, resumed with resume="allow";
offline, `wandb sync` joins the two local directories into it) and the same TensorBoard directory (the experiment name
defaults to the run's start time, from its manifest). The libraries are imported only when chosen; a missing one is
named, with the extra that installs it, before anything is loaded (`check`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import socket
import os
from pathlib import Path
from typing import Any

from rlbench.config import RunConfig
from rlbench.errors import BadInput
from rlbench.extras import require
from rlbench.rundir.directory import RunWriter
from rlbench.rundir.jsonio import read_bytes

WANDB_EXTRA = "pip install 'rlbench[wandb]'"
TENSORBOARD_EXTRA = "pip install 'rlbench[tensorboard]'"
# slime's wandb_utils._init_wandb_common: each family's x axis
STEP_METRICS = {
    "train/*": "train/step",
    "rollout/*": "rollout/step",
    "multi_turn/*": "rollout/step",
    "passrate/*": "rollout/step",
    "eval/*": "eval/step",
    "perf/*": "rollout/step",
}


def check(config: RunConfig) -> None:
    """The trackers `config` chooses can run here: their libraries are installed, and they know where to write
    (BadInput naming the setting, before anything is loaded or written)."""
    tracking = config.tracking
    if not tracking.on:
        return
    if not config.out:
        raise BadInput("W&B and TensorBoard log the steps a run directory commits: give --out", field="tracking")
    if tracking.use_wandb:
        require("wandb", WANDB_EXTRA, "tracking.use_wandb")
    if tracking.use_tensorboard:
        require("tensorboard", TENSORBOARD_EXTRA, "tracking.use_tensorboard")
        if tracking.tb_project_name is None and not os.environ.get("TENSORBOARD_DIR"):
            raise BadInput(
                "--use-tensorboard needs --tb-project-name, or TENSORBOARD_DIR set (slime requires the same)",
                field="tracking.tb_project_name",
            )
    out = Path(config.out).resolve()
    for name, where in (("tracking.wandb_dir", tracking.wandb_dir), ("TENSORBOARD_DIR", _tensorboard_env(tracking))):
        if where is not None and Path(where).resolve().is_relative_to(out):
            raise BadInput(
                f"{where} is inside the run directory, which holds rlbench's own files only: choose another", field=name
            )


def attach(config: RunConfig, writer: RunWriter | None) -> None:
    """Open the trackers `config` chooses, and have `writer` hand them each line it commits (and close them)."""
    if writer is None or not config.tracking.on:
        return
    manifest = json.loads(read_bytes(writer.root / "manifest.json"))
    created = manifest.get("created")
    run_id = run_key(manifest, writer.root)
    tracking = config.tracking
    wandb_run = _wandb(config, writer.root, run_id) if tracking.use_wandb else None
    try:
        tensorboard = _tensorboard(config, created) if tracking.use_tensorboard else None
    except BaseException:
        if wandb_run is not None:
            wandb_run.finish()
        raise
    writer.on_commit = Trackers(config.train.minibatches, tracking.wandb_always_use_train_step, wandb_run, tensorboard)


def run_key(manifest: dict, root: Path | None = None) -> str:
    """The run directory's own id, 16 hex digits: from what its manifest fixes when the directory is made (its
    start time, its --out, the machine), which neither --resume nor extending a run (a new `steps`) rewrites; two
    runs started at once differ by their --out. With `root`, the directory itself stands for --out (which is kept
    as typed: `runs/a` in two working directories, or on two hosts, is two runs), with the host's name."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    out = config.get("out") if root is None else [str(Path(root).resolve()), socket.gethostname()]
    fixed = [manifest.get("created"), out, manifest.get("platform")]
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


class Trackers:
    """The open trackers: `committed(line)` logs a committed step's metrics.jsonl line; `close()` ends the run."""

    def __init__(self, minibatches: int, always_train_step: bool, wandb_run: Any, tensorboard: Any) -> None:
        self.minibatches, self.always_train_step = minibatches, always_train_step
        self.wandb_run, self.tensorboard = wandb_run, tensorboard

    def steps(self, step: int) -> tuple[int, int]:
        """(rollout/step, train/step) of rlbench's step `step`."""
        train_step = step * self.minibatches
        return (train_step if self.always_train_step else step), train_step

    def committed(self, line: dict) -> None:
        """Log one committed line; a tracker that fails stops the run in one line (the step stays committed)."""
        metrics = {key: value for key, value in line.items() if key != "step"}
        rollout_step, train_step = self.steps(line["step"])
        if self.wandb_run is not None:
            try:
                self.wandb_run.log({**metrics, "rollout/step": rollout_step, "train/step": train_step})
            except Exception as exc:  # noqa: BLE001 - W&B's own errors, said in one line
                raise BadInput(f"W&B could not log step {line['step']}: {exc}", field="tracking.use_wandb") from None
        if self.tensorboard is not None:
            try:
                for key, value in metrics.items():
                    self.tensorboard.add_scalar(key, value, train_step if key.startswith("train/") else rollout_step)
                self.tensorboard.flush()  # each step to disk as it commits: a killed run loses none it committed
            except OSError as exc:
                raise BadInput(
                    f"TensorBoard could not write step {line['step']} ({exc.strerror or exc})",
                    field="tracking.use_tensorboard",
                ) from None

    def close(self) -> None:
        try:
            if self.tensorboard is not None:
                self.tensorboard.close()
        finally:
            if self.wandb_run is not None:
                self.wandb_run.finish()


def _wandb(config: RunConfig, root: Path, run_id: str) -> Any:
    """slime's init_wandb_primary, with the run's id and suffix drawn from its directory (the same on --resume)."""
    import wandb

    tracking = config.tracking
    group = name = tracking.wandb_group or root.name
    if tracking.wandb_random_suffix:
        group = f"{group}_{run_id[:8]}"
        name = f"{group}-RANK_0"
    if tracking.wandb_dir:
        os.makedirs(tracking.wandb_dir, exist_ok=True)  # as slime: W&B's backend fails on a missing directory
    try:
        run = wandb.init(
            entity=tracking.wandb_team,
            project=tracking.wandb_project,
            group=group,
            name=name,
            config=config.to_dict(),
            dir=tracking.wandb_dir,
            id=run_id,
            resume="allow",
            mode=tracking.wandb_mode,
        )
    except Exception as exc:  # noqa: BLE001 - W&B's own errors (no login, no network): bad input, said in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadInput(f"W&B could not start the run's logging: {first}", field="tracking.use_wandb") from None
    run.define_metric("train/step")
    run.define_metric("rollout/step")
    run.define_metric("eval/step")
    for family, step_metric in STEP_METRICS.items():
        run.define_metric(family, step_metric=step_metric)
    return run


def _tensorboard_env(tracking) -> str | None:
    return os.environ.get("TENSORBOARD_DIR") if tracking.use_tensorboard else None


def tensorboard_dir(config: RunConfig, created: str | None) -> str:
    """slime's _TensorboardAdapter directory: TENSORBOARD_DIR, else tensorboard_log/PROJECT/EXPERIMENT, the
    experiment named after the run's start time (`created`, the manifest's, in UTC: slime names it by local time,
    but a run resumed under another time zone must find its own directory) unless --tb-experiment-name says."""
    tracking = config.tracking
    experiment = tracking.tb_experiment_name
    if experiment is None:
        start = datetime.datetime.fromisoformat(created) if created else datetime.datetime.now(datetime.UTC)
        experiment = start.astimezone(datetime.UTC).strftime("%Y%m%d_%H%M%S")
    return os.environ.get("TENSORBOARD_DIR", f"tensorboard_log/{tracking.tb_project_name}/{experiment}")


def _tensorboard(config: RunConfig, created: str | None) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    directory = tensorboard_dir(config, created)
    os.makedirs(directory, exist_ok=True)
    return SummaryWriter(directory)
