"""The checksum's host side (digest.py's `wordsum/1`): its multiplier tables A and B, and the lanes of host bytes
with numpy's unsigned 64-bit products (unsigned arithmetic wraps modulo 2**64 by definition).

A tensor's lanes are sums modulo 2**64 over its chunks, so any split of the chunks gives the same lanes. Host
tensors checksummed together (`host_lanes_many`: an offloaded optimizer's fp32 gradients, 2.4 GB at Qwen3-0.6B)
are cut into pieces of PIECE_CHUNKS chunks and summed over torch's CPU threads at once (with numpy's multiply and
sum, which free the GIL, where one thread takes its integer matmul, which does not): the same lanes as one
thread's, in a fraction of the time.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

CHUNK = 1 << 14  # words per chunk: A's table (2 x 128 KiB) stays in the CPU's cache
PIECE_CHUNKS = 64  # chunks a thread sums at a time (8 MiB)
PARALLEL_BYTES = 32 << 20  # host bytes checksummed together from which the threads share the work
MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_A_STREAMS, _B_STREAMS = (0xA0, 0xA1), (0xB0, 0xB1)  # one stream per lane, for A and for B


def splitmix64(seed: int, count: int) -> np.ndarray:
    """The first `count` outputs of SplitMix64 seeded with `seed` (Steele, Lea, Flood 2014; seed 0's first is
    0xE220A8397B1DCDAF), as uint64: numpy's unsigned array arithmetic wraps modulo 2**64."""
    z = (np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GOLDEN)) + np.uint64(seed)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


@functools.cache
def a_table() -> np.ndarray:
    """A: [2, CHUNK] uint64, lane k's multipliers within a chunk (odd)."""
    return np.stack([splitmix64(seed, CHUNK) | np.uint64(1) for seed in _A_STREAMS])


@functools.cache
def _b_rows(size: int) -> np.ndarray:
    table = np.stack([splitmix64(seed, size) | np.uint64(1) for seed in _B_STREAMS], axis=1)
    table[0] = 1
    return table


def b_table(count: int) -> np.ndarray:
    """B: [>= count, 2] uint64, each chunk's multiplier per lane (odd; chunk 0's is 1). Cached by powers of two."""
    return _b_rows(max(1024, 1 << max(count - 1, 0).bit_length()))


def tail_word(data, full: int):
    """The last nbytes % 8 bytes, zero-padded to one word (numpy or torch, as `data`)."""
    if isinstance(data, np.ndarray):
        tail = np.zeros(8, dtype=np.uint8)
        tail[: data.size - full] = data[full:]
        return int(tail.view(np.uint64)[0])
    tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
    tail[: data.numel() - full] = data[full:]
    return tail.view(torch.int64)


def host_lanes(data: np.ndarray) -> tuple[int, int]:
    """The two lanes of `data` (uint8): [chunks, C] x [C, 2] products, then the partial last chunk and word."""
    return host_lanes_many([data])[0]


def host_lanes_many(datas: list[np.ndarray]) -> list[tuple[int, int]]:
    """The lanes of each of `datas` (uint8 arrays), their whole chunks summed in pieces over torch's CPU threads
    when they hold PARALLEL_BYTES or more together (see the module)."""
    a, shapes, pieces = a_table(), [], []
    for index, data in enumerate(datas):
        full = data.size // 8 * 8
        words = data[:full].view(np.uint64)
        chunks, rest = divmod(words.size, CHUNK)
        shapes.append((words, chunks, rest, full))
        pieces += [(index, lo, min(lo + PIECE_CHUNKS, chunks)) for lo in range(0, chunks, PIECE_CHUNKS)]
    table = b_table(max((shape[1] for shape in shapes), default=0) + 1)

    def piece(job: tuple[int, int, int], threaded: bool = False) -> np.ndarray:
        index, lo, hi = job
        words = shapes[index][0][lo * CHUNK : hi * CHUNK].reshape(hi - lo, CHUNK)
        if not threaded:  # numpy's integer matmul: the fastest on one thread, but it holds the GIL
            return ((words @ a.T) * table[lo:hi]).sum(axis=0, dtype=np.uint64)
        products = np.empty_like(words)  # multiply and sum: ufuncs, which free the GIL
        lanes = [np.multiply(words, a[k], out=products).sum(axis=1, dtype=np.uint64) for k in range(2)]
        return (np.stack(lanes, axis=1) * table[lo:hi]).sum(axis=0, dtype=np.uint64)

    workers = min(torch.get_num_threads(), len(pieces))
    if workers > 1 and sum(shape[3] for shape in shapes) >= PARALLEL_BYTES:
        with ThreadPoolExecutor(workers) as pool:
            sums = list(pool.map(functools.partial(piece, threaded=True), pieces))
    else:
        sums = [piece(job) for job in pieces]
    lanes = [[0, 0] for _ in datas]
    for (index, _, _), part in zip(pieces, sums):
        lanes[index] = [lanes[index][0] + int(part[0]), lanes[index][1] + int(part[1])]
    out = []
    for data, (words, chunks, rest, full), acc in zip(datas, shapes, lanes):
        b = table[chunks] if chunks else (1, 1)  # the last chunk's multipliers (chunk 0's are 1)
        if rest:
            sums_rest = a[:, :rest] @ words[chunks * CHUNK :]
            acc = [acc[0] + int(sums_rest[0]) * int(b[0]), acc[1] + int(sums_rest[1]) * int(b[1])]
        if full < data.size:  # the last word, zero-padded, at position n
            word = tail_word(data, full)
            acc = [acc[k] + word * int(a[k, rest]) * int(b[k]) for k in range(2)]
        out.append((acc[0] & MASK, acc[1] & MASK))
    return out
