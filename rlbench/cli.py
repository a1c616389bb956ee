"""The `rlbench` command line. Thin: each command builds a config, calls one library function,
and renders its result (a rich table, or one JSON document with `--json`). Only this module
prints. Exit codes: 0 done / the check holds, 1 a check found a difference, 2 bad input.
"""

from __future__ import annotations

import json
import statistics
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from rich.console import Console
from rich.table import Table

from rlbench.errors import RlbenchError

app = typer.Typer(
    name="rlbench",
    help="Reproduce and debug LLM RL post-training runs: run, replay, diff, check.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
stderr = Console(stderr=True)
stdout = Console()


@app.callback()
def _group() -> None:
    """Reproduce and debug LLM RL post-training runs: run, replay, diff, check."""


class Mode(str, Enum):
    full = "full"
    rollout_only = "rollout-only"


class RolloutBackend(str, Enum):
    hf = "hf"


class TrainerBackend(str, Enum):
    torch = "torch"


def _default_out() -> str:
    import datetime

    return f"runs/run-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _summary(result) -> dict:
    rewards = [h["rollout/raw_reward"] for h in result.history]
    k = min(10, len(rewards))
    last = result.history[-1] if result.history else {}
    return {
        "out": result.config.out,
        "mode": result.config.mode,
        "seed": result.config.seed,
        "steps": len(result.history),
        "reward_first10": statistics.fmean(rewards[:k]) if rewards else None,
        "reward_last10": statistics.fmean(rewards[-k:]) if rewards else None,
        "final_loss": last.get("train/loss"),
        "wall_time": result.wall_time,
        "final_metrics": last,
    }


def _render_summary(summary: dict) -> None:
    table = Table(title="rlbench run", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [("run directory", summary["out"] or "(not written)"), ("mode", summary["mode"]),
            ("seed", str(summary["seed"])), ("steps", str(summary["steps"])),
            ("reward, first 10 steps", f"{summary['reward_first10']:.3f}"),
            ("reward, last 10 steps", f"{summary['reward_last10']:.3f}")]
    if summary["final_loss"] is not None:
        rows.append(("final train/loss", f"{summary['final_loss']:.5f}"))
    rows.append(("wall time", f"{summary['wall_time']:.1f} s"))
    for row in rows:
        table.add_row(*row)
    stdout.print(table)


@app.command()
def run(
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML file of settings (see rlbench/config.py); CLI options override it.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Master seed; every random draw is derived from it. [default: 1234]", min=0)] = None,
    steps: Annotated[Optional[int], typer.Option(help="Number of steps (rollout ids). [default: 100]", min=1)] = None,
    out: Annotated[Optional[Path], typer.Option(help="Run directory to create; must be new or empty. [default: runs/run-<time>]")] = None,
    mode: Annotated[Optional[Mode], typer.Option(help="full: the whole loop. rollout-only: generate, score and record; train nothing.")] = None,
    rollout_backend: Annotated[Optional[RolloutBackend], typer.Option(help="Rollout engine. hf: embedded transformers, in-process.")] = None,
    trainer_backend: Annotated[Optional[TrainerBackend], typer.Option(help="Trainer. torch: embedded transformers model + AdamW.")] = None,
    custom_rm_path: Annotated[Optional[str], typer.Option(help="Reward function by dotted path, package.module.function: fn(sample) -> float.")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda[:N]. [default: cpu]")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads, fixed and recorded (results depend on it). [default: 1]", min=1)] = None,
    no_record: Annotated[bool, typer.Option("--no-record", help="Do not write rollouts/ (metrics, checksums and checkpoints still are).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON document, no progress bar.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Run the RL loop deterministically: data, rollout, reward, advantage, logprob, train, sync.

    With no arguments it runs the embedded default (a tiny Qwen3-architecture model learning a parity task on the CPU) and writes a run directory: manifest.json, metrics.jsonl, checksums.jsonl, rollouts/, checkpoints/. Two runs with one seed write identical checksums.
    """
    from rlbench.config import load_config
    from rlbench.core.loop import run as run_loop

    cfg = load_config(config, seed=seed, steps=steps, mode=mode.value if mode else None,
                      device=device, threads=threads, out=str(out) if out else None,
                      record=False if no_record else None,
                      rollout__backend=rollout_backend.value if rollout_backend else None,
                      train__backend=trainer_backend.value if trainer_backend else None,
                      reward__custom_rm_path=custom_rm_path)
    if cfg.out is None:
        cfg = cfg.replace(out=_default_out())
    if as_json:
        result = run_loop(cfg)
        stdout.print_json(json.dumps(_summary(result)))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=stderr, transient=False) as progress:
        task = progress.add_task("run", total=cfg.steps, info="starting")

        def on_step(step: int, metrics: dict) -> None:
            info = f"reward {metrics['rollout/raw_reward']:.3f}"
            if "train/loss" in metrics:
                info += f"  loss {metrics['train/loss']:+.4f}"
            progress.update(task, completed=step + 1, info=info)

        result = run_loop(cfg, on_step=on_step)
    _render_summary(_summary(result))


def main() -> None:
    """Console entry point: typer's app, with errors mapped to one line and an exit code."""
    debug = "--debug" in sys.argv
    try:
        app(standalone_mode=False)
    except RlbenchError as exc:
        if debug:
            traceback.print_exc()
        stderr.print(f"rlbench: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except click.UsageError as exc:  # unknown option, invalid value, missing argument
        stderr.print(f"rlbench: error: {exc.format_message()}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except click.exceptions.Exit as exc:  # --help, no_args_is_help
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        stderr.print("rlbench: interrupted; committed steps are kept", markup=False)
        sys.exit(130)


if __name__ == "__main__":
    main()
