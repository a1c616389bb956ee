"""`rlbench check engine URL`: the determinism certificate of an SGLang server or router (checks/engine_cert.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from rlbench.cli.app import AsJson, Debug, render_table, stderr, stdout
from rlbench.cli.checks import check_app
from rlbench.errors import BadInput
from rlbench.keys import CLIENT_API_KEY_ENV

_DEFAULT_SIZES = "2,4,8"


@check_app.command("engine")
def check_engine(
    url: Annotated[str, typer.Argument(help="The server or router, e.g. http://127.0.0.1:30000.")],
    api_key: Annotated[
        Optional[str],
        typer.Option(
            "--api-key",
            envvar=CLIENT_API_KEY_ENV,
            show_envvar=True,
            help="The server's --api-key, sent as 'Authorization: Bearer KEY'; never printed.",
            show_default=False,
        ),
    ] = None,
    prompts: Annotated[
        Optional[Path],
        typer.Option(
            help='JSONL of prompts, each line {"prompt": "text"} (the server tokenizes it) or {"input_ids": [...]}; '
            "at least 2. Default: a built-in set of five, one of them long.",
            show_default=False,
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(help="Times each mode is played; the first answer is the reference.")] = 2,
    batch_sizes: Annotated[
        str,
        typer.Option(
            help="Sizes of mixed mode's batches, comma-separated; every prompt sits at every position of each."
        ),
    ] = _DEFAULT_SIZES,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens each answer decodes.")] = 16,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy).")] = 1.0,
    seed: Annotated[int, typer.Option(help="sampling_seed of every request.")] = 42,
    max_prefill_delta: Annotated[
        Optional[float],
        typer.Option(
            help="Gate: the decode's log-probs at most this far from the server's prefill of the finished sequence. "
            "Without it that figure is reported, not judged.",
            show_default=False,
        ),
    ] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Certify that an SGLang server (or router) answers as an RL run needs: the same prompts sent alone and inside \
batches of several sizes at every position, with a shared prefix cold and warm, repeated (the modes of SGLang's \
sglang.test.test_deterministic: single, mixed, prefix). Every answer's output ids and log-probs are held bit for bit \
to its prompt's first answer alone. Also reported: the decode's log-probs against the same server's prefill of the \
finished sequence (max |delta|), and the weight version it reports.

    Exit 0 deterministic (with the counts of what was compared), 1 not deterministic (naming the first mode, prompt, \
batch size, position, repeat and token that differ, with both values) or a --max-prefill-delta gate failed, 2 \
undetermined (an error or abort answered, the weight version changed, nothing compared) or the server not reached.
    """
    from rlbench.checks.engine_cert import PROMPTS, Server, Settings, certify, read_prompts

    sizes = _sizes(batch_sizes)
    settings = Settings(repeats, sizes, max_new_tokens, temperature, seed, max_prefill_delta)
    server = Server(url, api_key)
    cert = certify(server, read_prompts(prompts) if prompts is not None else PROMPTS, settings, server.url)
    if as_json:
        stdout.print_json(json.dumps(cert.to_json()))
    if cert.verdict == "undetermined":
        raise BadInput(f"undetermined: {cert.stopped}", path=server.url)
    if not as_json:
        _render(cert)
    if cert.verdict != "deterministic" or cert.failures:
        raise typer.Exit(1)


def _sizes(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return tuple(int(part) for part in parts)
    except ValueError:
        raise BadInput(
            f"expected whole numbers, e.g. {_DEFAULT_SIZES}, got {','.join(parts)!r}", field="--batch-sizes"
        ) from None


def _render(cert) -> None:
    counts = cert.counts
    answers, tokens = sum(t.answers for t in counts.values()), sum(t.tokens for t in counts.values())
    version = ", ".join(cert.weight_versions) or "not reported"
    if cert.first is None:
        head = f"deterministic: {answers} answers held to their prompt's reference bit for bit ({tokens} tokens)"
    else:
        differing = sum(t.differing for t in counts.values())
        head = f"not deterministic: {differing} of {answers} answers differ; the first at {cert.first}"
    stdout.print(f"{cert.url}: {head}; weight version {version}", markup=False, highlight=False, soft_wrap=True)
    if cert.stopped:
        stderr.print(f"note: stopped before the end: {cert.stopped}", markup=False, highlight=False, soft_wrap=True)
    table = Table(title=f"{len(cert.prompts)} prompts, each mode {cert.settings['repeats']} times")
    for column in ("mode", "answers", "tokens", "differing"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, tally in counts.items():
        table.add_row(mode, str(tally.answers), str(tally.tokens), str(tally.differing))
    render_table(table)
    figure = cert.prefill
    judged = f"gate <= {figure.gate!r}" if figure.gate is not None else "reported, not judged (no --max-prefill-delta)"
    stdout.print(
        f"decode vs prefill: max |delta| {figure.max_abs_delta:.6g} over {figure.tokens} tokens, {figure.differing} "
        f"not the same bits: {judged}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    for failure in cert.failures:
        stdout.print(f"gate failed: {failure}", markup=False, highlight=False, soft_wrap=True)
