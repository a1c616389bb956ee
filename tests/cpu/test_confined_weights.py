"""Issue 51, points 1 and 3: the weights directory a server confines (--weights-dir) cannot be escaped through
links, a delta chain verifies only what it read, and a pull changes nothing of the local checkpoint until every
tensor of every version is verified, and is whole after a kill at any step (rlbench/core/confine.py,
rlbench/core/weight_delta.py `pull`). Each case both ways: a link that stays inside still works. Outside files are
held to their bytes and modification times."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlbench.core import weight_delta, weight_pull
from rlbench.core.confine import Outside
from rlbench.errors import BadInput
from tests.conftest import REPO, cli
from tests.cpu.weight_chains import CONFIG, chain, pulled, raw, same, trained


def _tree(directory: Path) -> dict:
    """Every file below `directory` (links as their targets' names), the pull's lock file aside: what a pull may
    not change when it is refused."""
    out = {}
    for path in sorted(directory.rglob("*")) if directory.exists() else []:
        rel = str(path.relative_to(directory))
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_file() and rel != ".weight_sync/lock":
            out[rel] = path.read_bytes()
    return out


ARMED = 10**9  # an access time (1 s after the epoch) before every file's modification time


def _untouched(directory: Path) -> dict:
    """Bytes and modification times of every file below `directory` (outside the confining one), each file's access
    time then set to ARMED, before its modification time: a later read moves it (relatime, this file system's
    default, records a read so; mounted noatime, access times stay, and only bytes and modification times hold)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[path] = (path.read_bytes(), path.stat().st_mtime_ns)
            os.utime(path, ns=(ARMED, out[path][1]))
    return out


def _held(directory: Path, kept: dict) -> None:
    """Nothing below `directory` read (access times still ARMED), written, made or removed since `_untouched`."""
    assert {p: p.stat().st_atime_ns for p in kept} == dict.fromkeys(kept, ARMED), "an outside file was read"
    assert _untouched(directory) == kept


@pytest.fixture
def root(tmp_path):
    """D (the confining directory, resolved as the server holds it) with a chain of versions 1 (full) to 3 in
    D/chain, and a directory beside D, outside it, holding a copy of the chain and a victim file."""
    d = tmp_path / "D"
    chain(d / "chain", 3)
    outside = tmp_path / "outside"
    shutil.copytree(d / "chain", outside / "chain")
    (outside / "victim").write_bytes(b"not the checkpoint's")
    return d.resolve()


def _pull(root: Path, target: int, local: str = "local", source: str = "chain") -> int:
    return weight_pull.pull(root / local, root / "base-unused", root / source, target, root)


def _pull_through_link(root: Path, where: str, target: int, link: Path, resolved: Path) -> None:
    """Pull one version on, to `target`, with `link` in the way: outside D, refused naming the link and what it
    resolves to, the local checkpoint as it was; inside D, applied as `target`'s own weights. The outside files
    unread either way."""
    outside, local = root.parent / "outside", root / "local"
    before, kept = _tree(local), _untouched(outside)
    if where == "outside":
        with pytest.raises(Outside) as refused:
            _pull(root, target)
        assert str(refused.value).startswith(f"{link}: resolves to {resolved}, outside {root}"), refused.value
        assert _tree(local) == before
    else:
        assert _pull(root, target) == 1 and same(pulled(local), raw(trained(target)))
    _held(outside, kept)


# ---- links ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_version_directory_that_is_a_link_is_followed_only_inside_the_root(root, where):
    """D/chain/weight_v000002 a link: to the outside copy, refused by name and nothing pulled past version 1 (the
    local checkpoint as it was); to a copy inside D, pulled as the version itself."""
    outside = root.parent / "outside"
    _pull(root, 1)
    store = outside / "chain" if where == "outside" else root / "store"
    if where == "inside":
        shutil.copytree(root / "chain" / "weight_v000002", store / "weight_v000002")
    shutil.rmtree(root / "chain" / "weight_v000002")
    (root / "chain" / "weight_v000002").symlink_to(store / "weight_v000002")
    _pull_through_link(root, where, 2, root / "chain" / "weight_v000002", store / "weight_v000002")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_full_versions_file_linked_outside_the_root_is_not_copied_in(root, where, name):
    """A file of the full version (its weights, or its config.json, which no weight reader opens) a link: to a file
    outside D, refused, not read, and its bytes not copied into the local checkpoint; to a file inside D, copied as
    the version's own."""
    target = root.parent / "outside" / "chain" / "weight_v000001" if where == "outside" else root / "store"
    if where == "inside":
        shutil.copytree(root / "chain" / "weight_v000001", target)
    weights = root / "chain" / "weight_v000001" / name
    weights.unlink()
    weights.symlink_to(target / name)
    kept = _untouched(root.parent / "outside")
    if where == "outside":
        with pytest.raises(Outside, match="resolves to .*outside"):
            _pull(root, 1)
        assert _tree(root / "local") == {}
    else:
        _pull(root, 1)
        assert (root / "local" / name).read_bytes() == (target / name).read_bytes()
        assert not (root / "local" / name).is_symlink()
    _held(root.parent / "outside", kept)


def test_a_sync_directory_that_is_a_link_is_refused_and_nothing_written_through_it(root):
    """The local checkpoint's .weight_sync a link to a directory outside D: refused before anything (no lock, no
    state, no staged file) is written there."""
    sync = root.parent / "outside" / "sync"
    sync.mkdir()
    (root / "local").mkdir()
    (root / "local" / ".weight_sync").symlink_to(sync)
    with pytest.raises(BadInput, match="is a symbolic link: rlbench writes no file through a link"):
        _pull(root, 2)
    assert list(sync.iterdir()) == [] and _tree(root / "local") == {".weight_sync": ("link", str(sync))}


def test_names_a_pull_once_wrote_through_are_replaced_never_written_through(root):
    """Links planted at the names earlier pulls wrote their temporary files under, and the local checkpoint's files
    themselves links to files outside D: the pull writes new files of its own beside them, and the outside files
    keep their bytes. (The local files linked outside are not read: a pull from a full version replaces them.)"""
    outside = root.parent / "outside"
    local = root / "local"
    (local / ".weight_sync").mkdir(parents=True)
    for name in (".model.safetensors.tmp", ".config.json.tmp", ".weight_sync/state.json.tmp", "model.safetensors"):
        (local / name).symlink_to(outside / "victim")
    kept = _untouched(outside)
    assert _pull(root, 3) == 2
    assert same(pulled(local), raw(trained(3))) and not (local / "model.safetensors").is_symlink()
    _held(outside, kept)


def test_a_local_checkpoint_linked_outside_is_not_read_to_apply_a_delta(root):
    """Local at version 2, its model.safetensors then swapped for a link to the outside copy of version 1: pulling
    version 3 reads the local weights, and refuses the link (a link inside D is read)."""
    local = root / "local"
    _pull(root, 2)
    held = local / "model.safetensors"
    held.unlink()
    held.symlink_to(root.parent / "outside" / "chain" / "weight_v000001" / "model.safetensors")
    with pytest.raises(Outside):
        _pull(root, 3)
    shutil.copyfile(root / "chain" / "weight_v000001" / "model.safetensors", root / "v1.safetensors")
    held.unlink()
    held.symlink_to(root / "v1.safetensors")  # version 1's bytes marked as 2: the delta on them does not verify
    with pytest.raises(weight_delta.DeltaRefused, match="version 3, a: xxh3-128 of the applied bytes"):
        _pull(root, 3)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_sharded_local_checkpoints_index_linked_outside_is_refused_unread(root, where):
    """Local at version 2 made sharded (its weights in one shard, the index naming it), the index a link: outside D,
    the pull to 3 refused naming the link before weight_files reads it, the local checkpoint as it was and the outside
    index not read; inside D, the pull applies version 3 through it."""
    from safetensors import safe_open

    outside, local = root.parent / "outside", root / "local"
    _pull(root, 2)
    shard = local / "model-00001-of-00001.safetensors"
    (local / "model.safetensors").rename(shard)
    with safe_open(str(shard), "np") as f:
        table = {"metadata": {}, "weight_map": dict.fromkeys(sorted(f.keys()), shard.name)}
    store = outside if where == "outside" else root / "store"
    store.mkdir(exist_ok=True)
    (store / "index.json").write_text(json.dumps(table))
    link = local / "model.safetensors.index.json"
    link.symlink_to(store / "index.json")
    _pull_through_link(root, where, 3, link, store / "index.json")


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_delta_versions_tensor_file_linked_outside_the_root_is_refused_unread(root, where):
    """Version 3's index a file in D, the tensor file it names a link to a byte-identical copy of itself (no
    checksum can refuse it): the copy outside D, the pull from 2 to 3 refused naming the link, the local checkpoint
    as it was and the copy not read; the copy inside D, applied as the version's own."""
    outside = root.parent / "outside"
    _pull(root, 2)
    store = outside / "chain" / "weight_v000003" if where == "outside" else root / "store"
    if where == "inside":
        shutil.copytree(root / "chain" / "weight_v000003", store)
    delta = root / "chain" / "weight_v000003" / weight_delta.DELTA_FILE
    assert (store / weight_delta.DELTA_FILE).read_bytes() == delta.read_bytes()
    delta.unlink()
    delta.symlink_to(store / weight_delta.DELTA_FILE)
    _pull_through_link(root, where, 3, delta, store / weight_delta.DELTA_FILE)


@pytest.mark.parametrize("change", ["linked outside D", "linked inside D", "cut short"])
def test_local_weights_changed_between_the_pulls_two_reads_of_them_are_confined_and_named(root, monkeypatch, change):
    """A pull from 2 to 3 reads the local weights twice under its lock (which other writers of D do not take): to
    apply the delta to (read_checkpoint), then to patch. The second read holds the same rule as the first: the
    weights swapped between the two for a link to a byte-identical copy outside D, refused naming the link, the copy
    not read; for a link to that copy inside D, patched (the link replaced by the file, the copy kept); cut short,
    refused naming the file. A refused pull leaves the local checkpoint as the change left it."""
    local, outside = root / "local", root.parent / "outside"
    _pull(root, 2)
    held = local / "model.safetensors"
    copy = (outside if change == "linked outside D" else root) / "v2.safetensors"
    shutil.copyfile(held, copy)
    version2 = copy.read_bytes()
    kept, changed = _untouched(outside), []

    def read_then_changed(state, *args):  # the pull's one version, after read_checkpoint and before the patch
        held.unlink()
        if change == "cut short":
            held.write_bytes(b"\xff" * 8)
        else:
            held.symlink_to(copy)
        changed.append(_tree(local))
        return weight_delta.apply_version(state, *args)

    monkeypatch.setattr(weight_pull, "apply_version", read_then_changed)
    refusals = {
        "linked outside D": (Outside, f"{held}: resolves to {copy}, outside {root}"),
        "cut short": (
            weight_delta.DeltaRefused,
            "model.safetensors: not a safetensors file (8 bytes, short of the header it announces)",
        ),
    }
    if change in refusals:
        kind, says = refusals[change]
        with pytest.raises(kind) as refused:
            _pull(root, 3)
        assert str(refused.value).startswith(says), str(refused.value)
        assert len(changed) == 1 and _tree(local) == changed[0]
    else:
        assert _pull(root, 3) == 1 and same(pulled(local), raw(trained(3))) and not held.is_symlink()
        assert copy.read_bytes() == version2
    _held(outside, kept)


def test_a_local_checkpoint_inside_a_published_version_is_refused_and_the_chain_kept(root):
    """Pulling into weight_v000001 (or a directory in it) would write into the chain: refused, naming the field;
    a local checkpoint beside the versions is pulled."""
    chain = _tree(root / "chain")
    for local in ("chain/weight_v000001", "chain/weight_v000001/sub"):
        with pytest.raises(BadInput) as refused:
            _pull(root, 3, local=local)
        assert str(refused.value) == (
            f"local_checkpoint_dir: {root / local} lies in the published version {root / 'chain' / 'weight_v000001'}"
            ": a pull writes the local checkpoint, never a published version"
        )
    assert _tree(root / "chain") == chain
    assert _pull(root, 3, local="chain/local") == 2  # in the chain's directory, not in a version


def test_a_local_checkpoint_outside_the_root_is_refused_and_the_servers_own_model_is_read_from_anywhere(root):
    """The local checkpoint is held to the root like every version (a link to a directory outside it refused,
    nothing made there); version 0 is the server's own model (--model-path), read wherever it lies."""
    outside = root.parent / "outside" / "local"
    outside.mkdir()
    (root / "local").symlink_to(outside)
    with pytest.raises(Outside):
        _pull(root, 2)
    assert list(outside.iterdir()) == []
    (root / "local").unlink()
    base = root.parent / "outside" / "chain" / "weight_v000001"  # the server's model, outside --weights-dir
    assert weight_pull.pull(root / "local", base, root / "chain", 0, root) == 0
    assert weight_pull.applied_version(root / "local") == 0 and same(pulled(root / "local"), raw(trained(1)))


# ---- staged: nothing changes until every version is verified ------------------------------------------------------


def _drop_shard(version: Path) -> None:
    (version / weight_delta.DELTA_FILE).unlink()


def _flip_byte(version: Path) -> None:
    path = version / weight_delta.DELTA_FILE
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x40
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("damage", [_drop_shard, _flip_byte], ids=["a shard missing", "a byte changed"])
@pytest.mark.parametrize("held", [None, 1], ids=["from nothing", "from version 1"])
def test_a_refused_pull_changes_no_byte_of_the_local_checkpoint_or_its_state(root, damage, held):
    """Version 3 damaged: a pull to 3 is refused naming version 3, whether it starts from the full version 1 (which
    it read, and did not write) or from the version held; the local directory is byte for byte as before. The same
    pull to 2 then goes through."""
    if held is not None:
        _pull(root, held)
    damage(root / "chain" / "weight_v000003")
    before = _tree(root / "local")
    with pytest.raises(weight_delta.DeltaRefused, match="^version 3, "):
        _pull(root, 3)
    assert _tree(root / "local") == before
    _pull(root, 2)
    assert weight_pull.applied_version(root / "local") == 2 and same(pulled(root / "local"), raw(trained(2)))


def _killed_pull(root: Path, target: int, failpoint: str) -> int:
    """`pull` in a process of its own, SIGKILLed at `failpoint` (rlbench/rundir/failpoints.py): its exit status."""
    code = (
        "import sys; from pathlib import Path; from rlbench.core.weight_pull import pull; "
        "r = Path(sys.argv[1]); pull(r / 'local', r / 'unused', r / 'chain', int(sys.argv[2]), r)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLBENCH_FAILPOINT": failpoint}
    return subprocess.run([sys.executable, "-c", code, str(root), str(target)], env=env, check=False).returncode


@pytest.mark.parametrize(
    ("held", "failpoint"),
    [
        pytest.param(held, point, id=f"{label}, {point}")
        for held, label in ((None, "from nothing"), (1, "from version 1"), ("foreign", "from another dir"))
        for point in ("pull.staging@1", "pull.staged@1", "pull.journal@1", "pull.renamed@1", "pull.marked@1")
        + (("pull.removed@1",) if held == "foreign" else ())  # only there has the pull a file to remove
    ],
)
def test_a_pull_killed_at_each_step_leaves_its_version_or_the_next_pull_finishes_it(root, failpoint, held):
    """A pull to 3 SIGKILLed at each step of its writes, from an empty local checkpoint (two files from the full
    version 1), from version 1 (one file rewritten) or from a directory of two files no pull wrote (removed: the
    local checkpoint becomes the full version's copy): before the journal, the checkpoint and its marker are as
    they were, the staged files named for the files they replace; after it, the journal is there for the next
    pull. Either way the next pull leaves exactly what a pull to 3 that was never killed leaves (every file's
    bytes, the marker), with no staged file."""
    if held == "foreign":
        (root / "local").mkdir()
        for name in ("a.txt", "b.txt"):
            (root / "local" / name).write_text(name)
        held = None
    elif held is not None:
        _pull(root, held)
    before = _tree(root / "local")
    _pull(root, 3, local="reference")
    assert _killed_pull(root, 3, failpoint) == -signal.SIGKILL
    after = _tree(root / "local")
    staged = [k.split("/")[-1] for k in after if k.startswith(".weight_sync/staging/")]
    assert all(any(n.startswith(f".{f}.") for f in ("model.safetensors", "config.json")) for n in staged), staged
    journalled = failpoint.split("@")[0] not in ("pull.staging", "pull.staged")
    assert (".weight_sync/" + weight_pull.JOURNAL in after) == journalled
    if not journalled:
        assert {k: v for k, v in after.items() if not k.startswith(".weight_sync/staging/")} == before
        assert weight_pull.applied_version(root / "local") == held
    assert _pull(root, 3) == (0 if journalled else 3 - (held or 1))
    assert _tree(root / "local") == _tree(root / "reference")


# ---- rlbench check weights ----------------------------------------------------------------------------------------


def _check(chain: Path):
    return cli("check", "weights", str(chain))


def test_check_weights_counts_the_checksums_it_held_not_the_names_an_index_lists(root):
    """Without weight_maps (an index that promises nothing) every tensor in the files is still verified and
    counted; an index that names a tensor no file holds is exit 1 naming it."""
    chain = root / "chain"
    files = 0
    for version in (2, 3):
        index = chain / f"weight_v{version:06d}" / weight_delta.INDEX
        table = json.loads(index.read_text())
        files += len(table.pop("weight_map"))
        index.write_text(json.dumps(table))
    done = _check(chain)
    assert done.returncode == 0 and f"; {files} tensor checksums held after applying" in done.stdout, done.stdout
    table = json.loads(index.read_text()) | {"weight_map": {"a": weight_delta.DELTA_FILE, "absent": "x.safetensors"}}
    index.write_text(json.dumps(table))
    done = _check(chain)
    assert done.returncode == 1
    assert "then version 3, absent: in its index, in none of its files (1 tensors)" in done.stdout


@pytest.mark.parametrize("version", [1, 3], ids=["the first, full", "a delta"])
def test_check_weights_follows_no_link_out_of_the_chain(root, version):
    """A version that is a link out of the chain's directory: exit 2 naming it, nothing of it read; the same
    link to a copy inside the chain's directory verifies."""
    chain, name = root / "chain", f"weight_v{version:06d}"
    shutil.move(chain / name, root / "moved")
    (chain / name).symlink_to(root / "moved")
    kept = _untouched(root / "moved")
    done = _check(chain)
    assert done.returncode == 2 and done.stderr.startswith(f"rlbench: error: {chain / name}: resolves to")
    assert len(done.stderr.strip().splitlines()) == 1
    _held(root / "moved", kept)
    (chain / name).unlink()
    shutil.move(root / "moved", chain / "store")
    (chain / name).symlink_to(chain / "store")
    assert _check(chain).returncode == 0


@pytest.mark.parametrize(
    "linked",
    [
        "weight_v000001/model.safetensors",
        f"weight_v000003/{weight_delta.INDEX}",
        f"weight_v000003/{weight_delta.DELTA_FILE}",
    ],
    ids=["a full version's weights", "a delta's index", "a delta's tensor file"],
)
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_check_weights_reads_no_file_of_a_version_through_a_link_out_of_the_chain(root, where, linked):
    """A file of a version in the chain's directory (the full version's weights, a delta's index, a delta's tensor
    file) a link to a byte-identical copy of itself (no checksum can refuse it): the copy outside the chain's
    directory, exit 2 in one line naming the link, the copy not read; the copy inside it, the chain verifies."""
    chain, outside = root / "chain", root.parent / "outside"
    version = linked.split("/")[0]
    store = outside / "chain" if where == "outside" else chain / "store"
    if where == "inside":
        shutil.copytree(chain / version, store / version)
    assert (store / linked).read_bytes() == (chain / linked).read_bytes()
    (chain / linked).unlink()
    (chain / linked).symlink_to(store / linked)
    kept = _untouched(outside)
    done = _check(chain)
    if where == "outside":
        assert done.returncode == 2, done.stdout + done.stderr
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"rlbench: error: {chain / linked}: resolves to {store / linked}, outside {chain}"), line
    else:
        assert done.returncode == 0 and done.stdout.startswith("verified: versions 1..3"), done.stdout + done.stderr
    _held(outside, kept)


