"""The counter-based sampling noise (rlbench/backends/sampling.py `uniforms`) on a GPU: the same bits as on
the CPU, by construction (integer operations only), at Qwen3's vocabulary and for seeds of every sign."""

from __future__ import annotations

import torch

from rlbench.backends.sampling import seed_words, uniforms


def test_the_gpus_noise_is_the_cpus_bit_for_bit():
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 1234, *range(10**12, 10**12 + 58)]
    words = [seed_words(s) for s in seeds]
    lo, hi = torch.tensor([w[0] for w in words]), torch.tensor([w[1] for w in words])
    for step in (0, 1, 255, 4095):
        cpu = uniforms(lo, hi, step, 151_936)
        gpu = uniforms(lo.cuda(), hi.cuda(), step, 151_936)
        assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu), step
