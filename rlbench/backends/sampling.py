"""Token choice for the embedded engine: per-request noise, temperature, top-k and top-p, batched.

Gumbel-max sampling: with g = -log(-log(u)), the token is argmax(log_softmax(logits / T) + g) over the
tokens top-k and top-p keep. That is a sample of the renormalised truncated distribution, and every
quantity in it belongs to one row, so a request's choice depends on its own logits and its own noise,
never on its neighbours (SGLang's deterministic mode samples the same way, with noise hashed from the
seed and the position).

The noise is counter-based (`uniforms`): u for vocabulary index v of a request's t-th new token is a
hash of (its seed, t, v), computed with 32-bit integer operations held in int64 tensors that never
overflow (multiplications split into 16-bit halves), then turned into a float32 by exact steps. So it
is computed where the logits are, for the whole batch in a few tensor operations, with no host work
and no copy per token, and its bits are the same on every device: the CPU's and a GPU's are equal by
construction (tests/cpu/test_sampling.py holds the tensors to a pure-Python definition; tests/gpu, the
GPU's to the CPU's). The hash is lowbias32 (C. Wellons' integer hash, a bijection of 32-bit words),
applied in rounds: over the seed's two words and t for the row, then over the row's word and v.

Filters follow SGLang's semantics (srt/layers/sampler.py, the pytorch sampler): probabilities are
sorted descending (stable: ties keep index order); a token is kept if its rank is below top_k and
the mass before it is at most top_p, both measured on the unfiltered distribution. top_k -1 or 0
and top_p 1.0 switch a filter off, per row: a row's own switches decide whether it is filtered.
Temperature 0 is greedy (argmax of the logits; filters cannot remove the argmax).

The log-prob reported is log_softmax(logits / T) at the chosen token, whatever the filters did:
it is what the trainer computes for that token. With rollout.logprobs "filtered" a filtered row reports it
renormalised over the tokens the filters kept (`renormalised`), as an engine does that reports its sampling
distribution's log-probs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from rlbench.core.types import GenerateRequest


MASK32 = 0xFFFFFFFF
_SALT = 0x243F6A88  # pi's first 32 fraction bits: the row hash's start (any constant would do; this one is named)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64 and a 32-bit constant c, with every product under
    2^48: int64 never overflows, on any device."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijection of 32-bit words whose every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_words(seed: int) -> tuple[int, int]:
    """A request's seed (any i64, as SGLang's sampling_seed) as its two's-complement (low, high) 32-bit words."""
    bits = seed & ((1 << 64) - 1)
    return bits & MASK32, bits >> 32


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 in (0, 1): the noise of each row's token number `step` (0: its first new token),
    rows given by their seeds' words ([B] int64 each, on the device the noise is wanted on). Exact: the
    hash's top 23 bits h give u = (2h + 1) / 2^24, an odd multiple of 2^-24 (never 0 or 1), which float32
    holds exactly. On the CPU the words are computed in numpy's uint32 (whose multiplication wraps mod 2^32:
    a third of the operations of the int64 emulation), elsewhere in int64 tensors: the same words."""
    if seed_lo.device.type == "cpu":
        return torch.from_numpy(_uniforms_uint32(seed_lo.numpy(), seed_hi.numpy(), step, vocab))
    return _uniforms_int64(seed_lo, seed_hi, step, vocab)


def _uniforms_int64(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    row = _mix32(_mix32(_mix32(seed_hi ^ _SALT) ^ seed_lo) ^ (step & MASK32))
    index = _mix32(torch.arange(vocab, dtype=torch.int64, device=seed_lo.device))
    word = _mix32(_mix32(row[:, None] ^ index[None, :]) ^ row[:, None])
    return ((word >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """lowbias32 over a uint32 array, in place."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


@functools.lru_cache(maxsize=8)
def _index_words(vocab: int) -> np.ndarray:
    """The vocabulary indices' hashes, made once per size; read-only, as every caller shares them."""
    words = _mix32_np(np.arange(vocab, dtype=np.uint32))
    words.setflags(write=False)
    return words


def _uniforms_uint32(seed_lo: np.ndarray, seed_hi: np.ndarray, step: int, vocab: int) -> np.ndarray:
    row = _mix32_np(seed_hi.astype(np.uint32) ^ np.uint32(_SALT))
    row = _mix32_np(row ^ seed_lo.astype(np.uint32))
    row = _mix32_np(row ^ np.uint32(step & MASK32))[:, None]
    word = _mix32_np(_mix32_np(row ^ _index_words(vocab)[None, :]) ^ row)
    word >>= np.uint32(9)
    return (word.astype(np.float32) * np.float32(2.0) + np.float32(1.0)) * np.float32(2.0**-24)


class SamplingRows:
    """The sampling parameters of a batch's rows as tensors; rows past the requests are padding
    (greedy, unfiltered), so a fixed-size batch is the same arithmetic whatever fills it."""

    def __init__(
        self,
        requests: Sequence[GenerateRequest],
        rows: int,
        device: str | torch.device = "cpu",
        numerics=None,
        fused: bool = True,
    ):
        pad = rows - len(requests)
        # rollout.logprobs "filtered": a filtered row reports its log-prob renormalised over the tokens it kept
        self.renormalise = numerics is not None and numerics.logprobs == "filtered"
        # known on the host once per batch, so no decode step asks the device
        each = [r.temperature != 0 and (r.top_k > 0 or r.top_p < 1.0) for r in requests] + [False] * pad
        self.filtered = any(each)
        self.filtered_rows = torch.tensor(each, device=device)
        self.fused = fused and torch.device(device).type == "cuda" and _triton()
        self.temperature = torch.tensor([r.temperature for r in requests] + [0.0] * pad, device=device)
        self.top_k = torch.tensor([r.top_k for r in requests] + [-1] * pad, device=device)
        self.top_p = torch.tensor([r.top_p for r in requests] + [1.0] * pad, device=device)
        words = [seed_words(r.seed) for r in requests] + [(0, 0)] * pad  # padding rows are greedy: never used
        self.seed_lo = torch.tensor([lo for lo, _ in words], dtype=torch.int64, device=device)
        self.seed_hi = torch.tensor([hi for _, hi in words], dtype=torch.int64, device=device)

    def noise(self, step: int, vocab: int) -> torch.Tensor:
        """[rows, vocab] uniforms of every row's token number `step` (greedy rows ignore theirs)."""
        return uniforms(self.seed_lo, self.seed_hi, step, vocab)