@pytest.mark.parametrize(
    "linked", ["weight_v000002", f"weight_v000002/{weight_delta.INDEX}"], ids=["itself", "its index"]
)
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_check_weights_refuses_a_first_delta_linked_out_of_the_chain_before_asking_for_its_base(root, where, linked):
    """A chain that starts with a delta (version 2, version 1 moved out to be its --base) whose directory or index
    is a link to a byte-identical copy: outside the chain's directory, exit 2 naming the link, --base given or not
    (the index is not read to learn that the version is a delta, so not asked for a base), the copy not read; inside
    it, a first delta like any other: without --base undetermined, naming --base, and with it verified."""
    chain, outside = root / "chain", root.parent / "outside"
    shutil.move(chain / "weight_v000001", root / "base")
    store = outside / "chain" if where == "outside" else chain / "store"
    if where == "inside":
        shutil.copytree(chain / "weight_v000002", store / "weight_v000002")
    if (chain / linked).is_dir():
        shutil.rmtree(chain / linked)
    else:
        (chain / linked).unlink()
    (chain / linked).symlink_to(store / linked)
    kept = _untouched(outside)
    alone, based = _check(chain), cli("check", "weights", str(chain), "--base", str(root / "base"))
    if where == "outside":
        for done in (alone, based):
            assert done.returncode == 2, done.stdout + done.stderr
            [line] = done.stderr.strip().splitlines()
            assert line.startswith(f"rlbench: error: {chain / linked}: resolves to {store / linked}, outside {chain}")
    else:
        assert alone.returncode == 2 and alone.stderr.startswith(
            "rlbench: error: --base: undetermined: version 2 is a delta"
        ), alone.stderr
        assert based.returncode == 0 and based.stdout.startswith("verified: versions 2..3"), based.stdout
    _held(outside, kept)


