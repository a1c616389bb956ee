"""The float32 log-softmax of the train and log-prob passes, chunked along positions (rlbench/core/algo.py
CHUNK_LOGITS, issue 34): chunked or whole, the log-probs, entropies and the gradients they send back to the
logits are the same bits, and a chunk never holds more logits than the bound."""

from __future__ import annotations

import pytest
import torch

from rlbench.core import algo


def _case(dtype):
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 9, 1000, generator=generator) * 3).to(dtype)
    tokens = torch.randint(0, 1000, (3, 12), generator=generator)
    return logits, tokens


def _forward_backward(logits, tokens):
    leaf = logits.clone().requires_grad_(True)
    logp = algo.token_logprobs(leaf, tokens, 0.7)
    entropy = algo.token_entropy(leaf, 0.7, 12)
    weights = torch.linspace(-1, 1, 12)
    ((logp * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
    return logp.detach(), entropy.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_is_whole_bit_for_bit(monkeypatch, dtype):
    logits, tokens = _case(dtype)
    whole = _forward_backward(logits, tokens)
    assert len(algo._position_chunks(logits[:, :-1])) == 1  # the default bound: one chunk at this size
    for per in (1, 2, 5):  # positions per chunk: 3 rows x 1000 logits each
        monkeypatch.setattr(algo, "CHUNK_LOGITS", 3 * 1000 * per)
        assert len(algo._position_chunks(logits[:, :-1])) == -(-8 // per)
        chunked = _forward_backward(logits, tokens)
        for a, b in zip(whole, chunked):
            assert a.dtype == b.dtype and torch.equal(a, b), per
    with torch.no_grad():
        assert torch.equal(algo.token_logprobs(logits, tokens, 0.7), whole[0])


def test_a_chunk_holds_at_most_the_bound():
    logits = torch.empty(16, 300, 151_936, dtype=torch.bfloat16, device="meta")
    chunks = algo._position_chunks(logits)
    assert max(c.stop - c.start for c in chunks) * 16 * 151_936 <= algo.CHUNK_LOGITS
    assert [c.start for c in chunks] == list(range(0, 300, chunks[0].stop)) and chunks[-1].stop == 300
    one = algo._position_chunks(torch.empty(2**20, 1, 2**10, device="meta"))  # a position over the bound: alone
    assert one == [slice(0, 1)]
