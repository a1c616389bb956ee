"""`rlbench run`, `replay` and `diff` (`import slime`: imports.py)."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from rlbench import slime_args
from rlbench.cli.app import AsJson, Debug, app, progress, refuse_misspelt, render_table, stderr, stdout
from rlbench.cli.options import AsyncMode, WeightMode, config_option, option_fields, overrides
from rlbench.config import RunConfig
from rlbench.errors import BadInput

_DEFAULT = RunConfig()  # what an option left out means (the config's defaults, shown in --help)


class Mode(str, Enum):
    full = "full"
    rollout_only = "rollout-only"
    train_only = "train-only"


class RolloutBackend(str, Enum):
    hf = "hf"
    sglang = "sglang"


class SGLangServer(str, Enum):
    sglang = "sglang"
    rlbench = "rlbench"


class Placement(str, Enum):
    local = "local"
    ray = "ray"


class TrainerBackend(str, Enum):
    torch = "torch"
    megatron = "megatron"


def _summary(result, history: list[dict] | None = None) -> dict:
    """What a finished run did; `history` is every committed step's metrics (default: this invocation's)."""
    history = result.history if history is None else history
    rewards = [h["rollout/raw_reward"] for h in history]
    k = min(10, len(rewards))
    last = history[-1] if history else {}
    return {
        "out": result.config.out,
        "mode": result.config.mode,
        "seed": result.config.seed,
        "steps": len(history),
        "reward_first10": statistics.fmean(rewards[:k]) if rewards else None,
        "reward_last10": statistics.fmean(rewards[-k:]) if rewards else None,
        "final_loss": last.get("train/loss"),
        "weights": _weights_line(result.manifest.get("weights")),
        "plugins": _plugins_line(result.manifest.get("plugins")),
        "wall_time": result.wall_time,  # this invocation's
        "final_metrics": last,
    }


def _weights_line(weights: dict | None) -> str:
    """Where the run's initial weights came from, in one line."""
    if not isinstance(weights, dict):
        return "not recorded (a run from before rlbench recorded it)"
    if weights.get("init") == "random":
        return f"random weights, seed {weights.get('seed')}"
    files = weights.get("files") or {}
    digest = next(iter(files.values()), "")
    what = "checkpoint" if weights.get("init") == "checkpoint" else "the recording's checkpoint"
    return f"{what} {weights.get('path')} ({len(files)} file{'s' * (len(files) != 1)}, first sha256 {digest[:12]})"


def _plugins_line(plugins: dict | None) -> str | None:
    """Which contract the run called its generate function with, in one line (None: no generate function)."""
    if not isinstance(plugins, dict):
        return None
    if plugins.get("contract") == "slime":
        return f"slime's contract, {plugins.get('sample_class')}: {plugins.get('generate')}"
    return f"rlbench's contract: {plugins.get('generate')}"


