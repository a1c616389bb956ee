"""`rlbench import slime`: slime's rollout dumps turned into an rlbench recording."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlbench.cli.app import AsJson, Debug, app, stdout

import_app = typer.Typer(help="Turn other frameworks' dumps into rlbench recordings.", no_args_is_help=True)
app.add_typer(import_app, name="import")


@import_app.command("slime")
def import_slime(
    dumps: Annotated[
        list[Path],
        typer.Argument(
            help="slime --save-debug-rollout-data files (torch.save of {rollout_id, samples}), or one --dump-details "
            "directory (rollout_data/ and train_data/)."
        ),
    ],
    out: Annotated[Path, typer.Option(help="The run directory to create.")],
    model: Annotated[
        Optional[Path],
        typer.Option(
            help="Model directory (config.json, optional "
            "model.safetensors) that replay and train-only will "
            "train. \\[default: the fixture]"
        ),
    ] = None,
    tokenizer: Annotated[
        Optional[Path],
        typer.Option(
            help="Tokenizer directory the dumps were tokenised with. \\[default: a --dump-details directory's "
            "tokenizer/, else the fixture]"
        ),
    ] = None,
    reward_key: Annotated[
        Optional[str], typer.Option(help="When rewards are dicts: the key to use (slime's --reward-key).")
    ] = None,
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Import slime's debug rollout dumps as a recording that check, diff and replay accept.

    Files load with torch.load(weights_only=True); one that needs more unpickling is refused. Rollout ids become steps \
in id order. Every field of slime's Sample is used, kept in the samples' metadata, or refused by name: samples slime \
removed (remove_sample) stay in their groups, untrained and unjudged; samples without engine log-probs are not judged \
by the log-prob checks; a top-p nucleus is kept for check logprobs --recompute; groups may differ in size; multimodal \
samples and evaluation dumps (eval_<id>) are refused.

    A --dump-details directory brings slime's train dumps too (train_data/<id>.pt, format 2; or format 1's \
<id>_<rank>.pt, tensor-, pipeline- and context-parallel ranks put together): each is joined to its rollout dump \
sample by sample (position, index, ids, lengths, loss mask, engine log-probs, DP shards and micro-batches), and the \
recording gains the trainer's log-probs (old_logprobs, ref_logprobs on trained tokens), the advantages, the DP \
layout and every other train-dump field, for diff and check. A pair that does not join is a finding (exit 1) naming \
the rollout and the samples, and nothing is written. Miles' trajectory/ JSONL puts each conversation back in its \
sample's metadata; its other sidecars are named and not read.
    """
    from rlbench.config import ModelConfig
    from rlbench.core.model import weight_files
    from rlbench.replay.slime import import_slime as run_import

    defaults = ModelConfig()
    # The model the dumps were sampled with (or, without --model, the default's): its checkpoint where the
    # directory has one, else seeded random weights (recorded as model.init).
    path = model or defaults.path
    init = "checkpoint" if weight_files(path) else "random"
    summary = run_import(
        dumps,
        out,
        ModelConfig(path=str(path), init=init, tokenizer=str(tokenizer or _saved(dumps) or defaults.tokenizer)),
        reward_key,
        model_given=model is not None,
    )
    if as_json:
        stdout.print_json(json.dumps(summary))
    else:
        _render_import(summary)


def _saved(dumps: list[Path]) -> Path | None:
    """The tokenizer slime saved in a --dump-details directory (DIR/tokenizer/), where one is given."""
    if len(dumps) == 1 and (dumps[0] / "tokenizer").is_dir():
        return (dumps[0] / "tokenizer").resolve()
    return None


def _render_import(summary: dict) -> None:
    sizes = sorted({s for step in summary["group_sizes"] for s in step})
    groups = f"groups of {sizes[0]}" if len(sizes) == 1 else f"groups of {sizes[0]} to {sizes[-1]} samples"
    stdout.print(
        f"imported {summary['steps']} rollout ids ({summary['samples']} samples, {groups}) into {summary['out']}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    lines = {
        "removed": "removed by slime (remove_sample): kept in their groups, not trained, not judged",
        "without_logprobs": "without engine log-probs: the log-prob checks do not judge them",
        "top_p": "with a recorded top-p nucleus",
    }
    for key, text in lines.items():
        if summary[key]:
            stdout.print(f"{summary[key]} samples {text}", markup=False, highlight=False, soft_wrap=True)
    for note in summary["notes"]:
        stdout.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
