"""Property: a sample's response tokens and log-probs are the same bytes whether it is generated
alone or in a batch of any size and composition (other prompts, other seeds, the same prompt)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbench.config import load_config
from rlbench.core.context import _encode_prompts
from rlbench.core.data import load_dataset
from rlbench.core.model import build_model, load_tokenizer
from rlbench.backends.hf_engine import HFEngine
from rlbench.core.types import GenerateRequest


@pytest.fixture(scope="module")
def engine_and_prompts():
    config = load_config()
    tokenizer = load_tokenizer(config.model.tokenizer)
    prompts = _encode_prompts(tokenizer, load_dataset(config.data.path)[:12])
    engine = HFEngine(build_model(config.model.path, master_seed=5))
    return engine, list(prompts.values()), tokenizer.eos_token_id


requests = st.tuples(st.integers(0, 11), st.integers(0, 2**63 - 1), st.sampled_from([0.0, 0.7, 1.0]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=requests, others=st.lists(requests, max_size=6), position=st.integers(0, 6),
       same_prompt=st.integers(0, 3))
def test_sample_does_not_depend_on_its_batch(engine_and_prompts, target, others, position, same_prompt):
    engine, prompts, eos = engine_and_prompts

    def request(spec):
        prompt, seed, temperature = spec
        return GenerateRequest(prompts[prompt], seed, 6, temperature, (eos,))

    # Neighbours that share the target's prompt exercise the shared-prefill path.
    neighbours = [request(o) for o in others] + [request((target[0], s, target[2])) for s in range(same_prompt)]
    batch = neighbours[:position] + [request(target)] + neighbours[position:]
    alone = engine.generate([request(target)])[0]
    within = engine.generate(batch)[min(position, len(neighbours))]
    assert within.output_ids == alone.output_ids
    assert within.logprobs == alone.logprobs  # exact float equality, not approx
    assert within.finish_reason == alone.finish_reason


def test_temperature_zero_ignores_the_seed(engine_and_prompts):
    engine, prompts, eos = engine_and_prompts
    a, b = engine.generate([GenerateRequest(prompts[0], 1, 6, 0.0, (eos,)), GenerateRequest(prompts[0], 2, 6, 0.0, (eos,))])
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs


def test_different_seeds_sample_differently(engine_and_prompts):
    engine, prompts, eos = engine_and_prompts
    results = engine.generate([GenerateRequest(prompts[0], s, 6, 1.0, (eos,)) for s in range(8)])
    assert len({r.output_ids for r in results}) > 1