@functools.cache
def _triton() -> bool:
    try:
        import triton  # noqa: F401  (torch's CUDA wheels bring it)
    except ImportError:
        return False
    return True


def sample(logits: torch.Tensor, rows: SamplingRows, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B], their log-probs [B]) of every row's token number `step`: `choose` over `uniforms`. On a
    GPU (with Triton) a row that is not top-k or top-p filtered is chosen by one Triton kernel instead
    (rlbench/backends/sampling_triton.py: the same noise and the same choice rule; its log-probs' last bits are
    its own reduction's), whatever its neighbours are: which path a row takes is its own parameters' choice, so
    its token and log-prob do not depend on the batch it is in."""
    if not rows.fused:
        return choose(logits, rows.noise(step, logits.shape[-1]), rows)
    from rlbench.backends.sampling_triton import choose_fused

    tokens, logprobs = choose_fused(logits, rows.seed_lo, rows.seed_hi, rows.temperature, step)
    if rows.filtered:  # those rows by the tensor path (the kernel does not filter)
        filtered_tokens, filtered_logprobs = choose(logits, rows.noise(step, logits.shape[-1]), rows)
        tokens = torch.where(rows.filtered_rows, filtered_tokens, tokens)
        logprobs = torch.where(rows.filtered_rows, filtered_logprobs, logprobs)
    return tokens, logprobs


def choose(logits: torch.Tensor, uniform: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B], their log-probs [B]) for logits [B, V] and each row's uniforms [B, V]."""
    greedy = rows.temperature == 0
    scaled = logits.float() / torch.where(greedy, 1.0, rows.temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    gumbel = -torch.log(-torch.log(uniform.to(logp.device)))  # u in (0, 1): finite
    scores = torch.where(greedy[:, None], logp, logp + gumbel)
    if not rows.filtered:
        tokens = torch.argmax(scores, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    # rows that are not filtered pass through torch.where untouched
    filtered = ~greedy & ((rows.top_k > 0) | (rows.top_p < 1.0))
    keep = _kept(logp, rows)
    tokens = torch.argmax(torch.where(filtered[:, None] & ~keep, float("-inf"), scores), dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    if rows.renormalise:
        chosen = torch.where(filtered, renormalised(logp, keep, tokens), chosen)
    return tokens, chosen


def _kept(logp: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    return kept(logp, rows.top_k, rows.top_p)


def kept(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: the tokens top-k and top-p keep, in SGLang's joint order (`top_k`, `top_p`: [B] per row)."""
    probs, order = torch.sort(logp.exp(), dim=-1, descending=True, stable=True)
    before = torch.cumsum(probs, dim=-1) - probs
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])
    keep_sorted = (rank < k[:, None]) & (before <= top_p[:, None])
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def renormalised(logp: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The targets' log-probs in the distribution renormalised over the kept tokens (rollout.logprobs "filtered":
    what an engine reports that returns its sampling distribution's log-probs): logp - logsumexp(logp[kept])."""
    norm = torch.logsumexp(logp.masked_fill(~keep, float("-inf")), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1) - norm


def filtered_logprobs(logp: torch.Tensor, targets: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`renormalised` for rows [n, V] of one request's top-k and top-p, the targets kept too: a sampled token was
    kept when it was sampled, and logits computed again may leave it just outside (slime's trainer keeps it the same
    way over a recorded nucleus: `_build_topp_keep_mask`)."""
    n = logp.shape[0]
    keep = kept(logp, torch.full((n,), top_k, device=logp.device), torch.full((n,), top_p, device=logp.device))
    keep[torch.arange(n, device=logp.device), targets] = True
    return renormalised(logp, keep, targets)


def row_logp(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """The log-softmax `choose` reports its log-probs from (the same expression over the same rows: the
    same bits)."""
    greedy = rows.temperature == 0
    return torch.log_softmax(logits.float() / torch.where(greedy, 1.0, rows.temperature)[:, None], dim=-1)


def top(logits: torch.Tensor, rows: SamplingRows, row: int, n: int) -> list[tuple[float, int]]:
    """Row `row`'s n most likely tokens, (log-prob, id) by descending log-prob."""
    logp = row_logp(logits, rows)
    values, ids = torch.topk(logp[row], min(n, logp.shape[-1]))
    return list(zip(values.tolist(), ids.tolist()))


def probed(logits: torch.Tensor, rows: SamplingRows, row: int, ids: tuple[int, ...]) -> list[tuple[float, int]]:
    """Row `row`'s log-probs of the tokens `ids`, (log-prob, id) in their order."""
    return list(zip(row_logp(logits, rows)[row, list(ids)].tolist(), ids))


def biased(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Logits plus the rows' logit biases; a row without one keeps its logits untouched (the same bits)."""
    if bias is None:
        return logits
    return torch.where((bias != 0).any(-1, keepdim=True), logits + bias, logits)
