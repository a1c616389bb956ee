"""The batched engine on a GPU in deterministic mode: a request's bits do not depend on its batch
(fixed requests, several compositions and rows), and the batched path agrees with the per-sample
path to rounding. The CPU suite holds the same property under hypothesis."""

from __future__ import annotations

import random

from rlbench.backends.hf_engine import HFEngine
from rlbench.config import load_config
from rlbench.core.data import encode_prompts
from rlbench.core.data import load_dataset
from rlbench.core.model import build_model, load_tokenizer
from rlbench.core.seeding import configure_determinism
from rlbench.core.types import GenerateRequest


def _setup():
    config = load_config(device="cuda")
    configure_determinism(config.threads, config.device)
    tokenizer = load_tokenizer(config.model.tokenizer)
    prompts = list(encode_prompts(tokenizer, load_dataset(config.data.path)[:12]).values())
    model = build_model(RANDOM_INIT_MODEL, master_seed=5, device="cuda", init="random")
    eos = tokenizer.eos_token_id
    requests = [
        GenerateRequest(prompts[i % 12], 100 + i, 4, [1.0, 0.7, 0.0][i % 3], (eos,), [-1, 5][i % 2], [1.0, 0.9][i % 2])
        for i in range(40)
    ]
    return model, requests


def test_cuda_batched_decode_is_batch_invariant():
    model, requests = _setup()
    engine = HFEngine(model, device="cuda", batch_size=16)
    reference = engine.generate(requests)
    for seed in range(4):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        take = order[: 5 + 9 * seed]  # other sizes, compositions and rows
        got = engine.generate([requests[i] for i in take])
        assert [reference[i] for i in take] == got, seed
    assert engine.generate(requests[7:8])[0] == reference[7]


def test_cuda_paths_agree():
    model, requests = _setup()
    batched = HFEngine(model, device="cuda").generate(requests)
    alone = HFEngine(model, device="cuda", decode="per-sample").generate(requests)
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]
    assert max(abs(a - b) for x, y in zip(batched, alone) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4


# ---------------------------------------------------------------- the hypothesis property and CUDA graphs on the GPU

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.helpers import ROWS, NaiveEngine, batches, check_property, engine_request, moved  # noqa: E402
from tests.conftest import RANDOM_INIT_MODEL


@pytest.fixture(scope="module")
def setup():
    """The CPU property test's setup, on the GPU: the batched engine (CUDA graphs, grouped attention) and the
    per-sample reference."""
    config = load_config(device="cuda")
    configure_determinism(config.threads, config.device, deterministic=True)
    tokenizer = load_tokenizer(config.model.tokenizer)
    prompts = list(encode_prompts(tokenizer, load_dataset(config.data.path)[:12]).values())
    prompts.append(prompts[0] + prompts[1])
    model = build_model(RANDOM_INIT_MODEL, master_seed=5, device="cuda", init="random")
    engines = {
        "batched": HFEngine(model, device="cuda", batch_size=ROWS),
        "per-sample": HFEngine(model, device="cuda", decode="per-sample"),
    }
    return engines, prompts, tokenizer.eos_token_id, model


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**batches)
def test_cuda_batched_sample_does_not_depend_on_its_batch(setup, batch, others, same_prompt, order):
    assert setup[0]["batched"].cuda_graphs
    check_property(setup, "batched", batch, others, same_prompt, order)


def test_cuda_naive_batched_decode_breaks_the_property(setup):
    _, prompts, eos, model = setup
    naive = NaiveEngine(model, device="cuda")
    batch = [engine_request(prompts, eos, (i % 13, 100 + i, 1.0, -1, 1.0, 6)) for i in range(6)]
    others = [engine_request(prompts, eos, (12, 7, 1.0, -1, 1.0, 6))]
    assert moved(naive, batch, others, 0) != []


def test_cuda_graphs_give_the_eager_bits_and_follow_weight_updates(setup):
    """The captured decode replays the eager forward's kernels: the same tokens and log-probs, before and after a
    weight update (the graph reads the parameters in place), and a graph is reused, not captured again."""
    _, prompts, eos, model = setup
    requests = [engine_request(prompts, eos, (i % 13, 50 + i, [1.0, 0.7, 0.0][i % 3], -1, 1.0, 12)) for i in range(9)]
    graphs = HFEngine(model, device="cuda", batch_size=ROWS)
    eager = HFEngine(model, device="cuda", batch_size=ROWS, cuda_graphs=False)
    before = graphs.generate(requests)
    assert before == eager.generate(requests)
    captured = sum(len(kept) for kept in graphs.graphs.values())
    assert captured >= 1
    changed = {name: t * 1.01 for name, t in graphs.model.named_parameters()}
    graphs.update_weights(changed, 1)
    eager.update_weights(changed, 1)
    after = graphs.generate(requests)
    assert after == eager.generate(requests)
    assert after != before  # the new weights were read
    assert sum(len(kept) for kept in graphs.graphs.values()) == captured
    assert not torch.cuda.is_current_stream_capturing()


def test_cuda_graphs_follow_a_weight_load_of_rlbench_serve(tmp_path):
    """rlbench serve's /update_weights_from_disk with decode graphs captured before it: the weights go into the
    parameters the graphs read (in place), so what it generates next equals a server started from those weights.
    A model swapped in instead left the graphs replaying the old, freed weights (tests/cpu/test_serve_weights.py)."""
    from rlbench.serve.server import ServeConfig, ServerState
    from tests.conformance.sglang.conftest import write_checkpoint
    from tests.helpers import fixture_requests

    first, second = write_checkpoint(tmp_path / "a", seed=1), write_checkpoint(tmp_path / "b", seed=2)
    state = ServerState(ServeConfig(model_path=str(first), load_format="auto", device="cuda"))
    before = state.engine.generate(fixture_requests())
    captured = sum(len(kept) for kept in state.engine.graphs.values())
    assert captured >= 1
    state.load_weights(str(second), "auto")
    after = state.engine.generate(fixture_requests())
    assert sum(len(kept) for kept in state.engine.graphs.values()) == captured  # replayed, not captured again
    fresh = ServerState(ServeConfig(model_path=str(second), load_format="auto", device="cuda"))
    assert after == fresh.engine.generate(fixture_requests())
    assert after != before


def test_the_kv_write_lifts_the_deterministic_flag_for_itself_only():
    """The fixed KV store writes its one column with the plain index_copy_ kernel (no sort, no device asserts)
    and leaves torch's deterministic-algorithms setting as it found it, warn-only flag included."""
    from rlbench.backends.batched_forward import _one_index

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        for warn in (False, True):
            torch.use_deterministic_algorithms(True, warn_only=warn)
            target = torch.zeros(2, 3, 5, device="cuda")
            with _one_index(target.device):
                assert not torch.are_deterministic_algorithms_enabled()
                target.index_copy_(2, torch.tensor([3], device="cuda"), torch.ones(2, 3, 1, device="cuda"))
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.is_deterministic_algorithms_warn_only_enabled() == warn
            assert target[:, :, 3].eq(1).all() and target.sum() == 6
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
