"""The decode step's token choice in one Triton kernel on a GPU: `sampling.choose` over `sampling.uniforms`
fused, for batches whose rows are not top-k or top-p filtered (those take the tensor path).

One program per row, over the vocabulary in blocks of a fixed width, in three passes over the row's logits:
their maximum, the sum of exp(x - max), then log p = (x - max) - log(sum) (log_softmax's expression), the
Gumbel noise of each index (the hash `uniforms` defines, in native 32-bit unsigned arithmetic, which wraps mod
2^32 as the int64 emulation's masks do: the same words, so the same u, by construction) and the first index of
the largest log p + g (of log p, at temperature 0). Nothing of a row depends on another row or on how many rows
there are, so a request's token and log-prob are the same bits in any batch (batch invariance by construction);
the reduction order is the kernel's own, not torch's, so its log-probs may differ from torch's log_softmax in the
last bits (the GPU test bounds the difference and checks the tokens). What is read: the logits, three times; what
is written: a token id and a log-prob per row. No [rows, vocab] tensor of noise, scores or log-probs exists.

Imported only where CUDA and Triton are (torch's CUDA wheels bring Triton); `sampling.sample` decides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary indices per block: part of the reduction order, so of the bits (fixed, not tuned)


@triton.jit
def _mix32(x):
    """lowbias32 over uint32 (multiplication wraps mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["step"])  # step 1 would otherwise be a compile-time constant (a Python int)
def _choose_kernel(
    logits, stride, seed_lo, seed_hi, temperature, step, vocab, out_token, out_logprob, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    base = logits + row.to(tl.int64) * stride
    t = tl.load(temperature + row)
    greedy = t == 0.0
    divisor = tl.where(greedy, 1.0, t)
    lo = tl.load(seed_lo + row).to(tl.uint32)
    hi = tl.load(seed_hi + row).to(tl.uint32)
    row_word = _mix32(_mix32(_mix32(hi ^ 0x243F6A88) ^ lo) ^ step.to(tl.uint32))
    offsets = tl.arange(0, BLOCK)
    top = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        index = start + offsets
        x = tl.load(base + index, mask=index < vocab, other=float("-inf")).to(tl.float32) / divisor
        top = tl.maximum(top, tl.max(x, axis=0))
    total = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        index = start + offsets
        x = tl.load(base + index, mask=index < vocab, other=float("-inf")).to(tl.float32) / divisor
        total += tl.sum(tl.exp(x - top), axis=0)
    log_total = tl.log(total)
    best_score = tl.full((), float("-inf"), tl.float32)
    best_index = tl.zeros((), tl.int64)
    best_logp = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        index = start + offsets
        inside = index < vocab
        x = tl.load(base + index, mask=inside, other=float("-inf")).to(tl.float32) / divisor
        logp = (x - top) - log_total
        word = _mix32(_mix32(row_word ^ _mix32(index.to(tl.uint32))) ^ row_word)
        u = ((word >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, logp, logp + gumbel)
        score = tl.where(inside, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_index = tl.min(tl.where(score == block_best, index, vocab), axis=0)  # the first index of the maximum
        block_logp = tl.sum(tl.where(index == block_index, logp, 0.0), axis=0)
        better = block_best > best_score  # strictly: an earlier block keeps a tie
        best_score = tl.where(better, block_best, best_score)
        best_index = tl.where(better, block_index.to(tl.int64), best_index)
        best_logp = tl.where(better, block_logp, best_logp)
    tl.store(out_token + row, best_index)
    tl.store(out_logprob + row, best_logp)


def choose_fused(
    logits: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor, temperature: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B] int64, their log-probs [B] float32) for logits [B, V] on a CUDA device (any float dtype),
    rows' seed words and temperatures ([B] each, on the same device), token number `step`."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _choose_kernel[(rows,)](
        logits,
        logits.stride(0),
        seed_lo,
        seed_hi,
        temperature.float(),
        step & 0xFFFFFFFF,
        vocab,
        tokens,
        logprobs,
        BLOCK=BLOCK,
    )
    return tokens, logprobs
