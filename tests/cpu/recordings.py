"""Helpers for tests that edit recordings: rewrite one step's files as a valid (self-consistent)
recording with changed content, as a deliberate edit or another run would produce."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rlbench.rundir.recording import encode_step, read_step


def small_run(out: Path, steps: int) -> Path:
    """A complete small run of the default task, a checkpoint every 2 steps, written to `out`."""
    from rlbench.config import load_config
    from rlbench.session import run

    run(
        load_config(
            out=str(out),
            steps=steps,
            checkpoint_every=2,
            data__prompts_per_step=2,
            rollout__n_samples_per_prompt=4,
            train__minibatches=2,
            train__micro_batch_size=4,
        )
    )
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_step(root: Path, step: int, edit, checksums: bool = True) -> None:
    """Load step `step`, let `edit(tensors, meta)` change it in place, write it back consistently: the files' own
    digests, and (`checksums`) the step's line of checksums.jsonl where the recording determines it, as another
    run that sampled or scored so would have written them. With checksums=False the recording no longer matches
    its run's checksums: an edited or mixed-up file, which every reader refuses (replay/integrity.py)."""
    import json

    from rlbench.core.loop import recorded_checksums

    tensors, meta = read_step(root, step)
    tensors = {k: v.clone() for k, v in tensors.items()}
    edit(tensors, meta)
    extra = {k: v for k, v in meta.items() if k not in ("schema", "step", "samples", "samples_sha256")}
    st_bytes, js_bytes = encode_step(step, tensors, meta["samples"], extra)
    (root / "rollouts" / f"{step:06d}.safetensors").write_bytes(st_bytes)
    (root / "rollouts" / f"{step:06d}.json").write_bytes(js_bytes)
    if checksums:
        path = root / "checksums.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        fresh = recorded_checksums(tensors)
        for row in rows:
            if row["step"] == step:
                row.update({key: value for key, value in fresh.items() if key in row})
        path.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))


def response_positions(tensors: dict[str, torch.Tensor], sample: int) -> range:
    start = int(tensors["offsets"][sample]) + int(tensors["prompt_lengths"][sample])
    return range(start, int(tensors["offsets"][sample + 1]))


def bump_response_token(root: Path, step: int, sample: int, index: int) -> None:
    """Change response token `index` of `sample` at `step` to another id (+1 mod 300), consistently."""

    def change(t, meta):
        pos = response_positions(t, sample)[index]
        t["tokens"][pos] = (t["tokens"][pos] + 1) % 300

    edit_step(root, step, change)
