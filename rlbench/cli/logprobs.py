"""`rlbench check logprobs`: the train-inference mismatch (checks/logprobs.py), and with --attribute its split by
cause (checks/attribution.py) as tables, or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from rlbench.cli.app import AsJson, Debug, render_table, stderr, stdout
from rlbench.cli.checks import check_app
from rlbench.errors import BadInput


@check_app.command("logprobs")
def check_logprobs(
    run_dir: Annotated[Path, typer.Argument(help="A run directory, or a slime --dump-details directory.")],
    recompute: Annotated[
        bool,
        typer.Option(
            "--recompute",
            help="Recompute trainer log-probs with the exact weights each step "
            "sampled with (rollout-only runs; steps with a checkpoint) "
            "instead of reading the recorded ones.",
        ),
    ] = False,
    top: Annotated[int, typer.Option(help="How many of the worst tokens to show.", min=0)] = 10,
    max_mean: Annotated[
        Optional[float],
        typer.Option(
            help="Gate: train_rollout_logprob_abs_diff at most "
            "this: slime's metric, the per-sample mean "
            "|delta| (each sample's mean over its tokens, "
            "then over samples; its CI uses 0.1)."
        ),
    ] = None,
    max_token_mean: Annotated[
        Optional[float],
        typer.Option(
            help="Gate: token_mean_abs at most this: the mean |delta| over all tokens (longer samples weigh more)."
        ),
    ] = None,
    max_p99: Annotated[Optional[float], typer.Option(help="Gate: p99 |delta| at most this.")] = None,
    max_abs: Annotated[Optional[float], typer.Option(help="Gate: max |delta| at most this.")] = None,
    max_k3: Annotated[Optional[float], typer.Option(help="Gate: K3 KL at most this.")] = None,
    max_exp: Annotated[
        Optional[float], typer.Option(help="Gate: mean exp(|delta|) at most this (NeMo-RL: 1.05).")
    ] = None,
    attribute: Annotated[
        bool,
        typer.Option(
            "--attribute",
            help="Split the mismatch by cause, token by token: a chain of links from the engine's decode to the "
            "trainer's log-prob (KV cache and batch, kernels, dtype, weight version, micro-batch, log-prob "
            "definition), each link's mean |delta| and share. Needs the checkpoints of the weights each step "
            "sampled and trained with (checkpoint_every = 1).",
        ),
    ] = False,
    engine_url: Annotated[
        Optional[str],
        typer.Option(
            help="--attribute: measure the engine's side on this SGLang server or router (or rlbench serve) "
            "through its native API, instead of the embedded engine rebuilt here."
        ),
    ] = None,
    engine_load_weights: Annotated[
        bool,
        typer.Option(
            "--engine-load-weights",
            help="--engine-url: load each weight version the steps sampled with into the server first, from the "
            "run's checkpoints (/update_weights_from_disk; the server must read this machine's temporary folder). "
            "Without it, samples of a version the server does not hold are not measured.",
        ),
    ] = False,
    device: Annotated[
        Optional[str],
        typer.Option(help="--attribute: where the forwards run (cpu, cuda, cuda:N); default: the run's device."),
    ] = None,
    steps: Annotated[
        Optional[str], typer.Option(help="--attribute: the steps A:B to attribute (default: every committed step).")
    ] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Report the train-inference log-prob mismatch: |trainer - rollout| as slime's per-sample mean \
(train_rollout_logprob_abs_diff) and as a token mean, p99 and max, K3 KL, mean exp(|delta|), and the worst tokens with \
context. Samples slime removed and samples without engine log-probs are not judged, and counted. An async run's \
(--async) mismatch is also given by policy lag, so what staleness costs shows. Exit 1 when a gate is exceeded."""
    from dataclasses import asdict

    from rlbench.checks.logprobs import check_logprobs as run_check
    from rlbench.replay.slime import as_runs

    gates = [
        n
        for n, v in (
            ("--max-mean", max_mean),
            ("--max-token-mean", max_token_mean),
            ("--max-p99", max_p99),
            ("--max-abs", max_abs),
            ("--max-k3", max_k3),
            ("--max-exp", max_exp),
        )
        if v is not None
    ]
    if attribute:
        if gates or recompute:
            raise BadInput(
                "not with --attribute (it recomputes both sides and gates nothing)", field=(gates or ["--recompute"])[0]
            )
        with as_runs(run_dir) as (run,):
            _attribute(run, steps, top, engine_url, engine_load_weights, device, as_json)
        return
    for name, value in (
        ("--engine-url", engine_url),
        ("--engine-load-weights", engine_load_weights or None),
        ("--device", device),
        ("--steps", steps),
    ):
        if value is not None:
            raise BadInput("only with --attribute", field=name)
    with as_runs(run_dir) as (run,):  # a slime --dump-details directory is imported first
        report = run_check(
            run,
            top,
            {
                "train_rollout_logprob_abs_diff": max_mean,
                "token_mean_abs": max_token_mean,
                "p99_abs": max_p99,
                "max_abs": max_abs,
                "k3_kl": max_k3,
                "mean_exp_abs": max_exp,
            },
            recompute,
        )
    if as_json:
        stdout.print_json(json.dumps(asdict(report)))
    else:
        for note in report.notes:
            stderr.print(f"note: {note}", markup=False, highlight=False)
        table = Table(
            title=f"log-prob mismatch, {report.tokens} tokens of {report.samples} samples over "
            f"{len(report.steps)} steps ({report.source} trainer log-probs)"
        )
        table.add_column("statistic")
        table.add_column("value", justify="right")
        table.add_column("gate", justify="right")
        for name, value in report.stats.items():
            limit = report.thresholds.get(name)
            table.add_row(
                name,
                f"{value:.6g}",
                "" if limit is None else f"<= {limit:g}",
                style="bold red" if limit is not None and not value <= limit else None,
            )
        render_table(table)
        if report.per_lag:
            lags = Table(title="by policy lag (weight versions between the sample's generation and its training)")
            for col in ("lag", "samples", "tokens", "train_rollout_logprob_abs_diff", "token_mean_abs", "max_abs"):
                lags.add_column(col, justify="right")
            for row in report.per_lag:
                lags.add_row(
                    *(str(row[k]) for k in ("lag", "samples", "tokens")),
                    *(f"{row[k]:.6g}" for k in ("train_rollout_logprob_abs_diff", "token_mean_abs", "max_abs")),
                )
            render_table(lags)
        if report.worst:
            worst = Table(title="worst tokens")
            for col in ("step", "sample", "resp. token", "token", "context", "trainer", "rollout", "delta"):
                worst.add_column(col)
            for w in report.worst:
                worst.add_row(
                    str(w.step),
                    str(w.sample),
                    str(w.response_token),
                    repr(w.text),
                    repr(w.context[-30:]),
                    f"{w.trainer:.6g}",
                    f"{w.rollout:.6g}",
                    f"{w.delta:+.3g}",
                )
            render_table(worst)
        for failure in report.failures:
            stdout.print(f"[bold red]gate failed[/]: {failure}")
    if report.failures:
        raise typer.Exit(1)


