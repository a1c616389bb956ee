"""`rlbench check tito|weights` (`check logprobs`: logprobs.py; `check golden` and `golden update`: golden.py;
`check engine`: engine_check.py), and the `check` group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from rlbench.cli.app import AsJson, Debug, app, render_table, stderr, stdout
from rlbench.errors import BadInput


check_app = typer.Typer(
    help="Checks over runs: tito (token drift), logprobs (train-inference mismatch), golden "
    "(metrics against a golden log), weights (a chain of slime's delta weight versions), engine (an SGLang "
    "server's determinism).",
    no_args_is_help=True,
)
app.add_typer(check_app, name="check")


@check_app.command("tito")
def check_tito(
    target: Annotated[
        Optional[Path],
        typer.Argument(
            help="A run directory, a slime --dump-details directory, or a JSONL of {messages, "
            "token_ids} trajectories (optional per row: tools, "
            "chat_template_kwargs, sampled: the engine's "
            "output ids of each assistant turn)."
        ),
    ] = None,
    tokenizer: Annotated[
        Optional[Path],
        typer.Option(
            help="Tokenizer directory (for --audit and JSONL; a run "
            "directory names its own, and another one is "
            "refused). Its generation_config.json, where it "
            "has one, names the stop ids."
        ),
    ] = None,
    model: Annotated[
        Optional[Path],
        typer.Option(
            help="Model directory the samples were generated with "
            "(the run's own): lets a recording without engine "
            "ids (an imported dump) tell sampled from "
            "re-tokenised ids by their log-probs."
        ),
    ] = None,
    audit: Annotated[
        bool,
        typer.Option(
            "--audit",
            help="Check the tokenizer's chat template for the prefix property over generated conversation shapes.",
        ),
    ] = False,
    tito_model: Annotated[
        Optional[str],
        typer.Option(
            "--tito-model",
            help="--audit with Miles' TITO builder for this model family "
            "(qwen3, qwen35, qwennext, glm47, nemotron3, kimi25, "
            "kimi26, minimax_m25, minimax_m27, deepseekv32, "
            "deepseekv4, default), its registered template kwargs and "
            "merge rule; DeepSeek through its encoder. Without it, "
            "rlbench's plain append-only builder.",
        ),
    ] = None,
    roles: Annotated[
        Optional[list[str]],
        typer.Option(
            "--tito-allowed-append-roles",
            help="Roles the --tito-model builder may append after an "
            "assistant turn (tool, user, system; comma-separated or "
            "repeated; Miles' default: tool). Shapes that append "
            "others are not audited, and counted.",
        ),
    ] = None,
    template_kwargs: Annotated[
        Optional[str],
        typer.Option(
            "--chat-template-kwargs",
            "--apply-chat-template-kwargs",
            help="Chat template kwargs as a JSON object, e.g. "
            "'{\"enable_thinking\": true}' (slime's "
            "--apply-chat-template-kwargs spelling too): every "
            "rendering gets them, recorded in the result; a JSONL "
            "row's own chat_template_kwargs win.",
        ),
    ] = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Hazards fail the check too: what only a naive pipeline breaks (a "
            "re-render or a decode of the sampled ids).",
        ),
    ] = False,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Find token-in-token-out drift: ids the trainer trained on that are not the ids the engine sampled. Compares \
ids, never text, then names the cause of every divergence (1 re-encode, 2 separator, 3 stop token, 4 reasoning \
stripped, 5 position-dependent, 8 special token dropped, 10 truncated turn continued), with the category Miles' \
comparator gives it.

    RUN_DIR: each sample's recorded engine ids (every turn's prompt and output) against the ids it trained on; the \
share of samples sampled as non-canonical ids (exposure to a re-tokenising pipeline) is reported apart. A recording \
without engine ids (an imported dump) is judged by its evidence (--model). JSONL: each trajectory against the chat \
template's re-render, and against its sampled ids where a row gives them. --audit: a TITO builder played over \
generated conversations. Exit 1 on a finding; hazards (what only a naive pipeline breaks) are reported and fail only \
with --strict.
    """
    from dataclasses import asdict

    kwargs = _template_kwargs(template_kwargs)
    roles = [r.strip() for item in roles or [] for r in item.split(",") if r.strip()] or None
    if audit:
        from rlbench.checks.tito_audit import audit as run_audit

        if tokenizer is None:
            raise BadInput("--audit needs --tokenizer DIR", field="--audit")
        report = run_audit(tokenizer, family=tito_model, kwargs=kwargs, roles=roles, strict=strict)
        findings = [("", f) for f in report.findings]
        doc = {**asdict(report), "modes": report.modes, "hazards": len(report.hazards), "strict": report.strict}
        headline = _audit_headline(report)
    else:
        from rlbench.checks.tito_run import check_run

        if target is None:
            raise BadInput("give a run directory or JSONL, or --audit --tokenizer DIR", field="check tito")
        if tito_model is not None or roles:
            raise BadInput(
                "--tito-model and --tito-allowed-append-roles choose the builder --audit plays", field="--tito-model"
            )
        from rlbench.replay.slime import as_runs

        with as_runs(target) as (run,):  # a slime --dump-details directory is imported first
            report = check_run(run, tokenizer, model, kwargs=kwargs if template_kwargs is not None else None)
        if run != target:  # named as the user gave it, not as the temporary import
            report.source = str(target)
        findings = [
            (f"{f.step}/{f.sample}" if f.step is not None else str(f.sample), f.finding) for f in report.findings
        ]
        doc = {
            **asdict(report),
            "rates": report.rates,
            "hazards": len(report.hazards),
            "strict": report.strict or (strict and bool(findings)),
        }
        headline = _tito_headline(report)
    if as_json:
        stdout.print_json(json.dumps(doc))
    else:
        _render_tito(report, findings, headline, audit)
    if report.strict or (strict and findings):
        raise typer.Exit(1)


