"""slime's delta weight sync, both sides (issue 38): versions published as slime writes them, pulled as slime's SGLang
patch applies them, and a chain verified.

The format (THUDM/slime 624b824a: docs/en/advanced/delta-weight-sync.md, slime/backends/megatron_utils/update_weight/
update_weight_from_disk_delta.py, slime/utils/disk_delta.py, docker/patch/latest/sglang-pull_weights.patch's
sglang/srt/weight_sync/local_checkpoint.py): each sync is a directory `weight_v{N:06d}/` under a shared root. A full
version is an ordinary Hugging Face checkpoint; a delta version holds `model-00000-of-00001.safetensors` (each
changed tensor as its zstd-compressed (level 1) diff, a uint8 tensor under the tensor's name, and in the header's
`__metadata__` the checksum of the tensor's new bytes) and `model.safetensors.index.json` with `metadata`:
`version`, `base_version` (N - 1, zero-padded), `delta_encoding` (`xor`: new ^ old, an involution, right exactly once
on its base; `overwrite`: a little-endian u4 count, u4 byte positions, then the new bytes there, idempotent),
`compression_format` (`zstd`), `checksum_format` (`xxh3-128`, `blake3` or `adler32`), and a `weight_map`. Diffs are
over each tensor's raw bytes, so they are dtype-blind. Version 0 is the engine's own base checkpoint unless a full
version 0 is published.

The receiving side (rlbench/core/weight_pull.py) keeps a host-local checkpoint and a marker of the version it holds
(`.weight_sync/state.json`, `{"version": "000003"}`); a pull to version T seeds from the newest full version at or
below T (or the base), then applies each delta in order, each only on its declared base. slime's patch applies in
place and checks after; here each version is applied in memory and every tensor verified before anything is written,
and the files are replaced whole (a refused version leaves the local checkpoint as it was). A version is applied
only whole: a tensor its index names and none of its files holds (a file lost), or one in two of its files (slime
applies a version's tensors concurrently: no order), refuses it.
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlbench.core.confine import inside
from rlbench.errors import BadInput

ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
INDEX = "model.safetensors.index.json"
SYNC_DIR = ".weight_sync"
DELTA_FILE = "model-00000-of-00001.safetensors"  # slime's name for the one rank that writes


class DeltaRefused(Exception):
    """A version that cannot be applied as published: its message names the version and the tensor."""


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"weight_v{version:06d}"


def checksum(algorithm: str, data) -> str:
    """The hex digest slime stores for a tensor's new bytes."""
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128(data).hexdigest()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(data).hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(data, 1):08x}"
    raise DeltaRefused(f"checksum_format {algorithm!r}: expected one of {', '.join(CHECKSUMS)}")


def raw_bytes(tensor) -> np.ndarray:
    """A tensor's bytes, as slime diffs them (its storage order, dtype-blind)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def write_hf_directory(path: Path, weights: dict, config_json: str | Path, metadata: dict | None = None) -> Path:
    """An ordinary Hugging Face checkpoint at `path` (model.safetensors and config.json), made under a temporary
    name and renamed into place: a full version here, and each version the SGLang engine pushes in full."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in weights.items()},
        str(tmp / "model.safetensors"),
        metadata=metadata,
    )
    shutil.copyfile(config_json, tmp / "config.json")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


# ---- the trainer's side -------------------------------------------------------------------------------------------


@dataclass
class Published:
    version: int
    full: bool
    tensors: int  # tensors in the version (all of a full one, the changed ones of a delta)
    changed_bytes: int
    total_bytes: int
    wire_bytes: int  # bytes of the version's files