def _attribute(run, steps: str | None, top: int, engine_url, load_weights: bool, device, as_json: bool) -> None:
    from rlbench.replay.replay import parse_range
    from rlbench.rundir.directory import read_run

    wanted = None
    if steps is not None:
        first, last = parse_range(steps, len(read_run(run).steps))
        wanted = list(range(first, last))
    run_attribution(run, wanted, top, engine_url, load_weights, device, as_json)


def run_attribution(run, steps, top, engine_url, load_weights: bool, device, as_json: bool) -> None:
    from rlbench.checks.attribution_run import attribute_run

    def shown(done: int, total: int) -> None:
        if not as_json and (done % 10 == 0 or done == total):
            stderr.print(f"attributed step {done}/{total}", markup=False, highlight=False)

    found, context = attribute_run(run, steps, top, engine_url, load_weights, device, shown)
    if as_json:
        stdout.print_json(json.dumps({**context, **asdict(found), "all_zero": found.all_zero}))
        return
    render(found, context)


def render(found, context: dict) -> None:
    from rlbench.checks.attribution import LINKS, STATES

    stdout.print(
        f"attribution of the train-inference log-prob mismatch: {context['run']}, steps "
        f"{_steps(context['steps'])}, {found.tokens} judged tokens",
        markup=False,
        highlight=False,
    )
    stdout.print(f"engine: {context['engine']}; trainer: {context['trainer']}", markup=False, highlight=False)
    stdout.print(
        "chain, in this order (each link changes one factor of the state before it): " + " -> ".join(STATES),
        markup=False,
        highlight=False,
    )
    if found.total.tokens:
        stdout.print(
            f"mismatch |trainer - engine|, mean over {found.total.tokens} tokens: {found.total.mean_abs:.6g}",
            markup=False,
            highlight=False,
        )
    table = Table(title="links (a span: links not split, a state between them not measured)")
    for col in ("link", "changes", "tokens", "mean |delta|", "share"):
        table.add_column(col, justify="right" if col in ("tokens", "mean |delta|", "share") else "left")
    for link in found.links:
        changes = LINKS[link.names[0]] if len(link.names) == 1 else "not split: " + "; ".join(link.reasons)
        table.add_row(link.name, changes, str(link.tokens), f"{link.mean_abs:.6g}", f"{link.share:.1%}")
    for link in found.not_measured:
        table.add_row(
            link.name, "not measured: " + "; ".join(link.reasons or ["no token has both its ends"]), "0", "", ""
        )
    render_table(table)
    for note in [note for link in found.links for note in link.notes] + found.notes:
        stdout.print(f"note: {note}", markup=False, highlight=False)
    if found.all_zero:
        counts = ", ".join(f"{link.name} {link.tokens}" for link in found.links)
        stdout.print(f"every link is 0 (tokens compared: {counts})", markup=False, highlight=False)
        return
    stdout.print(f"largest: {found.largest}", markup=False, highlight=False)
    if found.worst:
        worst = Table(title=f"worst tokens of {found.largest}")
        for col in ("step", "sample", "resp. token", "token id", "before", "after", "delta"):
            worst.add_column(col)
        for w in found.worst:
            worst.add_row(
                str(w.step),
                str(w.sample),
                str(w.response_token),
                str(w.token_id),
                f"{w.before:.6g}",
                f"{w.after:.6g}",
                f"{w.delta:+.3g}",
            )
        render_table(worst)


def _steps(steps: list[int]) -> str:
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return ", ".join(map(str, steps))
