"""The `rlbench` command line. Thin: each command builds a config, calls one library function,
and renders its result (a rich table, or one JSON document with `--json`). Only this module
prints. Exit codes: 0 done / the check holds, 1 a check found a difference, 2 bad input.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import traceback
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from rlbench.errors import BadInput, RlbenchError

app = typer.Typer(
    name="rlbench",
    help="Reproduce and debug LLM RL post-training runs: run, replay, diff, check.",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
stderr = Console(stderr=True)
# Options every command has. `--debug` is read by main() from argv; commands declare it for --help.
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as one JSON document.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
stdout = Console()


@app.callback(invoke_without_command=True)
def _group(ctx: typer.Context) -> None:
    """Reproduce and debug LLM RL post-training runs: run, replay, diff, check."""
    if ctx.invoked_subcommand is None:  # bare `rlbench`: the help, and success
        stdout.print(ctx.get_help(), markup=False, highlight=False)
        raise typer.Exit(0)


class Mode(str, Enum):
    full = "full"
    rollout_only = "rollout-only"
    train_only = "train-only"


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
    mode: Annotated[Optional[Mode], typer.Option(help="full: the whole loop. rollout-only: generate, score and record; train nothing. train-only: train on --rollouts, start no engine.")] = None,
    rollouts: Annotated[Optional[Path], typer.Option(help="train-only: the run directory whose recorded rollouts are trained on (its model, data and sampling settings come along).")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Continue a killed run from its last checkpoint and committed step, with its recorded config.")] = None,
    rollout_backend: Annotated[Optional[RolloutBackend], typer.Option(help="Rollout engine. hf: embedded transformers, in-process.")] = None,
    trainer_backend: Annotated[Optional[TrainerBackend], typer.Option(help="Trainer. torch: embedded transformers model + AdamW.")] = None,
    custom_rm_path: Annotated[Optional[str], typer.Option(help="Reward function by dotted path, package.module.function: fn(sample) -> float.")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda[:N]. [default: cpu]")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads, fixed and recorded (results depend on it). [default: 1]", min=1)] = None,
    no_record: Annotated[bool, typer.Option("--no-record", help="Do not write rollouts/ (metrics, checksums and checkpoints still are).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON document, no progress bar.")] = False,
    debug: Debug = False,
) -> None:
    """Run the RL loop deterministically: data, rollout, reward, advantage, logprob, train, sync.

    With no arguments it runs the embedded default (a tiny Qwen3-architecture model learning a parity task on the CPU) and writes a run directory: manifest.json, metrics.jsonl, checksums.jsonl, rollouts/, checkpoints/. Two runs with one seed write identical checksums.
    """
    from rlbench.config import load_config

    if resume is not None:
        given = [name for name, value in (("--config", config), ("--seed", seed), ("--steps", steps), ("--out", out),
                                          ("--mode", mode), ("--rollouts", rollouts), ("--device", device),
                                          ("--threads", threads), ("--custom-rm-path", custom_rm_path))
                 if value is not None]
        if given:
            raise BadInput(f"--resume continues a run with its recorded config; drop {', '.join(given)}",
                           field="--resume")
        _resume(resume, as_json)
        return
    if (mode == Mode.train_only) != (rollouts is not None):
        raise BadInput("train-only mode and --rollouts go together (--mode train-only --rollouts RUN_DIR)",
                       field="--rollouts")
    cfg = load_config(config, seed=seed, steps=steps, mode=mode.value if mode else None,
                      device=device, threads=threads, out=str(out) if out else None,
                      rollouts=str(rollouts) if rollouts else None,
                      record=False if no_record else None,
                      rollout__backend=rollout_backend.value if rollout_backend else None,
                      train__backend=trainer_backend.value if trainer_backend else None,
                      reward__custom_rm_path=custom_rm_path)
    if rollouts is not None:
        from rlbench.replay.replay import train_only_config

        cfg = train_only_config(cfg, rollouts, steps)
    if cfg.out is None:
        cfg = cfg.replace(out=_default_out())
    from rlbench.core.loop import run as run_loop  # torch loads here, after the config is known good
    command = shlex.join(["rlbench", *sys.argv[1:]])
    if as_json:
        result = run_loop(cfg, command=command)
        stdout.print_json(json.dumps(_summary(result)))
        return
    with _progress(cfg.steps) as on_step:
        result = run_loop(cfg, on_step=on_step, command=command)
    _render_summary(_summary(result))


@contextmanager
def _progress(total: int, start: int = 0):
    """A step progress bar on stderr, handed out as an on_step callback. Started at the first
    step, not before: inputs are validated while a run is built, and a bad one must leave one
    error line on stderr, not a progress line above it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=stderr)
    task = progress.add_task("run", total=total, completed=start, info="")

    def on_step(state) -> None:
        info = f"reward {state.metrics['rollout/raw_reward']:.3f}"
        if "train/loss" in state.metrics:
            info += f"  loss {state.metrics['train/loss']:+.4f}"
        progress.start()
        progress.update(task, completed=state.step + 1, info=info)

    try:
        yield on_step
    finally:
        progress.stop()