@pytest.mark.parametrize(
    ("swapped", "reader"),
    [
        ("weight_v000001", "read_checkpoint"),
        ("weight_v000003", "apply_version"),
        (f"weight_v000003/{weight_delta.INDEX}", "apply_version"),
    ],
    ids=["the full version it seeds from", "a delta", "a delta's index"],
)
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_version_swapped_for_a_link_after_the_pull_checked_it_is_confined_where_it_is_read(
    root, monkeypatch, where, swapped, reader
):
    """A pull learns whether each version is a delta (is_delta, which confines the version and its index) before it
    reads it (read_checkpoint, apply_version), and other writers of D take no lock: the version it seeds from, a
    delta, or a delta's index swapped between the two for a link to a byte-identical copy: outside D, refused where
    it is read, naming the link (the version, not a file in it), the copy not read and the local checkpoint as it
    was; inside D, pulled as the version's own."""
    chain, outside = root / "chain", root.parent / "outside"
    target = 1 if reader == "read_checkpoint" else 3
    if target == 3:
        _pull(root, 2)
    store = outside / "chain" if where == "outside" else root / "store"
    if where == "inside":
        shutil.copytree(chain / swapped.split("/")[0], store / swapped.split("/")[0])
    read, link, swaps = getattr(weight_pull, reader), chain / swapped, []

    def swap_then_read(*args):  # after the pull's is_delta of the version, before the read
        if not swaps:
            shutil.rmtree(link) if link.is_dir() else link.unlink()
            link.symlink_to(store / swapped)
            swaps.append(link)
        return read(*args)

    monkeypatch.setattr(weight_pull, reader, swap_then_read)
    before, kept = _tree(root / "local"), _untouched(outside)
    if where == "outside":
        with pytest.raises(Outside) as refused:
            _pull(root, target)
        assert str(refused.value).startswith(f"{link}: resolves to {store / swapped}, outside {root}"), refused.value
        assert _tree(root / "local") == before
    else:
        _pull(root, target)
        assert weight_pull.applied_version(root / "local") == target
        assert same(pulled(root / "local"), raw(trained(target)))
    assert swaps == [link]
    _held(outside, kept)


