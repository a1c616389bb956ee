"""The engine's side of slime's delta weight sync, /pull_weights (slime 624b824a's SGLang patch,
docker/patch/latest/sglang-pull_weights.patch, sglang/srt/weight_sync/local_checkpoint.py): a host-local checkpoint
brought to a published version, read and verified whole (rlbench/core/weight_delta.py reads each version) before it
is written.

The local checkpoint keeps a marker of the version it holds (`.weight_sync/state.json`, `{"version": "000003"}`); a
pull to version T seeds from the newest full version at or below it (or the engine's base for version 0), then
applies each delta in order, each only on its declared base. `root` (rlbench serve --weights-dir) confines every
path read or written (rlbench/core/confine.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rlbench.core.confine import inside, no_link, open_lock, replace_with, write_new
from rlbench.core.weight_delta import (
    SYNC_DIR,
    apply_version,
    is_delta,
    read_checkpoint,
    safetensors_header,
    version_dir,
)
from rlbench.errors import BadInput
from rlbench.rundir.failpoints import hit

# A pull reads and verifies everything first (the seed's files, every delta, every tensor) and only then writes:
# each new file staged under a fresh name in `.weight_sync/staging/`, flushed, then a journal (`pending.json`:
# the version and the renames) written, then each file renamed into place and the version marked. A pull killed
# before the journal leaves the checkpoint as it was (the next pull clears the staging); killed after it, the next
# pull finishes the renames first: either way no reader of the marker sees files of another version.

STAGING = "staging"
JOURNAL = "pending.json"


def applied_version(local: Path) -> int | None:
    try:
        return int(json.loads((local / SYNC_DIR / "state.json").read_text())["version"])
    except FileNotFoundError:
        return None


def pull(local: str | Path, base: str | Path, source: str | Path, target: int, root: Path | None = None) -> int:
    """Bring the host-local checkpoint `local` to version `target` of `source` (slime's `pull`): seeded from the
    newest full version at or below it (the engine's `base` for version 0), then each delta in order, every tensor
    verified before the first byte of the checkpoint or its state changes. `root` confines the local checkpoint
    and the versions (not `base`, the server's own model). Returns the versions applied."""
    import fcntl

    local, source = Path(local), Path(source)
    _apart(local, source)
    sync = no_link(inside(local, root) / SYNC_DIR)
    fd = open_lock(sync / "lock")  # a host's servers share the checkpoint: one pulls at a time
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _recover(local)
        return _pull(local, Path(base), source, target, root)
    finally:
        os.close(fd)


def _apart(local: Path, source: Path) -> None:
    """A local checkpoint that is (or lies inside) a published version would be written into the chain."""
    a, b = local.resolve(), source.resolve()
    if b in a.parents and a.relative_to(b).parts[0].startswith("weight_v"):
        raise BadInput(
            f"{local} lies in the published version {b / a.relative_to(b).parts[0]}: a pull writes the local "
            "checkpoint, never a published version",
            field="local_checkpoint_dir",
        )


def _pull(local: Path, base: Path, source: Path, target: int, root: Path | None) -> int:
    held = applied_version(local)
    start = target
    while start > (held if held is not None else 0) and is_delta(version_dir(source, start), root):
        start -= 1
    seed = None
    if held is None or start > held:
        seed = base if start == 0 else version_dir(source, start)
        state, held = read_checkpoint(seed, None if start == 0 else root), start
    elif target <= held:
        return 0
    else:
        state = read_checkpoint(local, root)
    for version in range(held + 1, target + 1):
        held, _ = apply_version(state, version_dir(source, version), held, root)
    if seed is None:
        files, remove = _patched(local, state, root), []
    else:
        files = _seeded(seed, state, None if start == 0 else root)
        remove = sorted(f.name for f in local.iterdir() if (f.is_file() or f.is_symlink()) and f.name not in files)
    _commit(local, files, remove, target)
    return target - start


def _patch(blob: bytes, file: str, state: dict) -> bytes:
    """A safetensors file's bytes with the tensors `state` keeps in it (by file name) replaced (its header, and so
    its layout, unchanged)."""
    spans, _ = safetensors_header(blob, file)
    out = bytearray(blob)
    for name, (begin, end) in spans.items():
        if state[name][0] == file:  # a name in two shards is read from the later one
            out[begin:end] = state[name][1].tobytes()
    return bytes(out)


def _seeded(seed: Path, state: dict, root: Path | None) -> dict[str, bytes]:
    """Each file of the full checkpoint `seed`, by name, with `state`'s bytes (the local checkpoint made its exact
    copy)."""
    files, weights = {}, {file for file, _ in state.values()}
    for f in sorted(seed.iterdir()):
        if f.is_file():
            blob = inside(f, root).read_bytes()
            files[f.name] = _patch(blob, f.name, state) if f.name in weights else blob
    return files


def _patched(local: Path, state: dict, root: Path | None) -> dict[str, bytes]:
    """Each file the local checkpoint's weights are in (read_checkpoint's; any other file left alone) with the new
    bytes."""
    return {f: _patch(inside(local / f, root).read_bytes(), f, state) for f in sorted({f for f, _ in state.values()})}


def _commit(local: Path, files: dict[str, bytes], remove: list[str], version: int) -> None:
    """Stage every file, write the journal, then rename, remove and mark (the comment above `applied_version`)."""
    sync = local / SYNC_DIR
    staging = no_link(sync / STAGING)
    renames = {}
    for name, data in files.items():
        renames[name] = write_new(staging, name, data).name
        hit("pull.staging")
    hit("pull.staged")
    replace_with(sync / JOURNAL, json.dumps({"version": version, "renames": renames, "remove": remove}).encode())
    hit("pull.journal")
    _recover(local)


def _recover(local: Path) -> None:
    """Finish a journalled pull (each staged file renamed into place, the files it removes removed, the version
    marked), then clear the staging: what a pull killed part way through left."""
    sync, journal = local / SYNC_DIR, local / SYNC_DIR / JOURNAL
    if journal.is_file() and not journal.is_symlink():
        plan = json.loads(journal.read_text())
        for name, staged in plan["renames"].items():
            if (sync / STAGING / staged).is_file():
                os.replace(sync / STAGING / staged, local / name)
                hit("pull.renamed")
        for name in plan["remove"]:
            (local / name).unlink(missing_ok=True)  # removed already by the pull that was killed
            hit("pull.removed")
        _mark(local, plan["version"])
        hit("pull.marked")
        journal.unlink()
    if (sync / STAGING).is_dir() and not (sync / STAGING).is_symlink():
        shutil.rmtree(sync / STAGING)


def _mark(local: Path, version: int) -> None:
    """The version the local checkpoint holds, recorded."""
    replace_with(local / SYNC_DIR / "state.json", json.dumps({"version": f"{version:06d}"}).encode())