class Publisher:
    """Publishes each sync under `root` as slime's trainer does: the first as a full version (resetting the
    chain), every later one as a delta against the previous sync's bytes."""

    def __init__(self, root: str | Path, encoding: str = "xor", checksum_format: str = "xxh3-128"):
        if encoding not in ENCODINGS:
            raise DeltaRefused(f"delta_encoding {encoding!r}: expected one of {', '.join(ENCODINGS)}")
        checksum(checksum_format, b"")  # refuse an unknown algorithm (or a missing package) before anything is written
        self.root, self.encoding, self.checksum_format = Path(root), encoding, checksum_format
        self.snapshot: dict[str, np.ndarray] = {}

    def publish_full(self, version: int, weights: dict, config_json: str | Path) -> Published:
        """An ordinary HF checkpoint (model.safetensors and config.json): a full version, the chain's new start."""
        path = write_hf_directory(version_dir(self.root, version), weights, config_json)
        self.snapshot = {name: raw_bytes(t) for name, t in weights.items()}
        total = sum(v.size for v in self.snapshot.values())
        wire = sum(f.stat().st_size for f in path.iterdir())
        return Published(version, True, len(weights), total, total, wire)

    def publish(self, version: int, weights: dict) -> Published:
        """The delta of `weights` against the last published state, as version `version` on base `version - 1`."""
        import zstandard
        from safetensors.numpy import save

        if not self.snapshot:
            raise DeltaRefused("a delta needs a base: publish a full version first")
        if set(weights) != set(self.snapshot):
            raise DeltaRefused(
                f"version {version}: other tensors than the base's ({sorted(set(weights) ^ set(self.snapshot))[:3]})"
            )
        delta, sums, changed_bytes, total, fresh = {}, {}, 0, 0, {}
        compressor = zstandard.ZstdCompressor(level=1)
        for name, tensor in weights.items():
            new, old = raw_bytes(tensor), self.snapshot[name]
            total += new.size
            if new.size != old.size:
                raise DeltaRefused(f"version {version}, {name}: {new.size} bytes, the base's {old.size}")
            if self.encoding == "xor":
                diff = new ^ old
                changed = int(np.count_nonzero(diff))
            else:
                mask = new != old
                changed = int(np.count_nonzero(mask))
                positions = np.flatnonzero(mask).astype("<u4")
                diff = np.concatenate(
                    [np.array([positions.size], "<u4").view(np.uint8), positions.view(np.uint8), new[mask]]
                )
            fresh[name] = new  # the base moves only once the version is published whole
            if changed:
                changed_bytes += changed
                delta[name] = np.frombuffer(compressor.compress(diff.tobytes()), dtype=np.uint8)
                sums[name] = checksum(self.checksum_format, new)
        path = version_dir(self.root, version)
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if delta:
            (tmp / DELTA_FILE).write_bytes(save(delta, metadata=sums))
        index = {
            "metadata": {
                "version": f"{version:06d}",
                "base_version": f"{version - 1:06d}",
                "delta_encoding": self.encoding,
                "compression_format": "zstd",
                "checksum_format": self.checksum_format,
            },
            "weight_map": {name: DELTA_FILE for name in delta},
        }
        (tmp / INDEX).write_text(json.dumps(index))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        self.snapshot = fresh
        wire = sum(f.stat().st_size for f in path.iterdir())
        return Published(version, False, len(delta), changed_bytes, total, wire)


# ---- reading a version --------------------------------------------------------------------------------------------
#
# `root`, where given, confines every path read (and, pulling, written): rlbench/core/confine.py's rule.