def _template_kwargs(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise BadInput(
            f"expected a JSON object, e.g. '{{\"enable_thinking\": true}}', got {text!r}",
            field="--chat-template-kwargs",
        )
    return value


def _audit_headline(report) -> str:
    who = f"Miles' {report.builder} builder" if report.builder != "plain" else "the plain append-only builder"
    kw = f", kwargs {json.dumps(report.kwargs, sort_keys=True)}" if report.kwargs else ""
    skipped = f" ({len(report.skipped)} not audited: see the notes)" if report.skipped else ""
    return (
        f"{report.tokenizer}: the template keeps every one of {len(report.shapes)} shapes intact under {who}"
        f"{kw}{skipped}"
    )


def _tito_headline(report) -> str:
    if report.lens == "rendered":
        return _rendered_headline(report)
    if report.lens == "sampled":
        return (
            f"{report.source}: no drift: the trained ids of all {report.samples} samples are the ids the engine "
            "sampled (every turn compared)"
        )
    no_model, no_logprobs = report.evidence.get("undetermined", 0), report.evidence.get("no_logprobs", 0)
    if no_model or no_logprobs:
        why = [f"{no_model} without --model"] * bool(no_model) + [f"{no_logprobs} without engine log-probs"] * bool(
            no_logprobs
        )
        return (
            f"{report.source}: the recording holds no engine ids; {no_model + no_logprobs} of {report.samples} "
            "samples are not the canonical encoding of their text and cannot be told sampled from re-tokenised ("
            f"{', '.join(why)}; the others are consistent with sampling)"
        )
    return (
        f"{report.source}: no drift found by evidence over {report.samples} samples (the recording holds no engine "
        f"ids): {report.evidence.get('sampled', 0)} non-canonical samples were sampled so (log-probs agree)"
    )


def _rendered_headline(report) -> str:
    """What a JSONL check compared, said as such: the re-render alone proves nothing about what was sampled."""
    n, k = report.samples, report.sampled_rows
    if k == n:
        return (
            f"{report.source}: trained on what was sampled: in all {n} trajectories every assistant turn's "
            "sampled ids stand unchanged in the trained ids, which are the chat template's re-render"
        )
    rest = (
        f"equal to the chat template's re-render ({n - k} of {n} trajectories gave no sampled ids: what their "
        "engine sampled was not compared, and a naive pipeline's ids are this re-render by construction)"
    )
    return f"{report.source}: " + (f"{k} trajectories trained on what was sampled; the others " if k else "") + rest


def _render_tito(report, findings, headline: str, audit: bool) -> None:
    from rlbench.checks.tito import MODES

    for note in getattr(report, "notes", []):
        stderr.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    for shape, why in getattr(report, "skipped", {}).items():
        stderr.print(f"note: shape {shape} not audited: {why}", markup=False, highlight=False, soft_wrap=True)
    if getattr(report, "kwargs", None):
        stdout.print(
            f"chat template kwargs: {json.dumps(report.kwargs, sort_keys=True)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if not findings:
        stdout.print(headline, markup=False, highlight=False, soft_wrap=True)
    else:
        strict = [f for _, f in findings if f.strict]
        table = Table(
            title=f"token-in-token-out drift: {len(strict)} findings, {len(findings) - len(strict)} hazards "
            "(every divergence)"
        )
        for col in ("shape" if audit else "sample", "where", "mode", "Miles", "index", "before", "expected", "got"):
            table.add_column(col, overflow="fold")
        for label, f in findings[:50]:
            table.add_row(
                label or f.shape,
                f.where,
                f"{f.number} {f.mode}" + ("" if f.strict else " (hazard)"),
                f.category,
                str(f.index),
                repr(f.context_text),
                f"{f.expected} {f.expected_text!r}",
                f"{f.got} {f.got_text!r}",
            )
        render_table(table)
        if len(findings) > 50:
            stdout.print(f"... and {len(findings) - 50} more (--json lists all)")
        counts = report.modes if audit else {m: r for m, r in report.rates.items()}
        for mode, value in counts.items():
            amount = f"{value}" if audit else f"{value:.1%} of {report.samples} samples"
            stdout.print(f"mode {MODES[mode][0]} {mode}: {MODES[mode][1]} ({amount})", markup=False)
        if not strict:
            stdout.print(f"hazards only: {headline}", markup=False, highlight=False, soft_wrap=True)
    if not audit and report.samples and report.lens != "rendered":
        stdout.print(_canonical_line(report), markup=False, highlight=False, soft_wrap=True)


def _canonical_line(report) -> str:
    """How many samples train on non-canonical ids, claiming "sampled so" only for those shown sampled: all of them
    where the engine's ids were compared, those whose log-probs agree where only evidence was."""
    n, share = report.non_canonical, report.non_canonical / report.samples
    head = f"canonical re-tokenisation: {n} of {report.samples} samples ({share:.1%})"
    tail = "a pipeline that decoded and re-tokenised them would train on other ids (mode 1)."
    if report.lens == "sampled":
        return (
            f"{head} were sampled as ids that are not the canonical encoding of their text. They trained as "
            f"sampled; {tail}"
        )
    evidence = report.evidence
    undetermined = evidence.get("undetermined", 0) + evidence.get("no_logprobs", 0)
    parts = [f"{evidence.get('sampled', 0)} shown sampled so (their log-probs agree)"]
    parts += [f"{evidence.get('retokenised', 0)} re-tokenised (findings above)"] * bool(evidence.get("retokenised"))
    parts += [f"{undetermined} undetermined"] * bool(undetermined)
    return (
        f"{head} train on ids that are not the canonical encoding of their text: {', '.join(parts)}. Where they were "
        f"sampled so, {tail}"
    )


@check_app.command("weights")
def check_weights(
    directory: Annotated[
        Path,
        typer.Argument(
            help="slime's published weight versions (weight_v<N>/, full HF checkpoints or deltas), as "
            "--update-weight-disk-dir holds them."
        ),
    ],
    base: Annotated[
        Optional[Path],
        typer.Option(
            help="The checkpoint version 0 stands for (the engine's model path), where the chain starts with a delta."
        ),
    ] = None,
    final: Annotated[
        Optional[Path], typer.Option(help="A checkpoint the last version must equal, tensor by tensor (the trainer's).")
    ] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Verify a chain of slime's delta weight versions (slime's docs/en/advanced/delta-weight-sync.md): each \
version applied in order on its declared base, from its first full version or from --base, every changed tensor's \
checksum (xxh3-128, blake3 or adler32) held after applying, and the last state held to --final. Exit 1 names the \
first version and tensor that fails (a changed byte, a version out of order or applied twice, another base)."""
    from dataclasses import asdict

    from rlbench.core.weight_delta import DeltaRefused, read_checkpoint, verify_chain
    from rlbench.extras import DELTA_EXTRA, DELTA_MODULES, require

    require(DELTA_MODULES, DELTA_EXTRA, "check weights")
    for label, path in (("DIRECTORY", directory), ("--base", base), ("--final", final)):
        if path is not None and not path.is_dir():
            raise BadInput("not a directory", path=path, field=label)
    try:
        wanted = {name: data for name, (_, data) in read_checkpoint(final).items()} if final is not None else None
        report = verify_chain(directory, base, wanted)
    except (DeltaRefused, OSError, ValueError, KeyError) as exc:
        raise BadInput(str(exc).strip("'\""), path=directory) from None
    if as_json:
        stdout.print_json(json.dumps(asdict(report)))
    elif report.failure is None:
        full = f", full: {', '.join(map(str, report.full))}" if report.full else ""
        stdout.print(
            f"verified: versions {report.versions[0]}..{report.versions[-1]} ({len(report.versions)}{full}); "
            f"{report.tensors_checked} tensor checksums held after applying"
            + (f"; {report.final}" if report.final else "; no --final given: the last state not compared"),
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    else:
        shown = f"versions {report.versions[0]}..{report.versions[-1]} verified, then " if report.versions else ""
        stdout.print(f"refused: {shown}{report.failure}", markup=False, highlight=False, soft_wrap=True)
    if report.failure is not None:
        raise typer.Exit(1)
