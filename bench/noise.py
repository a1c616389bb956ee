"""One decode step's token choice (noise and Gumbel-max over a batch's logits), the ways rlbench has made it
(issue 34, points 2 and 3), alternating rounds, each timed between device synchronisations; medians and ratios.

- previous: the engine's before issue 34, kept here as the baseline: each request's own CPU torch generator
  draws a vocabulary's width of uniforms, the rows are stacked and copied to the device, then
  `sampling.choose`;
- tensor: `sampling.choose` over the counter-based `sampling.uniforms`, computed where the logits are (the
  engine's path on the CPU, and on a GPU for top-k/top-p filtered batches);
- fused (CUDA with Triton): `sampling.sample`'s Triton kernel, noise and choice in one kernel
  (rlbench/backends/sampling_triton.py), the engine's path on a GPU.

    python bench/noise.py [--device cuda] [--rows 64] [--vocab 151936] [--rounds 30]

The default run's shape on the CPU: `python bench/noise.py --device cpu --vocab 314`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlbench.backends.sampling import SamplingRows, choose, sample
from rlbench.core.types import GenerateRequest


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def previous(generators: list[torch.Generator], vocab: int, device: str) -> torch.Tensor:
    """The uniforms the engine drew before issue 34: one CPU generator per request, copied to the device."""
    return torch.stack([torch.rand(vocab, generator=g) for g in generators]).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    device = args.device
    requests = [GenerateRequest((1,), 10**12 + i, 256, 1.0, ()) for i in range(args.rows)]
    rows = SamplingRows(requests, args.rows, device, fused=False)
    fused = SamplingRows(requests, args.rows, device)
    generators = [torch.Generator().manual_seed(r.seed) for r in requests]
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)).to(device)
    ways = {
        "previous (CPU generators + copy)": lambda step: choose(logits, previous(generators, args.vocab, device), rows),
        f"tensor (counter-based on {device})": lambda step: choose(logits, rows.noise(step, args.vocab), rows),
    }
    if fused.fused:
        ways["fused (one Triton kernel)"] = lambda step: sample(logits, fused, step)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for step in range(args.rounds + 1):
        order = list(ways) if step % 2 else list(reversed(ways))
        for name in order:
            _sync(device)
            start = time.perf_counter()
            ways[name](step)
            _sync(device)
            if step:  # the first round warms every way up
                times[name].append((time.perf_counter() - start) * 1e3)
    label = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(
        f"{label}, torch {torch.__version__}, {args.rows} rows x {args.vocab} logits, "
        f"median of {args.rounds} alternating rounds, one decode step's token choice:"
    )
    base = statistics.median(times[next(iter(ways))])
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"  {name:38s} {ms:8.3f} ms  x{base / ms:6.2f} of previous  ({ms * 256 / 1e3:.3f} s over 256 tokens)")


if __name__ == "__main__":
    main()