# ---- files of the wrong shape: one line naming the file and the field ----------------------------------------------


def _index_edit(change):
    def edit(version: Path):
        index = version / weight_delta.INDEX
        index.write_text(json.dumps(change(json.loads(index.read_text()))))

    return edit


def _header_edit(change):
    """Version 3's delta file with its header rewritten (the data kept)."""

    def edit(version: Path):
        path = version / weight_delta.DELTA_FILE
        blob = path.read_bytes()
        length = int.from_bytes(blob[:8], "little")
        header = json.dumps(change(json.loads(blob[8 : 8 + length]))).encode()
        path.write_bytes(len(header).to_bytes(8, "little") + header + blob[8 + length :])

    return edit


def _offsets_as_text(header):
    header["a"]["data_offsets"] = [str(o) for o in header["a"]["data_offsets"]]
    return header


def _offsets(begin, end):
    """`a`'s offsets set to [begin, end] (end None: one past the file's data)."""

    def change(header):
        header["a"]["data_offsets"] = [begin, end if end is not None else _data(header) + 1]
        return header

    return change


def _data(header) -> int:
    """The data bytes after the header: the end of the last tensor (safetensors packs them)."""
    return max(info["data_offsets"][1] for name, info in header.items() if name != "__metadata__")


@pytest.mark.parametrize(
    ("edit", "file", "says"),
    [
        (_index_edit(lambda t: [t]), weight_delta.INDEX, "expected an object, got [{'metadata'"),
        (_index_edit(lambda t: t | {"metadata": "xor"}), weight_delta.INDEX, "metadata: expected an object of strings"),
        (
            _index_edit(lambda t: t | {"metadata": t["metadata"] | {"version": None}}),
            weight_delta.INDEX,
            "metadata: expected an object of strings, got {'version': None",
        ),
        (
            _index_edit(lambda t: t | {"weight_map": ["a"]}),
            weight_delta.INDEX,
            "weight_map: expected an object of strings, got ['a']",
        ),
        (_header_edit(lambda h: [h]), weight_delta.DELTA_FILE, "its safetensors header is a list, expected an object"),
        (_header_edit(_offsets_as_text), weight_delta.DELTA_FILE, "a.data_offsets: expected [begin, end], integers"),
        (
            _header_edit(lambda h: h | {"__metadata__": {"a": 1}}),
            weight_delta.DELTA_FILE,
            "__metadata__: expected an object of strings, got {'a': 1}",
        ),
        (
            _header_edit(lambda h: h | {"a": [0, 4]}),
            weight_delta.DELTA_FILE,
            "a.data_offsets: expected [begin, end], integers within the file's {data} data bytes, got None",
        ),
        (
            _header_edit(_offsets(0, None)),
            weight_delta.DELTA_FILE,
            "a.data_offsets: expected [begin, end], integers within the file's {data} data bytes, got [0, {past}]",
        ),
        (
            _header_edit(_offsets(5, 4)),
            weight_delta.DELTA_FILE,
            "a.data_offsets: expected [begin, end], integers within the file's {data} data bytes, got [5, 4]",
        ),
    ],
    ids=[
        "index a list",
        "metadata text",
        "version null",
        "weight_map a list",
        "header a list",
        "offsets text",
        "sums",
        "an entry a list",
        "past the data",
        "backwards",
    ],
)
def test_a_version_file_of_the_wrong_json_shape_is_bad_input_in_one_line(root, edit, file, says):
    """Exit 2, one line naming the file and the field, from `rlbench check weights`; a pull is refused (BadInput,
    which /pull_weights answers 400) leaving the local checkpoint as it was."""
    _pull(root, 2)
    before = _tree(root / "local")
    blob = (root / "chain" / "weight_v000003" / weight_delta.DELTA_FILE).read_bytes()
    data = len(blob) - 8 - int.from_bytes(blob[:8], "little")
    says = says.replace("{data}", str(data)).replace("{past}", str(data + 1))
    edit(root / "chain" / "weight_v000003")
    done = _check(root / "chain")
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"rlbench: error: {root / 'chain' / 'weight_v000003' / file}: {says}"), line
    with pytest.raises(BadInput):
        _pull(root, 3)
    assert _tree(root / "local") == before