def _render_summary(summary: dict) -> None:
    table = Table(title="rlbench run", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("run directory", summary["out"] or "(not written)"),
        ("mode", summary["mode"]),
        ("seed", str(summary["seed"])),
        ("initial weights", summary["weights"]),
        *([("generate function", summary["plugins"])] if summary.get("plugins") else []),
        ("steps", str(summary["steps"])),
        (f"reward, first {min(10, summary['steps'])} steps", f"{summary['reward_first10']:.3f}"),
        (f"reward, last {min(10, summary['steps'])} steps", f"{summary['reward_last10']:.3f}"),
    ]
    if summary["final_loss"] is not None:
        rows.append(("final train/loss", f"{summary['final_loss']:.5f}"))
    rows.append(("wall time", f"{summary['wall_time']:.1f} s"))
    for row in rows:
        table.add_row(*row)
    render_table(table)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    config: Annotated[
        Optional[Path],
        typer.Option(
            "--config",
            "-c",
            help="TOML file of settings; a relative path in it is relative to the file's folder. CLI options "
            "override it.",
        ),
    ] = None,
    seed: Annotated[Optional[int], config_option("seed", min=0)] = None,
    steps: Annotated[Optional[int], config_option("steps", min=1)] = None,
    out: Annotated[Optional[Path], config_option("out", default_text="runs/run-<time>")] = None,
    mode: Annotated[Optional[Mode], config_option("mode")] = None,
    rollouts: Annotated[Optional[Path], config_option("rollouts")] = None,
    resume: Annotated[
        Optional[Path],
        typer.Option(
            help="Continue a killed run from its last checkpoint, with its recorded config; --steps N extends it to N."
        ),
    ] = None,
    rollout_backend: Annotated[
        Optional[RolloutBackend], config_option("rollout.backend", "--rollout-backend", "--rollout")
    ] = None,
    external_engine_addrs: Annotated[
        Optional[str], config_option("rollout.external_engine_addrs", "--rollout-external-engine-addrs")
    ] = None,
    sglang_router_url: Annotated[
        Optional[str], config_option("rollout.sglang_router_url", "--sglang-router-url")
    ] = None,
    num_engines: Annotated[Optional[int], config_option("rollout.num_engines", "--rollout-num-engines", min=1)] = None,
    sglang_server: Annotated[Optional[SGLangServer], config_option("rollout.sglang_server", "--sglang-server")] = None,
    placement: Annotated[Optional[Placement], config_option("placement.backend", "--placement")] = None,
    ray_address: Annotated[Optional[str], config_option("placement.ray_address", "--ray-address")] = None,
    ray_timeout: Annotated[Optional[float], config_option("placement.ray_timeout", "--ray-timeout", min=0)] = None,
    trainer_backend: Annotated[
        Optional[TrainerBackend], config_option("train.backend", "--trainer-backend", "--trainer")
    ] = None,
    tp: Annotated[Optional[int], config_option("tp", "--tp", min=1)] = None,
    dp: Annotated[Optional[int], config_option("dp", "--dp", min=1)] = None,
    deterministic: Annotated[bool, config_option("deterministic", "--deterministic", flag_value=True)] = False,
    custom_rm_path: Annotated[
        Optional[str],
        config_option("reward.custom_rm_path", default_text=f"the built-in {_DEFAULT.reward.verifier!r} verifier"),
    ] = None,
    custom_generate_function_path: Annotated[
        Optional[str], config_option("rollout.custom_generate_function_path", default_text="the engine's own")
    ] = None,
    group_rm: Annotated[bool, config_option("reward.group_rm", "--group-rm", flag_value=True)] = False,
    async_mode: Annotated[Optional[AsyncMode], config_option("rollout.async_mode", "--async")] = None,
    max_staleness: Annotated[Optional[int], config_option("rollout.max_staleness", "--max-staleness", min=0)] = None,
    update_weights_interval: Annotated[
        Optional[int], config_option("rollout.update_weights_interval", "--update-weights-interval", min=1)
    ] = None,
    update_weight_mode: Annotated[
        Optional[WeightMode], config_option("rollout.update_weight_mode", "--update-weight-mode")
    ] = None,
    device: Annotated[Optional[str], config_option("device")] = None,
    threads: Annotated[Optional[int], config_option("threads", min=1)] = None,
    no_record: Annotated[bool, config_option("record", "--no-record", flag_value=False)] = False,
    print_config: Annotated[
        bool,
        typer.Option(
            "--print-config",
            help="Print the configuration the command line resolves "
            "to (each slime argument with the rlbench settings "
            "it sets) and exit without running.",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the result as one JSON document; no progress on stderr.")
    ] = False,
    debug: Debug = False,
) -> None:
    """Run the RL loop deterministically: data, rollout, reward, advantage, logprob, train, sync.

    With no arguments it runs the embedded default (a tiny Qwen3-architecture model learning a parity task on the CPU, \
from a committed warm-started policy that knows the answer format, not the parity) and writes a run \
directory: manifest.json, metrics.jsonl, checksums.jsonl, rollouts/, checkpoints/. Two runs with one seed write \
identical checksums.

    slime's own arguments are read too (--hf-checkpoint, --prompt-data, --input-key, --label-key, \
--apply-chat-template, --rollout-batch-size, --n-samples-per-prompt, --global-batch-size, --num-rollout, \
--rollout-max-response-len, the algorithm and optimizer flags, ...; docs/usage.md lists them): with any of them, \
slime's defaults apply to the settings slime defines. An argument rlbench does not model is refused by name; \
--sglang-* passes through to the servers.
    """
    from rlbench.command import run_config, split_extra

    refuse_misspelt(ctx, (*slime_args.ARGS, *slime_args.ONLY, *slime_args.REFUSED), passed="--sglang-")
    sglang_args, slime_given = split_extra(ctx.args)
    given = overrides(run, ctx.params)
    if resume is not None:
        names = {option.path: option.label(name) for name, option in RUN_FIELDS.items()}
        refused = (
            (["--config"] if config is not None else [])
            + [names[key.replace("__", ".")] for key in given if key != "steps"]  # --steps N: extend to N steps
            + (["--sglang-*"] if sglang_args else [])
            + list(slime_given)
        )
        if refused:
            raise BadInput(
                f"--resume continues a run with its recorded config; drop {', '.join(refused)}", field="--resume"
            )
        _resume(resume, as_json, steps)
        return
    if (mode == Mode.train_only) != (rollouts is not None):
        raise BadInput(
            "train-only mode and --rollouts go together (--mode train-only --rollouts RUN_DIR)", field="--rollouts"
        )
    resolved = run_config(ctx.args, config, given, rollouts, steps)
    cfg, notes, slime_fields = resolved.config, resolved.notes, resolved.slime
    if print_config:
        _print_config(cfg, slime_fields, as_json)
        return
    from rlbench.session import run as run_loop  # torch loads here, after the config is known good

    command = shlex.join(["rlbench", *sys.argv[1:]])
    with progress(cfg.steps, out=cfg.out, quiet=as_json) as on_step:
        result = run_loop(cfg, on_step=on_step, command=command)
    if as_json:
        stdout.print_json(json.dumps({**_summary(result), "notes": notes}))
        return
    for note in notes:  # after the run: bad input stays one line
        stderr.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    _render_summary(_summary(result))