def safetensors_header(blob: bytes, where: str) -> tuple[dict, dict]:
    """A safetensors file's header: (tensor name -> (begin, end) in the file, the string metadata), each field of the
    type safetensors writes (BadInput naming the field otherwise)."""
    length = int.from_bytes(blob[:8], "little")  # a file under 8 bytes falls short of any header too
    if length > len(blob) - 8:
        raise DeltaRefused(f"{where}: not a safetensors file ({len(blob)} bytes, short of the header it announces)")
    try:
        header = json.loads(blob[8 : 8 + length])
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise DeltaRefused(f"{where}: its safetensors header does not parse ({exc.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise BadInput(f"its safetensors header is a {type(header).__name__}, expected an object", path=where)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BadInput(f"expected an object of strings, got {_kind(metadata)}", path=where, field="__metadata__")
    data = len(blob) - 8 - length
    spans = {}
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise BadInput(
                f"expected [begin, end], integers within the file's {data} data bytes, got {_kind(offsets)}",
                path=where,
                field=f"{name}.data_offsets",
            )
        spans[name] = (8 + length + offsets[0], 8 + length + offsets[1])
    return spans, metadata


def _kind(value) -> str:
    return f"{value!r:.60}"


def _tensors(path: Path, root: Path | None = None) -> tuple[bytes, dict, dict[str, tuple[int, int]]]:
    """A safetensors file's bytes, its header's metadata, and where each tensor's bytes lie in them."""
    blob = inside(path, root).read_bytes()
    spans, metadata = safetensors_header(blob, str(path))
    return blob, metadata, spans


def read_checkpoint(directory: str | Path, root: Path | None = None) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of an HF checkpoint directory (the files its weights are in, as core/model.py's `weight_files`
    picks them: an rlbench checkpoint's optimizer state aside) as (file name, its bytes)."""
    from rlbench.core.model import weight_files

    out = {}
    directory = inside(directory, root)
    inside(directory / INDEX, root)  # the index weight_files reads where the weights are sharded: confined first
    files = weight_files(directory)
    if not files:
        raise DeltaRefused(f"{directory}: no model.safetensors (nor an index of its shards)")
    for path in files:
        blob, _, tensors = _tensors(path, root)
        for name, (begin, end) in tensors.items():
            out[name] = (path.name, np.frombuffer(blob, np.uint8, end - begin, begin).copy())
    return out


def _index(path: Path, root: Path | None) -> dict:
    """A version's index, each field it is read by of the type slime writes (DeltaRefused naming it otherwise)."""
    try:
        index = json.loads(inside(path / INDEX, root).read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise DeltaRefused(f"{path / INDEX}: not JSON ({exc.__class__.__name__})") from None
    if not isinstance(index, dict):
        raise BadInput(f"expected an object, got {_kind(index)}", path=path / INDEX)
    for key in ("metadata", "weight_map"):
        value = index.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise BadInput(f"expected an object of strings, got {_kind(value)}", path=path / INDEX, field=key)
    return index


def is_delta(path: Path, root: Path | None = None) -> bool:
    """A version is a delta when its index metadata names an encoding (slime's `_is_delta`)."""
    if not inside(path, root).is_dir():
        raise DeltaRefused(f"published weight version missing: {path}")
    if not (path / INDEX).is_file():
        return False
    return "delta_encoding" in _index(path, root).get("metadata", {})


def _decompress(data: bytes, limit: int, label: str) -> np.ndarray:
    """A zstd frame's bytes, refused when it holds (or declares) more than `limit`: what the tensor it changes can
    take, so no frame makes rlbench allocate more than that."""
    import zstandard

    try:
        declared = zstandard.get_frame_parameters(data).content_size
        if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > limit:
            raise DeltaRefused(f"{label}: its zstd frame declares {declared} bytes, the tensor takes at most {limit}")
        return np.frombuffer(zstandard.ZstdDecompressor().decompress(data, max_output_size=limit), np.uint8)
    except zstandard.ZstdError as exc:
        raise DeltaRefused(f"{label}: its zstd data does not decompress within {limit} bytes ({exc})") from None


def apply_version(
    state: dict[str, tuple[str, np.ndarray]], path: Path, held: int, root: Path | None = None
) -> tuple[int, int]:
    """Apply delta version `path` to `state` (name -> (file, bytes)) in place, verifying every tensor it changes;
    `held` is the version the state is at. Returns the new version and the tensors verified. DeltaRefused names the
    version and tensor."""
    index = _index(inside(path, root), root)
    meta = index.get("metadata", {})
    numbers = [meta.get(k) for k in ("version", "base_version")]
    if not all(isinstance(n, str) and n.isdigit() and n.isascii() for n in numbers):
        raise DeltaRefused(f"{path / INDEX}: metadata without version and base_version (zero-padded numbers)")
    version, base = (int(n) for n in numbers)
    label = f"version {version}" + ("" if path.name == f"weight_v{version:06d}" else f" ({path.name})")
    if path.name != f"weight_v{version:06d}":
        raise DeltaRefused(f"{label}: published under {path.name} (out of order)")
    if base != held:
        raise DeltaRefused(f"{label}: builds on version {base}, the weights are at {held} (out of order)")
    if meta.get("compression_format") != "zstd":
        raise DeltaRefused(f"{label}: compression_format {meta.get('compression_format')!r}, expected zstd")
    encoding, algorithm = meta.get("delta_encoding"), meta.get("checksum_format")
    if encoding not in ENCODINGS:
        raise DeltaRefused(f"{label}: delta_encoding {encoding!r}, expected one of {', '.join(ENCODINGS)}")
    if algorithm not in CHECKSUMS:
        raise DeltaRefused(f"{label}: checksum_format {algorithm!r}, expected one of {', '.join(CHECKSUMS)}")
    staged = {}
    for file in sorted(path.glob("*.safetensors")):
        blob, sums, tensors = _tensors(file, root)
        for name, (begin, end) in tensors.items():
            if name not in state:
                raise DeltaRefused(f"{label}, {name}: no such tensor in the weights it applies to")
            if name in staged:  # slime applies a version's tensors concurrently: a tensor twice has no order
                raise DeltaRefused(f"{label}, {name}: in two of the version's files")
            old = state[name][1]
            # xor: one byte per byte; overwrite: a count, then at most every position (4 bytes) and its new byte
            limit = old.size if encoding == "xor" else 4 + 5 * old.size
            diff = _decompress(blob[begin:end], limit, f"{label}, {name}")
            if encoding == "xor":
                if diff.size != old.size:
                    raise DeltaRefused(f"{label}, {name}: {diff.size} diff bytes for a tensor of {old.size}")
                new = old ^ diff
            else:
                count = int.from_bytes(diff[:4].tobytes(), "little")
                positions = np.frombuffer(diff[4 : 4 + 4 * count].tobytes(), "<u4")
                values = diff[4 + 4 * count :]
                if values.size != count or (count and int(positions.max()) >= old.size):
                    raise DeltaRefused(f"{label}, {name}: an overwrite of {count} positions that does not fit")
                new = old.copy()
                new[positions] = values
            if checksum(algorithm, new) != sums.get(name):
                raise DeltaRefused(
                    f"{label}, {name}: {algorithm} of the applied bytes is not the published one (a changed byte, "
                    "another base, or a version applied twice)"
                )
            staged[name] = new
    missing = sorted(set(index.get("weight_map", {})) - set(staged))
    if missing:  # a file lost (or cut short) would otherwise change nothing, and pass
        raise DeltaRefused(f"{label}, {missing[0]}: in its index, in none of its files ({len(missing)} tensors)")
    for name, new in staged.items():
        state[name] = (state[name][0], new)
    return version, len(staged)


# ---- `rlbench check weights` --------------------------------------------------------------------------------------


@dataclass
class ChainReport:
    root: str
    versions: list[int] = field(default_factory=list)  # verified, in order
    full: list[int] = field(default_factory=list)
    tensors_checked: int = 0  # tensor checksums verified over every delta
    failure: str | None = None  # the first version and tensor that failed
    final: str | None = None  # the last state held to the checkpoint given: what was equal


def verify_chain(
    root: str | Path, base: str | Path | None = None, final: dict[str, np.ndarray] | None = None
) -> ChainReport:
    """Every version under `root` applied in order, from its first full version (or from `base`, version 0),
    each delta on its declared base with every tensor's checksum held; the last state held to `final` (name ->
    bytes) where given. The chain's directory confines what is read of it (links inside it followed, none out)."""
    root = Path(root)
    confine = root.resolve()
    found = sorted(
        int(p.name[len("weight_v") :]) for p in root.glob("weight_v*") if p.name[len("weight_v") :].isdigit()
    )
    report = ChainReport(str(root))
    if not found:
        raise FileNotFoundError(f"{root}: no weight_v<N> version directory")
    expected = list(range(found[0], found[-1] + 1))
    state, held = None, None
    try:
        if not is_delta(version_dir(root, found[0]), confine):
            pass  # the chain starts with a full version
        elif base is None:
            raise BadInput(
                f"undetermined: version {found[0]} is a delta and no --base gives the weights it builds on",
                field="--base",
            )
        else:
            state, held = read_checkpoint(base), found[0] - 1
        for version in expected:
            path = version_dir(root, version)
            if not path.is_dir():
                raise DeltaRefused(f"version {version} is missing (the chain has {found[0]}..{found[-1]})")
            if not is_delta(path, confine):
                state, held = read_checkpoint(path, confine), version
                report.full.append(version)
            else:
                held, checked = apply_version(state, path, held, confine)
                report.tensors_checked += checked
            report.versions.append(version)
    except DeltaRefused as exc:
        report.failure = str(exc)
        return report
    if final is not None:
        names = sorted(set(final) | set(state))
        differs = [n for n in names if n not in state or n not in final or not np.array_equal(state[n][1], final[n])]
        report.final = f"{len(names)} tensors equal the checkpoint given" if not differs else None
        if differs:
            report.failure = (
                f"after version {held}: {differs[0]} differs from the checkpoint given ({len(differs)} tensors do)"
            )
    return report
