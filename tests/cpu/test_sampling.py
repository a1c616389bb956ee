"""The engine's token choice (rlbench/backends/sampling.py): Gumbel-max draws the distribution,
top-k and top-p keep SGLang's token sets, a row's filters are its own, and the reported log-prob
is the unfiltered log_softmax(logits / T) at the chosen token. The counter-based noise is the hash its docstring
defines, computed here again in plain Python integers (no tensor, no overflow possible), a request's
own stream, and uniform. Also: the config refuses bad values."""

from __future__ import annotations

import math

import pytest
import torch

from rlbench.backends.sampling import SamplingRows, choose, seed_words, uniforms
from rlbench.config import load_config
from rlbench.core.types import GenerateRequest
from rlbench.errors import BadInput

V = 6
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])  # distinct probabilities, sorted descending


def _request(seed=0, temperature=1.0, top_k=-1, top_p=1.0):
    return GenerateRequest((1,), seed, 1, temperature, (), top_k, top_p)


def _choose_many(requests, logits=LOGITS):
    """One token per request, all in one batch, each with its own noise."""
    rows = SamplingRows(requests, len(requests))
    return choose(logits.expand(len(requests), V), rows.noise(0, V), rows)


def test_gumbel_max_samples_the_softmax():
    """4000 seeds at temperature 0.5: each token's frequency within 4 standard errors of its
    probability (fixed seeds: the outcome is the same on every run)."""
    requests = [_request(seed, temperature=0.5) for seed in range(4000)]
    tokens, _ = _choose_many(requests)
    probs = torch.softmax(LOGITS / 0.5, dim=-1)
    counts = torch.bincount(tokens, minlength=V).double() / len(requests)
    stderr = (probs * (1 - probs) / len(requests)).sqrt()
    assert (counts - probs).abs().le(4 * stderr + 1e-9).all(), (counts, probs)


@pytest.mark.parametrize(
    "top_k, top_p, kept",
    [
        (1, 1.0, {0}),
        (3, 1.0, {0, 1, 2}),
        (0, 1.0, set(range(V))),
        (-1, 1.0, set(range(V))),
        (-1, 0.3, {0}),  # probabilities 0.42, 0.25, 0.15, ...: the mass before token 1 (0.42) is > 0.3
        (-1, 0.5, {0, 1}),  # the mass before token 2 (0.67) is > 0.5
        (-1, 0.7, {0, 1, 2}),  # the mass before token 2 is <= 0.7, before token 3 (0.83) not
        (2, 0.95, {0, 1}),  # both filters: the smaller set wins
    ],
)
def test_filters_keep_sglangs_token_sets(top_k, top_p, kept):
    probs = torch.softmax(LOGITS, dim=-1)
    before = torch.cumsum(probs, 0) - probs
    expected = {i for i in range(V) if (top_k <= 0 or i < top_k) and before[i] <= top_p}
    assert expected == kept  # the hand-written sets above are SGLang's rule, worked out
    tokens, _ = _choose_many([_request(seed, top_k=top_k, top_p=top_p) for seed in range(600)])
    assert set(tokens.tolist()) == kept  # every kept token drawn at least once, nothing else


def test_a_rows_filters_are_its_own():
    """An unfiltered row gives the same token and log-prob bits beside filtered rows as alone."""
    plain = _request(seed=11)
    alone = _choose_many([plain])
    mixed = _choose_many([_request(seed=3, top_k=1), plain, _request(seed=4, top_p=0.2)])
    assert mixed[0][1].item() == alone[0][0].item() and mixed[1][1].item() == alone[1][0].item()


def test_logprob_is_the_unfiltered_one_and_greedy_ignores_noise():
    tokens, logprobs = _choose_many([_request(seed, temperature=0.7, top_k=2) for seed in range(50)])
    full = torch.log_softmax(LOGITS / 0.7, dim=-1)
    assert torch.equal(logprobs, full[tokens])  # not renormalised over the two kept tokens
    greedy, greedy_lp = _choose_many([_request(seed, temperature=0.0, top_p=0.5) for seed in range(5)])
    assert greedy.tolist() == [0] * 5 and torch.equal(greedy_lp, torch.log_softmax(LOGITS, -1)[[0] * 5])


def test_noise_is_the_requests_own_stream():
    """A row's noise depends on its seed and token number only: not on its place in the batch or its
    neighbours; another token number or seed is other noise."""
    alone = SamplingRows([_request(seed=9)], 1)
    batch = SamplingRows([_request(seed=3), _request(seed=9), _request(seed=10)], 5)  # 2 padding rows
    first = alone.noise(0, V)[0]
    assert torch.equal(batch.noise(0, V)[1], first) and not torch.equal(alone.noise(1, V)[0], first)
    assert not torch.equal(batch.noise(0, V)[2], first)
    assert math.isfinite(float(_choose_many([_request(seed=9)])[1][0]))


