"""slime's delta weight sync (rlbench/core/weight_delta.py, issue 38), held to slime's own code: a chain published by
slime's own trainer-side encoder and reproduced by slime's own receiving side (tests/slime_deltas/make_deltas.py, slime
624b824a8) verifies with `rlbench check weights`, and each way it can go wrong is named; rlbench's writer writes the
bytes slime's receiving side was seen to pull, and rlbench's pull reaches the same weights."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from rlbench.core import weight_delta, weight_pull
from tests.conftest import REPO, cli
from tests.cpu.weight_chains import (
    CONFIG,
    chain as _chain,
    pulled as _pulled,
    raw as _raw,
    same as _same,
    trained as _trained,
)

DELTAS = REPO / "examples" / "slime-delta-weights"  # written by tests/slime_deltas/make_deltas.py
RECORD = REPO / "tests" / "slime_deltas" / "pulled_by_slime.json"


def _check(chain: Path, *more: str):
    return cli("check", "weights", str(chain), *more)


def _copy(tmp_path: Path) -> Path:
    chain = tmp_path / "chain"
    shutil.copytree(DELTAS / "chain", chain)
    return chain


def test_a_chain_slime_published_verifies_to_the_trainers_weights():
    done = _check(DELTAS / "chain", "--base", str(DELTAS / "base"), "--final", str(DELTAS / "final"))
    assert done.returncode == 0, done.stdout + done.stderr
    changed = sum(
        len(json.loads((p / "model.safetensors.index.json").read_text())["weight_map"])
        for p in sorted((DELTAS / "chain").glob("weight_v*"))
        if (p / "model.safetensors.index.json").is_file()
    )
    tensors = len(weight_delta.read_checkpoint(DELTAS / "final"))
    assert done.stdout.startswith(
        f"verified: versions 1..5 (5, full: 4); {changed} tensor checksums held after applying"
    )
    assert f"{tensors} tensors equal the checkpoint given" in done.stdout


def _flip(chain: Path) -> str:
    """One byte of version 2's first compressed tensor flipped: which tensor."""
    path = chain / "weight_v000002" / weight_delta.DELTA_FILE
    blob = bytearray(path.read_bytes())
    spans, _ = weight_delta.safetensors_header(bytes(blob), str(path))
    name = sorted(spans)[0]
    begin, end = spans[name]
    blob[(begin + end) // 2] ^= 0x40
    path.write_bytes(bytes(blob))
    return name


def _twice(chain: Path) -> None:
    """Version 3 replaced by version 1's xor delta again, declared as 3 on 2 (a version applied twice)."""
    v3 = chain / "weight_v000003"
    shutil.rmtree(v3)
    shutil.copytree(chain / "weight_v000001", v3)
    index = json.loads((v3 / "model.safetensors.index.json").read_text())
    index["metadata"].update(version="000003", base_version="000002")
    (v3 / "model.safetensors.index.json").write_text(json.dumps(index))


def _swap(chain: Path) -> None:
    a, b, tmp = chain / "weight_v000002", chain / "weight_v000003", chain / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.parametrize("case", ["flipped byte", "applied twice", "out of order", "wrong base"])
def test_each_broken_chain_is_named_by_version_and_tensor(tmp_path, case):
    chain, base = _copy(tmp_path), DELTAS / "base"
    expected = {
        "applied twice": "version 3, model.",
        "out of order": "version 3 (weight_v000002): published under weight_v000002 (out of order)",
        "wrong base": "version 1, model.",
    }.get(case)
    if case == "flipped byte":
        expected = f"version 2, {_flip(chain)}:"
    elif case == "applied twice":
        _twice(chain)
    elif case == "out of order":
        _swap(chain)
    else:
        base = DELTAS / "final"
    done = _check(chain, "--base", str(base))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("refused: ") and expected in done.stdout, done.stdout
    if case != "out of order":
        assert "is not the published one" in done.stdout or "does not decompress" in done.stdout


def _rewrite(version: Path, edit) -> None:
    """A delta version's file written again after `edit(diffs, sums)` changes its tensors (name -> the compressed
    diff, uint8) and their checksums (the header's metadata) in place."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    path = version / weight_delta.DELTA_FILE
    with safe_open(str(path), "np") as f:
        diffs, sums = {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata())
    edit(diffs, sums)
    save_file(diffs, str(path), metadata=sums)


FIRST = "model.embed_tokens.weight"  # a tensor versions 2 (an overwrite) and 3 (an xor) both change


def _edit_diff(version: Path, change, name: str = FIRST) -> None:
    """A tensor's diff in `version` decompressed, changed (`change(bytes) -> bytes`) and compressed again."""
    import zstandard

    def edit(diffs, sums):
        raw = zstandard.ZstdDecompressor().decompress(diffs[name].tobytes())
        diffs[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(change(raw)), np.uint8)

    _rewrite(version, edit)


def _short_xor(version: Path) -> None:  # one byte fewer than the tensor has
    _edit_diff(version, lambda raw: raw[:-1])


def _overcounted(version: Path) -> None:  # an overwrite counting one position more than it holds
    _edit_diff(version, lambda raw: (int.from_bytes(raw[:4], "little") + 1).to_bytes(4, "little") + raw[4:])


def _renamed(version: Path) -> None:  # FIRST's diff and checksum under a name the weights lack
    def edit(diffs, sums):
        diffs["model.layers.9.mlp.up_proj.weight"] = diffs.pop(FIRST)
        sums["model.layers.9.mlp.up_proj.weight"] = sums.pop(FIRST)

    _rewrite(version, edit)


def _gzip(version: Path) -> None:  # the index names a compression slime's receiving side does not read
    index = json.loads((version / weight_delta.INDEX).read_text())
    index["metadata"]["compression_format"] = "gzip"
    (version / weight_delta.INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("version", "edit", "says"),
    [
        pytest.param(3, _short_xor, f"version 3, {FIRST}: 40191 diff bytes for a tensor of 40192", id="xor short"),
        pytest.param(
            2, _overcounted, f"version 2, {FIRST}: an overwrite of 10755 positions that does not fit", id="overwrite"
        ),
        pytest.param(
            3,
            _renamed,
            "version 3, model.layers.9.mlp.up_proj.weight: no such tensor in the weights it applies to",
            id="no such tensor",
        ),
        pytest.param(2, _gzip, "version 2: compression_format 'gzip', expected zstd", id="not zstd"),
    ],
)
def test_a_delta_that_cannot_be_applied_as_published_is_refused_naming_version_and_tensor(
    tmp_path, version, edit, says
):
    """slime's receiving side applies only what fits the weights it holds: an xor diff of another size than its
    tensor, an overwrite whose count its positions and bytes do not hold, a tensor the weights lack and a
    compression other than zstd each stop `check weights` at that version (exit 1), named, never applied anyway
    (nor a crash)."""
    chain = _copy(tmp_path)
    edit(chain / f"weight_v{version:06d}")
    done = _check(chain, "--base", str(DELTAS / "base"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith(f"refused: versions 1..{version - 1} verified, then {says}"), done.stdout


def test_check_weights_holds_the_chains_last_state_to_the_final_checkpoint_tensor_by_tensor(tmp_path):
    """--final: the weights the chain ends at are compared with the checkpoint given, every tensor's bytes; one
    byte changed in one tensor of the trainer's final checkpoint is named (exit 1)."""
    import torch
    from safetensors.torch import load_file, save_file

    final = tmp_path / "final"
    shutil.copytree(DELTAS / "final", final)
    tensors = load_file(str(final / "model.safetensors"))
    name = sorted(tensors)[-1]
    tensors[name].reshape(-1).view(torch.uint8)[0] ^= 1
    save_file(tensors, str(final / "model.safetensors"))
    done = _check(DELTAS / "chain", "--base", str(DELTAS / "base"), "--final", str(final))
    assert done.returncode == 1, done.stdout + done.stderr
    says = f"after version 5: {name} differs from the checkpoint given (1 tensors do)"
    assert done.stdout.startswith(f"refused: versions 1..5 verified, then {says}"), done.stdout


def test_a_delta_is_published_only_over_the_bases_tensors_at_their_sizes(tmp_path):
    """The trainer's side refuses a delta it could not encode on its base: a tensor of another byte size, or a
    tensor missing (which would otherwise be left out of the version silently); no version directory is written,
    and the base stays the last published version's, every tensor of it (the next delta is taken against it)."""
    states = _states()
    name = list(states[1])[-1]  # the last one encoded: every tensor before it was already diffed
    config = REPO / "rlbench/fixtures/models/tiny-qwen3/config.json"
    for weights, says in (
        ({**states[1], name: states[1][name].reshape(-1)[:-1]}, f"version 2, {name}: "),
        ({k: v for k, v in states[1].items() if k != name}, "version 2: other tensors than the base's"),
    ):
        publisher = weight_delta.Publisher(tmp_path / "chain")
        publisher.publish_full(1, states[0], config)
        with pytest.raises(weight_delta.DeltaRefused) as refused:
            publisher.publish(2, weights)
        assert str(refused.value).startswith(says), refused.value
        assert not (tmp_path / "chain" / "weight_v000002").exists()
        base = {k: weight_delta.raw_bytes(v) for k, v in states[0].items()}
        assert set(publisher.snapshot) == set(base)
        assert all((publisher.snapshot[k] == base[k]).all() for k in base)


def test_check_weights_that_cannot_judge_says_so(tmp_path):
    done = _check(DELTAS / "chain")
    assert done.returncode == 2 and "undetermined: version 1 is a delta and no --base" in done.stderr
    (tmp_path / "empty").mkdir()
    done = _check(tmp_path / "empty")
    assert done.returncode == 2 and "no weight_v<N> version directory" in done.stderr


def _module():
    spec = importlib.util.spec_from_file_location("make_deltas", RECORD.parent / "make_deltas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _states():
    import torch

    return _module().states(torch)


def test_rlbench_writes_what_slime_pulled_and_pulls_what_slime_did(tmp_path):
    """The states make_deltas.py published with rlbench's writer: the same file bytes slime's receiving side pulled
    then (pulled_by_slime.json), and rlbench's pull reaches, version by version, the tensors slime's reached."""
    record = json.loads(RECORD.read_text())
    states = _states()
    ours = tmp_path / "ours"
    publisher = weight_delta.Publisher(ours)
    publisher.publish_full(1, states[1], REPO / "rlbench/fixtures/models/tiny-qwen3/config.json")
    local = tmp_path / "local"
    for version in range(1, len(states)):
        if version > 1:
            publisher.publish(version, states[version])
        weight_pull.pull(local, DELTAS / "base", ours, version)
        got = {n: hashlib.sha256(b.tobytes()).hexdigest() for n, (_, b) in weight_delta.read_checkpoint(local).items()}
        assert got == record["sha256_after_each_version"][str(version)], f"version {version}"
    digest = _module().content_digest
    assert {str(f.relative_to(ours)): digest(f) for f in sorted(ours.rglob("*")) if f.is_file()} == record[
        "rlbench_chain_sha256"
    ]


def test_a_refused_version_leaves_the_local_checkpoint_as_it_was(tmp_path):
    """The local checkpoint at version 3, its marker lost (says 2): pulling 3 again would apply its xor twice; every
    tensor is verified before anything is written, so it is refused and not one byte changes."""
    local = tmp_path / "local"
    weight_pull.pull(local, DELTAS / "base", DELTAS / "chain", 3)
    before = {p.name: p.read_bytes() for p in local.glob("*.safetensors")}
    (local / weight_delta.SYNC_DIR / "state.json").write_text(json.dumps({"version": "000002"}))
    with pytest.raises(weight_delta.DeltaRefused, match="version 3, .*applied twice"):
        weight_pull.pull(local, DELTAS / "base", DELTAS / "chain", 3)
    assert {p.name: p.read_bytes() for p in local.glob("*.safetensors")} == before
    overwrite = tmp_path / "again"
    weight_pull.pull(overwrite, DELTAS / "base", DELTAS / "chain", 2)  # version 2 is an overwrite: idempotent
    state = weight_delta.read_checkpoint(overwrite)
    held, _ = weight_delta.apply_version(state, DELTAS / "chain" / "weight_v000002", 1)
    assert held == 2 and all(
        np.array_equal(state[n][1], b) for n, (_, b) in weight_delta.read_checkpoint(overwrite).items()
    )


@pytest.mark.slow
def test_a_run_with_delta_sync_equals_the_full_sync_run_and_its_chain_verifies(tmp_path):
    """`rlbench serve` pulls each version through /pull_weights and reloads it; the run's bytes are the full-sync
    run's; the chain it published verifies against the run's last checkpoint; each sync's bytes are recorded."""
    toml = tmp_path / "d.toml"
    toml.write_text(
        f'steps = 3\ncheckpoint_every = 3\n[rollout]\nbackend = "sglang"\nsglang_server = "rlbench"\n'
        f'weights_dir = "{tmp_path / "weights"}"\n'
    )
    full = cli("run", "-c", str(toml), "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr
    delta = cli("run", "-c", str(toml), "--out", str(tmp_path / "delta"), "--update-weight-mode", "delta")
    assert delta.returncode == 0, delta.stderr
    assert (tmp_path / "full" / "checksums.jsonl").read_bytes() == (tmp_path / "delta" / "checksums.jsonl").read_bytes()
    rows = [json.loads(line) for line in (tmp_path / "delta" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["perf/update_weights_wire_bytes"] > 0 for row in rows)
    done = _check(tmp_path / "weights", "--final", str(tmp_path / "delta" / "checkpoints" / "000003"))
    assert done.returncode == 0 and done.stdout.startswith("verified: versions 1..4 (4, full: 1)"), done.stdout


@pytest.mark.parametrize(
    ("encoding", "algorithm"), [("xor", "adler32"), ("overwrite", "blake3"), ("overwrite", "xxh3-128")]
)
def test_rlbench_writes_each_encoding_and_checksum_slime_reads(tmp_path, encoding, algorithm):
    """Every encoding and checksum slime's index can name, written by rlbench: the index metadata slime writes, and
    the chain pulled and verified to the last state (a full version first, then deltas)."""
    states = _states()
    root = tmp_path / "chain"
    publisher = weight_delta.Publisher(root, encoding, algorithm)
    publisher.publish_full(1, states[0], REPO / "rlbench/fixtures/models/tiny-qwen3/config.json")
    for version in (2, 3):
        publisher.publish(version, states[version - 1])
    meta = json.loads((root / "weight_v000003" / "model.safetensors.index.json").read_text())["metadata"]
    assert meta == {
        "version": "000003",
        "base_version": "000002",
        "delta_encoding": encoding,
        "compression_format": "zstd",
        "checksum_format": algorithm,
    }
    last = {n: weight_delta.raw_bytes(t) for n, t in states[2].items()}
    report = weight_delta.verify_chain(root, None, last)
    assert report.failure is None and report.versions == [1, 2, 3] and report.full == [1]
    weight_pull.pull(tmp_path / "local", DELTAS / "base", root, 3)
    assert all(np.array_equal(last[n], b) for n, (_, b) in weight_delta.read_checkpoint(tmp_path / "local").items())


def test_rlbench_serve_pulls_a_version_refuses_one_out_of_order_and_a_path_outside_its_weights_dir(tmp_path):
    """/pull_weights (slime's SGLang patch) on `rlbench serve`: a chain pulled to version 2 lands byte for byte and
    reloads through /update_weights_from_disk; a version that does not sit on the version held is refused (400,
    naming it) and the local checkpoint keeps every byte; a directory outside `--weights-dir` is refused."""
    import requests

    from rlbench.core.model import build_model, named_weights
    from rlbench.serve.server import ServeConfig, serve_in_thread
    from tests.conformance.sglang.conftest import FIXTURE_MODEL, write_checkpoint

    base = write_checkpoint(tmp_path / "base")  # the fixture model's seeded weights, as the server starts with
    weights = named_weights(build_model(FIXTURE_MODEL, 1234, init="random"))
    states = [{k: (v * (1 + step / 100)).contiguous() for k, v in weights.items()} for step in (1, 2, 3)]
    publisher = weight_delta.Publisher(tmp_path / "chain")
    publisher.publish_full(1, states[0], base / "config.json")
    publisher.publish(2, states[1])
    publisher.publish(3, states[2])
    index = tmp_path / "chain" / "weight_v000003" / "model.safetensors.index.json"
    bad = json.loads(index.read_text())
    bad["metadata"]["base_version"] = "000001"  # declared on version 1: out of order once 2 is held
    index.write_text(json.dumps(bad))
    serving = serve_in_thread(ServeConfig(model_path=str(base), load_format="auto", port=0, weights_dir=str(tmp_path)))
    try:
        local = tmp_path / "local"

        def pull(target: int, source: Path = tmp_path / "chain"):
            body = {"local_checkpoint_dir": str(local), "source_dir": str(source), "target_version": target}
            return requests.post(serving.url + "/pull_weights", json=body, timeout=60)

        done = pull(2)
        assert done.status_code == 200 and done.json() == {"success": True, "message": "Success."}
        pulled = weight_delta.read_checkpoint(local)
        assert all(np.array_equal(pulled[n][1], weight_delta.raw_bytes(t)) for n, t in states[1].items())
        load = requests.post(
            serving.url + "/update_weights_from_disk",
            json={"model_path": str(local), "weight_version": "2"},
            timeout=60,
        )
        assert load.status_code == 200 and load.json()["success"], load.text
        before = {p.name: p.read_bytes() for p in local.glob("*.safetensors")}
        refused = pull(3)
        assert refused.status_code == 400 and refused.json()["success"] is False
        assert "version 3: builds on version 1, the weights are at 2 (out of order)" in refused.json()["message"]
        assert {p.name: p.read_bytes() for p in local.glob("*.safetensors")} == before
        outside = pull(2, Path("/etc"))
        assert outside.status_code == 400 and "outside the directory this server reads weights from" in outside.text
    finally:
        serving.close()


# ---- unit level: a small chain of three tensors, built in each test --------------------------------------------------


def test_the_publisher_refuses_what_it_cannot_publish_naming_why(tmp_path):
    """An encoding or checksum slime does not read is refused before anything is written; a delta before any full
    version has no base; a delta over other tensors than the base's names (up to three of) those that differ."""
    root = tmp_path / "chain"
    for args, says in (
        (("zigzag",), "delta_encoding 'zigzag': expected one of xor, overwrite"),
        (("xor", "md5"), "checksum_format 'md5': expected one of xxh3-128, blake3, adler32"),
    ):
        with pytest.raises(weight_delta.DeltaRefused) as refused:
            weight_delta.Publisher(root, *args)
        assert str(refused.value) == says
    assert not root.exists()
    publisher = weight_delta.Publisher(root)
    with pytest.raises(weight_delta.DeltaRefused) as refused:
        publisher.publish(1, _trained(1))
    assert str(refused.value) == "a delta needs a base: publish a full version first"
    base = _trained(1)
    publisher.publish_full(1, {**base, "d": base["c"].clone(), "e": base["c"].clone()}, CONFIG)
    with pytest.raises(weight_delta.DeltaRefused) as refused:
        publisher.publish(2, {"a": base["a"], "z": base["c"]})
    assert str(refused.value) == "version 2: other tensors than the base's (['b', 'c', 'd'])"


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_each_version_reports_the_tensors_and_bytes_it_carries_and_its_files_size(tmp_path, encoding):
    """What a publish reports is what it wrote: a full version all its tensors and bytes; a delta the tensors and
    bytes that changed, of all the weights' bytes; each the size of its files (the sync's wire bytes)."""
    root = tmp_path / "chain"
    publisher = weight_delta.Publisher(root, encoding)
    old, new = _raw(_trained(1)), _raw(_trained(2))
    total = sum(data.size for data in old.values())
    changed = {name: int(np.count_nonzero(new[name] != old[name])) for name in old}
    assert sum(1 for n in changed.values() if n) == 2  # a and b move, c does not

    def wire(version: int) -> int:
        return sum(f.stat().st_size for f in weight_delta.version_dir(root, version).iterdir())

    full = publisher.publish_full(1, _trained(1), CONFIG)
    assert full == weight_delta.Published(1, True, 3, total, total, wire(1))
    delta = publisher.publish(2, _trained(2))
    assert delta == weight_delta.Published(2, False, 2, sum(changed.values()), total, wire(2))


def test_a_version_is_written_whole_whatever_its_directory_held(tmp_path):
    """A publish leaves exactly the version's files: the temporary directory an interrupted write left behind is
    replaced, a version directory of the same number (an earlier chain's) replaced whole, and the root made again
    where it was cleared since the chain's full version."""
    root = tmp_path / "chain"
    for version in (1, 2):
        leftover = root / f".weight_v{version:06d}.tmp"
        leftover.mkdir(parents=True)
        (leftover / "model.safetensors").write_bytes(b"half written")
        (weight_delta.version_dir(root, version)).mkdir()
        (weight_delta.version_dir(root, version) / "stale.json").write_text("{}")
    publisher = _chain(root, 2)
    assert sorted(p.name for p in root.iterdir()) == ["weight_v000001", "weight_v000002"]
    assert sorted(p.name for p in (root / "weight_v000001").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in (root / "weight_v000002").iterdir()) == [weight_delta.DELTA_FILE, weight_delta.INDEX]
    shutil.rmtree(root)
    publisher.publish(3, _trained(3))
    assert sorted(p.name for p in (root / "weight_v000003").iterdir()) == [weight_delta.DELTA_FILE, weight_delta.INDEX]


def test_header_metadata_is_kept_where_written_and_passed_over_where_read(tmp_path):
    """A safetensors header's metadata (transformers writes format: pt) is no tensor: a full version written with it
    keeps it, a base checkpoint holding it is read and pulled onto, and the pulled checkpoint still carries it."""
    from safetensors import safe_open

    def metadata(directory: Path) -> dict:
        with safe_open(str(directory / "model.safetensors"), "np") as f:
            return f.metadata()

    base = weight_delta.write_hf_directory(tmp_path / "base", _trained(0), CONFIG, metadata={"format": "pt"})
    assert metadata(base) == {"format": "pt"}
    root = tmp_path / "chain"
    publisher = weight_delta.Publisher(root)
    publisher.publish_full(0, _trained(0), CONFIG)
    shutil.rmtree(root / "weight_v000000")  # a stream of deltas only: version 0 is the engine's base
    for version in (1, 2):
        publisher.publish(version, _trained(version))
    local = tmp_path / "local"
    assert weight_pull.pull(local, base, root, 2) == 2
    assert _same(_pulled(local), _raw(_trained(2))) and metadata(local) == {"format": "pt"}


@pytest.mark.parametrize(
    ("blob", "says"),
    [
        pytest.param(b"", "not a safetensors file (0 bytes, short of the header it announces)", id="empty"),
        pytest.param(b"\x02\x00\x00", "not a safetensors file (3 bytes, short of", id="no length"),
        pytest.param((3).to_bytes(8, "little") + b"{}", "not a safetensors file (10 bytes, short of", id="one short"),
        pytest.param(b"\xff" * 8 + b"{}", "not a safetensors file (10 bytes, short of", id="huge length"),
        pytest.param((0).to_bytes(8, "little"), "its safetensors header does not parse (JSONDecodeError)", id="0"),
        pytest.param((4).to_bytes(8, "little") + b"{no}", "its safetensors header does not parse", id="not json"),
    ],
)
def test_a_safetensors_file_cut_short_or_garbled_is_refused_naming_it(tmp_path, blob, says):
    """Every safetensors file is read through its announced header, which must fit in the file and parse: one that
    does not is refused, naming the file (a checkpoint read, or a delta applied), never read past its end. A file
    whose header fills it holds no tensor; a directory with no weights is refused naming it."""
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    with pytest.raises(weight_delta.DeltaRefused) as refused:
        weight_delta.read_checkpoint(directory)
    assert str(refused.value) == f"{directory}: no model.safetensors (nor an index of its shards)"
    (directory / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    assert weight_delta.read_checkpoint(directory) == {}
    (directory / "model.safetensors").write_bytes(blob)
    with pytest.raises(weight_delta.DeltaRefused) as refused:
        weight_delta.read_checkpoint(directory)
    assert str(refused.value).startswith(f"{directory / 'model.safetensors'}: {says}")
    root = tmp_path / "chain"
    _chain(root, 2)
    (root / "weight_v000002" / weight_delta.DELTA_FILE).write_bytes(blob)
    state = weight_delta.read_checkpoint(root / "weight_v000001")
    with pytest.raises(weight_delta.DeltaRefused) as refused:
        weight_delta.apply_version(state, root / "weight_v000002", 1)
    assert str(refused.value).startswith(f"{root / 'weight_v000002' / weight_delta.DELTA_FILE}: {says}")


def _index(edit):
    def change(version: Path) -> None:
        index = json.loads((version / weight_delta.INDEX).read_text())
        edit(index)
        (version / weight_delta.INDEX).write_text(json.dumps(index))

    return change


def _sums(edit):
    return lambda version: _rewrite(version, lambda diffs, sums: edit(sums))


def _overwrite_at_end(raw: bytes) -> bytes:  # the last position moved to the tensor's end: one past its last byte
    count = int.from_bytes(raw[:4], "little")
    return raw[: 4 + 4 * (count - 1)] + (48).to_bytes(4, "little") + raw[4 + 4 * count :]  # a: 12 float32


def _twice_in_files(version: Path) -> None:  # a's diff and checksum again in a second file of the version
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(version / weight_delta.DELTA_FILE), "np") as f:
        diff, sums = f.get_tensor("a"), f.metadata()
    save_file({"a": diff}, str(version / "model-00001-of-00002.safetensors"), metadata={"a": sums["a"]})


@pytest.mark.parametrize(
    ("encoding", "edit", "says"),
    [
        pytest.param(
            "xor",
            _index(lambda index: index["metadata"].pop("version")),
            "{index}: metadata without version and base_version",
            id="no version",
        ),
        pytest.param(
            "xor", _index(lambda index: index.pop("metadata")), "{index}: metadata without version and base_version"
        ),
        pytest.param(
            "xor",
            _index(lambda index: index["metadata"].update(delta_encoding="zigzag")),
            "version 2: delta_encoding 'zigzag', expected one of xor, overwrite",
            id="encoding",
        ),
        pytest.param(
            "xor",
            _index(lambda index: index["metadata"].update(checksum_format="md5")),
            "version 2: checksum_format 'md5', expected one of xxh3-128, blake3, adler32",
            id="checksum format",
        ),
        pytest.param(
            "xor",
            lambda version: _rewrite(version, lambda diffs, sums: diffs.update(a=np.frombuffer(b"no zstd", np.uint8))),
            "version 2, a: its zstd data does not decompress within 48 bytes (",
            id="not zstd",
        ),
        pytest.param(
            "xor",
            _sums(lambda sums: sums.update(a="0" * 32)),
            "version 2, a: xxh3-128 of the applied bytes is not the published one (a changed byte, another base, or "
            "a version applied twice)",
            id="checksum",
        ),
        pytest.param(
            "overwrite",
            lambda version: _edit_diff(version, lambda raw: raw + b"\x00", "a"),
            "version 2, a: an overwrite of {a_changed} positions that does not fit",
            id="a byte too many",
        ),
        pytest.param(
            "overwrite",
            lambda version: _edit_diff(version, _overwrite_at_end, "a"),
            "version 2, a: an overwrite of {a_changed} positions that does not fit",
            id="past the end",
        ),
        pytest.param("xor", _twice_in_files, "version 2, a: in two of the version's files", id="twice"),
        pytest.param(
            "xor",
            lambda version: (version / weight_delta.DELTA_FILE).unlink(),
            "version 2, a: in its index, in none of its files (2 tensors)",
            id="file lost",
        ),
    ],
)
def test_a_delta_not_as_published_is_refused_naming_version_and_tensor_and_changes_nothing(
    tmp_path, encoding, edit, says
):
    """apply_version applies a version only whole and as published: an index without its version, an encoding or a
    checksum slime does not write, data that does not decompress, a checksum that does not hold, an overwrite that
    does not fit its tensor (a byte too many, a position one past its end), a tensor in two of its files (slime
    applies them concurrently: no order) or one its index names and no file holds: each refused, naming the version
    and the tensor, and the weights it was applied to left as they were."""
    root = tmp_path / "chain"
    _chain(root, 2, encoding)
    edit(root / "weight_v000002")
    state = weight_delta.read_checkpoint(root / "weight_v000001")
    before = {name: (file, data.copy()) for name, (file, data) in state.items()}
    with pytest.raises(weight_delta.DeltaRefused) as refused:
        weight_delta.apply_version(state, root / "weight_v000002", 1)
    a_changed = int(np.count_nonzero(_raw(_trained(2))["a"] != _raw(_trained(1))["a"]))
    assert str(refused.value).startswith(
        says.format(index=root / "weight_v000002" / weight_delta.INDEX, a_changed=a_changed)
    )
    assert state.keys() == before.keys()
    assert all(state[n][0] == before[n][0] and np.array_equal(state[n][1], before[n][1]) for n in state)


def test_a_version_is_its_files_an_index_without_a_weight_map_promises_nothing(tmp_path):
    """slime's receiving side applies what a version's files hold: an index with no weight_map applies all the same,
    every tensor verified, to the published state."""
    root = tmp_path / "chain"
    _chain(root, 2)
    _index(lambda index: index.pop("weight_map"))(root / "weight_v000002")
    state = weight_delta.read_checkpoint(root / "weight_v000001")
    assert weight_delta.apply_version(state, root / "weight_v000002", 1)[0] == 2
    assert _same({n: data for n, (_, data) in state.items()}, _raw(_trained(2)))


def test_verify_chain_reports_the_chain_and_each_way_its_last_state_is_not_the_checkpoint_given(tmp_path):
    """The report names the chain it read; the last state is held to the checkpoint given, every tensor: equal, it
    says how many; a tensor missing on either side, or of other bytes, fails the chain naming the first, and no
    equality is claimed."""
    root = tmp_path / "chain"
    _chain(root, 3)
    last = _raw(_trained(3))
    report = weight_delta.verify_chain(root, None, last)
    assert (report.root, report.failure, report.final) == (str(root), None, "3 tensors equal the checkpoint given")
    for final, first in (
        ({**last, "d": last["c"]}, "d"),
        ({n: data for n, data in last.items() if n != "a"}, "a"),
        ({**last, "b": _raw(_trained(2))["b"]}, "b"),
    ):
        report = weight_delta.verify_chain(root, None, final)
        says = f"after version 3: {first} differs from the checkpoint given (1 tensors do)"
        assert (report.versions, report.failure, report.final) == ([1, 2, 3], says, None)


def test_verify_chain_names_a_missing_version_and_the_option_a_chain_of_deltas_needs(tmp_path):
    """A chain with a gap fails at the missing version, naming the chain's span; a chain that starts with a delta
    and no base given cannot be judged, naming the --base option."""
    from rlbench.errors import BadInput

    root = tmp_path / "chain"
    _chain(root, 4)
    shutil.rmtree(root / "weight_v000003")
    report = weight_delta.verify_chain(root)
    assert (report.versions, report.failure) == ([1, 2], "version 3 is missing (the chain has 1..4)")
    shutil.rmtree(root / "weight_v000001")
    with pytest.raises(BadInput) as undetermined:
        weight_delta.verify_chain(root)
    assert str(undetermined.value) == (
        "--base: undetermined: version 2 is a delta and no --base gives the weights it builds on"
    )


def test_a_pull_goes_on_from_the_version_held_and_rewrites_nothing_when_there(tmp_path):
    """A pull applies only what it must: from the version the local checkpoint holds, the versions after it (the
    older ones may be gone from the shared directory); it returns how many versions it applied; a pull to the
    version held applies none and rewrites not one file (a server may be reading them)."""
    root, local, no_base = tmp_path / "chain", tmp_path / "local", tmp_path / "never read"
    _chain(root, 5)
    assert weight_pull.pull(local, no_base, root, 3) == 2  # full version 1, then deltas 2 and 3
    for version in (1, 2, 3):
        shutil.rmtree(weight_delta.version_dir(root, version))
    files = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in local.iterdir() if p.is_file()}
    assert weight_pull.pull(local, no_base, root, 3) == 0
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in local.iterdir() if p.is_file()} == files
    assert weight_pull.pull(local, no_base, root, 5) == 2
    assert weight_pull.applied_version(local) == 5 and _same(_pulled(local), _raw(_trained(5)))


def test_a_pull_waits_while_another_server_on_the_host_holds_slimes_lock(tmp_path):
    """A host's servers share one local checkpoint: a pull waits while the lock slime's SGLang patch takes
    (.weight_sync/lock) is held, and runs once it is released."""
    import fcntl
    import threading

    root, local = tmp_path / "chain", tmp_path / "local"
    _chain(root, 2)
    (local / weight_delta.SYNC_DIR).mkdir(parents=True)
    pulled = []
    with open(local / weight_delta.SYNC_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pulling = threading.Thread(target=lambda: pulled.append(weight_pull.pull(local, root, root, 2)))
        pulling.start()
        pulling.join(timeout=1.0)
        assert pulling.is_alive() and weight_pull.applied_version(local) is None
        fcntl.flock(lock, fcntl.LOCK_UN)
    pulling.join()
    assert pulled == [1] and weight_pull.applied_version(local) == 2


def test_a_pull_of_a_sharded_checkpoint_rewrites_only_the_files_its_weights_are_in(tmp_path):
    """A full version sharded as transformers shards (an index with a weight_map and no metadata) is a full version;
    a pull onto it writes each tensor into its own shard, and a safetensors file beside the shards that the index
    does not name (a consolidated copy; here one that does not even parse) is copied and left as it is."""
    from safetensors.torch import save_file

    root, local = tmp_path / "chain", tmp_path / "local"
    _chain(root, 2)
    full, weights = root / "weight_v000001", _trained(1)
    shutil.rmtree(full)
    full.mkdir()
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    shards["c"] = shards["b"]
    for shard in sorted(set(shards.values())):
        save_file({n: weights[n] for n, s in shards.items() if s == shard}, str(full / shard))
    (full / weight_delta.INDEX).write_text(json.dumps({"weight_map": shards}))
    (full / "consolidated.safetensors").write_bytes(b"not safetensors")
    assert weight_pull.pull(local, tmp_path / "never read", root, 2) == 1
    pulled = weight_delta.read_checkpoint(local)
    assert {n: file for n, (file, _) in pulled.items()} == shards
    assert _same({n: data for n, (_, data) in pulled.items()}, _raw(_trained(2)))
    assert (local / "consolidated.safetensors").read_bytes() == b"not safetensors"


def test_a_pull_to_a_version_not_published_is_refused_naming_it(tmp_path):
    """A target version with no directory, or a version whose index is not JSON, is refused naming its path."""
    root, local = tmp_path / "chain", tmp_path / "local"
    _chain(root, 2)
    with pytest.raises(weight_delta.DeltaRefused) as refused:
        weight_pull.pull(local, root, root, 4)
    assert str(refused.value) == f"published weight version missing: {root / 'weight_v000004'}"
    (root / "weight_v000002" / weight_delta.INDEX).write_text("{not json")
    with pytest.raises(weight_delta.DeltaRefused) as refused:
        weight_pull.pull(local, root, root, 2)
    assert str(refused.value) == f"{root / 'weight_v000002' / weight_delta.INDEX}: not JSON (JSONDecodeError)"
