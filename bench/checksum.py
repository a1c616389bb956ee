"""What a checksum costs: wordsum/1 (rlbench/rundir/digest.py) against the sha256 it replaced, per device.

For each size, a set of tensors (bf16 gradients of a model's shape, or one flat buffer) is checksummed
  sha256    the old way: each tensor copied to the host and fed to hashlib's sha256 (rlbench before wordsum/1);
  wordsum   the lanes computed on the tensor's device, one copy of 16 bytes per tensor to the host, sha256
            over headers and lanes there (`tensors_digest`).
Each is timed `--repeats` times, alternating, after one untimed call; the best is printed with GB/s. On a CUDA
device every timing ends with a synchronisation. The CPU figures decide the default run (the tiny model's
checksums run on the CPU); the CUDA ones the issue's real sizes (issue 24: sha256 was 20.7 s of 49 s).

Run:  python bench/checksum.py [--device cpu|cuda] [--sizes 1e6,64e6,1e9] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch

from rlbench.rundir.digest import tensors_digest


def sha256_digest(tensors: dict[str, torch.Tensor]) -> str:
    """rlbench's checksum before wordsum/1: every tensor's bytes through hashlib on the host."""
    digest = hashlib.sha256()
    for name, t in tensors.items():
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def tensors_of(total_bytes: int, device: str) -> dict[str, torch.Tensor]:
    """bf16 tensors of a transformer's shapes (square and 3x-wide matrices, norm vectors) adding up to
    about `total_bytes`."""
    hidden = 1024 if total_bytes >= 1 << 26 else 128
    out, made, i = {}, 0, 0
    while made < total_bytes:
        shape = [(hidden, hidden), (3 * hidden, hidden), (hidden,)][i % 3]
        t = torch.randn(shape, device=device).bfloat16()
        out[f"layer{i}"] = t
        made += t.numel() * 2
        i += 1
    return out


def best_of(fn, repeats: int, device: str) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="1e6,64e6,1e9", help="total bytes per set, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {args.device} ({name}), torch {torch.__version__}, best of {args.repeats}")
    print(f"{'bytes':>12} {'tensors':>8} {'sha256 s':>10} {'GB/s':>7} {'wordsum s':>10} {'GB/s':>7} {'ratio':>6}")
    for size in (int(float(s)) for s in args.sizes.split(",")):
        tensors = tensors_of(size, args.device)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        old = best_of(lambda tensors=tensors: sha256_digest(tensors), args.repeats, args.device)
        new = best_of(lambda tensors=tensors: tensors_digest(tensors), args.repeats, args.device)
        print(
            f"{nbytes:>12} {len(tensors):>8} {old:>10.4f} {nbytes / old / 1e9:>7.2f} {new:>10.4f} "
            f"{nbytes / new / 1e9:>7.2f} {old / new:>6.1f}"
        )


if __name__ == "__main__":
    main()
