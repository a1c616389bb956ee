"""`rlbench export`: a run's checkpoint as a Hugging Face model directory (rlbench/replay/export.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlbench.cli.app import AsJson, Debug, app, stdout


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="The run directory whose checkpoint is exported.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The model directory to write; must not exist yet.")],
    step: Annotated[
        Optional[int],
        typer.Option("--step", min=0, help="The checkpoint after this many steps (default: the newest committed one)."),
    ] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Write a checkpoint of RUN_DIR as a model directory transformers loads with from_pretrained: config.json \
(the model's config as the run used it), the tokenizer, generation_config.json where the model has one, and the \
weights as model.safetensors under Hugging Face names.

    The checkpoint's weights are verified against the checksum the run recorded for them, and the model config and \
tokenizer against the manifest's sha256, before anything is written; OUT is written whole or not at all.
    """
    from rlbench.replay.export import export as export_checkpoint

    done = export_checkpoint(run_dir, out, step)
    if as_json:
        stdout.print_json(json.dumps(done.__dict__))
        return
    stdout.print(
        f"exported {run_dir}'s checkpoint after {done.steps_done} steps to {done.out} ({done.dtype}): "
        f"{', '.join(done.files)}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