def _mix32(x: int) -> int:
    """lowbias32 over Python's integers: the definition, with no tensor and no fixed-width arithmetic."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def _uniform(seed: int, step: int, v: int) -> float:
    lo, hi = (seed % 2**64) % 2**32, (seed % 2**64) >> 32
    row = _mix32(_mix32(_mix32(hi ^ 0x243F6A88) ^ lo) ^ step)
    word = _mix32(_mix32(row ^ _mix32(v)) ^ row)
    return ((word >> 9) * 2 + 1) / 2**24


@pytest.mark.parametrize("seed", [0, 1, 9, 2**31 + 5, 2**63 - 1, -1, -(2**63), 1234567890123])
def test_the_noise_is_the_hash_of_seed_step_and_index(seed):
    vocab, indices = 151_936, [0, 1, 2, 313, 314, 65_535, 65_536, 151_668, 151_935]
    lo, hi = seed_words(seed)
    for step in (0, 1, 7, 255, 2**31):
        got = uniforms(torch.tensor([lo]), torch.tensor([hi]), step, vocab)[0]
        assert got.dtype == torch.float32 and got.shape == (vocab,)
        assert [float(got[v]) for v in indices] == [_uniform(seed, step, v) for v in indices], (seed, step)


def test_the_noise_is_a_rows_own_and_uniform():
    """A row's noise does not depend on the rows beside it; another seed or step gives other noise; over
    100 rows x 10,000 indices the values are uniform on (0, 1) (a chi-square over 100 bins, at the 1e-6
    level: fixed seeds, so the outcome is the same on every run) and never 0 or 1."""
    seeds = [seed_words(s) for s in range(100)]
    lo, hi = torch.tensor([w[0] for w in seeds]), torch.tensor([w[1] for w in seeds])
    many = uniforms(lo, hi, 3, 10_000)
    assert torch.equal(many[41], uniforms(lo[41:42], hi[41:42], 3, 10_000)[0])
    assert not torch.equal(many[41], uniforms(lo[41:42], hi[41:42], 4, 10_000)[0])
    assert not torch.equal(many[41], many[42])
    assert float(many.min()) > 0 and float(many.max()) < 1
    counts = torch.bincount((many * 100).long().flatten(), minlength=100).double()
    expected = many.numel() / 100
    assert float(((counts - expected) ** 2 / expected).sum()) < 175  # chi2(99) exceeds 175 with p < 1e-6


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("top_k", -2, "rollout.top_k"),
        ("top_p", 0.0, "rollout.top_p"),
        ("top_p", 1.5, "rollout.top_p"),
        ("decode", "fast", "rollout.decode"),
        ("decode_batch_size", 0, "rollout.decode_batch_size"),
    ],
)
def test_config_refuses_bad_sampling_values(tmp_path, key, value, needle):
    path = tmp_path / "bad.toml"
    path.write_text(f"[rollout]\n{key} = {value!r}\n".replace("'", '"'))
    with pytest.raises(BadInput, match=needle):
        load_config(path)


def test_on_a_gpu_a_rows_path_is_its_own(monkeypatch):
    """`sample` on a GPU: rows that are not top-k/top-p filtered go through the fused kernel, filtered rows through
    `choose`, decided row by row, so a row's result does not depend on whether a filtered row shares its batch (the
    kernel stood in for here by a marker: the CPU has no Triton; tests/gpu runs the kernel itself)."""
    import sys
    import types

    import rlbench.backends.sampling as sampling

    def fused(logits, seed_lo, seed_hi, temperature, step):  # a stand-in whose answers are recognisable
        return torch.full((logits.shape[0],), 99, dtype=torch.long), torch.full((logits.shape[0],), -7.0)

    monkeypatch.setitem(sys.modules, "rlbench.backends.sampling_triton", types.SimpleNamespace(choose_fused=fused))
    monkeypatch.setattr(sampling, "_triton", lambda: True)
    plain, top_k, top_p = _request(seed=1), _request(seed=2, top_k=2), _request(seed=3, top_p=0.5)

    def rows(requests):
        made = SamplingRows(requests, len(requests) + 1)  # one padding row
        made.fused = True  # as on a CUDA device
        return made

    logits = LOGITS.expand(4, V)
    tokens, logprobs = sampling.sample(logits, rows([plain, top_k, top_p]), 0)
    want, want_logprobs = choose(
        logits[1:3], SamplingRows([top_k, top_p], 2).noise(0, V), SamplingRows([top_k, top_p], 2)
    )
    assert tokens[[0, 3]].tolist() == [99, 99] and logprobs[[0, 3]].tolist() == [-7.0, -7.0]  # the kernel's rows
    assert torch.equal(tokens[1:3], want) and torch.equal(logprobs[1:3], want_logprobs)  # the tensor path's
    alone = sampling.sample(logits[:2], rows([plain]), 0)
    assert alone[0].tolist() == [99, 99]  # the plain row takes the kernel alone as beside filtered rows