def test_a_zstd_frame_larger_than_its_tensor_is_refused_before_it_is_expanded(root):
    """A diff whose frame declares (or, without a declared size, holds) far more bytes than the tensor takes: refused
    naming version and tensor, no memory for it allocated."""
    import zstandard
    from safetensors.numpy import save

    version = root / "chain" / "weight_v000003"
    path = version / weight_delta.DELTA_FILE
    sums = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])["__metadata__"]
    for declared in (True, False):
        frame = zstandard.ZstdCompressor(level=19, write_content_size=declared).compress(bytes(1 << 26))
        path.write_bytes(save({"a": np.frombuffer(frame, np.uint8)}, metadata={"a": sums["a"]}))
        state = weight_delta.read_checkpoint(root / "chain" / "weight_v000001")
        weight_delta.apply_version(state, root / "chain" / "weight_v000002", 1)
        with pytest.raises(weight_delta.DeltaRefused) as refused:
            weight_delta.apply_version(state, version, 2)
        size = raw(trained(3))["a"].size
        says = f"declares {1 << 26} bytes, the tensor takes at most {size}" if declared else f"within {size} bytes"
        assert str(refused.value).startswith("version 3, a: its zstd") and says in str(refused.value)


def test_an_overwrite_frame_holds_at_most_an_entry_per_byte_of_its_tensor(tmp_path):
    """An overwrite's diff is a 4-byte count, then at most one 4-byte position and one new byte per byte of the
    tensor: 4 + 5 * n bytes for a tensor of n, which a version that changes every byte reaches, and applies. One byte
    more (the size declared, or not), or a valid overwrite of one entry more (a position twice, its checksum holding),
    refused naming version and tensor, before anything past the bound is allocated."""
    import zstandard
    from safetensors.numpy import save

    root = tmp_path / "chain"
    publisher = weight_delta.Publisher(root, "overwrite")
    publisher.publish_full(1, {"w": torch.zeros(7, dtype=torch.uint8)}, CONFIG)
    publisher.publish(2, {"w": torch.ones(7, dtype=torch.uint8)})
    limit, path = 4 + 5 * 7, root / "weight_v000002" / weight_delta.DELTA_FILE
    blob = path.read_bytes()
    spans, sums = weight_delta.safetensors_header(blob, str(path))
    begin, end = spans["w"]
    diff = zstandard.ZstdDecompressor().decompress(blob[begin:end])
    assert len(diff) == limit and zstandard.get_frame_parameters(blob[begin:end]).content_size == limit
    state = weight_delta.read_checkpoint(root / "weight_v000001")
    assert weight_delta.apply_version(state, root / "weight_v000002", 1) == (2, 1) and state["w"][1].tolist() == [1] * 7
    again = (8).to_bytes(4, "little") + np.array([*range(7), 0], "<u4").tobytes() + bytes([1] * 8)
    for content, declared, says in (
        (diff + b"\x00", True, f"declares {limit + 1} bytes, the tensor takes at most {limit}"),
        (diff + b"\x00", False, f"does not decompress within {limit} bytes"),
        (again, True, f"declares {limit + 5} bytes, the tensor takes at most {limit}"),
        (again, False, f"does not decompress within {limit} bytes"),
    ):
        frame = zstandard.ZstdCompressor(level=1, write_content_size=declared).compress(content)
        path.write_bytes(save({"w": np.frombuffer(frame, np.uint8)}, metadata=sums))
        state = weight_delta.read_checkpoint(root / "weight_v000001")
        with pytest.raises(weight_delta.DeltaRefused) as refused:
            weight_delta.apply_version(state, root / "weight_v000002", 1)
        assert str(refused.value).startswith("version 2, w: its zstd ") and says in str(refused.value), refused.value
        assert state["w"][1].tolist() == [0] * 7


