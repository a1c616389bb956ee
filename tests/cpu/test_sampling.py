"""The engine's token choice (rlbench/backends/sampling.py): Gumbel-max draws the distribution,
top-k and top-p keep SGLang's token sets, a row's filters are its own, and the reported log-prob
is the unfiltered log_softmax(logits / T) at the chosen token. Also: the config refuses bad values."""

from __future__ import annotations

import math

import pytest
import torch

from rlbench.backends.sampling import RequestNoise, SamplingRows, choose
from rlbench.config import load_config
from rlbench.core.types import GenerateRequest
from rlbench.errors import BadInput

V = 6
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])  # distinct probabilities, sorted descending


def _request(seed=0, temperature=1.0, top_k=-1, top_p=1.0):
    return GenerateRequest((1,), seed, 1, temperature, (), top_k, top_p)


def _choose_many(requests, logits=LOGITS):
    """One token per request, all in one batch, each with its own noise."""
    uniform = torch.stack([RequestNoise(r, V).draw() for r in requests])
    return choose(logits.expand(len(requests), V), uniform, SamplingRows(requests, len(requests)))


def test_gumbel_max_samples_the_softmax():
    """4000 seeds at temperature 0.5: each token's frequency within 4 standard errors of its
    probability (fixed seeds: the outcome is the same on every run)."""
    requests = [_request(seed, temperature=0.5) for seed in range(4000)]
    tokens, _ = _choose_many(requests)
    probs = torch.softmax(LOGITS / 0.5, dim=-1)
    counts = torch.bincount(tokens, minlength=V).double() / len(requests)
    stderr = (probs * (1 - probs) / len(requests)).sqrt()
    assert (counts - probs).abs().le(4 * stderr + 1e-9).all(), (counts, probs)


@pytest.mark.parametrize("top_k, top_p, kept", [
    (1, 1.0, {0}), (3, 1.0, {0, 1, 2}), (0, 1.0, set(range(V))), (-1, 1.0, set(range(V))),
    (-1, 0.3, {0}),  # probabilities 0.42, 0.25, 0.15, ...: the mass before token 1 (0.42) is > 0.3
    (-1, 0.5, {0, 1}),  # the mass before token 2 (0.67) is > 0.5
    (-1, 0.7, {0, 1, 2}),  # the mass before token 2 is <= 0.7, before token 3 (0.83) not
    (2, 0.95, {0, 1}),  # both filters: the smaller set wins
])
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
    a, b = RequestNoise(_request(seed=9), V), RequestNoise(_request(seed=9), V)
    first = a.draw()
    assert torch.equal(first, b.draw()) and not torch.equal(first, a.draw())
    assert not torch.equal(RequestNoise(_request(seed=10), V).draw(), first)
    assert math.isfinite(float(_choose_many([_request(seed=9)])[1][0]))


@pytest.mark.parametrize("key, value, needle", [
    ("top_k", -2, "rollout.top_k"), ("top_p", 0.0, "rollout.top_p"), ("top_p", 1.5, "rollout.top_p"),
    ("decode", "fast", "rollout.decode"), ("decode_batch_size", 0, "rollout.decode_batch_size"),
])
def test_config_refuses_bad_sampling_values(tmp_path, key, value, needle):
    path = tmp_path / "bad.toml"
    path.write_text(f"[rollout]\n{key} = {value!r}\n".replace("'", '"'))
    with pytest.raises(BadInput, match=needle):
        load_config(path)