def _resume(run_dir: Path, as_json: bool) -> None:
    from rlbench.replay.resume import resume as resume_run
    from rlbench.replay.rundir import read_run

    total = read_run(run_dir).manifest["config"]["steps"]
    if as_json:
        res = resume_run(run_dir)
    else:
        with _progress(total) as on_step:
            res = resume_run(run_dir, on_step=on_step)
    doc = {"run_dir": res.run_dir, "committed_before": res.committed, "restarted_from_checkpoint": res.checkpoint,
           "recomputed_and_verified": max(res.committed - res.checkpoint, 0), "discarded": res.discarded,
           "complete": True, "summary": _summary(res.result) if res.result else None}
    if as_json:
        stdout.print_json(json.dumps(doc))
        return
    if res.result is None:
        stdout.print(f"{run_dir}: already complete ({res.committed} steps); nothing to do")
        return
    for item in res.discarded:
        stderr.print(f"discarded (uncommitted): {item}", markup=False, highlight=False)
    stdout.print(f"resumed {run_dir} from checkpoint {res.checkpoint}: {doc['recomputed_and_verified']} committed "
                 f"step(s) recomputed and verified, {len(res.result.history) - doc['recomputed_and_verified']} new")
    _render_summary(_summary(res.result))


@app.command()
def replay(
    run_dir: Annotated[Path, typer.Argument(help="The run directory whose recording is retrained on.")],
    out: Annotated[Optional[Path], typer.Option(help="Where the replay writes its own run directory. [default: RUN_DIR.replay-<time>]")] = None,
    steps: Annotated[Optional[str], typer.Option(help="A:B replays steps A..B-1, starting from the checkpoint after A steps. [default: all committed]")] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Retrain on RUN_DIR's recorded rollouts (no rollout engine) and verify every stage's checksum.

    Exit 0: every step reproduced. Exit 1: the first (step, stage) that differs is named; the replay's directory keeps that step, so `rlbench diff RUN_DIR OUT` shows where inside it. Writes only to its own directory.
    """
    from rlbench.replay.replay import parse_range, replay as replay_run
    from rlbench.replay.rundir import read_run

    if as_json:
        res = replay_run(run_dir, out, steps)
    else:
        first, last = parse_range(steps, len(read_run(run_dir).steps))
        with _progress(last, first) as on_step:
            res = replay_run(run_dir, out, steps, on_step=on_step)
    first, last = res.steps
    doc = {"source": res.source, "out": res.out, "steps": [first, last], "reproduced": res.reproduced,
           "ok": res.ok, "compared_stages": res.compared_stages, "first_difference": None}
    if res.diverged is not None:
        d = res.diverged
        doc["first_difference"] = {"step": d.step, "stage": d.stage, "expected": d.expected, "got": d.got}
    if as_json:
        stdout.print_json(json.dumps(doc))
    elif res.ok:
        stdout.print(f"reproduced {res.reproduced} steps ({first}..{last - 1}) of {res.source}, bit for bit; "
                     f"stages compared: {', '.join(res.compared_stages)}")
    else:
        d = res.diverged
        stdout.print(f"[bold red]replay differs[/] at step {d.step}, stage {d.stage}: expected {d.expected[:16]}, "
                     f"got {d.got[:16]} ({res.reproduced - 1} steps before it reproduced)")
        stdout.print(f"see where inside: rlbench diff {res.source} {res.out}", markup=False, highlight=False)
    if not res.ok:
        raise typer.Exit(1)


@app.command()
def diff(
    run_a: Annotated[Path, typer.Argument(help="A run directory.")],
    run_b: Annotated[Path, typer.Argument(help="Another run directory (a replay, a resumed run, a run on other hardware...).")],
    atol: Annotated[Optional[float], typer.Option(help="Compare recorded values within |a-b| <= atol + rtol*|b| instead of bit for bit.", min=0)] = None,
    rtol: Annotated[Optional[float], typer.Option(help="Relative tolerance (see --atol).", min=0)] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Name the first step and stage where two runs differ, where inside it, and by how much.

    Compares checksums first (bit for bit), then opens both sides' recordings at that step: sample and token for tokens and log-probs, sample for rewards and advantages, minibatch for the loss, parameter for gradients and weights. Exit 0: no difference; exit 1: a difference.
    """
    from dataclasses import asdict

    from rlbench.replay.diff import diff as diff_runs

    res = diff_runs(run_a, run_b, atol, rtol)
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
    if res.first is None:
        stdout.print(f"no difference over {len(res.steps_compared)} steps ({how}); stages: "
                     f"{', '.join(res.stages_compared)}", markup=False, highlight=False)
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
    stdout.print(table)
    if res.metrics_around:
        around = Table(title=f"metrics around step {d.step}")
        for col in ("step", "metric", "A", "B"):
            around.add_column(col)
        for row in res.metrics_around:
            style = "bold" if row["a"] != row["b"] else None
            around.add_row(str(row["step"]), row["metric"], f"{row['a']:.6g}", f"{row['b']:.6g}", style=style)
        stdout.print(around)


import_app = typer.Typer(help="Turn other frameworks' dumps into rlbench recordings.", no_args_is_help=True)
app.add_typer(import_app, name="import")


@import_app.command("slime")
def import_slime(
    dumps: Annotated[list[Path], typer.Argument(help="slime --save-debug-rollout-data files (torch.save of {rollout_id, samples}).")],
    out: Annotated[Path, typer.Option(help="The run directory to create.")],
    model: Annotated[Optional[Path], typer.Option(help="Model directory (config.json, optional model.safetensors) that replay and train-only will train. [default: the fixture]")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option(help="Tokenizer directory the dumps were tokenised with. [default: the fixture]")] = None,
    reward_key: Annotated[Optional[str], typer.Option(help="When rewards are dicts: the key to use (slime's --reward-key).")] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Import slime's debug rollout dumps as a recording that check, diff and replay accept.

    Files load with torch.load(weights_only=True); one that needs more unpickling is refused. Rollout ids become steps in id order.
    """
    from rlbench.config import ModelConfig
    from rlbench.replay.slime import import_slime as run_import

    defaults = ModelConfig()
    summary = run_import(dumps, out, ModelConfig(path=str(model or defaults.path),
                                                 tokenizer=str(tokenizer or defaults.tokenizer)), reward_key)
    if as_json:
        stdout.print_json(json.dumps(summary))
    else:
        stdout.print(f"imported {summary['steps']} rollout ids ({summary['samples_per_step']} samples each, groups of "
                     f"{summary['group_size']}) into {summary['out']}", markup=False, highlight=False)


check_app = typer.Typer(help="Checks over runs: tito (token drift), logprobs (train-inference mismatch), golden "
                             "(metrics against a golden log).",
                        no_args_is_help=True)
app.add_typer(check_app, name="check")


@check_app.command("logprobs")
def check_logprobs(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    recompute: Annotated[bool, typer.Option("--recompute", help="Recompute trainer log-probs with the exact weights each step sampled with (rollout-only runs; steps with a checkpoint) instead of reading the recorded ones.")] = False,
    top: Annotated[int, typer.Option(help="How many of the worst tokens to show.", min=0)] = 10,
    max_mean: Annotated[Optional[float], typer.Option(help="Gate: mean |delta| at most this (slime's train_rollout_logprob_abs_diff; its CI uses 0.1).")] = None,
    max_p99: Annotated[Optional[float], typer.Option(help="Gate: p99 |delta| at most this.")] = None,
    max_abs: Annotated[Optional[float], typer.Option(help="Gate: max |delta| at most this.")] = None,
    max_k3: Annotated[Optional[float], typer.Option(help="Gate: K3 KL at most this.")] = None,
    max_exp: Annotated[Optional[float], typer.Option(help="Gate: mean exp(|delta|) at most this (NeMo-RL: 1.05).")] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Report the train-inference log-prob mismatch: per-token |trainer - rollout| (mean, p99, max), K3 KL, mean exp(|delta|), and the worst tokens with context. Exit 1 when a gate is exceeded."""
    from dataclasses import asdict

    from rlbench.checks.logprobs import check_logprobs as run_check

    report = run_check(run_dir, top, {"mean_abs": max_mean, "p99_abs": max_p99, "max_abs": max_abs,
                                      "k3_kl": max_k3, "mean_exp_abs": max_exp}, recompute)
    if as_json:
        stdout.print_json(json.dumps(asdict(report)))
    else:
        for note in report.notes:
            stderr.print(f"note: {note}", markup=False, highlight=False)
        table = Table(title=f"log-prob mismatch, {report.tokens} tokens over {len(report.steps)} steps "
                            f"({report.source} trainer log-probs)")
        table.add_column("statistic")
        table.add_column("value", justify="right")
        table.add_column("gate", justify="right")
        for name, value in report.stats.items():
            limit = report.thresholds.get(name)
            table.add_row(name, f"{value:.6g}", "" if limit is None else f"<= {limit:g}",
                          style="bold red" if limit is not None and value > limit else None)
        stdout.print(table)
        if report.worst:
            worst = Table(title="worst tokens")
            for col in ("step", "sample", "resp. token", "token", "context", "trainer", "rollout", "delta"):
                worst.add_column(col)
            for w in report.worst:
                worst.add_row(str(w.step), str(w.sample), str(w.response_token), repr(w.text), repr(w.context[-30:]),
                              f"{w.trainer:.6g}", f"{w.rollout:.6g}", f"{w.delta:+.3g}")
            stdout.print(worst)
        for failure in report.failures:
            stdout.print(f"[bold red]gate failed[/]: {failure}")
    if report.failures:
        raise typer.Exit(1)


@check_app.command("tito")
def check_tito(
    target: Annotated[Optional[Path], typer.Argument(help="A run directory, or a JSONL of {messages, token_ids} trajectories.")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option(help="Tokenizer directory (for --audit and JSONL; a run directory names its own).")] = None,
    audit: Annotated[bool, typer.Option("--audit", help="Check the tokenizer's chat template for the prefix property over generated conversation shapes.")] = False,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Find token-in-token-out drift: ids the trainer would see that are not the ids the engine sampled. Compares ids, never text, then names the cause (1 re-encode, 2 separator, 4 reasoning stripped, 5 position-dependent, 8 special token dropped, 10 truncated turn closed). RUN_DIR: each sample's turns must each be a prefix of the next, and of the trained ids; single-turn samples are compared with the template's re-render. --audit: a TITO builder played over generated conversations. Exit 1 on a strict finding."""
    from dataclasses import asdict

    from rlbench.checks.tito import MODES, audit as run_audit, check_run

    if audit:
        if tokenizer is None:
            raise BadInput("--audit needs --tokenizer DIR", field="--audit")
        report = run_audit(tokenizer)
        findings = [("", f) for f in report.findings]
        doc = {**asdict(report), "modes": report.modes, "strict": report.strict}
        headline = f"{tokenizer}: the template keeps the prefix property over {len(report.shapes)} shapes"
    else:
        if target is None:
            raise BadInput("give a run directory or JSONL, or --audit --tokenizer DIR", field="check tito")
        report = check_run(target, tokenizer)
        findings = [(f"{f.step}/{f.sample}" if f.step is not None else str(f.sample), f.finding)
                    for f in report.findings]
        doc = {**asdict(report), "rates": report.rates, "strict": report.strict}
        headline = f"{target}: no drift in {report.samples} samples"
    if as_json:
        stdout.print_json(json.dumps(doc))
    elif not findings:
        stdout.print(headline, markup=False, highlight=False)
    else:
        table = Table(title="token-in-token-out drift (first divergence of each)")
        for col in ("sample" if not audit else "shape", "where", "mode", "index", "expected", "got"):
            table.add_column(col)
        for label, f in findings[:50]:
            table.add_row(label or f.shape, f.where, f"{f.number} {f.mode}" + ("" if f.strict else " (not strict)"),
                          str(f.index), repr(f.expected_text), repr(f.got_text))
        stdout.print(table)
        if len(findings) > 50:
            stdout.print(f"... and {len(findings) - 50} more (--json lists all)")
        counts = report.modes if audit else {m: r for m, r in report.rates.items()}
        for mode, value in counts.items():
            amount = f"{value}" if audit else f"{value:.1%} of {report.samples} samples"
            stdout.print(f"mode {MODES[mode][0]} {mode}: {MODES[mode][1]} ({amount})", markup=False)
    if report.strict:
        raise typer.Exit(1)


class Tier(str, Enum):
    exact = "exact"
    approx = "approx"


Tolerances = Annotated[Optional[list[str]], typer.Option("--tolerance", help="Per-metric tolerance override, METRIC-GLOB:key=value[,key=value]; keys kind (exact|approx|median), rtol, atol, failing_steps, mean_residual, max_ratio, window=A:B. Repeatable.")]


@check_app.command("golden")
def check_golden(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    golden: Annotated[Path, typer.Argument(help="A golden file (rlbench.golden/1, written by `rlbench golden update`) or a Megatron-LM golden values file.")],
    tier: Annotated[Tier, typer.Option(help="exact: every value bit for bit (refused, exit 2, across platforms or versions). approx: each metric within its tolerance.")] = Tier.exact,
    ignore: Annotated[Optional[list[str]], typer.Option("--ignore", help="Leave out metrics matching this glob (e.g. 'perf/*'). Repeatable.")] = None,
    tolerance: Tolerances = None,
    rename: Annotated[Optional[list[str]], typer.Option("--rename", help="GOLDEN_NAME=RUN_NAME, e.g. 'lm loss=train/loss' for a Megatron-LM file. Repeatable.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG: each compared metric, its golden values and tolerance band, failing steps marked.")] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Compare a run's metrics with a golden log. Exit 0: within the golden; exit 1: a regression (the failing metrics and steps are listed: expected, got, tolerance); exit 2: bad input, or a comparison that means nothing (another configuration; in the exact tier another platform, versions or determinism settings), with the reason.

    perf/* metrics compare window medians, never exactly: the run's median may be at most max_ratio times the golden's.
    """
    from rlbench.checks import golden as g
    from rlbench.checks.golden_compare import compare
    from rlbench.replay.rundir import read_run

    renames = {}
    for item in rename or []:
        old, eq, new = item.partition("=")
        if not eq or not old or not new:
            raise BadInput(f"expected GOLDEN_NAME=RUN_NAME, got {item!r}", field="--rename")
        renames[old] = new
    overrides = [g.parse_override(spec) for spec in tolerance or []]
    if plot is not None:
        from rlbench.checks.plot import _require_matplotlib

        _require_matplotlib()  # before the comparison's work, not after it
    run = read_run(run_dir)
    report = compare(run, g.load_golden(golden, renames), tier.value, ignore or [], overrides)
    if plot is not None:
        from rlbench.checks.plot import save

        save(report, plot)
    if as_json:
        doc = report.to_json()
        doc["plot"] = str(plot) if plot is not None else None
        stdout.print_json(json.dumps(doc))
    else:
        _render_golden(report, plot)
    if not report.ok:
        raise typer.Exit(1)


def _fmt(value) -> str:
    return "-" if value is None else repr(value)  # shortest round-trip form: a 1-ulp change shows


def _render_golden(report, plot: Path | None) -> None:
    for note in report.notes:
        stderr.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    steps = sorted({s for m in report.metrics for s in m.steps})
    span = f"steps {steps[0]}..{steps[-1]}" if steps else "no steps"
    if report.ok:
        stdout.print(f"golden check passed ({report.tier} tier): {len(report.metrics)} metrics over {span} of "
                     f"{report.run} match {report.golden}", markup=False, highlight=False, soft_wrap=True)
    else:
        summary = Table(title=f"golden check, {report.tier} tier: {len(report.failed)} of {len(report.metrics)} "
                              f"metrics regressed ({span})")
        for col in ("metric", "compared as", "what failed"):
            summary.add_column(col, overflow="fold")
        for m in report.failed:
            summary.add_row(m.name, m.kind, m.message, style="bold red")
        stdout.print(summary)
        rows = [(m, f) for m in report.failed for f in m.failures]
        if rows:
            table = Table(title="failing steps")
            for col in ("metric", "step", "expected", "got", "got - expected", "tolerance"):
                table.add_column(col, justify="left" if col == "metric" else "right", overflow="fold")
            for m, f in rows[:40]:
                table.add_row(m.name, str(f.step), _fmt(f.expected), _fmt(f.got), f"{f.delta:+.3g}",
                              "exact" if m.kind == "exact" else f"+-{f.allowed:.3g}")
            stdout.print(table)
            if len(rows) > 40:
                stdout.print(f"... and {len(rows) - 40} more failing steps (--json lists all)")
        passed = [m.name for m in report.metrics if m.status == "pass"]
        if passed:
            stdout.print(f"passed: {', '.join(passed)}", markup=False, highlight=False, soft_wrap=True)
    if report.ignored:
        stdout.print(f"ignored: {', '.join(report.ignored)}", markup=False, highlight=False, soft_wrap=True)
    if report.not_in_golden:
        stdout.print(f"not in the golden file (not compared): {', '.join(report.not_in_golden)}", markup=False,
                     highlight=False, soft_wrap=True)
    if plot is not None:
        stdout.print(f"plot: {plot}", markup=False, highlight=False, soft_wrap=True)


golden_app = typer.Typer(help="Write golden logs, deliberately.", no_args_is_help=True)
app.add_typer(golden_app, name="golden")


@golden_app.command("update")
def golden_update(
    run_dir: Annotated[Path, typer.Argument(help="The run directory whose metrics become the golden values.")],
    golden: Annotated[Path, typer.Argument(help="The golden file to write or refresh (JSON).")],
    reason: Annotated[str, typer.Option("--reason", help="Why the golden values change (kept in the file's history).")],
    tolerance: Tolerances = None,
    step_interval: Annotated[int, typer.Option(help="Keep every Nth step (Megatron-LM keeps every 5th).", min=1)] = 1,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Write or refresh a golden file from a run: every metric at every committed step, tolerances from the metric-family defaults (losses, rewards, grad norms, lengths, perf/*), with earlier --tolerance overrides carried and new ones applied. The reason is appended to the file's history. The file is replaced atomically; an existing file that is not a valid golden file is refused and left as it is."""
    from rlbench.checks import golden as g
    from rlbench.replay.rundir import read_run

    overrides = [g.parse_override(spec) for spec in tolerance or []]
    run = read_run(run_dir)
    previous = g.load_golden(golden) if golden.exists() else None
    if previous is not None and previous.format != "rlbench":
        raise BadInput("is a Megatron-LM golden values file; write the rlbench golden file to another path",
                       path=golden)
    command = shlex.join(["rlbench", *sys.argv[1:]])
    doc, changes = g.build_golden(run, reason, command, previous, overrides, step_interval)
    g.write_golden(golden, doc)
    for note in run.notes:
        stderr.print(f"note: {run_dir}: {note}", markup=False, highlight=False, soft_wrap=True)
    metrics = doc["metrics"]
    first = next(iter(metrics.values()))
    result = {"golden": str(golden), "run": str(run_dir), "metrics": len(metrics),
              "steps": [first["start_step"], first["end_step"]], "step_interval": step_interval,
              "history": len(doc["header"]["history"]), **changes}
    if as_json:
        stdout.print_json(json.dumps(result))
        return
    verb = "refreshed" if previous is not None else "wrote"
    stdout.print(f"{verb} {golden}: {len(metrics)} metrics over steps {first['start_step']}..{first['end_step']} "
                 f"(every {step_interval}), platform {doc['header']['platform']}; history: "
                 f"{result['history']} entr{'y' if result['history'] == 1 else 'ies'}", markup=False, highlight=False, soft_wrap=True)
    for key in ("changed", "added", "removed", "tolerance_changed"):
        if changes[key]:
            stdout.print(f"{key.replace('_', ' ')}: {', '.join(changes[key])}", markup=False, highlight=False, soft_wrap=True)
    if changes["config_changed"]:
        stdout.print(f"note: the configuration differs from the one {golden} held; it now holds this run's",
                     markup=False, highlight=False, soft_wrap=True)
    if changes["platform_changed"]:
        stdout.print(f"note: the platform changed to {doc['header']['platform']}", markup=False, highlight=False,
                     soft_wrap=True)


def main() -> None:
    """Console entry point: typer's app, with errors mapped to one line and an exit code."""
    debug = "--debug" in sys.argv
    try:
        code = app(standalone_mode=False)  # without standalone mode, an Exit(n) comes back as n
        if isinstance(code, int) and code != 0:
            sys.exit(code)
    except RlbenchError as exc:
        if debug:
            traceback.print_exc()
        _fail(str(exc))
    except typer.Exit as exc:  # --help
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        stderr.print("rlbench: interrupted; committed steps are kept", markup=False, highlight=False)
        sys.exit(130)
    except typer.TyperException as exc:  # typer's (vendored click's) usage errors: unknown option, bad value
        if debug:
            traceback.print_exc()
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        _fail(" ".join(message.split()))


def _fail(message: str) -> None:
    stderr.print(f"rlbench: error: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
