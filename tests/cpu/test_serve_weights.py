"""`rlbench serve`'s weight loads (/update_weights_from_disk, /pull_weights' reload) copy the new weights into the
served parameters in place, once read whole: the engine's captured CUDA graphs read its parameters by address,
and a model swapped in under them left them replaying the freed old weights (at the Qwen3-0.6B shape on a GPU the
SGLang run's rollout log-probs sat 11 nats from the trainer's after the first update). The same on the GPU, with
graphs captured before the load: tests/gpu/test_engine_cuda.py."""

from __future__ import annotations

import torch

from rlbench.core.model import named_weights
from rlbench.serve.server import ServeConfig, ServerState
from tests.conformance.sglang.conftest import write_checkpoint
from tests.helpers import fixture_requests


def test_a_weight_load_goes_into_the_served_parameters_in_place(tmp_path):
    first, second = write_checkpoint(tmp_path / "a", seed=1), write_checkpoint(tmp_path / "b", seed=2)
    state = ServerState(ServeConfig(model_path=str(first), load_format="auto"))
    served = state.engine.model
    addresses = {name: p.data_ptr() for name, p in served.named_parameters()}
    before = state.engine.generate(fixture_requests())
    assert state.load_weights(str(second), "auto") == "Succeeded to update model weights."
    assert state.engine.model is served
    assert {name: p.data_ptr() for name, p in served.named_parameters()} == addresses
    fresh = ServerState(ServeConfig(model_path=str(second), load_format="auto"))
    loaded, wanted = named_weights(served), named_weights(fresh.engine.model)
    assert loaded.keys() == wanted.keys()
    assert all(torch.equal(loaded[name], wanted[name]) for name in wanted)
    after = state.engine.generate(fixture_requests())
    assert after == fresh.engine.generate(fixture_requests())
    assert after != before  # the new weights were read