RUN_FIELDS = option_fields(run)  # the options of `rlbench run` that set a config field, by parameter name


def _print_config(cfg: RunConfig, slime_fields: list, as_json: bool) -> None:
    """The resolved configuration, and what each slime argument set in it."""
    slime = [{"argument": name, "value": value, "sets": sets} for name, value, sets in slime_fields]
    if as_json:
        stdout.print_json(json.dumps({"config": cfg.to_dict(), "slime": slime}, default=list))
        return
    if slime:
        table = Table(title="slime arguments", show_header=True)
        for column in ("argument", "value", "rlbench setting"):
            table.add_column(column)
        for row in slime:
            table.add_row(
                row["argument"],
                str(row["value"]),
                ", ".join(f"{path} = {value!r}" for path, value in row["sets"].items()) or "-",
            )
        render_table(table)
    stdout.print_json(json.dumps(cfg.to_dict(), default=list))


def _resume(run_dir: Path, as_json: bool, steps: int | None) -> None:
    from rlbench.replay.resume import resume as resume_run
    from rlbench.rundir.directory import read_run
    from rlbench.replay.replay import source_config

    total = steps or source_config(read_run(run_dir)).steps
    with progress(total, out=run_dir, quiet=as_json) as on_step:
        res = resume_run(run_dir, on_step=on_step, steps=steps)
    doc = {
        "run_dir": res.run_dir,
        "committed_before": res.committed,
        "restarted_from_checkpoint": res.checkpoint,
        "recomputed_and_verified": max(res.committed - res.checkpoint, 0),
        "discarded": res.discarded,
        "extended_from": res.extended_from,  # the steps the run was started with, where --steps extended it
        "complete": True,
        "summary": _summary(res.result, read_run(run_dir).metrics) if res.result else None,
    }
    if as_json:
        stdout.print_json(json.dumps(doc))
        return
    if res.result is None:
        stdout.print(f"{run_dir}: already complete ({res.committed} steps); nothing to do")
        return
    for item in res.discarded:
        stderr.print(f"discarded (uncommitted): {item}", markup=False, highlight=False)
    extending = f"extending {run_dir} from {res.extended_from} to {total} steps\n" if res.extended_from else ""
    stdout.print(
        f"{extending}resumed {run_dir} from checkpoint {res.checkpoint}: {doc['recomputed_and_verified']} committed "
        f"step(s) recomputed and verified, {len(res.result.history) - doc['recomputed_and_verified']} new"
    )
    _render_summary(doc["summary"])


