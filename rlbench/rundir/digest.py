"""Checksums of tensors (algorithm `wordsum/1`), the unit of `checksums.jsonl`, computed where the tensor lives.

A checksum covers, for each tensor in order, its name, dtype, shape, byte count and bytes, so two stages agree
only when every value agrees to the bit and nothing was reshaped or recast. The bytes are reduced on the tensor's
own device to two 64-bit lanes; only those 16 bytes per tensor cross to the host, where sha256 runs over each
tensor's header and lanes, in order: the checksum string is that sha256's hex digest.

The lanes. The tensor's bytes (row-major, as stored: little-endian on every device rlbench runs on) are read as
n = ceil(nbytes / 8) little-endian 64-bit words w_i, the last one zero-padded (the header holds nbytes, so the
padding is never mistaken for data). Lane k (k = 0, 1) is

    L_k = sum_i  w_i * m_k(i)   mod 2**64,     m_k(i) = A_k[i mod C] * B_k[i div C]   mod 2**64,

with C = CHUNK = 2**14 words, A_k[j] and B_k[c] (c >= 1) SplitMix64 outputs of four fixed streams with the
lowest bit set, and B_k[0] = 1: every multiplier is odd.

Why it is exact and order-independent: the sum runs in the ring of integers modulo 2**64, where addition is
associative and commutative, so any reduction order, any split into chunks, any thread count and any device give
the same value. The CPU path computes it with numpy's unsigned 64-bit dot product (unsigned arithmetic wraps by
definition); a CUDA path with int64 multiplies and sums (a Triton kernel's, or torch's), which wrap modulo 2**64
in two's complement (the same bits): tests/cpu/test_digest.py pins that on the CPU with known values,
tests/gpu/test_digest_cuda.py holds the devices and the two CUDA paths equal.

Memory: A's table is 256 KiB (kept per device), B's 16 bytes per chunk of the largest tensor seen. On a GPU a
Triton kernel reads each word once and writes 16 bytes per chunk; without Triton, torch's ops multiply at most
GROUP chunks at a time (a 16 MiB temporary). A non-contiguous tensor is copied once to its row-major bytes; a
contiguous one is read in place.

What it catches: flipping bit b of word i changes w_i by +-2**b, so lane k changes by +-2**b * m_k(i) mod 2**64,
which is never 0 since m_k(i) is odd and b < 64: a single flipped bit changes both lanes, with certainty. Other
changes (two tensors swapped in a checksum: the host's sha256 runs over the headers and lanes in order) are
caught unless they cancel in both lanes at once, which for these pseudo-random multipliers takes a change built
for it. It is a checksum against accidents and bugs, not a cryptographic hash: nothing here is secret.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Hashable, Iterable, Mapping

import numpy as np
import torch

from rlbench.rundir.algorithm import CHECKSUM as ALGORITHM
from rlbench.rundir.digest_host import CHUNK, MASK, a_table, b_table, host_lanes, host_lanes_many, tail_word

GROUP = 64  # chunks per device kernel: bounds the device's temporary product to 16 MiB
BATCH_BYTES = 4 << 20  # `Digests.add_all` concatenates smaller device tensors into batches of about this size
_PREFIX = f"rlbench checksum {ALGORITHM}\0".encode()  # a checksum of another algorithm never equals one of these


_DEVICE_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def _on_device(which: str, count: int, device: torch.device) -> torch.Tensor:
    """A (count ignored) or B as int64 on `device` (the same bits): copied there once per size, and kept."""
    key = (which, str(device))
    table = _DEVICE_TABLES.get(key)
    if table is None or (which == "B" and table.shape[0] < count):
        host = a_table() if which == "A" else b_table(count)
        table = _DEVICE_TABLES[key] = torch.from_numpy(host.view(np.int64)).to(device)
    return table


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (a copy only when it is not contiguous)."""
    flat = tensor.detach()
    flat = (flat if flat.is_contiguous() else flat.contiguous()).view(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _device_lanes(data: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """The two lanes of `data` (uint8, any device) with int64 multiplies and sums, which wrap modulo 2**64: a [2]
    int64 tensor on that device, computed without a synchronisation. On a GPU with Triton one kernel reads each
    word once (`_fused_lanes`); else torch's ops, which make a temporary product per group of chunks. `fused`
    True or False picks the kernel or torch's ops on any device (the tests hold the two equal; Triton's interpreter
    runs the kernel on the CPU)."""
    if _use_kernel(data.device, fused):
        return _fused_lanes([data])[0]
    full = data.numel() // 8 * 8
    body = data[:full]
    if body.storage_offset() % 8:  # an int64 view needs aligned bytes
        body = body.clone()
    words = body.view(torch.int64)
    n, a = words.numel(), _on_device("A", 0, data.device)
    chunks, rest = divmod(n, CHUNK)
    b = _on_device("B", chunks + 1, data.device)
    parts = []
    grid = words[: chunks * CHUNK].view(chunks, CHUNK)
    for g in range(0, chunks, GROUP):
        block = grid[g : g + GROUP]
        parts.append(((block.unsqueeze(1) * a).sum(dim=2) * b[g : g + block.shape[0]]).sum(dim=0))
    if rest:
        sums = (words[chunks * CHUNK :] * a[:, :rest]).sum(dim=1)
        parts.append(sums * b[chunks] if chunks else sums)  # chunk 0's multiplier is 1
    if full < data.numel():  # the last word, zero-padded, at position n
        parts.append(tail_word(data, full) * a[:, rest] * b[chunks])
    if not parts:
        return torch.zeros(2, dtype=torch.int64, device=data.device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(dim=0)


_BLOCK, _WARPS = 256, 8  # words each step of a Triton program multiplies, and its warps (measured fastest on an H100)
_KERNEL: list = []  # [the Triton kernel, or None where Triton cannot be imported], filled on first use


def _chunk_kernel():
    """The Triton kernel behind `_fused_lanes`, or None where Triton cannot be imported (a CPU-only install: the
    CPU's path is numpy's). Program g reads chunk c = place[g] of tensor t = owner[g]: its words w_j (j < CHUNK)
    at `base` + offsets[t] + c * CHUNK (every tensor addressed from one pointer argument, so any number of tensors
    take one launch), and writes out[slot[g]] = (sum_j w_j * A_k[j]) * B_k[c] for k = 0, 1 in int64 arithmetic,
    which wraps modulo 2**64 as the definition does. MASKED reads words past the tensor's count (counts[t]) as 0:
    the last, partial chunk of a tensor. Whole chunks go unmasked, which runs about 5 times faster (a mask against
    a count read from memory keeps the loads from being vectorised)."""
    if not _KERNEL:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _KERNEL.append(None)
            return None

        @triton.jit
        def chunk_sums(
            base,
            offsets,
            counts,
            owner,
            place,
            slot,
            a,
            b,
            out,
            CHUNK: tl.constexpr,
            BLOCK: tl.constexpr,
            MASKED: tl.constexpr,
        ):
            g = tl.program_id(0).to(tl.int64)
            t = tl.load(owner + g)
            c = tl.load(place + g)
            row = tl.load(slot + g)
            words = base + tl.load(offsets + t) + c * CHUNK
            left = tl.load(counts + t) - c * CHUNK  # words of this chunk in the tensor (all of them unless MASKED)
            lanes = tl.arange(0, BLOCK)
            first = tl.zeros([BLOCK], dtype=tl.int64)
            second = tl.zeros([BLOCK], dtype=tl.int64)
            for start in range(0, CHUNK, BLOCK):
                j = start + lanes
                if MASKED:
                    w = tl.load(words + j, mask=j < left, other=0)
                else:
                    w = tl.load(words + j)
                first += w * tl.load(a + j)
                second += w * tl.load(a + CHUNK + j)
            tl.store(out + 2 * row, tl.sum(first, axis=0) * tl.load(b + 2 * c))
            tl.store(out + 2 * row + 1, tl.sum(second, axis=0) * tl.load(b + 2 * c + 1))

        _KERNEL.append(chunk_sums)
    return _KERNEL[0]


def _use_kernel(device: torch.device, fused: bool | None) -> bool:
    """Whether lanes on `device` come from the Triton kernel: on a GPU where Triton imports, or when asked."""
    return bool(fused or fused is None and device.type == "cuda") and _chunk_kernel() is not None


def _fused_lanes(datas: list[torch.Tensor]) -> torch.Tensor:
    """[len(datas), 2] int64: the lanes of each tensor's bytes (any dtype; all on one device) from the Triton kernel
    over all their chunks, each word read once where it lies (no concatenation, no temporary product): one launch
    for the whole chunks of every tensor, one for the last partial chunks. Per-chunk products are totalled per
    tensor (`_segment_totals`); a tensor's last nbytes % 8 bytes (its zero-padded last word) are added apart."""
    device, originals, datas = datas[0].device, datas, list(datas)
    sizes, addresses, base = [], [], None  # bytes, word addresses, the first's 8 bytes (the kernel's `base`)
    for i, data in enumerate(datas):
        data = datas[i] = data if data.is_contiguous() else data.contiguous()
        nbytes = data.numel() * data.element_size()
        address = data.data_ptr()
        if nbytes >= 8:
            if address % 8:  # an unaligned view: its whole words copied to aligned memory (kept alive in `datas`)
                data = datas[i] = _byte_view(data)[: nbytes // 8 * 8].clone()
                address = data.data_ptr()
            if base is None:
                base = _byte_view(data)[:8].view(torch.int64)
        sizes.append(nbytes)
        addresses.append(address if nbytes >= 8 else 0)
    sizes = np.array(sizes, dtype=np.int64)
    counts, tails = sizes // 8, sizes % 8 > 0
    first = base.data_ptr() if base is not None else 0
    addresses = np.array([a or first for a in addresses], dtype=np.int64)
    chunks = -(-counts // CHUNK)
    whole = counts // CHUNK
    offsets = (addresses - first) // 8  # every address is 8-byte aligned: whole words apart
    starts = np.cumsum(chunks) - chunks  # each tensor's first row of `out`
    owner = np.repeat(np.arange(len(datas), dtype=np.int64), whole)  # the whole chunks' programs
    place = np.arange(owner.size, dtype=np.int64) - np.repeat(np.cumsum(whole) - whole, whole)
    partial = np.flatnonzero(chunks > whole)  # the tensors with a last, partial chunk
    ends = np.cumsum(chunks)
    tables = [
        offsets,
        counts,
        owner,
        place,
        starts[owner] + place,
        partial,
        whole[partial],
        starts[partial] + whole[partial],
        ends,
        ends - chunks,
    ]
    # One copy to the device, from pinned memory and not waited for (a blocking copy would wait for all the work
    # queued before it: a trainer's backward). Each part starts 16 bytes aligned (Triton compiles a variant per
    # pointer alignment).
    parts = [part.astype(np.int64) if part.size % 2 == 0 else np.append(part, 0).astype(np.int64) for part in tables]
    bounds = np.cumsum([0] + [part.size for part in parts])
    host = torch.from_numpy(np.concatenate(parts))
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    offsets_, counts_, *programs, ends_, begins_ = (table[lo : lo + part.size] for lo, part in zip(bounds[:-1], tables))
    total = int(chunks.sum())
    a = _on_device("A", 0, device)
    b = _on_device("B", int(max(chunks.max(initial=0), whole.max(initial=0))) + 1, device)
    out = torch.empty(total, 2, dtype=torch.int64, device=device)
    # Triton launches on the current device: make it the tensors' (a run on "cuda:1" keeps cuda:0 current)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for (owner_, place_, slot_), masked in ((programs[:3], False), (programs[3:6], True)):
            if owner_.numel():
                _chunk_kernel()[(owner_.numel(),)](
                    base,
                    offsets_,
                    counts_,
                    owner_,
                    place_,
                    slot_,
                    a,
                    b,
                    out,
                    CHUNK=CHUNK,
                    BLOCK=_BLOCK,
                    MASKED=masked,
                    num_warps=_WARPS,
                )
    result = _segment_totals(out, ends_, begins_)
    for row in np.flatnonzero(tails):  # the last word, zero-padded, at position n
        chunk, rest = divmod(int(counts[row]), CHUNK)
        result[row] += tail_word(_byte_view(originals[row]), int(counts[row]) * 8) * a[:, rest] * b[chunk]
    return result


def _device_lanes_many(datas: list[torch.Tensor]) -> torch.Tensor:
    """[len(datas), 2] int64: the lanes of each uint8 tensor (all on one device), equal to `_device_lanes` of
    each, from one concatenation, so a few hundred small tensors cost a few kernels instead of a few each. Every
    tensor's bytes are zero-padded to whole chunks there: a word keeps its place in its chunk and its chunk its
    place in its tensor, and the padding's zero words add nothing. Per-chunk sums are totalled per tensor as
    differences of a running sum, which wraps like every other sum here."""
    device, span = datas[0].device, CHUNK * 8
    chunks = [-(-d.numel() // span) for d in datas]
    zeros = torch.zeros(max(c * span - d.numel() for c, d in zip(chunks, datas)), dtype=torch.uint8, device=device)
    pieces = []
    for data, count in zip(datas, chunks):
        pieces += [data, zeros[: count * span - data.numel()]]
    words = torch.cat(pieces).view(torch.int64).view(-1, CHUNK)
    a, b = _on_device("A", 0, device), _on_device("B", max(chunks) + 1, device)
    place = torch.from_numpy(np.concatenate([np.arange(c) for c in chunks] + [np.zeros(0, np.int64)])).to(device)
    sums = torch.cat(
        [(words[g : g + GROUP].unsqueeze(1) * a).sum(dim=2) for g in range(0, words.shape[0], GROUP)]
        or [torch.zeros(0, 2, dtype=torch.int64, device=device)]
    )
    ends = torch.from_numpy(np.cumsum(chunks)).to(device)
    return _segment_totals(sums * b[place], ends, ends - torch.tensor(chunks, device=device))


def _segment_totals(values: torch.Tensor, ends: torch.Tensor, begins: torch.Tensor) -> torch.Tensor:
    """[len(ends), 2] int64: the totals of `values`' rows ([N, 2] int64, per-chunk products) from begins[t] to
    ends[t], as differences of a running sum, which wraps like every other sum here. Each lane's running sum is
    taken over one contiguous row: torch scans a 1-D tensor with one device-wide scan, while a scan down the first
    dimension of an [N, 2] tensor runs a thread per column (13 ms for the 110,000 chunks of a 4B model's fp32
    gradients on an H200, about twice the checksum kernel's own time)."""
    per_lane = values.t().contiguous()
    running = torch.zeros(2, values.shape[0] + 1, dtype=torch.int64, device=values.device)
    for k in range(2):
        torch.cumsum(per_lane[k], 0, out=running[k, 1:])
    return (running[:, ends] - running[:, begins]).t().contiguous()


def lanes(tensor: torch.Tensor, on_device: bool | None = None) -> torch.Tensor | tuple[int, int]:
    """The two lanes of `tensor`'s bytes, computed on its device: a pair of ints for a CPU tensor (numpy), a
    [2] int64 tensor on the device otherwise (`on_device=True` takes that path on the CPU too: the tests
    hold the two paths equal)."""
    data = _byte_view(tensor)
    if on_device or (on_device is None and not data.is_cpu):
        return _device_lanes(data)
    return host_lanes(data.numpy())


def to_unsigned(pair) -> tuple[int, int]:
    """Lanes as two ints in [0, 2**64), from a pair of ints or int64 values."""
    return int(pair[0]) & MASK, int(pair[1]) & MASK


@functools.lru_cache(maxsize=8192)
def _header(name: str, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    """The length-prefixed JSON header of a tensor: a step checksums the same few hundred names again and
    again (every gradient of every minibatch), so each is built once."""
    header = json.dumps([name, str(dtype), list(shape), nbytes], separators=(",", ":")).encode()
    return len(header).to_bytes(4, "little") + header


class Digests:
    """Running checksums over tensors, several at once: `add` computes a tensor's lanes on its device and
    counts them in each digest it names; `hexdigests` brings every pending lane to the host in one copy per
    device and runs sha256 there. A trainer adds every gradient of every minibatch and asks once a step."""

    def __init__(self, keys: Iterable[Hashable] = ()):
        self._keys = dict.fromkeys(keys)  # digests asked for even if nothing is added to them
        self._entries: list[tuple[tuple[Hashable, ...], bytes, object]] = []

    def add(self, name: str, tensor: torch.Tensor, *keys: Hashable) -> None:
        header = _header(name, tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size())
        self._keys.update(dict.fromkeys(keys))
        self._entries.append((keys, header, lanes(tensor)))

    def add_all(self, items: Iterable[tuple[str, torch.Tensor, tuple[Hashable, ...]]]) -> None:
        """`add(name, tensor, *keys)` for each item, in order. On a GPU with Triton every tensor of a device is
        reduced in one kernel launch (`_fused_lanes`); without, tensors smaller than BATCH_BYTES are reduced together
        in batches (`_device_lanes_many`). The same lanes either way."""
        batch: list[int] = []
        size = 0

        def flush() -> None:
            nonlocal size
            if batch:
                self._fill(batch, _device_lanes_many([_byte_view(self._entries[i][2]) for i in batch]))
            batch.clear()
            size = 0

        fused: dict[torch.device, list[int]] = {}  # devices with the Triton kernel: every tensor in one launch
        host: list[int] = []
        for name, tensor, keys in items:
            nbytes = tensor.numel() * tensor.element_size()
            if not tensor.is_cpu and _use_kernel(tensor.device, None):
                fused.setdefault(tensor.device, []).append(self._hold(name, tensor, keys, nbytes))
                continue
            if tensor.is_cpu:  # summed together at the end (digest_host.host_lanes_many)
                host.append(self._hold(name, tensor, keys, nbytes))
                continue
            if nbytes >= BATCH_BYTES:
                self.add(name, tensor, *keys)
                continue
            if size + nbytes > BATCH_BYTES or (batch and self._entries[batch[0]][2].device != tensor.device):
                flush()
            batch.append(self._hold(name, tensor, keys, nbytes))
            size += nbytes
        flush()
        pairs = host_lanes_many([_byte_view(self._entries[i][2]).numpy() for i in host])
        for i, pair in zip(host, pairs):
            self._entries[i] = (*self._entries[i][:2], pair)
        for indices in fused.values():
            self._fill(indices, _fused_lanes([self._entries[i][2].detach() for i in indices]))

    def _hold(self, name: str, tensor: torch.Tensor, keys: tuple[Hashable, ...], nbytes: int) -> int:
        """An entry whose lanes its batch computes later (`_fill`), holding the tensor until then; its index."""
        self._keys.update(dict.fromkeys(keys))
        self._entries.append((keys, _header(name, tensor.dtype, tuple(tensor.shape), nbytes), tensor))
        return len(self._entries) - 1

    def _fill(self, indices: list[int], rows: torch.Tensor) -> None:
        """The held entries `indices` take their batch's lanes: (rows, row), fetched with the batch by hexdigests."""
        for row, i in enumerate(indices):
            self._entries[i] = (*self._entries[i][:2], (rows, row))

    def hexdigests(self) -> dict[Hashable, str]:
        """Each key's checksum: sha256 over the prefix and, for each tensor added to it in order, its header
        and its lanes (two little-endian uint64)."""
        pending = [value for _, _, value in self._entries if isinstance(value, torch.Tensor)]
        fetched = iter(_fetch(pending))
        batches: dict[int, bytes] = {}  # rows of a batch reduced together (`add_all` on a device): one copy each,
        for _, _, value in self._entries:  # as the little-endian bytes of its int64 (= uint64) lanes
            if type(value) is tuple and isinstance(value[0], torch.Tensor) and id(value[0]) not in batches:
                batches[id(value[0])] = value[0].cpu().numpy().astype("<i8").tobytes()
        digests = {key: hashlib.sha256(_PREFIX) for key in self._keys}
        for keys, header, value in self._entries:
            if isinstance(value, torch.Tensor):
                pair = next(fetched)
                record = header + pair[0].to_bytes(8, "little") + pair[1].to_bytes(8, "little")
            elif isinstance(value[0], torch.Tensor):
                record = header + batches[id(value[0])][16 * value[1] : 16 * value[1] + 16]
            else:
                record = header + value[0].to_bytes(8, "little") + value[1].to_bytes(8, "little")
            for key in keys:
                digests[key].update(record)
        return {key: digest.hexdigest() for key, digest in digests.items()}


def _fetch(pending: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Device lanes to the host as unsigned pairs, in order: one stacked copy per device."""
    out: list[tuple[int, int] | None] = [None] * len(pending)
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(pending):
        by_device.setdefault(value.device, []).append(i)
    for indices in by_device.values():
        host = torch.stack([pending[i] for i in indices]).cpu().numpy().view(np.uint64)
        for i, row in zip(indices, host.tolist()):
            out[i] = (row[0], row[1])
    return out


def tensors_digest(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """Checksum of named tensors, in the order given (pass a dict sorted by name for weights)."""
    digests = Digests([None])
    digests.add_all(
        (name, tensor, (None,)) for name, tensor in (tensors.items() if isinstance(tensors, Mapping) else tensors)
    )
    return digests.hexdigests()[None]


def weights_digests(weights: Mapping[str, torch.Tensor]) -> tuple[str, dict[str, str]]:
    """(weights_digest, tensor_digests) of a state dict from one pass over its bytes."""
    digests = Digests([None])
    digests.add_all((name, tensor, (None, ("tensor", name))) for name, tensor in sorted(weights.items()))
    out = digests.hexdigests()
    return out.pop(None), {name: out[("tensor", name)] for name in weights}


def tensor_digests(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's own checksum, by name: what an engine reports of the weights it holds."""
    return weights_digests(weights)[1]


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """Checksum of a state dict, by sorted name, so the order parameters were visited does not matter."""
    return tensors_digest(sorted(weights.items()))