# ---- /update_weights_from_disk and /pull_weights on a server with --weights-dir -----------------------------------


def test_the_server_reads_no_weights_through_a_link_out_of_its_weights_dir(tmp_path):
    """rlbench serve --weights-dir D: /update_weights_from_disk of a directory in D whose model.safetensors links
    outside D answers 400 and the served weights stay; linked inside D it loads. /pull_weights of a chain whose
    version links outside D answers 400 and the local checkpoint is as it was."""
    import requests

    from rlbench.serve.server import ServeConfig, serve_in_thread
    from tests.conformance.sglang.conftest import write_checkpoint

    d = tmp_path / "D"
    base = write_checkpoint(d / "base")
    other = write_checkpoint(tmp_path / "outside" / "other", seed=2)
    linked = d / "linked"
    linked.mkdir()
    shutil.copyfile(other / "config.json", linked / "config.json")
    (linked / "model.safetensors").symlink_to(other / "model.safetensors")
    kept = _untouched(tmp_path / "outside")
    serving = serve_in_thread(ServeConfig(model_path=str(base), load_format="auto", port=0, weights_dir=str(d)))
    try:
        checksum = requests.post(serving.url + "/weights_checker", json={"action": "checksum"}, timeout=60).json()
        load = requests.post(serving.url + "/update_weights_from_disk", json={"model_path": str(linked)}, timeout=60)
        assert load.status_code == 400 and "resolves to" in load.json()["message"], load.text
        same = requests.post(serving.url + "/weights_checker", json={"action": "checksum"}, timeout=60).json()
        assert same == checksum
        shutil.copyfile(other / "model.safetensors", d / "inside.safetensors")
        (linked / "model.safetensors").unlink()
        (linked / "model.safetensors").symlink_to(d / "inside.safetensors")
        load = requests.post(serving.url + "/update_weights_from_disk", json={"model_path": str(linked)}, timeout=60)
        assert load.status_code == 200, load.text
        weights = {k: torch.ones(2) for k in ("w",)}
        publisher = weight_delta.Publisher(tmp_path / "outside" / "chain")
        publisher.publish_full(1, weights, CONFIG)
        (d / "chain").mkdir()
        (d / "chain" / "weight_v000001").symlink_to(tmp_path / "outside" / "chain" / "weight_v000001")
        kept = _untouched(tmp_path / "outside")
        body = {"local_checkpoint_dir": str(d / "local"), "source_dir": str(d / "chain"), "target_version": 1}
        pulled = requests.post(serving.url + "/pull_weights", json=body, timeout=60)
        assert pulled.status_code == 400 and "resolves to" in pulled.json()["message"], pulled.text
        assert _tree(d / "local") == {}
    finally:
        serving.close()
    _held(tmp_path / "outside", kept)