@app.command()
def replay(
    run_dir: Annotated[Path, typer.Argument(help="The run directory whose recording is retrained on.")],
    out: Annotated[
        Optional[Path],
        typer.Option(help="Where the replay writes its own run directory. \\[default: RUN_DIR.replay-<time>]"),
    ] = None,
    steps: Annotated[
        Optional[str],
        typer.Option(
            help="A:B replays steps A..B-1, starting from the checkpoint after A steps. \\[default: all committed]"
        ),
    ] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Retrain on RUN_DIR's recorded rollouts (no rollout engine) and verify every stage's checksum.

    Exit 0: every step reproduced. Exit 1: the first (step, stage) that differs is named; the replay's directory keeps \
that step, so `rlbench diff RUN_DIR OUT` shows where inside it. Writes only to its own directory.
    """
    from rlbench.replay.replay import parse_range, replay as replay_run
    from rlbench.rundir.directory import read_run

    if as_json:
        res = replay_run(run_dir, out, steps)
    else:
        first, last = parse_range(steps, len(read_run(run_dir).steps))
        with progress(last, first) as on_step:
            res = replay_run(run_dir, out, steps, on_step=on_step)
    first, last = res.steps
    doc = {
        "source": res.source,
        "out": res.out,
        "steps": [first, last],
        "reproduced": res.reproduced,
        "ok": res.ok,
        "compared_stages": res.compared_stages,
        "checksums_compared": res.comparisons,
        "checkpoints_verified": res.checkpoints_verified,
        "notes": res.notes,
        "first_difference": None,
    }
    if res.diverged is not None:
        d = res.diverged
        doc["first_difference"] = {"step": d.step, "stage": d.stage, "expected": d.expected, "got": d.got}
    if as_json:
        stdout.print_json(json.dumps(doc))
    else:
        _render_replay(res)
    if not res.ok:
        raise typer.Exit(1)


def _render_replay(res) -> None:
    from rlbench.replay.checkpoints import counted

    first, last = res.steps
    for note in res.notes:
        stderr.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if res.ok:
        stdout.print(
            f"reproduced {res.reproduced} steps ({first}..{last - 1}) of {res.source}, bit for bit: "
            f"{res.comparisons} checksums compared, {len(res.compared_stages)} stages at every step "
            f"({', '.join(res.compared_stages)}); checkpoints verified: "
            f"{counted(len(res.checkpoints_verified))}; the replay is in {res.out}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return
    d = res.diverged
    stdout.print(
        f"[bold red]replay differs[/] at step {d.step}, stage {d.stage}: expected {d.expected[:16]}, "
        f"got {d.got[:16]} ({res.reproduced} step{'s' * (res.reproduced != 1)} before it reproduced)"
    )
    stdout.print(f"see where inside: rlbench diff {res.source} {res.out}", markup=False, highlight=False)


@app.command()
def diff(
    run_a: Annotated[Path, typer.Argument(help="A run directory, or a slime --dump-details directory.")],
    run_b: Annotated[
        Path,
        typer.Argument(
            help="Another run directory (a replay, a resumed run, a run on other hardware, another slime run's "
            "--dump-details directory...)."
        ),
    ],
    atol: Annotated[
        Optional[float],
        typer.Option(help="Compare recorded values within |a-b| <= atol + rtol*|b| instead of bit for bit.", min=0),
    ] = None,
    rtol: Annotated[Optional[float], typer.Option(help="Relative tolerance (see --atol).", min=0)] = None,
    steps: Annotated[
        Optional[str],
        typer.Option(
            help="A:B compares steps A..B-1 only (both runs must have committed "
            "them). \\[default: every step either run committed]"
        ),
    ] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Name the first step and stage where two runs differ, where inside it, and by how much.

    Compares checksums first (bit for bit), then opens both sides' recordings at that step: sample and token for \
tokens and log-probs, sample for rewards and advantages, minibatch for the loss, parameter for gradients and weights. \
Exit 0: no difference; exit 1: a difference.
    """
    from dataclasses import asdict

    from rlbench.replay.diff import diff as diff_runs
    from rlbench.replay.slime import as_runs

    with as_runs(run_a, run_b) as (a, b):  # a slime --dump-details directory is imported first
        res = diff_runs(a, b, atol, rtol, steps)
    res.a, res.b = str(run_a), str(run_b)
    if as_json:
        stdout.print_json(json.dumps(asdict(res), default=str))
    else:
        _render_diff(res)
    if res.first is not None:
        raise typer.Exit(1)


def _render_diff(res) -> None:
    for note in res.notes:
        stderr.print(f"note: {note}", markup=False, highlight=False)
    how = "bit for bit" if res.tolerance is None else f"within atol={res.tolerance[0]:g}, rtol={res.tolerance[1]:g}"
    for side, stages in res.stages_only.items():
        if stages:
            stderr.print(
                f"note: stages only {side} records (not compared): {', '.join(stages)}", markup=False, highlight=False
            )
    if res.first is None:
        from rlbench.replay.checkpoints import describe

        verified = ", ".join(f"{side} {n} steps" for side, n in res.recordings_verified.items())
        checkpoints = describe({side: len(done) for side, done in res.checkpoints_verified.items()})
        skipped = len(res.steps_compared) * len(res.stages_compared) - res.comparisons  # PPO's critic-only steps
        stdout.print(
            f"no difference ({how}): {len(res.steps_compared)} steps x {len(res.stages_compared)} stages, "
            f"{res.comparisons} checksums compared ({', '.join(res.stages_compared)}"
            + (f"; {skipped} not computed by either run: PPO's critic-only steps" if skipped else "")
            + "); "
            + (
                f"the training schedules (DP shards, micro-batches) of {res.schedules_compared} steps and "
                f"{res.train_fields_compared} values of the train dumps' other fields compared; "
                if res.schedules_compared
                else ""
            )
            + (f"the weights versions of {res.versions_compared} samples compared; " if res.versions_compared else "")
            + f"recordings verified: {verified}; {checkpoints}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        _render_largest(res)
        return
    d = res.first
    stdout.print(f"[bold red]first difference[/]: step {d.step}, stage {d.stage} ({how})")
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("where", d.where)
    if d.a is not None or d.b is not None:
        table.add_row("A", repr(d.a))
        table.add_row("B", repr(d.b))
    if d.max_abs is not None:
        table.add_row("max |A - B|", f"{d.max_abs:.6g}")
    if d.count is not None:
        table.add_row("values differing", str(d.count))
    for note in d.notes:
        table.add_row("", note)
    render_table(table)
    if res.metrics_around:
        around = Table(title=f"metrics around step {d.step}")
        for col in ("step", "metric", "A", "B"):
            around.add_column(col)
        for row in res.metrics_around:
            style = "bold" if row["a"] != row["b"] else None
            around.add_row(str(row["step"]), row["metric"], f"{row['a']:.6g}", f"{row['b']:.6g}", style=style)
        render_table(around)
    if res.advice:
        stdout.print(f"advice: {res.advice}", markup=False, highlight=False, soft_wrap=True)
    _render_largest(res)


def _render_largest(res) -> None:
    """With a tolerance: each value stage's largest difference over the run, wherever it was (within or not)."""
    for stage, big in res.largest.items():
        rel = f", {big['max_rel']:.3e} relative" if big["max_rel"] is not None else ""
        stdout.print(
            f"largest difference, {stage}: {big['max_abs']:.3e}{rel} at step {big['step']}, {big['where']}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
