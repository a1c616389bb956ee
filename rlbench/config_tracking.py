"""The run config's tracking section: the run's committed metrics mirrored to Weights & Biases and TensorBoard,
with slime's own arguments (THUDM/slime slime/utils/arguments.py `add_wandb_arguments`,
`add_tensorboard_arguments`; slime/observability/) and their defaults. Each field is the `args` attribute slime's
parser sets. Where the values go is core/trackers.py's to say; none of them changes what a run computes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from rlbench.config_sections import setting
from rlbench.validate import check, text

WANDB_MODES = ("online", "offline", "disabled")
_WANDB_ONLY = ("wandb_mode", "wandb_dir", "wandb_project", "wandb_team", "wandb_group")


@dataclass(frozen=True)
class TrackingConfig:
    """Where the metrics of each committed step are also logged, besides metrics.jsonl (slime's names and step
    axes: `rollout/step`, `train/step`)."""

    use_wandb: bool = setting(False, "slime's --use-wandb: log each committed step to Weights & Biases.")
    wandb_mode: Literal["online", "offline", "disabled"] | None = setting(
        None, "slime's --wandb-mode: online, offline (a local run directory) or disabled; none: WANDB_MODE decides."
    )
    wandb_dir: str | None = setting(None, "slime's --wandb-dir: where W&B writes (none: ./wandb, or WANDB_DIR).")
    wandb_project: str | None = setting(None, "slime's --wandb-project.")
    wandb_team: str | None = setting(None, "slime's --wandb-team: the W&B entity.")
    wandb_group: str | None = setting(None, "slime's --wandb-group (none: the run directory's name).")
    wandb_random_suffix: bool = setting(
        True,
        "slime's --disable-wandb-random-suffix sets it false; true: the group takes a suffix, the run's id, as "
        "slime's takes a random one.",
    )
    wandb_always_use_train_step: bool = setting(
        False,
        "slime's --wandb-always-use-train-step: rollout/* and perf/* are logged at the train step "
        "(step * optimizer steps per step) instead of the rollout step.",
    )
    use_tensorboard: bool = setting(False, "slime's --use-tensorboard: write TensorBoard event files.")
    tb_project_name: str | None = setting(
        None,
        "slime's --tb-project-name: events go to tensorboard_log/PROJECT/EXPERIMENT (TENSORBOARD_DIR, when set, "
        "instead).",
    )
    tb_experiment_name: str | None = setting(
        None, "slime's --tb-experiment-name (none: the run's start time, %Y%m%d_%H%M%S, as slime names it)."
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, bool):
                check(isinstance(value, bool), f"tracking.{f.name}", "true or false", value)
            else:
                text(value, f"tracking.{f.name}", optional=True)
        check(
            self.wandb_mode is None or self.wandb_mode in WANDB_MODES,
            "tracking.wandb_mode",
            " or ".join(WANDB_MODES),
            self.wandb_mode,
        )
        for name in _WANDB_ONLY + ("wandb_random_suffix",):
            check(
                self.use_wandb or getattr(self, name) == getattr(TrackingConfig, name),
                f"tracking.{name}",
                "unset without use_wandb (--use-wandb): W&B is off, nothing would read it",
                getattr(self, name),
            )
        for name in ("tb_project_name", "tb_experiment_name"):
            check(
                self.use_tensorboard or getattr(self, name) is None,
                f"tracking.{name}",
                "unset without use_tensorboard (--use-tensorboard): TensorBoard is off, nothing would read it",
                getattr(self, name),
            )
        check(
            self.tb_experiment_name is None or self.tb_project_name is not None,
            "tracking.tb_experiment_name",
            "unset without tb_project_name (--tb-project-name): slime names the directory after both",
            self.tb_experiment_name,
        )
        check(
            not self.wandb_always_use_train_step or self.use_wandb or self.use_tensorboard,
            "tracking.wandb_always_use_train_step",
            "false unless use_wandb or use_tensorboard is on: nothing is logged to W&B or TensorBoard",
            self.wandb_always_use_train_step,
        )

    @property
    def on(self) -> bool:
        return self.use_wandb or self.use_tensorboard
