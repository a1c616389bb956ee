"""The sampling noise of one decode step, both ways (issue 34, point 2): the engine's today, each request's
CPU generator drawing a vocabulary's width of uniforms and the rows copied to the device
(`rlbench.backends.sampling.RequestNoise`), against the counter-based `uniforms`, computed on the device
for the whole batch. Alternating rounds, each timed between device synchronisations; medians and their ratio.

    python bench/noise.py [--device cuda] [--rows 64] [--vocab 151936] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlbench.backends.sampling import RequestNoise, seed_words, uniforms
from rlbench.core.types import GenerateRequest


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    requests = [GenerateRequest((1,), 10**12 + i, 256, 1.0, ()) for i in range(args.rows)]
    noises = [RequestNoise(r, args.vocab) for r in requests]
    words = [seed_words(r.seed) for r in requests]
    lo = torch.tensor([w[0] for w in words], device=args.device)
    hi = torch.tensor([w[1] for w in words], device=args.device)
    cpu_ms, device_ms = [], []
    for step in range(args.rounds + 1):
        _sync(args.device)
        start = time.perf_counter()
        drawn = torch.stack([n.draw() for n in noises]).to(args.device)
        _sync(args.device)
        middle = time.perf_counter()
        hashed = uniforms(lo, hi, step, args.vocab)
        _sync(args.device)
        end = time.perf_counter()
        assert drawn.shape == hashed.shape
        if step:  # the first round warms both up
            cpu_ms.append((middle - start) * 1e3)
            device_ms.append((end - middle) * 1e3)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    per_gen, per_hash = statistics.median(cpu_ms), statistics.median(device_ms)
    print(f"{name}, {args.rows} rows x {args.vocab} logits, median of {args.rounds} alternating rounds:")
    print(f"  CPU generators + copy (the engine's today): {per_gen:.3f} ms a decode step")
    print(f"  counter-based on {args.device}: {per_hash:.3f} ms a decode step")
    print(f"  ratio: x{per_gen / per_hash:.1f}; at 256 new tokens a rollout: {per_gen * 256 / 1e3:.2f} s vs "
          f"{per_hash * 256 / 1e3:.3f} s")


if __name__ == "__main__":
    main()
