"""A run's checkpoint as a Hugging Face model directory (`rlbench export RUN --out DIR`), which transformers'
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load as they are.

A checkpoint holds the trained weights under Hugging Face names (model.safetensors: both trainers export them so,
the megatron trainer gathering its shards), but not what a model directory needs beside them. The export writes:

- config.json: the model's config as the run used it (the run's model.path), its dtype the weights' own;
- the tokenizer files, as transformers saves the run's tokenizer (its model.tokenizer);
- generation_config.json, where the model directory has one;
- model.safetensors: the checkpoint's tensors, with the metadata transformers asks of a safetensors file.

Nothing is written before everything is verified: the run directory's integrity (replay/integrity.py), the chosen
checkpoint's weights against the checksum the run recorded for them (checksums.jsonl's `weights` of the step
before it; for checkpoint 0 the manifest's initial weights), and the model config and tokenizer against the sha256
the manifest recorded for them (a directory changed since the run would pair the weights with another model). The
directory is written under a temporary name beside DIR and renamed into place: DIR is whole or absent.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlbench.errors import BadInput
from rlbench.replay.checkpoints import CHECKPOINT_NAME, recorded_weights, verify_weights
from rlbench.replay.integrity import METRICS_ONLY, open_run
from rlbench.replay.replay import source_config
from rlbench.rundir.directory import RunDir, step_name

GENERATION = "generation_config.json"


@dataclass(frozen=True)
class Exported:
    out: str
    steps_done: int  # the exported checkpoint: the weights after this many steps
    dtype: str
    files: list[str]


def export(run_dir: str | Path, out: str | Path, steps_done: int | None = None) -> Exported:
    """Write the checkpoint after `steps_done` steps (default: the newest committed one) of the run at `run_dir`
    as a Hugging Face model directory `out`, which must not exist yet."""
    from safetensors.torch import save_file

    from rlbench.core.context import check_made_with
    from rlbench.core.model import load_tokenizer
    from rlbench.rundir.jsonio import read_json

    out = Path(out)
    if out.exists() or out.is_symlink():
        raise BadInput("exists: give a new directory (an export never overwrites one)", path=out)
    run = open_run(run_dir, **METRICS_ONLY).run
    config = source_config(run)
    if config.mode == "rollout-only":
        raise BadInput("a rollout-only run trains nothing: it has no checkpoint to export", path=run.root)
    done = _chosen(run, steps_done)
    expected = recorded_weights(run, done)
    if expected is None:
        raise BadInput(
            "the run recorded no checksum for these weights: they cannot be verified", path=_folder(run, done)
        )
    weights = verify_weights(_folder(run, done), done, expected)
    check_made_with(run, tokenizer=config.model.tokenizer, model=config.model.path)
    model_config = read_json(Path(config.model.path) / "config.json")  # the bytes check_made_with verified
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})
    if len(dtypes) != 1:
        raise BadInput(f"the weights are of several dtypes ({', '.join(dtypes)})", path=_folder(run, done))
    model_config["dtype"] = dtypes[0]  # what transformers' save_pretrained writes (modeling_utils.py, 5.23)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")
        load_tokenizer(config.model.tokenizer).save_pretrained(tmp)
        if (Path(config.model.path) / GENERATION).is_file():
            shutil.copyfile(Path(config.model.path) / GENERATION, tmp / GENERATION)
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        os.rename(tmp, out)  # fails, rather than merges, where `out` appeared meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(str(out), done, dtypes[0], sorted(p.name for p in out.iterdir()))


def _folder(run: RunDir, done: int) -> Path:
    return run.root / "checkpoints" / step_name(done)


def _chosen(run: RunDir, steps_done: int | None) -> int:
    """The checkpoint to export: `steps_done`, or the newest within the committed steps."""
    folder = run.root / "checkpoints"
    last = run.steps[-1] + 1
    found = sorted(
        int(p.name)
        for p in (folder.iterdir() if folder.is_dir() else [])
        if CHECKPOINT_NAME.fullmatch(p.name) and int(p.name) <= last and (p / "state.json").is_file()
    )
    if not found:
        raise BadInput("holds no checkpoint to export", path=folder)
    if steps_done is None:
        return found[-1]
    if steps_done not in found:
        raise BadInput(
            f"no checkpoint after {steps_done} steps; the run has checkpoints after {', '.join(map(str, found))} steps",
            field="--step",
        )
    return steps_done
