"""Checks of the GPU checksum kernel (rlbench/rundir/digest.py `_fused_lanes`) under Triton's interpreter, run by
tests/cpu/test_digest.py in a process of its own with TRITON_INTERPRET=1: every tensor's lanes equal the numpy
definition, in one batch of whole and partial chunks, tails, several dtypes, a non-contiguous and an unaligned
tensor; a batch's checksums (each row fetched with its batch) equal `add`'s; a flipped bit changes its tensor's
lanes only. Prints "ok"."""

from __future__ import annotations

import os

import torch

from rlbench.rundir import digest

C = digest.CHUNK


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    g = torch.Generator().manual_seed(11)
    datas = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        for n in (0, 3, 8, 8 * C - 8, 8 * C, 8 * C + 5, 8 * (2 * C + 3) + 7)
    ]
    datas += [
        torch.randn(33, 7, generator=g).to(torch.bfloat16),
        torch.randn(40, 9, generator=g).T,
        torch.randn(1001, generator=g).to(torch.bfloat16)[1:],
        torch.randint(0, 256, (8 * C + 20,), dtype=torch.uint8, generator=g)[3:],
    ]
    host = [digest.lanes(d) for d in datas]
    rows = digest._fused_lanes(datas)
    assert [digest.to_unsigned(r) for r in rows] == host
    assert all(
        digest.to_unsigned(digest._device_lanes(digest._byte_view(d), fused=True)) == h for d, h in zip(datas, host)
    )
    batch = digest.Digests([None])
    for i, d in enumerate(datas):  # add_all's GPU branch: each entry a row of one batch
        nbytes = d.numel() * d.element_size()
        batch._entries.append(((None,), digest._header(str(i), d.dtype, tuple(d.shape), nbytes), (rows, i)))
    reference = digest.Digests([None])
    for i, d in enumerate(datas):
        reference.add(str(i), d, None)
    assert batch.hexdigests() == reference.hexdigests()
    flipped = [d.clone() for d in datas]
    raw = digest._byte_view(flipped[5])
    raw[8 * C + 2] ^= 4
    again = [digest.to_unsigned(r) for r in digest._fused_lanes(flipped)]
    assert [i for i, (a, b) in enumerate(zip(again, host)) if a != b] == [5]
    print("ok")


if __name__ == "__main__":
    main()
