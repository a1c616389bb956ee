"""Token choice for the embedded engine: per-request noise, temperature, top-k and top-p, batched.

Gumbel-max sampling: with g = -log(-log(u)), u ~ U[0, 1) drawn from the request's own generator
(seeded with its `seed`, one draw of a vocabulary's width per decoded token), the token is
argmax(log_softmax(logits / T) + g) over the tokens top-k and top-p keep. That is a sample of
the renormalised truncated distribution, and every quantity in it belongs to one row, so a
request's choice depends on its own logits and its own noise, never on its neighbours (SGLang's
deterministic mode samples the same way, with noise hashed from the seed and the position).

Filters follow SGLang's semantics (srt/layers/sampler.py, the pytorch sampler): probabilities are
sorted descending (stable: ties keep index order); a token is kept if its rank is below top_k and
the mass before it is at most top_p, both measured on the unfiltered distribution. top_k -1 or 0
and top_p 1.0 switch a filter off, per row: a row's own switches decide whether it is filtered.
Temperature 0 is greedy (argmax of the logits; filters cannot remove the argmax).

The log-prob reported is log_softmax(logits / T) at the chosen token, whatever the filters did:
it is what the trainer computes for that token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlbench.core.types import GenerateRequest


class RequestNoise:
    """A request's own noise stream: the t-th call gives the uniform draws for its t-th token."""

    def __init__(self, request: GenerateRequest, vocab: int):
        self.vocab = vocab
        self.generator = None if request.temperature == 0 else torch.Generator().manual_seed(request.seed)

    def draw(self) -> torch.Tensor:
        """[vocab] float32 uniforms in [0, 1) (a constant for a greedy request, which draws nothing).
        The CPU generator on every device: a request's noise is the same bits on CPU and CUDA."""
        if self.generator is None:
            return torch.full((self.vocab,), 0.5)
        return torch.rand(self.vocab, generator=self.generator)


class SamplingRows:
    """The sampling parameters of a batch's rows as tensors; rows past the requests are padding
    (greedy, unfiltered), so a fixed-size batch is the same arithmetic whatever fills it."""

    def __init__(self, requests: Sequence[GenerateRequest], rows: int, device: str | torch.device = "cpu"):
        pad = rows - len(requests)
        self.temperature = torch.tensor([r.temperature for r in requests] + [0.0] * pad, device=device)
        self.top_k = torch.tensor([r.top_k for r in requests] + [-1] * pad, device=device)
        self.top_p = torch.tensor([r.top_p for r in requests] + [1.0] * pad, device=device)


def choose(logits: torch.Tensor, uniform: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B], their log-probs [B]) for logits [B, V] and each row's uniforms [B, V]."""
    greedy = rows.temperature == 0
    scaled = logits.float() / torch.where(greedy, 1.0, rows.temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    tiny = torch.finfo(torch.float32).tiny  # u = 0 would give -log(0) = inf: clamp to the smallest normal
    gumbel = -torch.log(-torch.log(uniform.to(logp.device).clamp(min=tiny)))
    scores = torch.where(greedy[:, None], logp, logp + gumbel)
    filtered = ~greedy & ((rows.top_k > 0) | (rows.top_p < 1.0))
    if bool(filtered.any()):  # rows that are not filtered pass through torch.where untouched
        scores = torch.where(filtered[:, None] & ~_kept(logp, rows), float("-inf"), scores)
    tokens = torch.argmax(scores, dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _kept(logp: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """[B, V] bool: the tokens top-k and top-p keep, in SGLang's joint order."""
    probs, order = torch.sort(logp.exp(), dim=-1, descending=True, stable=True)
    before = torch.cumsum(probs, dim=-1) - probs
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(rows.top_k > 0, rows.top_k, probs.shape[-1])
    keep_sorted = (rank < k[:, None]) & (before <= rows.top_p[:, None])
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