def test_an_empty_tensor_and_a_frame_without_its_size_are_read(tmp_path):
    """What safetensors and zstd may write and slime's readers take: a tensor of no elements (begin == end) in a full
    version, and a delta frame that does not declare its size (bounded by the tensor's then): both applied."""
    import zstandard
    from safetensors.numpy import save

    weights = trained(1) | {"e": torch.zeros(0)}
    publisher = weight_delta.Publisher(tmp_path / "chain")
    publisher.publish_full(1, weights, CONFIG)
    publisher.publish(2, trained(2) | {"e": torch.zeros(0)})
    state = weight_delta.read_checkpoint(tmp_path / "chain" / "weight_v000001")
    assert state["e"][1].size == 0 and same({n: b for n, (_, b) in state.items()}, raw(weights))
    path = tmp_path / "chain" / "weight_v000002" / weight_delta.DELTA_FILE
    blob = path.read_bytes()
    spans, sums = weight_delta.safetensors_header(blob, str(path))
    frames = {
        name: np.frombuffer(
            zstandard.ZstdCompressor(level=1, write_content_size=False).compress(
                zstandard.ZstdDecompressor().decompress(blob[begin:end])
            ),
            np.uint8,
        )
        for name, (begin, end) in spans.items()
    }
    path.write_bytes(save(frames, metadata=sums))
    assert weight_delta.apply_version(state, tmp_path / "chain" / "weight_v000002", 1) == (2, len(frames))
    assert same({n: b for n, (_, b) in state.items()}, raw(trained(2) | {"e": torch.zeros(0)}))
