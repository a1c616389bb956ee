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


def _rows(count: int, pad: int, temperature: float = 1.0):
    from rlbench.backends.sampling import SamplingRows
    from rlbench.core.types import GenerateRequest

    requests = [
        GenerateRequest((1,), 7919 * i - 3, 1, 0.0 if i % 5 == 4 else temperature, (), -1, 1.0) for i in range(count)
    ]
    return SamplingRows(requests, count + pad, "cuda")


def test_the_fused_kernel_makes_the_tensor_paths_choice():
    """The Triton kernel (sampling_triton.py) against `choose` over `uniforms` on the same GPU logits (bf16, as a
    bf16 model's, and float32), Qwen3's vocabulary: the same tokens (greedy rows too), log-probs within 2e-6 of
    torch's log_softmax (its own reduction order: the last bits may differ)."""
    from rlbench.backends.sampling import choose, sample

    rows = _rows(60, 4, temperature=0.8)
    assert rows.fused
    generator = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for step in (0, 1, 16, 255):
            logits = (torch.randn(64, 151_936, device="cuda", generator=generator) * 4).to(dtype)
            tokens, logprobs = sample(logits, rows, step)
            want_tokens, want_logprobs = choose(logits, rows.noise(step, 151_936), rows)
            assert torch.equal(tokens, want_tokens), (dtype, step)
            assert (logprobs - want_logprobs).abs().max().item() <= 2e-6, (dtype, step)


def test_the_fused_kernel_is_batch_invariant():
    """A row's token and log-prob are the same bits alone, in a batch of 64, in a batch of 8 with other rows and
    beside a filtered row (which the kernel does not take)."""
    from rlbench.backends.sampling import SamplingRows, sample
    from rlbench.core.types import GenerateRequest

    generator = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(64, 151_936, device="cuda", generator=generator).to(torch.bfloat16) * 3
    requests = [GenerateRequest((1,), 1000 + i, 1, 1.0, (), -1, 1.0) for i in range(64)]
    full = sample(logits, SamplingRows(requests, 64, "cuda"), 3)
    for i in (0, 17, 63):
        alone = sample(logits[i : i + 1], SamplingRows([requests[i]], 1, "cuda"), 3)
        assert torch.equal(alone[0][0], full[0][i]) and torch.equal(alone[1][0], full[1][i]), i
    eight = sample(logits[8:16], SamplingRows(requests[8:16], 8, "cuda"), 3)
    assert torch.equal(eight[0], full[0][8:16]) and torch.equal(eight[1], full[1][8:16])
    mixed = [GenerateRequest((1,), 5, 1, 1.0, (), 20, 0.9), requests[17]]  # a top-k/top-p row takes the tensor path
    beside = sample(logits[[16, 17]], SamplingRows(mixed, 2, "cuda"), 3)
    assert torch.equal(beside[0][1], full[0][17]) and torch.equal(beside[1][1], full[1][17])
